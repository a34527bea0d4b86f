"""The CPU trainer's two shortcuts leave what is learned unchanged.

- The unpadded forward (``UnpaddedAttention``, ``response_logprobs`` on the real tokens only)
  gives the padded forward's log-probs bit for bit and its gradients to float32 round-off;
  with a prompt that several rows share packed once, both to float32 round-off.
- Micro-batches run side by side (``parallel.MicroBatchPool``) train the serial loop's
  weights and report its metrics, bit for bit.
- Rows whose advantages are all 0 (``RLStep._gradless_rows``) get no forward by default and
  run forward only with ``zero_advantage_rows="forward"``: the weights of running them with
  autograd, to float32 round-off, and with "forward" its metrics too.
"""

from __future__ import annotations

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig, embedded, logprobs
from miles.trainers.batching import build_batch
from miles.trainers.parallel import MicroBatchPool
from tests.unit.trainers.conftest import make_model, make_traj, random_groups, set_behaviour


@pytest.fixture(autouse=True)
def _one_thread():
    """A CPU trainer's ops run on one thread in its actor process (``configure_process``), and
    the pool is used only then (``cpu_helpers``): with two intra-op threads the serial loop's
    reductions take another order on some CPUs, and neither comparison is bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ragged_batch():
    trajs = [t for g in random_groups(num_groups=4, size=4, seed=3) for t in g]
    for i, t in enumerate(trajs):  # prompts of different lengths too
        t.prompt_tokens = t.prompt_tokens + [5] * (i % 5)
    return build_batch(trajs, device="cpu", vocab_size=288)


@pytest.mark.parametrize("entropy", ["none", "metric"])
@pytest.mark.parametrize("shared", [False, True])
def test_unpadded_forward_matches_the_padded_one(monkeypatch: pytest.MonkeyPatch, entropy: str, shared: bool) -> None:
    """Bit for bit on ragged rows; with shared prompts packed once, to float32 round-off."""
    mb = _shared_batch() if shared else _ragged_batch()
    assert len(set(mb.seq_lens)) > 1
    model = make_model()
    out = {}
    for unpad in (False, True):
        monkeypatch.setattr(logprobs, "unpads", lambda *a, u=unpad: u)
        model.zero_grad()
        logp, ent = logprobs.response_logprobs(model, mb, temperature=0.7, dtype=torch.float32, entropy=entropy)
        (logp * mb.loss_mask).sum().backward()
        out[unpad] = logp.detach(), ent, [p.grad.clone() for p in model.parameters()]
    (lp0, e0, g0), (lp1, e1, g1) = out[False], out[True]
    atol = 1e-6 if shared else 0.0
    torch.testing.assert_close(lp0, lp1, rtol=0, atol=atol)
    if entropy == "metric":
        torch.testing.assert_close(e0, e1, rtol=0, atol=atol)
    for a, b in zip(g0, g1):  # round-off of sums taken in another order, relative to the tensor's scale
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())


def test_unpadded_path_is_the_cpu_default() -> None:
    mb = _ragged_batch().select(range(4))
    assert logprobs.unpads(mb, None, compiled=False)
    assert not logprobs.unpads(mb, None, compiled=True)
    assert not logprobs.unpads(mb, torch.zeros(1), compiled=False)  # replayed routing keeps its layout


def _shared_batch():
    """GRPO groups (a prompt per group; within a group, responses of different lengths) and
    one row alone with a group's prompt plus a token."""
    groups = random_groups(num_groups=3, size=4, seed=5)
    groups[2][3].prompt_tokens = groups[2][3].prompt_tokens + [7]
    return build_batch([t for g in groups for t in g], device="cpu", vocab_size=288, share_prompts=True)


