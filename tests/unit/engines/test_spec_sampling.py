"""Speculative sampling as pure functions: the output distribution is the policy's
(chi-square over many seeded rows) in rejection and coupled modes, at temperature 1 and
0.7 and with truncation; greedy rows accept iff the draft is the argmax; seeded draws are
reproducible and independent of the batch; device-side counter keys equal host keys."""

from __future__ import annotations

import pytest
import torch

from miles.engines.sampling import row_key
from miles.engines.spec.config import SpeculativeConfig, from_sglang_args, sglang_args
from miles.engines.spec.sampling import (
    ACCEPT,
    ACCEPT_STREAM,
    PLAIN,
    RoundParams,
    draft_noise,
    draft_pick,
    processed_logprobs,
    stream_seed,
    verify,
)
from miles.types import SamplingParams

from .stats import chi2_pvalue

V, K, N = 7, 2, 12000


def _dists(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-independent policy logits for K+1 positions and draft logits for K, different."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(K + 1, V, generator=g) * 1.5
    q = p[:K] + torch.randn(K, V, generator=g) * 1.5  # a draft that is often, not always, right
    return p, q


def _round(p: torch.Tensor, q: torch.Tensor, params: list[SamplingParams], mode: str, generator=None):
    rp = RoundParams.build(params, [0] * len(params), torch.device("cpu"))
    n = len(params)
    noise = draft_noise(rp, K, V, mode, generator)
    logqs, drafts = [], []
    for j in range(K):
        logq = processed_logprobs(q[j].expand(n, V), rp)
        drafts.append(draft_pick(logq, None if noise is None else noise[j]))
        logqs.append(logq)
    draft = torch.stack(drafts, 1)
    v = verify(p.expand(n, K + 1, V), draft, torch.stack(logqs, 1), rp, mode, noise=noise, generator=generator)
    return rp, draft, v


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.9, top_k=5, top_p=0.9)],
                         ids=["t1", "t0.7", "trunc"])
def test_every_position_follows_the_policy(mode: str, params: dict) -> None:
    p, q = _dists(3)
    rows = [SamplingParams(seed=1000 + i, **params) for i in range(N)]
    rp, draft, v = _round(p, q, rows, mode)
    target = processed_logprobs(p.expand(1, K + 1, V), rp.__class__.build(rows[:1], [0], torch.device("cpu")))[0].exp()
    a = v.accepted
    assert 0 < float(a.float().mean()) < K  # accepts and rejects both happen
    for j in range(K + 1):
        # Token j exists when the first j drafts were accepted; its law given that is p_j.
        sel = a >= j
        counts = torch.bincount(v.tokens[sel, j], minlength=V)
        assert chi2_pvalue(counts, target[j]) > 1e-3, (mode, j)
    # The test has power: the draft's own tokens do not follow the policy.
    wrong = chi2_pvalue(torch.bincount(draft[:, 0], minlength=V), target[0])
    assert wrong < 1e-3
    # Recorded log-probs are the policy's processed log-probs of the emitted tokens.
    expect = target.log()[torch.arange(K + 1)[None, :].expand(N, -1), v.tokens]
    used = torch.arange(K + 1)[None, :] <= a[:, None]
    assert torch.allclose(v.logprobs[used], expect[used], atol=1e-5)


@pytest.mark.parametrize("mode", ["rejection", "coupled"])
def test_unseeded_and_greedy_rows_mixed_with_seeded_ones(mode: str) -> None:
    p, q = _dists(11)
    rows = [SamplingParams(seed=None if i % 3 else i) if i % 7 else SamplingParams(temperature=0.0) for i in range(N)]
    rp, _, v = _round(p, q, rows, mode, torch.Generator().manual_seed(0))
    target = processed_logprobs(p.expand(1, K + 1, V), RoundParams.build([SamplingParams()], [0], torch.device("cpu")))[0].exp()
    greedy = torch.tensor([r.temperature == 0 for r in rows])
    assert (v.tokens[greedy, 0] == p[0].argmax()).all()
    for j in range(K + 1):
        sel = (v.accepted >= j) & ~greedy
        assert chi2_pvalue(torch.bincount(v.tokens[sel, j], minlength=V), target[j]) > 1e-3, j


