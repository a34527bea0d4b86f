"""The embedded engine on CUDA: CUDA graphs and torch.compile on, float32 for exact checks,
bf16 for the production dtype. Mirrors the CPU must-show tests."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.models import CausalLM, tiny_config, token_logprobs  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402


def _model(seed: int = 0, moe: bool = False) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(moe=moe, initializer_range=0.1)).eval()


def _engine(model: CausalLM, **kw) -> EmbeddedEngine:
    cfg = dict(max_batch_size=8, max_seq_len=512, device="cuda", dtype="float32", kv_block=64)
    return EmbeddedEngine(model, config=EngineConfig(**{**cfg, **kw}))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 260, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _logprobs(ref: CausalLM, prompt: list[int], out) -> torch.Tensor:
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logits = ref(ids).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(out.output_ids))


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "matmul", "triton"])
def test_engine_float32_logprobs_match_cpu_full_forward(moe: bool, attention: str) -> None:
    ref = _model(moe=moe)
    _check_against_full_forward(ref, _engine(copy.deepcopy(ref), decode_attention=attention), _prompts(6), 100,
                                graphs=not moe)


@pytest.mark.parametrize("in_gemm,fused_mlp", [(True, True), (True, False), (False, False)])
def test_decode_with_residual_adds_in_the_gemms_matches_full_forward(in_gemm: bool, fused_mlp: bool) -> None:
    """``decode_residual_gemm``: the o / down projections added into the residual stream
    by cuBLAS (beta = 1) in captured decode graphs, or by an add after them; with
    ``decode_fused_mlp`` the gate/up GEMM and SiLU·up in one Triton kernel: float32 log-probs
    match a full forward every way."""
    ref = _model()
    engine = _engine(copy.deepcopy(ref), decode_attention="triton", decode_residual_gemm=in_gemm,
                     decode_fused_mlp=fused_mlp)
    assert engine.runner.fused_mlp == fused_mlp  # the kernel's probe passed where it was asked for
    _check_against_full_forward(ref, engine, _prompts(7, seed=4), 60, graphs=True)


def _check_against_full_forward(ref: CausalLM, engine: EmbeddedEngine, ps: list[list[int]], new: int, *,
                                graphs: bool) -> None:
    """``new`` seeded tokens for each prompt, at once; each one's float32 log-prob within 1e-4
    of ``ref``'s full forward, and (``graphs``) the decode steps ran as CUDA graphs."""
    sp = SamplingParams(max_new_tokens=new, seed=3, ignore_eos=True)

    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=sp))
                                      for i, p in enumerate(ps)))
        await engine.close()
        return outs

    outs = asyncio.run(go())
    if graphs:
        captured = engine.runner.graphs
        assert captured is not None and not captured.failed and captured.graphs  # CUDA graphs ran
    for p, out in zip(ps, outs):
        assert len(out.output_ids) == new
        assert (_logprobs(ref, p, out) - torch.tensor(out.logprobs)).abs().max() < 1e-4


def test_abort_resume_and_weight_update_with_graphs() -> None:
    ref_old, ref_new = _model(1), _model(2)
    engine = _engine(copy.deepcopy(ref_old))
    prompt = _prompts(1, seed=5)[0]
    sp = SamplingParams(max_new_tokens=80, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)

    async def go():
        full = await engine.generate(GenerateRequest(rid="full", input_ids=prompt, sampling=sp))
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=sp)))
        while (engine.progress("a") or 0) < 20:
            await asyncio.sleep(0.001)
        await engine.abort("a")
        part = await task
        rest = await engine.generate(GenerateRequest(rid="b", input_ids=prompt + part.output_ids, sampling=sp,
                                                     num_prefix_tokens=len(part.output_ids)))
        plain = SamplingParams(max_new_tokens=80, seed=12, ignore_eos=True)  # no truncation
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="c", input_ids=prompt, sampling=plain)))
        while (engine.progress("c") or 0) < 20:
            await asyncio.sleep(0.001)
        await engine.pause()
        k = engine.progress("c")
        await engine.update_weights(ref_new.state_dict().items(), version=1, keep_kv_cache=False)
        await engine.resume()
        updated = await task
        await engine.close()
        return full, part, rest, k, updated

    full, part, rest, k, updated = asyncio.run(go())
    assert part.output_ids + rest.output_ids == full.output_ids
    assert updated.versions == [0] * k + [1] * (80 - k)
    lp_new = _logprobs(ref_new, prompt, updated)
    assert (lp_new[k:] - torch.tensor(updated.logprobs[k:])).abs().max() < 1e-4