@pytest.mark.parametrize("share", [False, True])
def test_packed_positions(share: bool) -> None:
    batch = _shared_batch() if share else _ragged_batch()
    index, positions, pred, grid = batch.packed_positions()
    flat, L = batch.input_ids.reshape(-1), batch.input_ids.shape[1]
    prompts = {tuple(batch.input_ids[n, : s - r].tolist()) for n, (s, r) in enumerate(zip(batch.seq_lens, batch.resp_lens))}
    packed = sum(batch.resp_lens) + (sum(len(p) for p in prompts) if share else sum(batch.seq_lens) - sum(batch.resp_lens))
    assert index.numel() == packed and (not share or packed < sum(batch.seq_lens))  # each prompt packed once
    assert torch.equal(positions, index % L)
    for n, s in enumerate(batch.seq_lens):  # every real cell holds its own token, a pad the zero row
        cells = grid[n * L : n * L + L]
        assert torch.equal(flat[index[cells[:s]]], batch.input_ids[n, :s])
        assert torch.equal(positions[cells[:s]], torch.arange(s))
        assert bool((cells[s:] == packed).all())
    assert torch.equal(index[grid[index]], index)  # a packed token's own cell reads it back
    rows, _, pos = batch.response_positions()
    assert torch.equal(pred, grid[rows * L + pos])  # the same predicting positions, packed


def _train(monkeypatch: pytest.MonkeyPatch, helpers: int, steps: int = 3) -> tuple[EmbeddedTrainer, list[dict]]:
    monkeypatch.setattr(embedded, "cpu_helpers", lambda device: helpers)
    config = TrainerConfig(lr=1e-2, seed=0, max_tokens_per_micro_batch=12)  # several micro-batches a step (under the pool's cap)
    trainer = EmbeddedTrainer(make_model(), config=config, algo=AlgorithmConfig(use_tis=True))
    assert (trainer._pool is not None) == (helpers > 0)
    metrics = []
    for s in range(steps):
        groups = random_groups(num_groups=4, size=4, seed=s)
        for t in (t for g in groups for t in g):
            t.versions = [trainer.version] * len(t.response_tokens)
        set_behaviour(trainer, groups, shift=0.05)
        metrics.append(trainer.train_step(groups))
    return trainer, metrics


def test_micro_batches_side_by_side_train_as_the_serial_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    serial, m_serial = _train(monkeypatch, helpers=0)
    pooled, m_pooled = _train(monkeypatch, helpers=2)
    for a, b in zip(serial.model.parameters(), pooled.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(m_serial, m_pooled):
        keys = {k for k in a if k.startswith("train/") and k not in ("train/step_time_s", "train/tokens_per_s")}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_pool_raises_a_micro_batch_error_and_stays_usable() -> None:
    pool = MicroBatchPool(1)
    w = torch.ones(3, requires_grad=True)

    def work(i: int) -> torch.Tensor:
        if i == 2:
            raise ValueError("micro-batch 2")
        return (w * (i + 1)).sum()

    with pytest.raises(ValueError, match="micro-batch 2"):
        pool.run(4, work, [w], torch.enable_grad)
    assert w.grad is None  # nothing added on an error
    pool.run(3, lambda i: (w * (i + 1)).sum(), [w], torch.enable_grad)
    assert torch.equal(w.grad, torch.full((3,), 6.0))
    pool.close()


def test_a_cpu_trainer_shares_prompts_and_plans_a_prompt_s_rows_together() -> None:
    trainer = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=40),
                              algo=AlgorithmConfig())
    groups = [[make_traj(f"t{g}_{j}", g, [10 + g] * 3, [20 + j] * 3, 1.0) for j in range(4)]
              for g in range(4)]  # rows of one length: the plan's cut is by prompt alone
    batch = trainer._batch([t for g in groups for t in g])
    assert batch.prompt_class is not None
    order = [13, 2, 7, 0, 15, 4, 9, 11, 1, 6, 3, 14, 5, 8, 10, 12]  # a step's shuffled rows
    for mb in batch.plan(order, trainer.config):
        classes = [batch.prompt_class[r] for r in mb]
        assert classes == sorted(classes)  # each prompt's rows back to back, so a cut splits few
        packed = batch.select(mb).packed_positions()[0].numel()
        assert packed == 3 * len(mb) + 3 * len(set(classes))  # its responses, each prompt once


