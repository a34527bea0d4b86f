"""Periodic evaluation on held-out prompts (--eval-prompt-data, --eval-interval).

Evaluation runs on the rollout workers next to training rollouts (the engines batch both),
so training never stalls for it. Each prompt gets ``--n-samples-per-eval-prompt`` samples;
we report the mean reward, pass@k for k = 1, 2, 4, ... up to n (the unbiased estimator of
Chen et al. 2021, counting a sample as passed when its reward > 0), the mean length and the
failure count.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from miles.types import Status, Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def eval_metrics(trajs: Sequence[Trajectory], n: int, reward_key: str | None = None) -> dict[str, float]:
    """Mean reward and pass@k (a sample is correct when its reward is > 0), on the reward
    the trainer uses: ``reward_key``'s entry of a dict reward (None: the dict's sum)."""
    by_prompt: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_prompt[t.prompt_id].append(t)
    ok = [t for t in trajs if t.status is not Status.FAILED and t.reward is not None]
    rewards = [t.scalar_reward(reward_key) for t in ok]
    out = {
        "eval/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
        "eval/response_len_mean": statistics.fmean(len(t.response_tokens) for t in trajs) if trajs else 0.0,
        "eval/failed": float(len(trajs) - len(ok)),
        "eval/prompts": float(len(by_prompt)),
    }
    k = 1
    while k <= n:
        scores = []
        for group in by_prompt.values():
            correct = sum(1 for t in group if t.reward is not None and t.scalar_reward(reward_key) > 0)
            scores.append(pass_at_k(len(group), correct, k))
        out[f"eval/pass@{k}"] = statistics.fmean(scores) if scores else math.nan
        k *= 2
    return out


async def run_evaluation(cfg: Any, dataset: Any, workers: list[Any], step: int) -> dict[str, float]:
    """Spread the eval prompts over the workers, wait for all, and summarize."""
    prompts = dataset.all()
    if cfg.data.eval_max_prompts:
        prompts = prompts[: cfg.data.eval_max_prompts]
    n = cfg.data.n_samples_per_eval_prompt
    chunks = [prompts[i :: len(workers)] for i in range(len(workers))]
    results = await asyncio.gather(
        *(w.evaluate.remote(chunk, n, id_prefix=f"eval{step}") for w, chunk in zip(workers, chunks) if chunk)
    )
    trajs = [t for chunk in results for t in chunk]
    return eval_metrics(trajs, n, cfg.rollout.reward_key)
