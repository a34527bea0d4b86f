"""Speculative decoding in the embedded engine: exact greedy tokens, tokens identical to
plain decoding in coupled mode, the policy's log-probs and versions per token, the output
distribution (chi-square) at temperature 1 and 0.7, continuous batching with different
accept lengths, stop rules, MoE routing, and the CUDA-graph verify plumbing."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from miles.engines import EngineConfig, EmbeddedEngine
from miles.engines.spec.graphs import RoundGraphs, VerifyGraphs
from miles.types import GenerateRequest, SamplingParams

from .helpers import make_engine, make_model, prompts
from .spec_helpers import full_logprobs, generate_all, spec_engine
from .stats import chi2_pvalue

KINDS = ["draft", "eagle"]


def _requests(ps: list[list[int]], sps: list[SamplingParams], **kw) -> list[GenerateRequest]:
    return [GenerateRequest(rid=str(i), input_ids=p, sampling=s, **kw) for i, (p, s) in enumerate(zip(ps, sps))]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_plain_decoding(kind: str) -> None:
    policy = make_model(seed=1)
    ps = prompts(7, seed=2)
    sps = [SamplingParams(max_new_tokens=12 + 9 * (i % 3), temperature=0.0, ignore_eos=True) for i in range(7)]
    plain = generate_all(make_engine(policy, max_batch_size=4), _requests(ps, sps, return_hidden_states=True))
    engine = spec_engine(policy, kind, max_batch_size=4)  # 7 requests through 4 slots: joins and leaves
    outs = generate_all(engine, _requests(ps, sps, return_hidden_states=True))
    stats = engine.stats()
    assert stats["spec/rounds"] > 0 and stats["spec/accept_len"] > 1.0
    for p, a, b in zip(ps, plain, outs):
        assert b.output_ids == a.output_ids
        assert b.versions == a.versions == [0] * len(a.output_ids)
        assert (torch.tensor(b.logprobs) - full_logprobs(policy, p, b)).abs().max() < 1e-5
        assert b.spec_verify_count > 0
        h = engine.pop_hidden_states(b.rid)
        ids = torch.tensor([p + b.output_ids])
        with torch.no_grad():
            full = policy(ids, return_hidden=True).hidden[0, :-1]
        assert h.shape == full.shape and torch.allclose(h, full, atol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_coupled_mode_reproduces_plain_sampling_exactly(kind: str) -> None:
    policy = make_model(seed=3)
    ps = prompts(6, seed=4)
    sps = [SamplingParams(max_new_tokens=30, temperature=t, top_p=tp, seed=10 + i, ignore_eos=True)
           for i, (t, tp) in enumerate([(1.0, 1.0), (0.7, 1.0), (0.9, 0.8)] * 2)]
    plain = generate_all(make_engine(policy), _requests(ps, sps))
    outs = generate_all(spec_engine(policy, kind, mode="coupled", k=4), _requests(ps, sps))
    for a, b in zip(plain, outs):
        assert b.output_ids == a.output_ids and b.versions == a.versions
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_mode_records_the_policys_logprobs(kind: str, temperature: float) -> None:
    policy = make_model(seed=5)
    ps = prompts(8, seed=6)
    sps = [SamplingParams(max_new_tokens=25 + 5 * (i % 4), temperature=temperature, seed=i, ignore_eos=True)
           for i in range(8)]
    engine = spec_engine(policy, kind, max_batch_size=5)
    outs = generate_all(engine, _requests(ps, sps))
    accepted = [o.spec_accepted_tokens / max(o.spec_verify_count, 1) for o in outs]
    assert len(set(accepted)) > 1  # rows accepted different numbers of drafts per round
    for p, s, o in zip(ps, sps, outs):
        assert len(o.output_ids) == s.max_new_tokens and o.versions == [0] * s.max_new_tokens
        assert (torch.tensor(o.logprobs) - full_logprobs(policy, p, o, temperature)).abs().max() < 1e-5


def _exact_marginals(policy, prompt: list[int], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """P(t0) and P(t1) = Σ_x P(t0 = x) P(t1 | x) under the policy at ``temperature``."""
    V = policy.config.vocab_size
    with torch.no_grad():
        p0 = torch.softmax(policy(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        ids = torch.tensor([prompt + [x] for x in range(V)])
        p1 = torch.softmax(policy(ids).logits[:, -1] / temperature, -1)
    return p0, p0 @ p1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_output_distribution_is_the_policys(kind: str, temperature: float) -> None:
    """k = 1: token 0 comes from a round's accept / residual, token 1 from the bonus (when the
    draft was accepted) or from the next round; their marginals must be the policy's."""
    policy = make_model(seed=7)
    prompt = prompts(1, seed=8)[0]
    n = 3000
    sps = [SamplingParams(max_new_tokens=2, temperature=temperature, seed=50_000 + i, ignore_eos=True) for i in range(n)]
    engine = spec_engine(policy, kind, k=1, max_batch_size=64, max_seq_len=64)
    outs = generate_all(engine, _requests([prompt] * n, sps))
    assert 0.05 < engine.stats()["spec/accept_rate"] < 0.95  # both paths were taken
    p0, p1 = _exact_marginals(policy, prompt, temperature)
    V = policy.config.vocab_size
    t0 = torch.bincount(torch.tensor([o.output_ids[0] for o in outs]), minlength=V)
    t1 = torch.bincount(torch.tensor([o.output_ids[1] for o in outs]), minlength=V)
    assert chi2_pvalue(t0, p0) > 1e-3
    assert chi2_pvalue(t1, p1) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_one_token_prompts(kind: str) -> None:
    policy = make_model(seed=18)
    ps = [[7], [9], [11, 12]]
    sps = [SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)] * 3
    plain = generate_all(make_engine(policy), _requests(ps, sps))
    outs = generate_all(spec_engine(policy, kind), _requests(ps, sps))
    assert [o.output_ids for o in outs] == [o.output_ids for o in plain]


