"""The train-step template (``miles.trainers.step.RLStep``) with backends of a test's own.

A plain backend (a full forward with float32 logits and ``log_softmax``, micro-batches in a
loop, ``clip_grad_norm_`` and AdamW: nothing of the embedded trainer's fused LM head, OOM
guard or offload) driven by the template trains a tiny model step for step like the
embedded trainer: the same metrics and the same weights. A backend that only records its
calls shows which hooks the template calls, in which order, and how it counts a skipped step.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, NonFiniteError, RLStep, TrainerConfig
from miles.trainers.batching import TokenBatch, build_batch
from miles.trainers.step import MicroLoss
from tests.unit.trainers.conftest import make_model, random_groups, set_behaviour


class PlainTrainer(RLStep):
    """The least a backend can be: hooks written the obvious way."""

    def __init__(self, model: nn.Module, ref: nn.Module | None, config: TrainerConfig, algo: AlgorithmConfig) -> None:
        super().__init__(config=config, algo=algo)
        self.device = torch.device("cpu")
        torch.manual_seed(config.seed)
        self.model, self.ref = model.float().train(), ref
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)

    def _batch(self, trajs: list, *, check_versions: bool = True) -> TokenBatch:
        return build_batch(trajs, device="cpu", vocab_size=self.model.config.vocab_size,
                           current_version=self._version if check_versions else None)

    def _forward(self, model: nn.Module, mb: TokenBatch, entropy: str) -> tuple[Tensor, Tensor | None]:
        lsm = F.log_softmax(model(mb.input_ids).logits.float() / self.config.rollout_temperature, dim=-1)
        rows, cols, pos = mb.response_positions()
        logp = torch.zeros(mb.response_ids.shape).index_put((rows, cols), lsm[rows, pos, mb.response_ids[rows, cols]])
        if entropy == "none":
            return logp, None
        ent = -(lsm.exp() * lsm).sum(-1)[rows, pos]
        ent = ent if entropy == "grad" else ent.detach()
        return logp, torch.zeros(mb.response_ids.shape).index_put((rows, cols), ent)

    @torch.no_grad()
    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor | None:
        model = self.ref if reference else self.model
        return None if model is None else self._forward(model, batch, "none")[0]

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _forward_backward(self, batch: TokenBatch, rows: list[int], loss: MicroLoss, limits: TrainerConfig) -> None:
        for mb_rows in batch.plan(rows, limits):
            if any(batch.loss_tokens[r] for r in mb_rows):
                mb = batch.select(mb_rows)
                loss(mb, mb_rows, *self._forward(self.model, mb, self._entropy_mode())).backward()

    def _optimizer_step(self, finite: Tensor, lr: float) -> tuple[bool, Tensor | None]:
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad or float("inf"))
        if not bool(finite & torch.isfinite(grad_norm)):
            self._zero_grad()
            return False, None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._zero_grad()
        return True, grad_norm


CASES = {  # the template's paths: mini-batches, proximal recompute, reference KL, entropy bonus
    "grpo_tis": (dict(num_steps_per_rollout=1), dict(use_tis=True)),
    "two_steps_recompute_kl": (dict(num_steps_per_rollout=2), dict(prox_logp="recompute", kl_coef=0.05)),
    "entropy_bonus_micro_batches": (dict(num_steps_per_rollout=2, micro_batch_size=3), dict(entropy_coef=0.01)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_plain_backend_trains_like_the_embedded_trainer(case: str) -> None:
    tkw, akw = CASES[case]
    config = TrainerConfig(device="cpu", dtype="float32", lr=1e-3, weight_decay=0.1, compile=False, **tkw)
    algo = AlgorithmConfig(**akw)
    model = make_model()
    ref = copy.deepcopy(model).eval().requires_grad_(False) if algo.kl_coef > 0 else None
    plain = PlainTrainer(copy.deepcopy(model), copy.deepcopy(ref), config, algo)
    embedded = EmbeddedTrainer(copy.deepcopy(model), config=config, algo=algo, ref_model=copy.deepcopy(ref))
    groups = random_groups()
    for step in range(3):
        set_behaviour(embedded, groups, shift=-0.05 * step)  # off-policy from the second step on
        m_plain, m_emb = plain.train_step(groups), embedded.train_step(groups)
        assert set(m_plain) == set(m_emb), set(m_plain) ^ set(m_emb)
        for key, value in m_emb.items():
            if not key.endswith(("time_s", "tokens_per_s")):
                assert m_plain[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    assert plain.version == embedded.version == 3
    assert plain.optimizer_steps == embedded.optimizer_steps == 3 * config.num_steps_per_rollout
    # The same update: the two differ by float rounding, a sliver of how far training moved
    # the weights (AdamW turns rounding in near-zero gradients into whole steps of lr).
    start, mine = dict(model.named_parameters()), dict(embedded.model.named_parameters())
    moved = sum((mine[n] - start[n]).norm() ** 2 for n in start) ** 0.5
    apart = sum((p - mine[n]).norm() ** 2 for n, p in plain.model.named_parameters()) ** 0.5
    assert moved > 0 and apart < 1e-2 * moved, (float(apart), float(moved))


class Recorder(RLStep):
    """No model: each hook says it was called; ``finite`` decides each optimizer step."""

    def __init__(self, config: TrainerConfig, algo: AlgorithmConfig, *, finite: list[bool],
                 reference: bool = False) -> None:
        super().__init__(config=config, algo=algo)
        self.device = torch.device("cpu")
        self.calls: list[Any] = []
        self.finite, self.reference = list(finite), reference

    def _batch(self, trajs: list, *, check_versions: bool = True) -> TokenBatch:
        self.calls.append("batch")
        return build_batch(trajs, device="cpu", vocab_size=288)

    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor | None:
        if reference and not self.reference:
            return None
        self.calls.append("ref" if reference else "prox")
        return batch.logp_rollout.clone()

    def _zero_grad(self) -> None:
        self.calls.append("zero_grad")

    def _forward_backward(self, batch: TokenBatch, rows: list[int], loss: MicroLoss, limits: TrainerConfig) -> None:
        self.calls.append(("forward_backward", sorted(rows)))
        for mb_rows in batch.plan(rows, limits):
            mb = batch.select(mb_rows)
            logp = mb.logp_rollout.clone().requires_grad_(True)
            loss(mb, mb_rows, logp, None).backward()

    def _optimizer_step(self, finite: Tensor, lr: float) -> tuple[bool, Tensor | None]:
        taken = bool(finite) and self.finite.pop(0)
        self.calls.append(("optimizer_step", taken))
        return taken, torch.tensor(1.5) if taken else None

    def _begin_update(self) -> None:
        self.calls.append("begin")

    def _end_update(self) -> None:
        self.calls.append("end")


def test_the_template_calls_the_hooks_in_the_step_order() -> None:
    config = TrainerConfig(device="cpu", num_steps_per_rollout=2, micro_batch_size=2)
    tr = Recorder(config, AlgorithmConfig(prox_logp="recompute", kl_coef=0.1), finite=[True, True], reference=True)
    groups = random_groups()
    m = tr.train_step(groups)
    minis = [c[1] for c in tr.calls if isinstance(c, tuple) and c[0] == "forward_backward"]
    assert tr.calls == ["batch", "ref", "prox", "begin",
                        "zero_grad", ("forward_backward", minis[0]), ("optimizer_step", True),
                        "zero_grad", ("forward_backward", minis[1]), ("optimizer_step", True), "end"]
    assert sorted(minis[0] + minis[1]) == list(range(12))  # the batch split in two, each row once
    assert m["train/version"] == 1.0 and m["train/optimizer_steps"] == 2.0 and m["train/grad_norm"] == 1.5
    # With one optimizer step per batch the current forward is π_prox: no recompute pass.
    one = Recorder(TrainerConfig(device="cpu"), AlgorithmConfig(prox_logp="recompute"), finite=[True])
    one.train_step(groups)
    assert "prox" not in one.calls and "ref" not in one.calls


def test_a_skipped_step_is_counted_and_its_metrics_dropped() -> None:
    config = TrainerConfig(device="cpu", num_steps_per_rollout=2, max_consecutive_nonfinite=3)
    tr = Recorder(config, AlgorithmConfig(), finite=[False, True, False, False, False])
    groups = random_groups()
    m = tr.train_step(groups)
    assert m["train/skipped_steps"] == 1.0 and tr.optimizer_steps == 1 and tr.consecutive_nonfinite == 0
    m = tr.train_step(groups)
    assert m["train/skipped_steps"] == 2.0 and "train/loss" not in m and "train/grad_norm" not in m
    assert tr.skipped_steps_total == 3 and tr.version == 2
    with pytest.raises(NonFiniteError, match="3 consecutive"):
        tr.train_step(groups)
