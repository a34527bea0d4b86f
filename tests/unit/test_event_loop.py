"""Which event loop the driver runs on: uvloop where it is installed (a dependency of the
project), asyncio's own loop where it is not or ``MILES_UVLOOP=0``. The actors' loops (Ray's)
are checked in tests/integration/test_event_loop.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from miles.utils import aio

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _name() -> str:
    return aio.loop_name()


def test_run_uses_uvloop_where_it_is_installed() -> None:
    assert aio.run(_name()) == ("uvloop" if HAVE_UVLOOP else "asyncio")


def test_run_falls_back_to_asyncio(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # "import uvloop" raises ImportError
    assert aio.loop_factory() is None and aio.run(_name()) == "asyncio"
    monkeypatch.delitem(sys.modules, "uvloop")
    monkeypatch.setenv("MILES_UVLOOP", "0")
    assert aio.run(_name()) == "asyncio"


def test_miles_train_drives_the_run_on_that_loop(tmp_path, monkeypatch) -> None:
    """``miles train`` hands the driver's coroutine to that loop (the run itself replaced by
    one that records the loop it runs on)."""
    import miles.driver
    from miles.cli import main
    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config
    from miles.utils import gcpolicy

    save_pretrained(CausalLM(tiny_config()), tmp_path / "ckpt", tokenizer=build_tiny_tokenizer())
    (tmp_path / "data.jsonl").write_text(json.dumps({"input": "q", "label": "a"}) + "\n")
    (tmp_path / "rm.py").write_text("def reward(s):\n    return 1.0\n")
    seen: list[str] = []

    async def train(cfg) -> dict:
        seen.append(aio.loop_name())
        return {"status": "completed", "steps": 0}

    monkeypatch.setattr(miles.driver, "train", train)
    monkeypatch.setattr(gcpolicy, "install", lambda *a, **k: None)  # process-wide: not in the test process
    torch.manual_seed(0)
    code = main(["train", "--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", str(tmp_path / "data.jsonl"),
                 "--custom-rm-path", f"{tmp_path / 'rm.py'}:reward", "--output-dir", str(tmp_path / "out")])
    assert code == 0 and seen == ["uvloop" if HAVE_UVLOOP else "asyncio"]


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop not installed")
def test_uvloop_is_what_the_project_declares() -> None:
    """pyproject's dependency list promises uvloop; the installed one is that dependency."""
    from importlib.metadata import requires

    assert any(r.startswith("uvloop") for r in requires("miles") or [])
