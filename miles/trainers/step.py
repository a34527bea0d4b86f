"""The RL train step every policy trainer shares, with hooks for what a backend does itself.

``RLStep.train_step(groups)`` is one published policy version, in this order:

1. validate the trajectories and pad them into a ``TokenBatch`` (hook ``_batch``), before any
   state changes;
2. reference log-probs (hook ``_logprobs(reference=True)``) for the KL term and its metric;
3. advantages per group from the rewards (``miles.algorithms.compute_advantages``), with the
   reward KL of REINFORCE++ when it is on;
4. the proximal log-probs when ``prox_logp="recompute"`` and the batch is used for more than
   one optimizer step (with one step, π_prox is exactly the current forward's log-probs,
   detached: no extra pass);
5. ``num_steps_per_rollout`` optimizer steps over a shuffled split into mini-batches. Each
   zeroes the gradients (``_zero_grad``) and hands the mini-batch's rows and the per-micro-
   batch loss (``MicroLoss``: ``compute_loss`` with the mini-batch's denominators, the engine/
   trainer log-prob comparison, a finiteness flag kept on the device) to
   ``_forward_backward``, which cuts the rows into micro-batches under the limits it is
   given and runs forward, loss and backward on each. An out-of-memory error restarts the
   step with smaller micro-batches where the backend has an ``OOMGuard`` (``oom``). Then
   ``_optimizer_step`` clips, checks and steps at the schedule's learning rate; a step whose
   log-probs, loss or gradient is not finite is skipped and counted, and after
   ``max_consecutive_nonfinite`` in a row the trainer raises ``NonFiniteError``;
6. ``version += 1`` and the metrics named ``train/...`` (``_reduce_metrics`` combines them
   over data-parallel ranks), the same keys for every backend.

A backend subclasses ``RLStep``, calls ``RLStep.__init__`` once its model is built, and
implements the five hooks ``_batch``, ``_logprobs``, ``_zero_grad``, ``_forward_backward``
and ``_optimizer_step``; ``_begin_update`` / ``_end_update`` (around the optimizer steps: the
embedded trainer's ``--offload-train``), ``_reduce_metrics`` and ``_backend_metrics`` have
defaults. ``EmbeddedTrainer`` and ``MegatronTrainer`` are the two backends; the counters
(``_version``, ``optimizer_steps``, ``consecutive_nonfinite``, ``skipped_steps_total``) and
the shuffle generator are attributes of the trainer, so its checkpoint state holds them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from miles.algorithms import AlgorithmConfig, LossDenominators, PolicyBatch, compute_advantages, compute_loss
from miles.algorithms.losses import kl_estimate
from miles.algorithms.masked import deferred_finite_checks
from miles.trainers.batching import TokenBatch, rewards_of, trajectories_of
from miles.trainers.config import TrainerConfig, lr_at
from miles.trainers.metrics import MetricAccumulator, batch_metrics, check_on_policy, rollout_logprob_diff
from miles.trainers.oom import OOMGuard
from miles.types import Trajectory
from miles.utils.device import to_device

LOSS_SUMS = ("train/loss", "train/pg_loss")  # metrics whose micro-batch parts add up (see MetricAccumulator)


class NonFiniteError(FloatingPointError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


class MicroLoss:
    """The loss of one optimizer step's micro-batches, called by ``_forward_backward`` once
    per micro-batch with its log-probs. It keeps each micro-batch's metrics (recorded only
    if the step is taken) and one finiteness flag on the device: a check per micro-batch
    would make the host wait for the GPU every time, and a host that waits cannot queue the
    next micro-batch's kernels meanwhile."""

    def __init__(self, trainer: RLStep, advantages: Tensor, logp_prox: Tensor | None, logp_ref: Tensor | None,
                 den: LossDenominators, reference: Tensor | str | None, trained_version: int) -> None:
        self.algo, self.device = trainer.algo, trainer.device
        self.advantages, self.logp_prox, self.logp_ref, self.den = advantages, logp_prox, logp_ref, den
        self.reference, self.trained_version = reference, trained_version
        # Rows whose gradient is exactly 0 (``RLStep._gradless_rows``): a backend that can runs
        # their forward without autograd, for their metrics and finiteness, and no backward;
        # with ``skip_gradless`` it runs no forward for them at all.
        self.gradless: frozenset[int] = frozenset()
        self.skip_gradless = False
        self.reset()

    def reset(self) -> None:
        """Forget what was recorded: the step starts again (after an out-of-memory error)."""
        self.finite = torch.ones((), dtype=torch.bool, device=self.device)
        self.pending: list[tuple[dict[str, Tensor], float]] = []  # (metrics, loss tokens) per micro-batch

    @property
    def tokens(self) -> float:
        """Loss tokens of the micro-batches recorded (this rank's share of the mini-batch)."""
        return sum(w for _, w in self.pending)

    def __call__(self, mb: TokenBatch, rows: Sequence[int], logp: Tensor, entropy: Tensor | None, *,
                 weight: float = 1.0) -> Tensor:
        """The loss of micro-batch ``mb`` (rows ``rows`` of the step's batch) from its [n, R']
        log-probs; ``weight`` 0 marks a placeholder whose loss and metrics do not count."""
        R = logp.shape[1]
        sel = to_device(list(rows), torch.long, self.device)
        mask = mb.loss_mask
        pb = PolicyBatch(
            logp=logp, logp_rollout=mb.logp_rollout, advantages=self.advantages[sel, :R], loss_mask=mask,
            logp_prox=logp.detach() if self.logp_prox is None else self.logp_prox[sel, :R],
            versions=mb.versions, entropy=entropy,
            logp_ref=None if self.logp_ref is None else self.logp_ref[sel, :R],
        )
        loss, metrics = compute_loss(pb, self.algo, trainer_version=self.trained_version, denominators=self.den)
        if self.reference is not None:
            ref = logp.detach() if isinstance(self.reference, str) else self.reference[sel, :R]
            metrics.update(rollout_logprob_diff(ref, mb.logp_rollout, mask, mb.versions, self.trained_version,
                                                mb.kv_versions))
        self.finite &= torch.isfinite(torch.where(mask > 0, logp.detach(), 0.0)).all() & torch.isfinite(loss)
        if weight:
            self.pending.append((metrics, float(sum(mb.loss_tokens))))
        return loss if weight == 1.0 else loss * weight


