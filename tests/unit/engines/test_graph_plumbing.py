"""The CUDA-graph decode path's plumbing, on the CPU.

A captured graph replays kernels that read static input buffers and write static output
buffers. Here the "graph" re-runs the same step eagerly from those buffers, which checks
everything around the capture itself: bucket padding (rows n..nb-1 on free slots), static
inputs from host lists and from device token tensors (overlap), outputs read back before
they are overwritten, and hidden states copied out of the reused buffer.
"""

from __future__ import annotations

import asyncio
import copy
import types

import torch

from miles.engines.runner import DecodeGraphs
from miles.models import token_logprobs
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts, run


def _fake_graphs(engine) -> DecodeGraphs:
    graphs = DecodeGraphs(engine.runner)
    graphs._capture = lambda step: types.SimpleNamespace(replay=step)  # 'replay' runs the step eagerly
    engine.runner.graphs = graphs
    return graphs


def test_graph_path_matches_full_forward(overlap: bool) -> None:
    _check_graph_path(overlap)


def test_graph_path_with_residual_adds_matches_full_forward() -> None:
    """``decode_residual_gemm=False`` (a GEMM, then an add) against a full forward too."""
    _check_graph_path(True, decode_residual_gemm=False)


def _check_graph_path(overlap: bool, **config) -> None:
    ref = make_model(seed=8)
    engine = make_engine(copy.deepcopy(ref), max_batch_size=6, overlap=overlap, kv_block=32,
                         cpu_decode_kernel=False, **config)  # the torch decode path is what graphs capture
    graphs = _fake_graphs(engine)
    ps = prompts(9, seed=8)  # more requests than slots: batch sizes 6, 5, ... all bucketed
    sps = [SamplingParams(max_new_tokens=10 + 7 * (i % 4), seed=i, ignore_eos=True) for i in range(9)]

    async def go():
        outs = await asyncio.gather(*(
            engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=s, return_hidden_states=True))
            for i, (p, s) in enumerate(zip(ps, sps))))
        await engine.close()
        return outs

    outs = run(go)
    assert {nb for nb, _ in graphs.graphs} >= {6, 4}  # padded buckets were used
    assert len({L for _, L in graphs.graphs}) > 1  # and several context buckets
    for p, out, s in zip(ps, outs, sps):
        assert len(out.output_ids) == s.max_new_tokens
        ids = torch.tensor([p + out.output_ids])
        with torch.no_grad():
            full = ref(ids, return_hidden=True)
        lp = token_logprobs(full.logits[0, len(p) - 1 : -1], torch.tensor(out.output_ids))
        assert (lp - torch.tensor(out.logprobs)).abs().max() < 1e-5
        hidden = engine.pop_hidden_states(out.rid)
        assert torch.allclose(hidden, full.hidden[0, :-1], atol=1e-4)


def test_the_idle_engine_captures_every_missing_bucket_then_serves_from_them() -> None:
    """``capture_graphs_when_idle`` (a length-aware engine, whose one context serves every
    step): the stepping thread, with nothing to step, captures the batch buckets not met yet
    one at a time; a batch that comes after finds its graph there and decodes as a full
    forward does. Off, only the buckets met are captured."""
    import time

    ref = make_model(seed=8)
    ps = prompts(3, seed=9)
    sp = SamplingParams(max_new_tokens=6, seed=1, ignore_eos=True)
    for when_idle in (True, False):
        engine = make_engine(copy.deepcopy(ref), max_batch_size=6, kv_block=32, cpu_decode_kernel=False,
                             decode_split=False, capture_graphs_when_idle=when_idle)
        graphs = _fake_graphs(engine)
        engine.runner.length_aware = True  # as the triton attention is: one context, the whole cache
        L = engine.runner.cache.length
        assert graphs.missing() == [1, 2, 4, 6]

        async def go():
            first = await engine.generate(GenerateRequest(rid="a", input_ids=ps[0], sampling=sp))
            deadline = time.monotonic() + 120  # a liveness bound only, far above what the captures take
            while when_idle and graphs.missing():
                assert time.monotonic() < deadline, "the idle engine left buckets uncaptured"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            met = set(graphs.graphs)
            rest = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=sp))
                                          for i, p in enumerate(ps)))
            await engine.close()
            return first, met, rest

        first, met, rest = run(go)
        if when_idle:
            assert met == {(nb, L) for nb in (1, 2, 4, 6)} and set(graphs.graphs) == met
        else:
            assert met == {(1, L)}  # the first request's bucket only
        for p, out in zip([ps[0], *ps], [first, *rest]):
            with torch.no_grad():
                full = ref(torch.tensor([p + out.output_ids]))
            lp = token_logprobs(full.logits[0, len(p) - 1 : -1], torch.tensor(out.output_ids))
            assert (lp - torch.tensor(out.logprobs)).abs().max() < 1e-5


