"""No import cycle between miles' subpackages.

Each module's top-level imports (not those inside functions, which defer on purpose, nor
``if TYPE_CHECKING:`` blocks) are an edge from its subpackage (``miles.engines``) or
top-level module (``miles.config``) to the one it imports. A cycle among those nodes means
two packages cannot be understood, or imported, one before the other.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import miles

ROOT = Path(miles.__file__).parent


def _node(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _module_name(path: Path) -> tuple[str, str]:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        name = ".".join(parts[:-1])
        return name, name
    name = ".".join(parts)
    return name, name.rpartition(".")[0]


def _imports(body: list[ast.stmt], package: str) -> list[str]:
    out: list[str] = []
    for st in body:
        if isinstance(st, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(st.test):
                out += _imports(st.body, package) + _imports(st.orelse, package)
        elif isinstance(st, ast.Try):
            out += _imports(st.body, package) + _imports(st.orelse, package)
            for handler in st.handlers:
                out += _imports(handler.body, package)
        elif isinstance(st, ast.Import):
            out += [a.name for a in st.names]
        elif isinstance(st, ast.ImportFrom):
            if st.level:
                base = package.split(".")[: len(package.split(".")) - st.level + 1]
                module = ".".join(base + ([st.module] if st.module else []))
            else:
                module = st.module or ""
            out += [module] + [f"{module}.{a.name}" for a in st.names]
    return out


def import_graph() -> dict[str, dict[str, str]]:
    """node -> {imported node: a file that imports it}."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for path in sorted(ROOT.rglob("*.py")):
        name, package = _module_name(path)
        for target in _imports(ast.parse(path.read_text(encoding="utf-8")).body, package):
            if target.startswith("miles.") and _node(target) != _node(name):
                graph[_node(name)].setdefault(_node(target), str(path.relative_to(ROOT.parent)))
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one() -> None:
    graph = {"miles.a": {"miles.b": "a.py"}, "miles.b": {"miles.c": "b.py"}, "miles.c": {"miles.a": "c.py"}}
    assert find_cycle(graph) == ["miles.a", "miles.b", "miles.c", "miles.a"]
    assert find_cycle({"miles.a": {"miles.b": "a.py"}, "miles.b": {}}) is None


def test_the_walk_sees_imports() -> None:
    graph = import_graph()
    assert "miles.types" in graph["miles.rollout"]  # from miles.types import ... in rollout/context.py
    assert "miles.kernels" in graph["miles.engines"]


def test_no_cycle_between_subpackages() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        edges = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between miles' packages:\n  " + "\n  ".join(edges))


def test_kernels_are_a_leaf() -> None:
    """kernels/ imports nothing from engines/ or models/, at any depth of a function."""
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom | ast.Import):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                bad = [n for n in names if n.startswith(("miles.engines", "miles.models"))]
                assert not bad, f"{path.relative_to(ROOT.parent)} imports {bad}"


def test_core_does_not_import_the_http_server() -> None:
    """Only ``miles serve`` (serve.py, cli.py) and the server package itself import ``miles.serving``."""
    graph = import_graph()
    importers = sorted(n for n, targets in graph.items() if "miles.serving" in targets)
    assert set(importers) <= {"miles.serve", "miles.cli"}, importers


def test_an_eager_start_does_not_import_the_compiler() -> None:
    """Checking a checkpoint's shapes (a meta model: every actor's config check and load) and
    serving with an engine that compiles nothing leave torch's compiler unimported: its import
    is about a second of each process's start, on the way to the first trained step."""
    import subprocess
    import sys

    code = """
import asyncio, sys
import torch
from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import CausalLM, tiny_config
from miles.types import GenerateRequest, SamplingParams
with torch.device("meta"):
    CausalLM(tiny_config())
engine = EmbeddedEngine(CausalLM(tiny_config()), config=EngineConfig(max_batch_size=2, max_seq_len=32))
async def go():
    await engine.generate(GenerateRequest(rid="a", input_ids=[5, 6], sampling=SamplingParams(max_new_tokens=3)))
    await engine.close()
asyncio.run(go())
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))[:3])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
