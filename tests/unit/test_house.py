"""The repository stays readable: comments and docstrings in ``miles/`` say why in the present
tense, without dates, machine names or timings (those belong in commit messages and
``benchmarks/log/``), and no file points at a path outside the repository."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|H200|[0-9] ?(µs|us|ms) ")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings (string tokens that stand as a statement) of a Python file."""
    out: list[tuple[int, str]] = []
    prev = tokenize.NEWLINE
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.NL):
            out.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def test_history_detector_sees_a_dated_timing(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text('"""Fast."""\nx = "2026-01-01"  # code may parse dates\n# took 5 ms on the H200\n')
    assert [line for line, text in _prose(f) if HISTORY.search(text)] == [3]


def test_no_dates_machines_or_timings_in_miles_comments() -> None:
    hits = [f"{p.relative_to(ROOT)}:{line}: {text.strip()[:100]}"
            for p in sorted((ROOT / "miles").rglob("*.py"))
            for line, text in _prose(p) if HISTORY.search(text)]
    hits += [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "miles").rglob("*.md"))
             for n, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if HISTORY.search(text)]
    assert not hits, "history belongs in commit messages and benchmarks/log/:\n" + "\n".join(hits)


def test_no_pointer_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    outside = re.compile(r"\.\./shared|/work/|DESIGN\.md")
    hits = [f"{f}:{n}" for f in files if f.endswith((".py", ".md", ".sh", ".toml", ".yaml", ".yml"))
            and f != "tests/unit/test_house.py"
            for n, line in enumerate((ROOT / f).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if outside.search(line)]
    assert not hits, hits


def test_license_design_and_results_table() -> None:
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "docs" / "design.md").is_file()
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 150
