"""Trainer building blocks: config validation, LR schedule, micro-batch plan, the fused
LM-head log-prob function, batching layout and metric folding."""

from __future__ import annotations

import math
import shutil

import msgspec
import pytest
import torch

from miles.trainers import TrainerConfig, TrainerConfigError, lr_at
from miles.trainers.batching import build_batch, plan_micro_batches
from miles.trainers.logprobs import linear_logprobs
from miles.trainers.metrics import MetricAccumulator
from tests.unit.trainers.conftest import make_traj


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr_decay_style", "step"), ("dtype", "float16"), ("lr", -1.0), ("min_lr", 1.0),
     ("adam_beta2", 1.0), ("micro_batch_size", 0), ("num_steps_per_rollout", 0),
     ("max_consecutive_nonfinite", 0), ("rollout_temperature", 0.0), ("device", "tpu"),
     ("clip_grad", -1.0)],
)
def test_config_errors_name_the_field(field: str, value: object) -> None:
    with pytest.raises(TrainerConfigError, match=f"TrainerConfig.{field}"):
        TrainerConfig(**{field: value})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({field: value}, TrainerConfig)


def test_decay_needs_steps() -> None:
    with pytest.raises(TrainerConfigError, match="lr_decay_steps"):
        TrainerConfig(lr_decay_style="cosine")