@pytest.mark.parametrize("kv,tol", [("auto", 0.05), ("fp8_e4m3", 0.1)])
def test_bf16_engine_runs_and_tracks_full_forward(kv: str, tol: float) -> None:
    """bf16, the CUDA defaults (Triton decode attention, CUDA graphs, fused sampler); with an
    fp8 cache, its V transposed and the attention's dots in float16."""
    ref = _model()
    engine = _engine(copy.deepcopy(ref), dtype="bfloat16", max_batch_size=32, kv_cache_dtype=kv)
    ps = _prompts(32, seed=2)
    sp = SamplingParams(max_new_tokens=64, ignore_eos=True)

    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=sp))
                                      for i, p in enumerate(ps)))
        stats = engine.stats()
        await engine.close()
        return outs, stats

    outs, stats = asyncio.run(go())
    assert stats["engine/requests_finished"] == 32
    bf16_ref = copy.deepcopy(ref).to(device="cuda", dtype=torch.bfloat16)
    for p, out in zip(ps, outs):
        ids = torch.tensor([p + out.output_ids], device="cuda")
        with torch.no_grad():
            lp = token_logprobs(bf16_ref(ids).logits[0, len(p) - 1 : -1], ids[0, len(p):]).cpu()
        # bf16: KV-cache decode vs full forward differ by rounding; means stay close.
        assert (lp - torch.tensor(out.logprobs)).abs().mean() < tol


@pytest.mark.parametrize("when_idle", [True, False])
def test_decode_graphs_are_captured_while_idle_for_every_batch_bucket(when_idle: bool) -> None:
    """With the length-aware kernel the idle engine captures one decode graph per batch bucket,
    one between two checks for work, so a request never waits for all of them and batches of
    changing size no longer stop for a capture once it has idled; with the option off, graphs
    come only for the buckets met."""
    import time

    from miles.engines.runner import GRAPH_CAPTURES

    ref = _model()
    engine = _engine(copy.deepcopy(ref), decode_attention="triton", capture_graphs_when_idle=when_idle)
    graphs = engine.runner.graphs
    ps = _prompts(3)
    sp = SamplingParams(max_new_tokens=20, seed=3, ignore_eos=True)

    async def go():
        first = await engine.generate(GenerateRequest(rid="a", input_ids=ps[0], sampling=sp))
        deadline = time.monotonic() + 120
        while when_idle and graphs.missing():
            assert time.monotonic() < deadline, "the idle engine did not capture every bucket"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # an engine with the option off would capture nothing meanwhile
        captured = GRAPH_CAPTURES["count"]
        rest = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=sp))
                                      for i, p in enumerate(ps)))
        await engine.close()
        return first, captured, rest

    first, captured, rest = asyncio.run(go())
    assert not graphs.failed
    L = engine.runner.cache.length
    if when_idle:
        assert set(graphs.graphs) == {(nb, L) for nb in graphs.buckets}  # 1, 2, 4, 8
        assert GRAPH_CAPTURES["count"] == captured  # batches of 3 and 1 captured nothing new
    else:
        assert (1, L) in graphs.graphs and len(graphs.graphs) < len(graphs.buckets)
    for p, out in zip([ps[0], *ps], [first, *rest]):
        assert (_logprobs(ref, p, out) - torch.tensor(out.logprobs)).abs().max() < 1e-4


