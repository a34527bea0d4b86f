"""Speculative decoding on CUDA: verify and draft-decode CUDA graphs, float32 exactness
against full forwards and plain decoding, the output distribution, draft updates between
graph replays, and a bf16 run. Mirrors the CPU must-show tests."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.spec import SpeculativeConfig  # noqa: E402
from miles.models import CausalLM, tiny_config, token_logprobs  # noqa: E402
from miles.models.draft import build_draft  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1)).eval()


def _noisy(model: CausalLM, scale: float) -> CausalLM:
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def _engine(policy: CausalLM, draft, kind: str = "draft", mode: str = "rejection", k: int = 3, **kw) -> EmbeddedEngine:
    cfg = dict(max_batch_size=16, max_seq_len=512, device="cuda", dtype="float32", kv_block=64)
    spec = SpeculativeConfig(speculative_algorithm=kind, speculative_num_steps=k, speculative_sampling=mode,
                             speculative_adaptive=False)
    return EmbeddedEngine(copy.deepcopy(policy), config=EngineConfig(**{**cfg, **kw}), draft=copy.deepcopy(draft),
                          speculative=spec)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 260, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(engine: EmbeddedEngine, ps, sps):
    async def go():
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=str(i), input_ids=p, sampling=s))
                                      for i, (p, s) in enumerate(zip(ps, sps))))
        await engine.close()
        return outs

    return asyncio.run(go())


def _logprobs(ref: CausalLM, prompt: list[int], out, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + out.output_ids])
    with torch.no_grad():
        logits = ref(ids).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(out.output_ids), temperature)


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_logprobs_and_greedy_tokens_with_graphs(kind: str) -> None:
    ref = _model()
    draft = _noisy(ref, 0.05) if kind == "draft" else build_draft("eagle", ref.config, seed=2)
    ps = _prompts(12, seed=1)
    sampled = [SamplingParams(max_new_tokens=90, seed=i, temperature=0.8, ignore_eos=True) for i in range(12)]
    engine = _engine(ref, draft, kind)
    outs = _run(engine, ps, sampled)
    # Seeded rounds replay whole-round graphs; the verify graphs serve the other rounds.
    rounds = engine.spec.round_graphs
    assert engine.runner.verify_graphs.graphs or (rounds is not None and rounds.graphs)
    assert not engine.runner.verify_graphs.failed and not (rounds is not None and rounds.failed)
    for p, o in zip(ps, outs):
        assert len(o.output_ids) == 90 and o.versions == [0] * 90
        assert (_logprobs(ref, p, o, 0.8) - torch.tensor(o.logprobs)).abs().max() < 1e-4
    greedy = [SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)] * 12
    plain = EmbeddedEngine(copy.deepcopy(ref), config=EngineConfig(max_batch_size=16, max_seq_len=512, device="cuda",
                                                                   dtype="float32", kv_block=64))
    a, b = _run(plain, ps, greedy), _run(_engine(ref, draft, kind), ps, greedy)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_coupled_mode_equals_plain_decoding_on_cuda() -> None:
    ref = _model(3)
    ps = _prompts(8, seed=4)
    sps = [SamplingParams(max_new_tokens=64, seed=100 + i, temperature=1.0, ignore_eos=True) for i in range(8)]
    plain = EmbeddedEngine(copy.deepcopy(ref), config=EngineConfig(max_batch_size=16, max_seq_len=512, device="cuda",
                                                                   dtype="float32", kv_block=64))
    a = _run(plain, ps, sps)
    b = _run(_engine(ref, _noisy(ref, 0.05), mode="coupled", k=4), ps, sps)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_distribution_of_first_tokens_on_cuda() -> None:
    ref = _model(5)
    prompt = _prompts(1, seed=6)[0]
    n = 4000
    sps = [SamplingParams(max_new_tokens=1, seed=7_000 + i, temperature=0.7, ignore_eos=True) for i in range(n)]
    outs = _run(_engine(ref, _noisy(ref, 0.05), k=1, max_batch_size=64), [prompt] * n, sps)
    with torch.no_grad():
        p0 = torch.softmax(ref(torch.tensor([prompt])).logits[0, -1] / 0.7, -1).double()
    counts = torch.bincount(torch.tensor([o.output_ids[0] for o in outs]), minlength=p0.numel()).double()
    expected = n * p0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = (((obs - exp) ** 2) / exp).sum()
    dof = obs.numel() - 1
    assert float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2)) > 1e-3


def test_draft_update_between_graph_replays() -> None:
    ref = _model(7)
    engine = _engine(ref, _noisy(ref, 0.4), k=4)
    prompt = _prompts(1, seed=8)[0]
    sp = SamplingParams(max_new_tokens=200, seed=1, ignore_eos=True)

    async def go():
        task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=sp)))
        while (engine.progress("a") or 0) < 40:
            await asyncio.sleep(0.001)
        await engine.update_draft_weights(ref.state_dict().items(), version=1)
        # Measure once the updated draft has caught up (its stale cache entries are gone).
        at = engine.progress("a") or 0
        while (engine.progress("a") or 200) < at + 20:
            await asyncio.sleep(0.001)
        before = engine.stats()
        out = await task
        after = engine.stats()
        await engine.close()
        return out, before, after

    out, before, after = asyncio.run(go())
    assert out.versions == [0] * 200 and engine.draft_version == 1
    assert (_logprobs(ref, prompt, out) - torch.tensor(out.logprobs)).abs().max() < 1e-4
    rate = (after["spec/accepted"] - before["spec/accepted"]) / max(after["spec/drafted"] - before["spec/drafted"], 1)
    assert rate > 0.95


def test_bf16_speculative_run() -> None:
    ref = _model(9)
    engine = _engine(ref, _noisy(ref, 0.05), dtype="bfloat16", max_batch_size=32)
    ps = _prompts(32, seed=10)
    outs = _run(engine, ps, [SamplingParams(max_new_tokens=64, seed=i, ignore_eos=True) for i in range(32)])
    assert all(len(o.output_ids) == 64 for o in outs)
    assert engine.stats()["spec/accept_len"] > 1.0


def test_compiled_counter_uniform_is_bitwise_eager() -> None:
    from miles.engines.sampling import compile_counter_uniform, counter_uniform, hashed_uniform

    dev = torch.device("cuda")
    assert compile_counter_uniform(dev)
    keys = torch.randint(-(2**62), 2**62, (64,), dtype=torch.int64, device=dev)
    assert torch.equal(hashed_uniform(keys, 151936), counter_uniform(keys, 151936))


def test_compiled_draws_compile_nothing_after_the_engine_is_built() -> None:
    """Every draw a rollout makes after construction reuses a compiled graph: one key or
    many, one draw per key or a vocabulary, flattened [rows, k] keys for any k, with or
    without grad mode (a failed guard was a recompile in the middle of adaptive runs)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from miles.engines.sampling import _fast_classes, _mix, compile_counter_uniform, counter_uniform, hashed_uniform

    dev = torch.device("cuda")
    assert compile_counter_uniform(dev)
    # every class compiled: on 2026-11-30 the one-key class failed Triton's compile
    # (an int32 overflow of index × constant) and that made every draw eager
    assert _fast_classes == {(False, False), (False, True), (True, False), (True, True)}
    graphs = len(_debug_get_cache_entry_list(_mix.__code__))
    for rows in (1, 3, 64):
        for k in (4, 1, 2):
            keys = torch.randint(-(2**62), 2**62, (rows, k), dtype=torch.int64, device=dev)
            for vocab in (151936, 1):
                for grad in (False, True):
                    with torch.set_grad_enabled(grad):
                        got = hashed_uniform(keys.reshape(-1), vocab)
                    assert torch.equal(got, counter_uniform(keys.reshape(-1), vocab))
    assert len(_debug_get_cache_entry_list(_mix.__code__)) == graphs