def test_stop_token_inside_a_round_ends_the_output_there() -> None:
    policy = make_model(seed=9)
    p = prompts(1, seed=10)[0]
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    ref = generate_all(make_engine(policy), _requests([p], [greedy]))[0]
    stop = ref.output_ids[7]
    first = ref.output_ids.index(stop)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[stop])
    out = generate_all(spec_engine(policy, "draft", k=4), _requests([p], [sp]))[0]
    assert out.finish_reason == "stop" and out.matched_stop == stop
    assert out.output_ids == ref.output_ids[: first + 1]


def test_moe_policy_records_routing_per_token() -> None:
    policy = make_model(seed=11, moe=True)
    ps = prompts(3, seed=12)
    sps = [SamplingParams(max_new_tokens=20, seed=i, ignore_eos=True) for i in range(3)]
    from miles.models.draft import build_draft

    draft = build_draft("draft", policy.config, seed=3)
    outs = generate_all(spec_engine(policy, "draft", draft=draft), _requests(ps, sps, return_routed_experts=True))
    L, k = len(policy.config.moe_layers), policy.config.num_experts_per_tok
    for p, o in zip(ps, outs):
        assert len(o.routed_experts) == 20 and all(len(r) == L and len(r[0]) == k for r in o.routed_experts)
        assert (torch.tensor(o.logprobs) - full_logprobs(policy, p, o)).abs().max() < 1e-5


def test_verify_graph_plumbing_on_cpu() -> None:
    """The CUDA-graph verify path's buffers, padding and buckets, with a fake replay."""
    policy = make_model(seed=13)
    engine = spec_engine(policy, "draft", max_batch_size=6, kv_block=32)
    graphs = VerifyGraphs(engine.runner, 4)
    graphs._capture = lambda step: types.SimpleNamespace(replay=step)  # 'replay' runs the step eagerly
    engine.runner.verify_graphs = graphs
    ps = prompts(9, seed=14)
    sps = [SamplingParams(max_new_tokens=10 + 7 * (i % 4), seed=i, ignore_eos=True) for i in range(9)]
    outs = generate_all(engine, _requests(ps, sps))
    assert {nb for nb, _, _ in graphs.graphs} >= {6, 4} and len({L for _, L, _ in graphs.graphs}) > 1
    for p, s, o in zip(ps, sps, outs):
        assert len(o.output_ids) == s.max_new_tokens
        assert (torch.tensor(o.logprobs) - full_logprobs(policy, p, o)).abs().max() < 1e-5