def test_lr_schedule() -> None:
    c = TrainerConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_style="cosine", lr_decay_steps=10)
    assert [lr_at(s, c) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, c) == 1.0
    assert lr_at(9, c) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, c) == pytest.approx(0.1) and lr_at(100, c) == pytest.approx(0.1)
    lin = TrainerConfig(lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_decay_steps=4)
    assert [lr_at(s, lin) for s in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert lr_at(50, TrainerConfig(lr=0.3)) == 0.3


def test_micro_batch_plan() -> None:
    lens = [5, 9, 2, 9, 4]
    plan = plan_micro_batches(range(5), lens, micro_batch_size=2, max_tokens=None)
    assert plan == [[1, 3], [0, 4], [2]]
    plan = plan_micro_batches(range(5), lens, micro_batch_size=None, max_tokens=18)
    assert plan == [[1, 3], [0, 4, 2]]  # 2 rows × 9, then 3 rows × 5 = 15 ≤ 18
    assert plan_micro_batches([0, 1], [30, 2], micro_batch_size=None, max_tokens=10) == [[0], [1]]
    rows = sorted(r for p in plan_micro_batches(range(5), lens, micro_batch_size=1, max_tokens=3) for r in p)
    assert rows == [0, 1, 2, 3, 4]


def test_micro_batch_plan_splits_off_the_long_tail() -> None:
    """One long row among short ones: padding them all to it costs more than a second
    micro-batch, so the long row goes alone (no limits set, the default in a run)."""
    lens = [5] * 20 + [100]
    plan = plan_micro_batches(range(21), lens, micro_batch_size=None, max_tokens=None)
    assert plan == [[20], list(range(20))]
    assert plan_micro_batches(range(21), lens, micro_batch_size=None, max_tokens=None, cost=10**6) == [
        [20, *range(20)]]  # when a micro-batch costs more than any padding: one


def test_micro_batch_plan_is_the_cheapest_cut_of_the_sorted_order() -> None:
    """Against every way to cut the longest-first order into consecutive micro-batches."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 8)
        lens = [rng.choice([1, 2, 3, 50, 400]) + rng.randint(0, 3) for _ in range(n)]
        limit, rows_cap, cost = rng.choice([None, 400, 800]), rng.choice([None, 2, 3]), rng.choice([0, 30, 500])
        order = sorted(range(n), key=lambda r: -lens[r])

        def price(plan):
            if any(rows_cap and len(m) > rows_cap for m in plan):
                return float("inf")
            if any(limit and len(m) > 1 and len(m) * lens[m[0]] > limit for m in plan):
                return float("inf")
            return sum(len(m) * lens[m[0]] + cost for m in plan)

        cuts = [[order[a:b] for a, b in zip((0, *c), (*c, n))]
                for k in range(n) for c in itertools.combinations(range(1, n), k)]
        plan = plan_micro_batches(range(n), lens, micro_batch_size=rows_cap, max_tokens=limit, cost=cost)
        assert sorted(r for m in plan for r in m) == list(range(n))
        assert price(plan) == min(price(c) for c in cuts)


def test_batch_layout() -> None:
    a = make_traj("a", 0, [5, 6, 7], [10, 11], env=(1,))
    b = make_traj("b", 0, [8], [12, 13, 14, 15])
    batch = build_batch([a, b], device="cpu", vocab_size=288)
    assert batch.input_ids.tolist() == [[5, 6, 7, 10, 11], [8, 12, 13, 14, 15]]
    assert batch.response_ids.tolist() == [[10, 11, 0, 0], [12, 13, 14, 15]]
    assert batch.loss_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1]]
    rows, cols, pos = batch.response_positions()
    assert pos.tolist() == [2, 3, 0, 1, 2, 3]  # logits at P + j - 1 predict token j
    sub = batch.select([0])
    assert sub.input_ids.shape == (1, 5) and sub.response_ids.shape == (1, 2)
    # ragged rows, an empty response among them: every per-token tensor zero-padded in place
    c = make_traj("c", 1, [9, 9], [], version=0)
    d = make_traj("d", 1, [4], [16, 17, 18], version=3, logprobs=[-0.5, -1.5, -2.5])
    batch = build_batch([c, d, a], device="cpu", vocab_size=288)
    assert batch.input_ids.tolist() == [[9, 9, 0, 0, 0], [4, 16, 17, 18, 0], [5, 6, 7, 10, 11]]
    assert batch.logp_rollout.tolist() == [[0.0, 0.0, 0.0], [-0.5, -1.5, -2.5], [-1.0, 0.0, 0.0]]
    assert batch.versions.tolist() == [[0, 0, 0], [3, 3, 3], [0, 0, 0]]
    assert batch.response_lens.tolist() == [0, 3, 2] and batch.prompt_lens.tolist() == [2, 1, 3]
    assert batch.loss_tokens == [0, 3, 1]  # host counts: a step plans and weighs without device reads
    rows, cols, pos = batch.response_positions()  # built on the host, an empty row among them
    assert rows.tolist() == [1, 1, 1, 2, 2] and cols.tolist() == [0, 1, 2, 0, 1]
    assert pos.tolist() == [0, 1, 2, 2, 3]
    assert batch.select([2, 1]).loss_tokens == [1, 3]
    # the host counts give the denominators the device mask gives
    from miles.algorithms import LossDenominators

    rows = [0, 2]
    dev = LossDenominators.of(batch.loss_mask[rows])._replace(max_tokens=batch.loss_mask.shape[1])
    assert batch.denominators(rows) == dev


def test_linear_logprobs_matches_log_softmax_and_its_gradient() -> None:
    torch.manual_seed(0)
    h = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 11, (7,))
    logp, ent = linear_logprobs(h, w, tgt, temperature=0.8, with_entropy=True)
    ref_lsm = torch.log_softmax((h @ w.T) / 0.8, dim=-1)
    torch.testing.assert_close(logp, ref_lsm.gather(1, tgt[:, None]).squeeze(1))
    torch.testing.assert_close(ent, -(ref_lsm.exp() * ref_lsm).sum(-1))
    assert torch.autograd.gradcheck(lambda hh, ww: linear_logprobs(hh, ww, tgt, temperature=0.8)[0], (h, w))
    # float32 / bfloat16 compute: log-probs in float32, close to the float64 reference
    lp32, _ = linear_logprobs(h.float(), w.float(), tgt, temperature=0.8)
    assert lp32.dtype == torch.float32
    torch.testing.assert_close(lp32.double(), logp.detach(), atol=1e-5, rtol=1e-5)
    lp16, _ = linear_logprobs(h.float(), w.float(), tgt, temperature=0.8, dtype=torch.bfloat16)
    assert lp16.dtype == torch.float32 and (lp16.double() - logp.detach()).abs().max() < 0.1


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compiled_linear_logprobs_match_the_eager_chunks() -> None:
    """The compiled trainer's log-softmax (one fused pass, no row chunks) gives the eager
    path's log-probs, entropy and gradients, over changing row counts (1 row runs eager)."""
    torch.manual_seed(0)
    w = torch.randn(37, 6, requires_grad=True)
    for rows in (9, 4, 1, 13):
        h = torch.randn(rows, 6, requires_grad=True)
        tgt = torch.randint(0, 37, (rows,))
        out = {}
        for compiled in (False, True):
            logp, ent = linear_logprobs(h, w, tgt, temperature=0.7, with_entropy=True, compiled=compiled)
            gh, gw = torch.autograd.grad((logp * torch.linspace(-1, 2, rows)).sum(), (h, w))
            out[compiled] = (logp, ent, gh, gw)
        for a, b in zip(out[False], out[True]):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compiled_logprob_kernels_keep_the_vocabulary_static() -> None:
    """Only the row count is dynamic in the compiled log-softmax kernels: new row counts
    reuse the graphs, and the vocabulary is a constant in them (a dynamic one made the GPU
    kernels divide by it for every element)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)

    def run(rows: int, vocab: int = 29) -> None:
        h = torch.randn(rows, 6, requires_grad=True)
        w = torch.randn(vocab, 6, requires_grad=True)
        logp, _ = linear_logprobs(h, w, torch.randint(0, vocab, (rows,)), temperature=0.9, with_entropy=True,
                                  compiled=True)
        logp.sum().backward()

    run(7)
    before = counters["stats"]["unique_graphs"]
    for rows in (3, 11, 40):
        run(rows)
    assert counters["stats"]["unique_graphs"] == before  # rows are dynamic
    run(11, vocab=31)
    after = counters["stats"]["unique_graphs"]
    assert after > before  # the vocabulary is a constant of the graphs: a new one compiles
    run(5, vocab=31)
    run(9)
    assert counters["stats"]["unique_graphs"] == after  # ... and both stay served


def test_metric_accumulator() -> None:
    acc = MetricAccumulator()
    acc.add({"train/x": torch.tensor(1.0), "train/r_max": torch.tensor(2.0), "train/loss": 0.5},
            weight=1.0, sums=("train/loss",))
    acc.add({"train/x": torch.tensor(4.0), "train/r_max": torch.tensor(3.0), "train/loss": 0.25},
            weight=3.0, sums=("train/loss",))
    acc.end_group()
    acc.add({"train/loss": 1.25}, weight=1.0, sums=("train/loss",))
    out = acc.result()
    assert out == {"train/x": pytest.approx(13 / 4), "train/r_max": 3.0, "train/loss": pytest.approx(1.0)}


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler")
def test_compiled_logprobs_in_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled, the rows go COMPILED_ROWS at a time (the bound lets the compiler index in 32
    bits); a one-row remainder runs eagerly. Log-probs and gradients match the eager path."""
    from miles.trainers import logprobs

    monkeypatch.setattr(logprobs, "COMPILED_ROWS", 8)
    assert [(sl.start, fast) for sl, fast in logprobs._row_chunks(17, 50, True)] == [(0, True), (8, True), (16, False)]
    torch.manual_seed(1)
    w = torch.randn(41, 6, requires_grad=True)
    h = torch.randn(17, 6, requires_grad=True)
    tgt = torch.randint(0, 41, (17,))
    out = {}
    for compiled in (False, True):
        logp, ent = linear_logprobs(h, w, tgt, temperature=0.8, with_entropy=True, compiled=compiled)
        out[compiled] = (logp, ent, *torch.autograd.grad((logp * torch.linspace(-1, 1, 17)).sum(), (h, w)))
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_split_log_sum_exp_matches_the_plain_one() -> None:
    """The compiled path's piecewise log-sum-exp and entropy (pieces merged by their
    maxima) equal the one-piece form, including rows whose pieces differ by far in scale."""
    from miles.trainers.logprobs import _lse_rows, _lse_split_rows, _split_of

    assert _split_of(151936) == 32 and _split_of(4096) == 4 and _split_of(1031) == 1 and _split_of(3000) == 2
    torch.manual_seed(0)
    x = torch.randn(5, 8192, dtype=torch.float64) * 3
    x[1, :2048] += 80.0  # one piece dominates the row
    x[2, 6000:] -= 200.0  # one piece vanishes
    for with_entropy in (False, True):
        lse, ent = _lse_split_rows(x, 0.7, with_entropy)
        ref_lse, ref_ent = _lse_rows(x, 0.7, with_entropy)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-10, atol=1e-10)