def test_round_graphs_are_used_for_seeded_rounds() -> None:
    ref = _model(11)
    engine = _engine(ref, _noisy(ref, 0.05), k=3)
    ps = _prompts(8, seed=12)
    outs = _run(engine, ps, [SamplingParams(max_new_tokens=80, seed=i, ignore_eos=True) for i in range(8)])
    graphs = engine.spec.round_graphs
    assert graphs is not None and graphs.graphs and not graphs.failed
    for p, o in zip(ps, outs):
        assert (_logprobs(ref, p, o) - torch.tensor(o.logprobs)).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["draft", "eagle"])
def test_adaptive_probes_at_new_shapes_run_eagerly_on_cuda(kind: str) -> None:
    """An adaptive engine whose rule decodes plainly and probes k = 2 now and then: a probe
    at a shape with no round graph runs eagerly (no capture), untimed; the tokens and
    log-probs are plain decoding's (coupled mode, float32)."""
    ref = _model(13)
    draft = _noisy(ref, 0.05) if kind == "draft" else build_draft("eagle", ref.config, seed=2)
    spec = SpeculativeConfig(speculative_algorithm=kind, speculative_num_steps=3, speculative_sampling="coupled",
                             speculative_adaptive=True)
    cfg = EngineConfig(max_batch_size=16, max_seq_len=512, device="cuda", dtype="float32", kv_block=64)
    engine = EmbeddedEngine(copy.deepcopy(ref), config=cfg, draft=copy.deepcopy(draft), speculative=spec)
    c = engine.spec.controller
    script = iter(([(0, False)] * 6 + [(2, True)] + [(0, False)] * 5 + [(2, False), (2, True)]) * 20)

    def plan(batch: int) -> int:
        k, c.is_probe = next(script, (0, False))
        return k

    engine.spec.plan = plan
    ps = _prompts(6, seed=14)
    sps = [SamplingParams(max_new_tokens=70, seed=i, temperature=1.0, ignore_eos=True) for i in range(6)]
    plain = EmbeddedEngine(copy.deepcopy(ref), config=cfg)
    a, b = _run(plain, ps, sps), _run(engine, ps, sps)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    for p, o in zip(ps, b):
        assert (_logprobs(ref, p, o) - torch.tensor(o.logprobs)).abs().max() < 1e-4
    stats = engine.stats()
    assert stats["spec/eager_probes"] > 0 and stats["spec/graph_rounds"] > 0
    assert stats["spec/graph_rounds"] + stats["spec/eager_probes"] == stats["engine/spec_rounds"]
    assert not engine.spec.round_graphs.failed
