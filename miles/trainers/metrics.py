"""Folds per-micro-batch metric tensors into one dict of floats per train step.

Keys ending in ``_max`` take the max; keys listed as ``sums`` (the loss, whose micro-batch
parts add up to the mini-batch loss) are summed within a group (one optimizer step) and
averaged over groups; every other key is a weighted mean (weight = the micro-batch's loss
tokens). Values stay on the device until ``result`` so the loop does not sync per metric.

``rollout_logprob_diff`` is the true-on-policy check: the engine's recorded log-prob of each
loss token against the trainer's recompute under the same weights. It compares only tokens
the engine produced with the version being trained (a stale token of an async or partial
rollout was sampled under weights the trainer no longer holds; their share is
``train/rollout_logprob_compared_frac``). ``check_on_policy`` stops a strict run on a
non-zero difference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from miles.algorithms.masked import masked_mean

if TYPE_CHECKING:
    from miles.trainers.batching import TokenBatch


class MetricAccumulator:
    def __init__(self) -> None:
        self._wsum: dict[str, Tensor | float] = {}
        self._weight: dict[str, float] = {}
        self._max: dict[str, Tensor | float] = {}
        self._group: dict[str, Tensor | float] = {}
        self._groups: dict[str, list[Tensor | float]] = {}

    def add(self, metrics: Mapping[str, Tensor | float], *, weight: float, sums: Iterable[str] = ()) -> None:
        sums = set(sums)
        for key, value in metrics.items():
            if isinstance(value, Tensor):
                value = value.detach().float()
            if key in sums:
                self._group[key] = self._group.get(key, 0.0) + value
            elif key.endswith("_max"):
                prev = self._max.get(key)
                self._max[key] = value if prev is None else torch.maximum(torch.as_tensor(prev), torch.as_tensor(value))
            else:
                self._wsum[key] = self._wsum.get(key, 0.0) + value * weight
                self._weight[key] = self._weight.get(key, 0.0) + weight

    def end_group(self) -> None:
        for key, value in self._group.items():
            self._groups.setdefault(key, []).append(value)
        self._group = {}

    def result(self) -> dict[str, float]:
        self.end_group()
        out: dict[str, float] = {}
        for key, total in self._wsum.items():
            out[key] = float(total) / self._weight[key] if self._weight[key] > 0 else 0.0
        for key, value in self._max.items():
            out[key] = float(value)
        for key, values in self._groups.items():
            out[key] = sum(float(v) for v in values) / len(values)
        return out


def batch_metrics(batch: TokenBatch, rewards: Tensor, trained_version: int, elapsed: float) -> dict[str, float]:
    """What a train step's batch was, the same for every trainer backend: reward, sizes,
    the staleness of its loss tokens against the version trained, time and tokens/s."""
    mask = batch.loss_mask > 0
    stale = (trained_version - batch.versions).float()
    tokens = float(mask.sum())
    return {
        "train/reward_mean": float(rewards.mean()),
        "train/tokens": tokens,
        "train/sequences": float(batch.size),
        "train/response_len_mean": float(sum(batch.resp_lens)) / batch.size,
        "train/staleness_mean": float(masked_mean(stale, mask)),
        "train/staleness_max": float(stale[mask].max()) if tokens else 0.0,
        "train/step_time_s": elapsed,
        "train/tokens_per_s": float(sum(batch.seq_lens)) / max(elapsed, 1e-9),
    }


class TrueOnPolicyError(RuntimeError):
    """A rollout log-prob differs from the trainer's recompute under --true-on-policy-check strict."""


@torch.no_grad()
def rollout_logprob_diff(logp_train: Tensor, logp_rollout: Tensor, loss_mask: Tensor, versions: Tensor,
                         trained_version: int | None, kv_versions: Tensor | None = None) -> dict[str, Tensor]:
    """|trainer − engine| log-prob over the loss tokens sampled under ``trained_version``
    (all loss tokens when it is None): ``_max``, ``_mean`` and the compared fraction.

    With ``kv_versions`` (the oldest version in the engine's KV cache when each token was
    sampled) a token counts only if its cache held that version alone: a row that kept its
    cache across a weight update (``keep_kv_cache_on_update``) sampled its later tokens over
    keys and values of the older weights, a computation the trainer, holding the new weights
    only, does not repeat. A row aborted and resumed is re-prefilled under the new weights, so
    its resumed tokens do count."""
    mask = loss_mask > 0
    same = mask if trained_version is None else mask & (versions == trained_version)
    if trained_version is not None and kv_versions is not None:
        same = same & (kv_versions == trained_version)
    diff = torch.where(same, (logp_train.detach().float() - logp_rollout.float()).abs(), 0.0)
    n = same.sum()
    zero = torch.zeros((), device=diff.device)
    return {
        "train/rollout_logprob_abs_diff_max": diff.max() if diff.numel() else zero,
        "train/rollout_logprob_abs_diff_mean": diff.sum() / n.clamp(min=1),
        "train/rollout_logprob_compared_frac": n.float() / mask.sum().clamp(min=1),
    }


def check_on_policy(metrics: dict[str, float], mode: str, version: int) -> None:
    """Raise ``TrueOnPolicyError`` in strict mode when a compared log-prob differs at all."""
    worst = metrics.get("train/rollout_logprob_abs_diff_max", 0.0)
    if mode == "strict" and worst != 0.0:
        raise TrueOnPolicyError(
            f"--true-on-policy-check strict: at version {version} a rollout log-prob differs from the "
            f"trainer's recompute by up to {worst:.3g} (mean "
            f"{metrics.get('train/rollout_logprob_abs_diff_mean', 0.0):.3g}); the engine and the trainer "
            "do not compute tokens identically (see miles/engines/CONSISTENCY.md)"
        )