def test_capture_next_leaves_a_parked_rows_kv_as_it_was() -> None:
    """``DecodeGraphs.capture_next`` runs each bucket's step at position 0 of its slots: a
    request parked there (a partial rollout between weight updates) gets its K/V back."""
    engine = _engine(_model(), decode_attention="triton", capture_graphs_when_idle=False)
    runner, graphs = engine.runner, engine.runner.graphs
    with torch.no_grad():
        runner.prefill_eager([0, 1], _prompts(2, seed=4), logits=True)
        k, v = runner.cache.k.clone(), runner.cache.v.clone()
        count = 0
        while graphs.capture_next():
            count += 1
    assert count == len(graphs.buckets) and not graphs.missing()
    assert torch.equal(runner.cache.k, k) and torch.equal(runner.cache.v, v)
    asyncio.run(engine.close())


def test_prefill_graphs_match_eager_and_pad_into_the_scratch_slot() -> None:
    """A short prefill is eager the first time its shape is met, captured the second, replayed
    after that; its logits and K/V match the eager forward's, and its padding rows write only
    the scratch slot (a running request's cache is left bit for bit)."""
    engine = _engine(_model())
    runner = engine.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.scratch == 8 and runner.cache.k.shape[1] == 9
    ps = _prompts(4, seed=5)
    with torch.no_grad():
        runner.prefill_eager([0], [ps[0]], logits=True)  # a "running" request in slot 0
        k0, v0 = runner.cache.k[:, 0].clone(), runner.cache.v[:, 0].clone()
        want = runner.prefill_eager([1, 2, 3], ps[1:], logits=True).logits.clone()
        kw = [runner.cache.k[:, s, :, : len(p)].clone() for s, p in zip((1, 2, 3), ps[1:])]
        runner.cache.k[:, 1:4].zero_()
        for i in range(3):
            got = runner.prefill([1, 2, 3], ps[1:], logits=True).logits
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            assert len(graphs.graphs) == (0 if i == 0 else 1), i
        torch.cuda.synchronize()
    assert list(graphs.graphs) == [(4, 64)]
    assert torch.equal(runner.cache.k[:, 0], k0) and torch.equal(runner.cache.v[:, 0], v0)
    for s, p, k in zip((1, 2, 3), ps[1:], kw):
        torch.testing.assert_close(runner.cache.k[:, s, :, : len(p)], k, atol=1e-5, rtol=1e-5)
    # hidden states (a drafter) and over-long prompts stay eager
    with torch.no_grad():
        assert runner.prefill([1], [ps[1]], logits=True, hidden=True).hidden is not None
    assert graphs.key(1, 300) is None and graphs.key(9, 8) is None  # longer than a bucket; more rows than slots
    asyncio.run(engine.close())


def test_background_compile_serves_eagerly_then_switches() -> None:
    """``compile_warmup="background"`` on CUDA (miles.engines.warmup): the first requests are
    served with the eager step functions under CUDA graphs while the child compiles; once it is
    done the idle engine switches (compiled functions, graphs re-captured) and serves the same
    float32 log-probs as a full forward, before and after."""
    import time

    ref = _model(7)
    engine = _engine(copy.deepcopy(ref), decode_attention="triton", compile_warmup="background")
    child = engine._compile.child
    ps = _prompts(6, seed=8)
    sp = SamplingParams(max_new_tokens=40, seed=3, ignore_eos=True)

    async def go():
        first = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"a{i}", input_ids=p, sampling=sp))
                                       for i, p in enumerate(ps)))
        eager = engine.stats()
        deadline = time.monotonic() + 300
        while "engine/compile_switch_s" not in engine.stats():
            assert time.monotonic() < deadline, "no switch"
            await asyncio.sleep(0.2)
        second = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"b{i}", input_ids=p, sampling=sp))
                                        for i, p in enumerate(ps)))
        stats = engine.stats()
        await engine.close()
        return first, second, eager, stats

    first, second, eager, stats = asyncio.run(go())
    assert eager["engine/compiled"] == 0.0 and eager["engine/graph_captures"] > 0
    assert stats["engine/compiled"] == 1.0 and stats["engine/compile_child_ok"] == 1.0, child.log_path
    assert stats["engine/graph_captures"] > eager["engine/graph_captures"] and not engine.runner.graphs.failed
    for p, a, b in zip(ps, first, second):
        for out in (a, b):
            assert (_logprobs(ref, p, out) - torch.tensor(out.logprobs)).abs().max() < 1e-4