def _fake_round_graphs(engine: EmbeddedEngine, k: int, *, all_k: bool = False) -> RoundGraphs:
    """Round graphs whose 'replay' runs the captured step eagerly: the graph path's buffers,
    padding and read-back, on the CPU. A capture runs the step twice first, as
    ``capture_graph``'s warm-up runs do on CUDA (their side effects must be harmless)."""
    graphs = RoundGraphs(engine.spec, k, all_k=all_k)

    def capture(step):
        step(), step()
        return types.SimpleNamespace(replay=step)

    graphs._capture = capture
    engine.spec.round_graphs = graphs
    return graphs


@pytest.mark.parametrize("kind", KINDS)
def test_round_graph_plumbing_on_cpu(kind: str) -> None:
    """The whole-round CUDA graph path (static inputs, padding rows, outputs read back before
    the next replay), with a fake replay; seeded rows use it, unseeded ones run eagerly."""
    policy = make_model(seed=16)
    engine = spec_engine(policy, kind, mode="coupled", k=3, max_batch_size=6)
    graphs = _fake_round_graphs(engine, 3)
    ps = prompts(9, seed=17)
    sps = [SamplingParams(max_new_tokens=12 + 7 * (i % 4), seed=i, temperature=(0.0, 1.0, 0.8)[i % 3],
                          top_p=(1.0, 1.0, 0.9)[i % 3], ignore_eos=True) for i in range(9)]
    plain = generate_all(make_engine(policy, max_batch_size=6), _requests(ps, sps))
    outs = generate_all(engine, _requests(ps, sps, return_hidden_states=True))
    assert {nb for nb, *_ in graphs.graphs} >= {6, 4}  # padded buckets were used
    for p, a, b in zip(ps, plain, outs):
        assert b.output_ids == a.output_ids and b.spec_verify_count > 0
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
        ids = torch.tensor([p + b.output_ids])
        with torch.no_grad():
            full = policy(ids, return_hidden=True).hidden[0, :-1]
        assert torch.allclose(engine.pop_hidden_states(b.rid), full, atol=1e-4)


def _same_as_plain(policy: Any, engine: EmbeddedEngine, seed: int) -> None:
    """4 seeded requests (temperatures 1 and 0.8): ``engine`` gives plain decoding's tokens,
    versions and log-probs."""
    ps = prompts(4, seed=seed)
    sps = [SamplingParams(max_new_tokens=40, seed=i, temperature=(1.0, 0.8)[i % 2], ignore_eos=True) for i in range(4)]
    plain = generate_all(make_engine(policy, max_batch_size=4), _requests(ps, sps))
    outs = generate_all(engine, _requests(ps, sps))
    for a, b in zip(plain, outs):
        assert b.output_ids == a.output_ids and b.versions == a.versions
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def _scripted_graph_rounds(kind: str, script: list[int], seed: int, *,
                           all_k: bool = False) -> tuple[dict[str, float], set[int], RoundGraphs]:
    """Run 4 seeded requests under a scripted choice of k (0 = a plain step) with fake round
    graphs; check that the tokens are plain decoding's and that no round ran eagerly.
    Returns the engine's stats, the k of every round graph captured, and the graphs."""
    policy = make_model(seed=seed)
    engine = spec_engine(policy, kind, mode="coupled", k=3, max_batch_size=4)
    graphs = _fake_round_graphs(engine, 3, all_k=all_k)
    steps = iter(script * 20)
    engine.spec.plan = lambda batch: next(steps, 0)
    _same_as_plain(policy, engine, seed + 1)
    stats = engine.stats()
    assert stats["spec/graph_rounds"] == stats["engine/spec_rounds"] > 0  # no round ran eagerly
    return stats, {key[2] for key in graphs.graphs}, graphs


@pytest.mark.parametrize("kind", KINDS)
def test_rounds_after_plain_streaks_replay_their_graph(kind: str) -> None:
    """When the adaptive rule switches speculation back on after a plain stretch, the draft's
    backlog is fed first, so the round still fits its graph instead of running eagerly."""
    stats, ks, _ = _scripted_graph_rounds(kind, [0, 0, 0, 0, 0, 3, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 2], seed=18)
    assert stats["spec/backlog_flushes"] > 0 and ks == {2, 3}


