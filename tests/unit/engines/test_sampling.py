"""Sampling: recorded log-probs, truncation, seeded counter-based draws, and that the draws
follow the intended distribution."""

from __future__ import annotations

import math

import pytest
import torch

from miles.engines.sampling import (UNIFORM_BITS, SamplingBatch, counter_uniform, recorded_logprobs, row_key, sample,
                                    truncate, unit)
from miles.types import SamplingParams


def _batch(params: list[SamplingParams], positions: list[int] | None = None) -> SamplingBatch:
    return SamplingBatch.build(params, positions or [0] * len(params))


def test_logprob_is_log_softmax_over_temperature_without_truncation() -> None:
    logits = torch.randn(4, 50) * 3
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 1.7, 0.9)]
    tok, lp = sample(logits, _batch(params), torch.Generator().manual_seed(0))
    temps = torch.tensor([0.5, 1.0, 1.7, 0.9])
    ref = torch.log_softmax(logits / temps[:, None], -1).gather(-1, tok[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=1e-6)


@pytest.mark.parametrize("temps", [(0.0, 0.7, 1.0, 1e-7, 1.3), (1.0, 1.0), (0.0, 0.0)])
def test_recorded_logprobs_of_the_drawn_tokens_are_samples_own_bitwise(temps: tuple[float, ...]) -> None:
    """The log-probs --true-on-policy gives the fused draw's tokens are those ``sample`` records for
    the same tokens, bit for bit, greedy and tempered rows mixed (it takes the same ops)."""
    logits = torch.randn(len(temps), 300, generator=torch.Generator().manual_seed(3)) * 3
    batch = _batch([SamplingParams(temperature=t, seed=i) for i, t in enumerate(temps)])
    tok, lp = sample(logits, batch, None)
    assert torch.equal(recorded_logprobs(logits, batch, tok), lp)


def test_greedy_rows_take_argmax_and_record_t1_logprob() -> None:
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1e-7)]
    tok, lp = sample(logits, _batch(params), None)
    for row in (0, 2):
        assert tok[row] == logits[row].argmax()
        assert math.isclose(lp[row].item(), torch.log_softmax(logits[row], -1).max().item(), abs_tol=1e-6)


def test_truncate_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    out = truncate(logits, torch.tensor([2, -1, -1]), torch.tensor([1.0, 0.8, 0.5]))
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False, False]  # top-2
    assert kept[1].tolist() == [True, True, True, False, False]  # 0.5+0.2 < 0.8 → third kept
    assert kept[2].tolist() == [True, False, False, False, False]  # the top token always stays
    assert torch.equal(out[kept], logits[kept])


def test_truncated_logprob_is_renormalised() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    tok, lp = sample(logits, _batch([SamplingParams(top_k=2, seed=3)]), None)
    renorm = torch.tensor([0.5, 0.3]) / 0.8
    assert tok.item() in (0, 1)
    assert math.isclose(lp.item(), math.log(renorm[tok.item()]), abs_tol=1e-6)


def test_counter_uniform_is_a_pure_function_of_key_and_index() -> None:
    keys = torch.tensor([row_key(7, 0), row_key(7, 1), row_key(8, 0)])
    u = counter_uniform(keys, 1000)
    assert torch.equal(u, counter_uniform(keys, 1000))
    assert torch.equal(u[1:2], counter_uniform(keys[1:2], 1000))  # independent of the batch
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02  # roughly uniform


def test_hashed_uniforms_are_exact_and_inside_0_1_at_both_ends() -> None:
    """Every value of the hash's top bits maps to (k + 0.5) / 2^bits exactly, strictly inside
    (0, 1). A 24-bit form rounded k + 0.5 in float32, and the top k gave u = 1.0 exactly:
    an infinite Gumbel score."""
    top = (1 << UNIFORM_BITS) - 1
    k = torch.tensor([0, 1, (1 << (UNIFORM_BITS - 1)) + 1, top - 1, top])
    u = unit(k)
    assert u.dtype == torch.float32 and torch.equal(u.double(), (k.double() + 0.5) / (1 << UNIFORM_BITS))
    assert 0 < u.min() and u.max() < 1 and torch.isfinite(-torch.log(-torch.log(u))).all()


