"""The engine's compiled step functions from a background child (``compile_warmup="background"``,
``miles.engines.warmup``): the engine serves at once with the eager step functions, and switches
between steps once the child is done — when idle, or at a weight commit with rows in flight,
whose KV cache the switch's warm-up must leave as it found it. The child is simulated (a real
CPU compile takes minutes), and so is the compiled FastPath: the same functions, counted."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from miles.engines import EngineConfig, warmup
from miles.models import fused
from miles.types import GenerateRequest, SamplingParams
from tests.compile_child import expect_failed_child_reported
from tests.marks import real_compile

from .helpers import make_engine, make_model, paced, prompts, run

SP = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)


class FakeChild:
    """Stands in for the compile child: done once ``finish`` is set."""

    def __init__(self, ok: bool = True) -> None:
        self.finish, self.result, self.seconds, self.stopped = threading.Event(), ok, 3.0, False

    def done(self) -> bool:
        return self.finish.is_set()

    def ok(self) -> bool:
        return self.result

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def compiled_calls(monkeypatch) -> list[str]:
    """``compile_fast_path`` returns the plain functions, each call recorded."""
    calls: list[str] = []

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(fused, "compile_fast_path", lambda *a, **k: fused.FastPath(counted))
    return calls


def _engine(monkeypatch, child: FakeChild, **config: Any):
    monkeypatch.setattr(warmup, "BackgroundCompile", lambda spec, entry: child)
    # torch ops for decode (the CPU kernel would bypass the step functions)
    return make_engine(compile=True, compile_warmup="background", cpu_decode_kernel=False, **config)


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _reference(ids: list[list[int]]) -> list[list[int]]:
    engine = make_engine(cpu_decode_kernel=False)

    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=SP))
                                      for i, p in enumerate(ids)))
        await engine.close()
        return [o.output_ids for o in outs]

    return run(go)


def test_serves_eagerly_then_switches_when_idle(monkeypatch, compiled_calls) -> None:
    child = FakeChild()
    engine = _engine(monkeypatch, child)
    ids = prompts(3, seed=1)

    async def go():
        first = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"a{i}", input_ids=p, sampling=SP))
                                       for i, p in enumerate(ids)))
        before = engine.stats()
        child.finish.set()  # the engine is idle: it switches within a poll
        await asyncio.to_thread(_wait, lambda: engine.stats()["engine/compiled"] == 1.0, "no switch")
        n = len(compiled_calls)
        second = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"b{i}", input_ids=p, sampling=SP))
                                        for i, p in enumerate(ids)))
        after = engine.stats()
        await engine.close()
        return first, second, before, after, n

    first, second, before, after, at_switch = run(go)
    assert before["engine/compiled"] == 0.0 and before["engine/tokens_generated"] == 3 * SP.max_new_tokens
    assert at_switch > 0  # the switch's warm-up ran the compiled functions ...
    assert after["engine/compiled"] == 1.0
    assert after["engine/compile_child_s"] == 3.0 and after["engine/compile_child_ok"] == 1.0
    assert after["engine/compiled_after_decode_steps"] == before["engine/decode_steps"]
    assert after["engine/eager_serve_s"] > 0 and after["engine/compile_switch_s"] >= after["engine/compile_switch_warm_s"]
    # ... and the steps after it serve through them, with the same greedy tokens
    assert [o.output_ids for o in second] == [o.output_ids for o in first] == _reference(ids)


def test_switch_at_a_commit_keeps_rows_in_flight(monkeypatch, compiled_calls) -> None:
    """Rows decoding when the child is done switch with the next weight commit, in mid-
    generation: the switch's warm-up writes into slots 0 and 1, which two of them hold, and
    puts the entries back; every row finishes with the reference's tokens."""
    child = FakeChild()
    engine = paced(_engine(monkeypatch, child), 0.005)
    ids = prompts(4, seed=2)
    weights = [(k, v.clone()) for k, v in engine.model.state_dict().items()]

    async def go():
        tasks = [asyncio.create_task(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=SP)))
                 for i, p in enumerate(ids)]
        await asyncio.to_thread(_wait, lambda: engine.stats()["engine/tokens_generated"] >= 8, "no tokens")
        child.finish.set()
        await asyncio.sleep(0.05)
        assert engine.stats()["engine/compiled"] == 0.0  # running rows: it waits for a commit
        await engine.update_weights(weights, version=1)
        outs = await asyncio.gather(*tasks)
        stats = engine.stats()
        await engine.close()
        return outs, stats

    outs, stats = run(go)
    assert stats["engine/compiled"] == 1.0 and stats["engine/compiled_from_version"] == 1.0
    assert 0 < stats["engine/compiled_after_decode_steps"] < SP.max_new_tokens
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.output_ids for o in outs] == _reference(ids)
    assert len(compiled_calls) > 0