@pytest.mark.parametrize("kind", KINDS)
def test_a_lower_k_or_one_plain_step_needs_no_feed_before_the_round(kind: str) -> None:
    """A round graph's catch-up takes k_max + 2 entries whatever its k: a round after a
    longer one (the adaptive rule lowered k) or after one plain step (a probe) replays its
    graph at once. Only a longer plain stretch is fed to the draft first."""
    stats, ks, _ = _scripted_graph_rounds(kind, [3, 1, 3, 0, 1, 3, 0, 3, 2, 1], seed=20)
    assert stats["spec/backlog_flushes"] == 0 and ks == {1, 2, 3}


@pytest.mark.parametrize("kind", KINDS)
def test_adaptive_engines_capture_every_k_of_a_bucket_at_once(kind: str) -> None:
    """With ``all_k`` the first round in a (batch, context) bucket captures the graphs of
    k = 1..k_max there, so a rule that changes k later captures nothing new in that bucket;
    the other k's warm-up runs (K/V past the round's entries) leave the tokens, log-probs
    and versions exactly plain decoding's."""
    # k = 1 first in most buckets: the other k's warm-ups write past the round's entries
    _, ks, graphs = _scripted_graph_rounds(kind, [1, 1, 2, 1, 1, 3, 1], seed=22, all_k=True)
    keys = graphs.graphs
    buckets = {(nb, L, mode, flags) for nb, L, _, mode, flags in keys}
    assert ks == {1, 2, 3} and len(keys) == 3 * len(buckets)
    _, lazy, _ = _scripted_graph_rounds(kind, [1, 1, 1, 1, 1, 1, 1], seed=22)
    assert lazy == {1}  # the control: without all_k only the k that ran is captured


@pytest.mark.parametrize("kind", KINDS)
def test_probes_at_uncaptured_shapes_run_eagerly_and_untimed(kind: str) -> None:
    """A probe (the adaptive rule sampling an option it does not run) whose round graph is not
    captured runs eagerly with no graph at all and reports no time, only its acceptance; a
    chosen round captures; a probe at a captured shape replays it and is timed. The tokens,
    log-probs and versions are plain decoding's throughout."""
    policy = make_model(seed=24)
    engine = spec_engine(policy, kind, mode="coupled", k=3, max_batch_size=4)
    _fake_round_graphs(engine, 3)
    c = engine.spec.controller
    script = iter([(2, True), (2, False), (2, True), (0, False), (0, False)] * 20)

    def plan(batch: int) -> int:
        k, c.is_probe = next(script, (0, False))
        return k

    engine.spec.plan = plan
    seen, observe = [], c.observe_round
    c.observe_round = lambda b, k, seconds, *a, **kw: (seen.append((c.is_probe, seconds)), observe(b, k, seconds, *a, **kw))
    _same_as_plain(policy, engine, 25)
    stats = engine.stats()
    assert seen[0] == (True, None)  # the first round: a probe at a new shape
    assert all(probe for probe, seconds in seen if seconds is None)  # only probes go untimed
    assert any(probe and seconds is not None for probe, seconds in seen)  # a probe at a captured shape
    assert stats["spec/eager_probes"] == sum(seconds is None for _, seconds in seen) > 0
    assert stats["spec/graph_rounds"] + stats["spec/eager_probes"] == stats["engine/spec_rounds"]
    assert c.rates.count[(4, 2)] == sum(seconds is not None for _, seconds in seen)  # times: graph rounds only
    assert sum(c.accept.reach) > 0


def test_engine_without_draft_or_with_bad_draft() -> None:
    from miles.engines.spec import SpeculativeConfig
    from miles.models.draft import build_draft

    policy = make_model(seed=15)
    engine = make_engine(policy)
    assert engine.draft_version == -1 and engine.spec_stats() == {}
    with pytest.raises(RuntimeError, match="no draft model"):
        engine.stage_draft_weights([])
    bad = build_draft("draft", make_model(seed=1, vocab_size=300).config)
    with pytest.raises(ValueError, match="vocab_size 300"):
        EmbeddedEngine(make_model(seed=15), config=EngineConfig(max_batch_size=2, max_seq_len=64), draft=bad,
                       speculative=SpeculativeConfig(speculative_algorithm="draft"))
