"""Turn the config's ``"pkg.mod:fn"`` strings into callables — the only place that does.

Accepted forms: ``pkg.mod:fn``, ``pkg.mod.fn`` and ``path/to/file.py:fn``. Paths are loaded
only because the user wrote them in their own config or command line (see the reliability
notes in the README); nothing here evaluates strings from data files.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class LoadError(ValueError):
    """A ``--custom-*-path`` style reference could not be resolved."""


def load_function(ref: str) -> Callable[..., Any]:
    """Resolve ``ref`` to the object it names; raise LoadError with the reason."""
    if not ref or not isinstance(ref, str):
        raise LoadError(f"empty function reference {ref!r}")
    if ":" in ref:
        module_part, attr = ref.rsplit(":", 1)
    elif "." in ref:
        module_part, attr = ref.rsplit(".", 1)
    else:
        raise LoadError(f"{ref!r}: expected 'pkg.mod:fn', 'pkg.mod.fn' or 'file.py:fn'")
    if module_part.endswith(".py") or "/" in module_part:
        module = _load_file(Path(module_part), ref)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as exc:
            raise LoadError(f"{ref!r}: cannot import module {module_part!r}: {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise LoadError(f"{ref!r}: module {module_part!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise LoadError(f"{ref!r}: {attr!r} is not callable")
    return obj


def _load_file(path: Path, ref: str) -> Any:
    if not path.is_file():
        raise LoadError(f"{ref!r}: file {str(path)!r} does not exist")
    name = f"miles_user_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"{ref!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise LoadError(f"{ref!r}: importing {str(path)!r} failed: {exc!r}") from exc
    return module


def positional_arity(fn: Callable[..., Any]) -> int:
    """Number of positional parameters ``fn`` takes (to accept slime's ``fn(args, sample)``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)
