"""A torch.compile of a new shape variant is counted as ``engine/compile_s``, not as the
phase that met it: a first-met prefill shape's compile read as prefill time (issue #37: the
GPU run's 65% "prefill" at η = 2 with 2-token prompts), and a graph capture's warm-up compile
as capture time. The compiles are simulated by a fake dynamo clock (a real CPU compile takes
~10 s), so the test is fast and exact."""

from __future__ import annotations

import time

from miles.engines import runner as runner_mod
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, prompts, run

COMPILE_S = 0.5  # the simulated compile inside the first prefill
WALL_S = 0.55  # that prefill's wall time (the compile and 50 ms of work)


def test_compile_during_prefill_is_counted_apart() -> None:
    clock = [0.0]
    engine = make_engine()
    engine.stepper._compile_seconds = lambda: clock[0]
    prefill = engine.runner.prefill
    calls = [0]

    def compiling_prefill(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:  # the first shape compiles
            time.sleep(WALL_S)
            clock[0] += COMPILE_S
        return prefill(*args, **kwargs)

    engine.runner.prefill = compiling_prefill
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)

    async def go():
        await engine.generate(GenerateRequest(rid="a", input_ids=prompts(1, seed=1)[0], sampling=sp))
        await engine.generate(GenerateRequest(rid="b", input_ids=prompts(1, seed=2)[0], sampling=sp))
        stats = engine.stats()
        await engine.close()
        return stats

    stats = run(go)
    assert stats["engine/compile_s"] == COMPILE_S
    assert stats["engine/prefill_forwards"] == 2
    # without the compile taken out the first prefill alone would count WALL_S
    assert WALL_S - COMPILE_S <= stats["engine/prefill_s"] < WALL_S - 0.2  # slack for a loaded CI machine


def test_capture_leaves_its_compile_out(monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(runner_mod, "compile_seconds", lambda: clock[0])

    def capture(step, pool):
        time.sleep(0.1)
        clock[0] += 0.08  # the warm-up runs compiled a variant
        return "graph"

    monkeypatch.setattr(runner_mod, "_capture", capture)
    before = dict(runner_mod.GRAPH_CAPTURES)
    assert runner_mod.capture_graph(lambda: None, None) == "graph"
    took = runner_mod.GRAPH_CAPTURES["seconds"] - before["seconds"]
    assert runner_mod.GRAPH_CAPTURES["count"] == before["count"] + 1
    assert 0.02 - 1e-3 <= took < 0.08  # the capture's own 20 ms, not the compile's 80


def test_compile_seconds_reads_dynamo_timers() -> None:
    assert runner_mod.compile_seconds() >= 0.0


def test_compiled_engine_warms_every_shape_class_before_serving(monkeypatch) -> None:
    """Dynamo specializes a size of 1: with compile on, the engine runs the one-row and
    one-token prefills and the one-row decode at start, so no variant compiles mid-run (the
    compiles themselves are not run here: the step functions stay eager on the CPU)."""
    from miles.engines import runner as runner_mod

    seen: list[tuple[str, int, int]] = []
    real_prefill, real_decode = runner_mod.ModelRunner.prefill_eager, runner_mod.ModelRunner.decode_eager

    def prefill(self, slots, seqs, **kw):
        seen.append(("prefill", len(seqs), max(len(s) for s in seqs)))
        return real_prefill(self, slots, seqs, **kw)

    def decode(self, tokens, positions, L, **kw):
        seen.append(("decode", tokens.shape[0], 1))
        return real_decode(self, tokens, positions, L, **kw)

    monkeypatch.setattr(runner_mod.ModelRunner, "prefill_eager", prefill)
    monkeypatch.setattr(runner_mod.ModelRunner, "decode_eager", decode)
    engine = make_engine(cpu_decode_kernel=False)
    engine.compile_inline = True  # as compile=True, compile_warmup="inline" decides at construction
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)

    async def go():
        out = await engine.generate(GenerateRequest(rid="a", input_ids=prompts(1, seed=1)[0], sampling=sp))
        stats = engine.stats()
        await engine.close()
        return out, stats

    out, stats = run(go)
    assert len(out.output_ids) == 2
    assert stats["engine/warm_compile_s"] > 0
    warm = set(seen[:6])
    assert {("prefill", n, T) for n in (1, 2) for T in (1, 2)} <= warm
    assert {("decode", 1, 1), ("decode", 2, 1)} <= warm


def test_uncompiled_engine_skips_the_warm_up(monkeypatch) -> None:
    from miles.engines import runner as runner_mod

    calls = []
    monkeypatch.setattr(runner_mod.ModelRunner, "warm_compiled", lambda self: calls.append(1))
    engine = make_engine()
    sp = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)

    async def go():
        await engine.generate(GenerateRequest(rid="a", input_ids=prompts(1, seed=1)[0], sampling=sp))
        await engine.close()

    run(go)
    assert calls == []  # the CPU default: nothing compiles, nothing to warm