def _train_uniform(monkeypatch: pytest.MonkeyPatch, helpers: int, gradless: bool,
                   rows: str = "forward") -> tuple[EmbeddedTrainer, list[dict]]:
    """Steps with some groups of one reward (advantage 0), then a step where every group has
    one: its gradient is all zeros, and AdamW still steps (moments, weight decay)."""
    monkeypatch.setattr(embedded, "cpu_helpers", lambda device: helpers)
    monkeypatch.setattr(EmbeddedTrainer, "runs_gradless_rows", property(lambda self: gradless))
    config = TrainerConfig(lr=1e-2, seed=0, weight_decay=0.1, max_tokens_per_micro_batch=12,
                           zero_advantage_rows=rows)
    trainer = EmbeddedTrainer(make_model(), config=config, algo=AlgorithmConfig(use_tis=True))
    metrics, seen = [], []
    for s in range(4):
        groups = random_groups(num_groups=4, size=4, seed=s)
        for gi, g in enumerate(groups):
            for t in g:
                t.versions = [trainer.version] * len(t.response_tokens)
                if s == 3 or gi % 2:
                    t.reward = float(gi % 3 == 0)  # one reward for the whole group
        set_behaviour(trainer, groups, shift=0.05)
        metrics.append(trainer.train_step(groups))
        seen.append(groups)
    trainer.groups_seen = seen  # type: ignore[attr-defined]
    return trainer, metrics


@pytest.mark.parametrize("rows", ["forward", "skip"])
@pytest.mark.parametrize("helpers", [0, 2])
def test_rows_of_zero_advantage_run_forward_only_and_train_the_same(monkeypatch: pytest.MonkeyPatch,
                                                                     helpers: int, rows: str) -> None:
    full, m_full = _train_uniform(monkeypatch, helpers, gradless=False)
    forwards = []
    original = EmbeddedTrainer._forward
    monkeypatch.setattr(EmbeddedTrainer, "_forward",
                        lambda self, model, mb, mode: forwards.append(mb.size) or original(self, model, mb, mode))
    fast, m_fast = _train_uniform(monkeypatch, helpers, gradless=True, rows=rows)
    assert [m["train/gradless_token_frac"] for m in m_full] == [0.0] * 4
    fracs = [m["train/gradless_token_frac"] for m in m_fast]
    assert all(0.0 < f < 1.0 for f in fracs[:3]) and fracs[3] == 1.0
    for a, b in zip(full.model.parameters(), fast.model.parameters()):
        # AdamW's normalised steps (lr 1e-2) carry the gradients' round-off at elements whose
        # gradient is near 0; a row's lost gradient or a skipped step would move them by ~lr
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # every row forward in "forward"; in "skip" the live rows only, but all of them in the last
    # step, where none trains (its metrics come from them)
    forwarded = sum(forwards) - 16 * 4  # less set_behaviour's pass over every row per step
    uniform = [sum(4 for g in groups if len({t.reward for t in g}) == 1) for groups in fast.groups_seen]
    assert forwarded == (64 if rows == "forward" else 16 + sum(16 - u for u in uniform[:3])), (forwards, uniform)
    assert 0 < uniform[0] < 16 and uniform[3] == 16
    for a, b in zip(m_full, m_fast):
        assert set(a) == set(b)  # the same keys every step
        for key in a:
            if key.startswith("train/") and key not in ("train/step_time_s", "train/tokens_per_s",
                                                        "train/gradless_token_frac"):
                if rows == "forward" or key in ("train/loss", "train/pg_loss", "train/grad_norm") \
                        or b["train/gradless_token_frac"] in (0.0, 1.0):
                    assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_rows_of_zero_advantage_keep_their_gradient_under_an_entropy_bonus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "cpu_helpers", lambda device: 0)
    trainer = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-2), algo=AlgorithmConfig(entropy_coef=0.01))
    assert trainer.runs_gradless_rows
    assert trainer._gradless_rows(torch.zeros(4, 3)) == frozenset()
    trainer.algo = AlgorithmConfig()
    assert trainer._gradless_rows(torch.tensor([[0.0, 0.0], [0.0, 0.5], [0.0, 0.0]])) == frozenset({0, 2})


def test_zero_advantage_rows_keep_their_forward_where_a_check_or_the_metrics_need_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import msgspec

    monkeypatch.setattr(embedded, "cpu_helpers", lambda device: 0)
    trainer = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-2, zero_advantage_rows="skip"),
                              algo=AlgorithmConfig())
    gradless = frozenset({0, 1})
    assert trainer._skips_gradless([0, 1, 2], gradless)
    assert not trainer._skips_gradless([0, 1], gradless)  # no row trains: the step's metrics come from these
    assert not trainer._skips_gradless([2, 3], frozenset())
    trainer.config = msgspec.structs.replace(trainer.config, true_on_policy_check="strict")
    assert not trainer._skips_gradless([0, 1, 2], gradless)  # the check reads every row's log-prob
    assert TrainerConfig().zero_advantage_rows == "skip"