def test_a_capture_waits_until_the_engine_has_idled_a_while(monkeypatch) -> None:
    """A missing graph is due only after ``IDLE_CAPTURE_S`` with nothing to step (the requests
    of one batch arrive milliseconds apart and must not wait for captures between them), and
    never while paused, with the memory released, or with the option off. The idle time is
    set far from the bound either way, so no clock reading decides the test."""
    import time

    import miles.engines.stepping as stepping

    monkeypatch.setattr(stepping, "IDLE_CAPTURE_S", 3600.0)
    engine = make_engine(make_model(seed=8), max_batch_size=6, cpu_decode_kernel=False)
    graphs = _fake_graphs(engine)
    engine.runner.length_aware = True
    engine._last_work = time.perf_counter()  # just worked
    assert graphs.missing() and not engine._capture_due()
    assert 0 < engine._idle_wait() <= 3600.0 + 1e-3  # the idle thread wakes when it is due
    engine._last_work -= 2 * 3600.0  # idle for longer than the bound
    assert engine._capture_due() and engine._idle_wait() == 1e-3
    for attr, owner in (("_paused", engine), ("released", engine.offloader),
                        ("capture_graphs_when_idle", engine.config)):
        blocked = attr != "capture_graphs_when_idle"
        setattr(owner, attr, blocked)
        assert not engine._capture_due() and engine._idle_wait() is None, attr
        setattr(owner, attr, not blocked)
    assert engine._capture_due()
    while graphs.missing():
        assert graphs.capture_next()
    assert not engine._capture_due() and engine._idle_wait() is None  # nothing left: sleep until notified


def test_a_failed_capture_switches_graphs_off(monkeypatch) -> None:
    """Graphs are an optimisation: a capture that raises turns them off (run returns None,
    the caller decodes eagerly) instead of failing the step."""
    import miles.engines.runner as runner_mod

    engine = make_engine(make_model(seed=8), max_batch_size=4)
    graphs = DecodeGraphs(engine.runner)

    def broken(step, pool):
        raise RuntimeError("capture not supported")

    monkeypatch.setattr(runner_mod, "capture_graph", broken)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    assert graphs.run([5, 6], [3, 4], 32) is None
    assert graphs.failed and not graphs.graphs
    assert graphs.run([5, 6], [3, 4], 32) is None  # stays off


def test_decode_attention_launch_by_grid_width_and_cache_dtype() -> None:
    """Wide grids run 1024-position chunks (a 16-bit or float32 cache: LAUNCH[2]; 8-bit: LAUNCH[1]),
    narrow ones 256; an explicit chunk wins (pure Python: runs without triton)."""
    from miles.kernels import decode_attention as kernel

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    wide, narrow = kernel.WIDE, kernel.WIDE - 1
    assert kernel.default_launch(wide, bf16) == kernel.LAUNCH[2] and kernel.LAUNCH[2][0] == 1024
    assert kernel.default_launch(wide, torch.float32) == kernel.LAUNCH[2]
    assert kernel.default_launch(wide, fp8) == kernel.LAUNCH[1] and kernel.LAUNCH[1][0] == 1024
    assert kernel.default_launch(narrow, bf16) == kernel.NARROW[2] and kernel.NARROW[2][0] == kernel.CHUNK
    assert kernel.default_launch(narrow, fp8) == kernel.NARROW[1]
    assert kernel.default_launch(wide, bf16, chunk=128) == (128, *kernel.LAUNCH[2][1:])
    assert kernel.default_launch(narrow, fp8, chunk=64) == (64, *kernel.NARROW[1][1:])