class RLStep:
    """The train-step template (see the module docstring); a trainer backend subclasses it."""

    config: TrainerConfig
    algo: AlgorithmConfig
    device: torch.device
    oom: OOMGuard | None = None  # micro-batch halving on an out-of-memory error, where the backend allows it
    # Whether ``_forward_backward`` honours ``MicroLoss.gradless`` (runs those rows forward only).
    runs_gradless_rows: bool = False

    def __init__(self, *, config: TrainerConfig, algo: AlgorithmConfig, version: int = 0) -> None:
        self.config, self.algo = config, algo
        self._version = version
        self.optimizer_steps = 0
        self.consecutive_nonfinite = 0
        self.skipped_steps_total = 0
        self._shuffle = torch.Generator().manual_seed(config.seed)

    # ---- hooks a backend implements -------------------------------------------------------
    def _batch(self, trajs: list[Trajectory], *, check_versions: bool = True) -> TokenBatch:
        """``batching.build_batch`` for this model (vocab, replayed routing) on its device;
        ``check_versions`` holds every token's version against the trainer's."""
        raise NotImplementedError

    def _logprobs(self, batch: TokenBatch, *, reference: bool = False) -> Tensor | None:
        """[N, R] log-probs of every row without gradients, under the current weights or the
        reference model's (None when the backend has none)."""
        raise NotImplementedError

    def _zero_grad(self) -> None:
        """Drop the accumulated gradients (before a step, and after an out-of-memory error)."""
        raise NotImplementedError

    def _forward_backward(self, batch: TokenBatch, rows: list[int], loss: MicroLoss, limits: TrainerConfig) -> None:
        """Accumulate the gradients of ``rows``: cut them into micro-batches under ``limits``'
        micro-batch size and token cap, and on each run the forward (log-probs and, in
        ``_entropy_mode``, entropy), ``loss(mb, rows, logp, entropy)`` and its backward."""
        raise NotImplementedError

    def _optimizer_step(self, finite: Tensor, lr: float) -> tuple[bool, Tensor | float | None]:
        """Clip the gradients and step at ``lr`` unless ``finite`` (the loss's flag) or the
        gradients say otherwise; then the gradients are dropped. Returns (taken, grad norm)."""
        raise NotImplementedError

    def _begin_update(self) -> None:
        """Before the first optimizer step of a train step."""

    def _end_update(self) -> None:
        """After the last optimizer step of a train step."""

    def _reduce_metrics(self, metrics: dict[str, float], tokens: float) -> dict[str, float]:
        """The step's loss metrics, combined over ranks; ``tokens``: the loss tokens behind them here."""
        return metrics

    def _backend_metrics(self) -> dict[str, float]:
        """The backend's own metrics of the step (memory, compilation)."""
        return {}

    # ---- the step ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def train_step(self, groups: Sequence[Sequence[Trajectory]]) -> dict[str, float]:
        start = time.perf_counter()
        trajs, group_index = trajectories_of(groups)
        rewards = rewards_of(trajs, self.config.reward_key)
        batch = self._batch(trajs)  # validates everything before any state changes
        trained_version = self._version
        rewards = rewards.to(self.device)
        logp_ref = self._logprobs(batch, reference=True)
        advantages = self._advantages(batch, rewards, group_index, logp_ref)
        steps = self.config.num_steps_per_rollout
        logp_prox = self._logprobs(batch) if self.algo.prox_logp == "recompute" and steps > 1 else None

        gradless = self._gradless_rows(advantages)

        order = torch.randperm(batch.size, generator=self._shuffle).tolist()
        acc = MetricAccumulator()
        skipped, tokens = 0, 0.0
        self._begin_update()
        for i in range(steps):
            rows = order[i::steps]
            if not rows:
                continue
            # Log-probs under the rollout's weights: the first mini-batch's forward, or the
            # recomputed proximal pass for the later ones (after an update).
            reference = logp_prox if logp_prox is not None else (None if i else "forward")
            loss = MicroLoss(self, advantages, logp_prox, logp_ref, batch.denominators(rows), reference,
                             trained_version)
            loss.gradless = gradless
            loss.skip_gradless = self._skips_gradless(rows, gradless)
            if self._update(batch, rows, loss, acc):
                tokens += loss.tokens
            else:
                skipped += 1
        self._end_update()
        self._version += 1

        metrics = self._reduce_metrics(acc.result(), tokens)
        check_on_policy(metrics, self.config.true_on_policy_check, trained_version)
        metrics.update(batch_metrics(batch, rewards, trained_version, time.perf_counter() - start))
        metrics.update({
            "train/skipped_steps": float(skipped),
            "train/skipped_steps_total": float(self.skipped_steps_total),
            "train/optimizer_steps": float(self.optimizer_steps),
            "train/lr": lr_at(max(self.optimizer_steps - 1, 0), self.config),
            "train/version": float(self._version),
            "train/gradless_token_frac": sum(batch.loss_tokens[r] for r in gradless) / max(1, sum(batch.loss_tokens)),
            "mem/oom_recovered": float(self.oom.recovered if self.oom is not None else 0),
        })
        metrics.update(self._backend_metrics())
        return metrics

    def compute_logprobs(self, trajectories: Sequence[Trajectory]) -> list[list[float]]:
        """Log-probs of every response token under the current weights (no gradient)."""
        if not trajectories:
            return []
        batch = self._batch(list(trajectories), check_versions=False)
        logp = self._logprobs(batch).cpu()
        return [logp[i, :n].tolist() for i, n in enumerate(batch.resp_lens)]

    # ---- its parts --------------------------------------------------------------------------
    def _entropy_mode(self) -> str:
        """How the forward computes entropy: with gradients for an entropy bonus, else as a metric."""
        return "grad" if self.algo.entropy_coef > 0 else "metric"

    def _advantages(self, batch: TokenBatch, rewards: Tensor, group_index: list[int],
                    logp_ref: Tensor | None) -> Tensor:
        """[N, R] advantages, 0 off the loss mask."""
        kl = None
        if self.algo.reward_kl_coef > 0 and logp_ref is not None:
            kl = kl_estimate(batch.logp_rollout, logp_ref, self.algo.kl_type)
        adv = compute_advantages(
            self.algo.advantage_estimator, rewards, torch.tensor(group_index, device=self.device),
            loss_mask=batch.loss_mask, kl=kl, kl_coef=self.algo.reward_kl_coef, gamma=self.algo.gamma,
            lam=self.algo.lam, std_eps=self.algo.grpo_std_eps, std_level=self.algo.grpo_std_level,
            std_unbiased=self.algo.grpo_std_unbiased)
        if adv.ndim == 1:
            adv = adv[:, None].expand_as(batch.loss_mask)
        return adv * batch.loss_mask

    def _gradless_rows(self, advantages: Tensor) -> frozenset[int]:
        """The rows whose gradient is exactly 0: every advantage 0 (a GRPO group whose samples
        all got one reward: in RLVR with a pass/fail reward, the groups all right or all wrong,
        often half the batch) in a loss with no term besides the policy gradient's, which is
        the advantage times a finite factor (no entropy bonus, no KL loss). Empty where the
        backend runs every row the same way."""
        if not self.runs_gradless_rows or self.algo.entropy_coef > 0 or self.algo.kl_coef > 0:
            return frozenset()
        return frozenset((advantages == 0).all(dim=1).nonzero().flatten().tolist())

    def _skips_gradless(self, rows: list[int], gradless: frozenset[int]) -> bool:
        """Whether a mini-batch's gradless rows get no forward at all: their loss, gradient and
        share of the denominators (counted from the masks beforehand) are what a forward would
        give, so only their per-token diagnostics go. Not with ``--zero-advantage-rows
        forward``, not under a strict on-policy check (it reads every row's log-prob), and not
        when no row of the mini-batch trains (its metrics then come from those rows)."""
        return (self.config.zero_advantage_rows == "skip" and self.config.true_on_policy_check != "strict"
                and bool(gradless) and any(r not in gradless for r in rows))

    def _update(self, batch: TokenBatch, rows: list[int], loss: MicroLoss, acc: MetricAccumulator) -> bool:
        """One optimizer step over the mini-batch ``rows``. Returns False if it was skipped as
        non-finite."""

        def accumulate(limits: TrainerConfig) -> None:
            loss.reset()
            self._zero_grad()
            with deferred_finite_checks():
                self._forward_backward(batch, rows, loss, limits)

        if self.oom is None:
            accumulate(self.config)
        else:
            self.oom.run(accumulate, lambda cfg: batch.plan(rows, cfg), batch.seq_lens, self._zero_grad)
        taken, grad_norm = self._optimizer_step(loss.finite, lr_at(self.optimizer_steps, self.config))
        if not taken:
            return self._nonfinite()
        for metrics, weight in loss.pending:
            acc.add(metrics, weight=weight, sums=LOSS_SUMS)
        acc.end_group()
        self.optimizer_steps += 1
        self.consecutive_nonfinite = 0
        if grad_norm is not None:
            acc.add({"train/grad_norm": grad_norm.detach() if isinstance(grad_norm, Tensor) else grad_norm},
                    weight=1.0)
        return True

    def _nonfinite(self) -> bool:
        self.consecutive_nonfinite += 1
        self.skipped_steps_total += 1
        n, limit = self.consecutive_nonfinite, self.config.max_consecutive_nonfinite
        if not self.config.skip_nonfinite_steps or n >= limit:
            raise NonFiniteError(
                f"non-finite loss or gradient in {n} consecutive optimizer step(s) "
                f"(skip_nonfinite_steps={self.config.skip_nonfinite_steps}, max_consecutive_nonfinite={limit})"
            )
        return False