def test_failed_warm_up_keeps_the_eager_functions(monkeypatch, compiled_calls, caplog) -> None:
    """A failed child leaves the switch to compile in-process (the log says so); a warm-up that
    fails there too leaves the eager functions serving, with a log line, and nothing lost."""
    child = FakeChild(ok=False)
    engine = _engine(monkeypatch, child)
    monkeypatch.setattr(engine.runner, "warm_compiled", lambda: False)
    ids = prompts(2, seed=3)
    engine.start()
    child.finish.set()

    async def go():
        await asyncio.to_thread(_wait, lambda: "engine/compile_switch_s" in engine.stats(), "no switch")
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=SP))
                                      for i, p in enumerate(ids)))
        stats = engine.stats()
        await engine.close()
        return outs, stats

    with caplog.at_level("WARNING"):
        outs, stats = run(go)
    assert stats["engine/compiled"] == 0.0 and stats["engine/compile_child_ok"] == 0.0
    assert "keeps serving with the eager ones" in caplog.text
    assert compiled_calls == []  # the eager functions serve
    assert [o.output_ids for o in outs] == _reference(ids)


def test_auto_is_inline_on_the_cpu(monkeypatch) -> None:
    children: list[Any] = []
    child = FakeChild()
    monkeypatch.setattr(warmup, "BackgroundCompile", lambda spec, entry: children.append(spec) or child)
    cfg = EngineConfig(compile=True)
    assert not cfg.warm_in_background() and EngineConfig(device="cuda").warm_in_background()
    assert not EngineConfig(device="cuda", compile_warmup="inline").warm_in_background()
    assert not EngineConfig(device="cuda", compile=False).warm_in_background()
    assert not EngineConfig(device="cuda", deterministic=True).warm_in_background()  # a switch at no fixed step
    engine = make_engine(compile=False, compile_warmup="background")
    assert engine._compile is None and children == []
    engine = make_engine(model=make_model(), compile=True, compile_warmup="background", cpu_decode_kernel=False)
    assert engine._compile is not None and children[0]["model"]["num_hidden_layers"] == 2
    assert children[0]["engine"]["compile_warmup"] == "background"
    run(engine.close)
    assert child.stopped  # a child still compiling dies with its engine


@real_compile
def test_child_fills_the_caches_the_switch_reads(monkeypatch, tmp_path) -> None:
    """The real child process on the CPU, with fresh cache directories: the engine serves
    before it is done, and once it is, the switch's warm-up finds every inductor graph in the
    FX graph cache (no miss); greedy tokens after the switch are the eager engine's."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    torch._dynamo.reset()
    counters.clear()
    engine = make_engine(compile=True, compile_warmup="background", cpu_decode_kernel=False)
    child = engine._compile.child
    ids = prompts(3, seed=4)
    switch_counts: dict[str, int] = {}
    switch = engine._compile.switch

    def counted() -> bool:
        counters["inductor"].clear()
        done = switch()
        switch_counts.update(counters["inductor"])
        return done

    monkeypatch.setattr(engine._compile, "switch", counted)

    async def go():
        first = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"a{i}", input_ids=p, sampling=SP))
                                       for i, p in enumerate(ids)))
        served_before = child.proc.poll() is None
        await asyncio.to_thread(child.proc.wait, 540)
        await asyncio.to_thread(_wait, lambda: "engine/compile_switch_s" in engine.stats(), "no switch", 300)
        second = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"b{i}", input_ids=p, sampling=SP))
                                        for i, p in enumerate(ids)))
        stats = engine.stats()
        await engine.close()
        return first, second, stats, served_before

    first, second, stats, served_before = run(go)
    assert served_before  # the first requests did not wait for the compile
    assert child.proc.returncode == 0, child.log_path.read_text()[-2000:]
    assert stats["engine/compiled"] == 1.0 and stats["engine/compile_child_ok"] == 1.0
    assert switch_counts.get("fxgraph_cache_hit", 0) > 0
    assert switch_counts.get("fxgraph_cache_miss", 0) == 0
    assert [o.output_ids for o in second] == [o.output_ids for o in first] == _reference(ids)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the child fails for want of CUDA")
def test_a_failed_child_is_reported_with_its_log(caplog) -> None:
    """The engine's child as the engine starts it (its spec, its entry, its imports); one that
    fails (a CUDA engine on a machine without CUDA) is reported with the tail of its log."""
    from miles.utils.compile_child import BackgroundCompile

    engine = make_engine()
    spec = warmup.child_spec(engine)
    spec["engine"]["device"] = "cuda"
    expect_failed_child_reported(BackgroundCompile(spec, warmup.ENTRY), caplog)
    run(engine.close)