def test_a_near_certain_token_is_always_drawn_from_a_large_vocabulary() -> None:
    """One token 40 nats above the rest of a 152k vocabulary: every seeded draw takes it (any
    other has probability ~6e-13 a draw). With uniforms that could reach 1.0, ~0.9% of such draws
    (152k / 2^24) took a random token: ~11 of these 1200."""
    V, rows = 151936, 300
    logits = torch.zeros(rows, V)
    logits[:, 7] = 40.0
    for chunk in range(4):
        params = [SamplingParams(seed=chunk)] * rows
        tok, logprob = sample(logits, _batch(params, list(range(rows))), None)
        assert (tok == 7).all(), tok[tok != 7].tolist()
        assert logprob.abs().max() < 1e-6


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    logits = torch.randn(1, 64)
    p = SamplingParams(seed=11)
    alone, _ = sample(logits, _batch([p], [5]), torch.Generator().manual_seed(0))
    crowd = torch.cat([torch.randn(3, 64), logits])
    params = [SamplingParams(), SamplingParams(seed=2), SamplingParams(top_p=0.5), p]
    together, _ = sample(crowd, _batch(params, [0, 3, 9, 5]), torch.Generator().manual_seed(99))
    assert together[3] == alone[0]


def test_sampled_frequencies_follow_the_distribution() -> None:
    """Chi-square goodness of fit over many seeded positions (deterministic, not flaky)."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 4000
    logits = torch.log(probs).expand(n, -1).contiguous()
    params = [SamplingParams(seed=123)] * n
    tok, _ = sample(logits, _batch(params, list(range(n))), None)
    counts = torch.bincount(tok, minlength=5).float()
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    assert chi2 < 18.47  # 99.9% quantile of chi-square with 4 degrees of freedom
    # Top-p=0.7 sampling draws from {0, 1, 2} renormalised (0.4 + 0.25 < 0.7 → third kept).
    params = [SamplingParams(seed=5, top_p=0.7)] * n
    tok, _ = sample(logits, _batch(params, list(range(n))), None)
    counts = torch.bincount(tok, minlength=5).float()
    assert counts[3:].sum() == 0
    kept = probs[:3] / probs[:3].sum()
    chi2 = (((counts[:3] - n * kept) ** 2) / (n * kept)).sum().item()
    assert chi2 < 13.82  # 2 degrees of freedom


def test_a_compiled_draw_that_fails_one_shape_class_keeps_the_others() -> None:
    """The H200 compile of the seeded draw raised for one size-1 class (a Triton int32
    overflow), and that switched every draw to eager. Now only the failing class (or one
    that gives other numbers) is left out; the probes use the fake compiled copies below."""
    from miles.engines.sampling import _mix, verified_classes

    def raises_on_one_key_one_draw(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if keys.numel() == 1 and offsets.numel() == 1:
            raise ValueError("Scalar -7046029254386353131 is out of range for type int32")
        return _mix(keys, offsets)

    def wrong_for_one_key(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return _mix(keys, offsets) * (0.5 if keys.numel() == 1 else 1.0)

    cpu = torch.device("cpu")
    assert verified_classes(_mix, cpu) == {(False, False), (False, True), (True, False), (True, True)}
    assert verified_classes(raises_on_one_key_one_draw, cpu) == {(False, False), (False, True), (True, False)}
    assert verified_classes(wrong_for_one_key, cpu) == {(False, False), (False, True)}


def test_engines_report_how_many_draw_classes_run_fused() -> None:
    """The count reaches engine stats (and from there the run's metrics), so an eager draw
    shows up; the fused draw is CUDA's alone, so a CPU engine reports 0."""
    from miles.engines import EmbeddedEngine, EngineConfig
    from miles.engines.sampling import fused_draw_classes
    from miles.models import CausalLM, tiny_config

    engine = EmbeddedEngine(CausalLM(tiny_config()), config=EngineConfig(max_batch_size=2, max_seq_len=32))
    assert engine.stats()["engine/fused_draw_classes"] == 0.0
    assert fused_draw_classes() == 0  # nothing compiled in a CPU process


def test_fused_sampling_is_off_by_default_on_the_cpu_and_asked_for_where_it_cannot_run_it_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused Triton sampler is a CUDA path: auto leaves the CPU on the torch draw, and
    ``fused_sampling=True`` where the kernel cannot run is a clear error, not a silent fallback."""
    from miles.engines import EngineConfig
    from miles.engines import sampling as S

    assert EngineConfig().use_fused_sampling() is False
    assert EngineConfig(fused_sampling=False).use_fused_sampling() is False
    monkeypatch.setattr(S, "fused_failure", lambda device: "needs triton and a CUDA device (device 'cpu')")
    with pytest.raises(ValueError, match="fused_sampling cannot run here: the kernel needs triton"):
        EngineConfig(fused_sampling=True).use_fused_sampling()