def test_coupled_tokens_equal_plain_gumbel_max_sampling() -> None:
    from miles.engines.sampling import SamplingBatch, sample

    p, q = _dists(5)
    rows = [SamplingParams(seed=i, temperature=0.8) for i in range(500)]
    _, _, v = _round(p, q, rows, "coupled")
    for j in range(K + 1):
        plain, _ = sample(p[j].expand(len(rows), V).contiguous(), SamplingBatch.build(rows, [j] * len(rows)), None)
        sel = v.accepted >= j
        assert torch.equal(v.tokens[sel, j], plain[sel])


def test_greedy_accepts_iff_argmax() -> None:
    logits = torch.randn(4, K + 1, V)
    target = logits.argmax(-1)
    draft = target[:, :K].clone()
    draft[1, 0] = (draft[1, 0] + 1) % V  # row 1 is wrong at once, row 2 at the second
    draft[2, 1] = (draft[2, 1] + 1) % V
    rp = RoundParams.build([SamplingParams(temperature=0.0)] * 4, [0] * 4, torch.device("cpu"))
    logq = torch.log_softmax(torch.randn(4, K, V), -1)
    for mode in ("rejection", "coupled"):
        v = verify(logits, draft, logq, rp, mode)
        assert v.accepted.tolist() == [K, 0, 1, K]
        for b in range(4):
            assert v.tokens[b, : v.accepted[b] + 1].tolist() == target[b, : v.accepted[b] + 1].tolist()
        assert torch.allclose(v.logprobs, torch.log_softmax(logits, -1).gather(-1, v.tokens[..., None])[..., 0])


def test_seeded_rounds_reproduce_and_ignore_the_batch() -> None:
    p, q = _dists(7)
    row = SamplingParams(seed=42, temperature=1.0)
    others = [SamplingParams(seed=i) for i in range(5)] + [SamplingParams()]
    _, d1, v1 = _round(p, q, [row], "rejection")
    _, d2, v2 = _round(p, q, [*others, row], "rejection")
    assert torch.equal(d1[0], d2[-1]) and torch.equal(v1.tokens[0], v2.tokens[-1])


def test_non_finite_policy_logits_fail_the_row() -> None:
    logits = torch.randn(2, K + 1, V)
    logits[1, 0, 3] = float("nan")
    rp = RoundParams.build([SamplingParams(seed=1)] * 2, [0, 0], torch.device("cpu"))
    v = verify(logits, torch.zeros(2, K, dtype=torch.long), torch.log_softmax(torch.randn(2, K, V), -1), rp, "rejection")
    assert v.finite.tolist() == [True, False]


def test_device_keys_equal_host_keys() -> None:
    """The round's keys, computed on the device, are the plain sampler's ``row_key``."""
    rp = RoundParams.build([SamplingParams(seed=5), SamplingParams(seed=2**62 + 7)], [3, 10], torch.device("cpu"))
    off = torch.tensor([2, 4])
    assert rp.keys(PLAIN, off).tolist() == [row_key(5, 5), row_key(2**62 + 7, 14)]
    assert rp.keys(ACCEPT, off).tolist() == [row_key(stream_seed(5, ACCEPT_STREAM), 5),
                                             row_key(stream_seed(2**62 + 7, ACCEPT_STREAM), 14)]
    assert rp.keys(PLAIN, torch.tensor([[0], [1]])).tolist() == [[row_key(5, 3), row_key(2**62 + 7, 10)],
                                                                 [row_key(5, 4), row_key(2**62 + 7, 11)]]


def test_config_checks_and_sglang_mapping() -> None:
    with pytest.raises(ValueError, match="num-draft-tokens 7"):
        SpeculativeConfig(speculative_algorithm="eagle", speculative_num_steps=3, speculative_num_draft_tokens=7)
    with pytest.raises(ValueError, match="num-steps must be in"):
        SpeculativeConfig(speculative_num_steps=0)
    with pytest.raises(ValueError, match="enable-draft-training needs"):
        SpeculativeConfig(enable_draft_training=True)
    cfg = SpeculativeConfig(speculative_algorithm="eagle", speculative_num_steps=3, draft_model_path="/d")
    args = sglang_args(cfg)
    assert args["speculative-algorithm"] == "EAGLE" and args["speculative-num-draft-tokens"] == 4
    back = from_sglang_args({**args, "speculative-algorithm": "EAGLE3"})
    assert back == {"speculative_algorithm": "eagle", "speculative_num_steps": 3,
                    "speculative_num_draft_tokens": 4, "draft_model_path": "/d"}
    with pytest.raises(ValueError, match="topk"):
        from_sglang_args({"speculative-eagle-topk": 4})
