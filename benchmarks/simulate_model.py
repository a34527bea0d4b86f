"""The simulation's configuration and the closed-form model of its mean staleness.

``benchmarks/simulate.py`` runs a ``SimConfig`` with the real buffer and scheduler and prints
every measured row beside ``model(cfg)``; ``SimConfig`` lives here because its warm-up length
depends on the model's step times (``periods``), and the model reads no simulation state.

**The closed-form model of mean staleness** (Applied Compute, "Predicting and Controlling
Staleness in Fully Asynchronous RL Training", finds mean staleness set by utilization, batch
size, queue capacity, rollout concurrency and the tail of the length distribution; the terms
below are our own derivation from Little's law, for this runtime's admission rule and
in-flight updates).

A token's staleness is the number of version bumps between its generation and the take of
its batch, so summing over tokens, ``Σ staleness = Σ over bumps of M(bump)``, where ``M`` is
the number of tokens generated but not yet taken at that bump; with ``K = B·n·E[L]`` loss
tokens a batch, mean staleness ``S = E[M at a bump] / K`` (exact in steady state).

*Rollout-bound* (``P_roll = B·n·E[L]·d(c)/(W·c) + stall > P_train = T + publish``; the
budget leaves queued prompts, so every slot is busy; queued prompts hold no tokens, so the
queue adds no staleness): ``M`` is the tokens of (i) in-flight sequences — ``W·c`` slots,
each holding the age of a length-biased sample, ``E[L²]/(2E[L])``; (ii) finished samples
waiting for their group's last member — by Little's law, group rate × ``Σ_i L_i·(C − e_i)``
with member ``i`` started ``i·Δ`` after the first (``Δ = P/(B·n)``, the time between two
freed slots), ending at ``e_i = iΔ + L_i·τ`` (``τ = P·W·c/(B·n·E[L])``, a token's wall time),
``C = max e_i``; (iii) groups that became ready while the trainer trained and published,
``B·(T + publish)/(P − stall)``. Terms (i) and (ii) are ``A``, the tokens not yet in a
complete group, averaged over decode time; (iii) is what the decode adds between a take
and its bump, so ``M`` at a bump is ``A`` just after the take plus (iii). That ``A`` is not its
time average: a rollout-bound trainer waits, and takes the moment the B-th ready group
completes. ``A`` grows at the decode rate ``r`` between group completions
and falls, at each completion, by that group's tokens ``G = Σ_{i≤n} L_i``, so every take
samples ``A`` just after one of its falls. In steady state ``A²`` has no mean drift: it grows at
``2A·r`` and jumps by ``(A − G)² − A²`` at completions, which come at rate ``r/E[G]``; so
``E_time[A] = E_c[A⁺·G]/E[G] + E[G²]/(2E[G])``, ``A⁺`` the value just after a completion
(the rate-conservation law). The completing group's size is not what sets the rest of ``A``,
so ``E_c[A⁺] = E_time[A] − E[G²]/(2E[G])``, with ``E[G²] = n·Var L + n²E[L]²``: per ``K``,
``(1 + Var L/(n·E[L]²))/(2B)``. So, with ``W·c = B·n``::

    S_roll = E[L²]/(2E[L]²) + τ·E[Σ_i L_i (C − e_i)]/(P·n·E[L]) + (T + publish)/(P − stall)
             − (1 + Var L/(n·E[L]²))/(2B)

The last term is a finite-batch term: it falls as 1/B, and B grows with the workers (0.31 at
one worker with this setup's lengths, 0.031 at ten, under 0.004 from a hundred on), so the
many-worker limit (``S_inf`` in the model's output) is the first three terms. It ignores
groups that complete at the same instant (the take follows the last of them, a little lower
in ``A``) and takes that wait for the publish because ``B`` groups were ready before it.
``S_roll`` does not depend on η: the bound only clips it. Rows where the mask policy zeroed
more than 1% of the tokens are marked "bound binds": there the bound, not this model, sets
the mean.

*Trainer-bound* (``P_train > P_roll``; the budget binds and the trainer takes a batch at
once after each publish): the B groups admitted at bump ``v`` are taken at version
``v + η``, so a token of theirs has staleness ``η − k``, ``k`` the weight updates its
sequence saw before producing it; from the cohort's decode timeline (fluid: the active
count at depth ``j`` is ``c·P(L > j)``)::

    S_train = η − Σ_j P(L > j)·k(j) / E[L]

It ignores that ready groups are taken in the order they completed: a long group waits
behind later short ones, its first tokens pass the bound and the mask policy zeroes them,
so where many tokens are masked the simulated mean falls below ``S_train``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SimConfig:
    workers: int = 1
    eta: int = 4
    slots: int = 16  # c: sequences one engine decodes at once
    n: int = 8  # samples per prompt
    groups_per_worker: float = 2.0  # B = W · this (default c/n: a batch = the cluster's concurrency)
    len_unit: int = 256
    len_buckets: int = 64  # lengths unit..unit·K
    zipf_a: float = 1.2
    decode_base_s: float = 0.030  # d0
    decode_per_seq_s: float = 0.0006  # d1
    train_base_s: float = 5.0  # t0
    train_tps: float = 6e5  # trained tokens a second
    publish_s: float = 2.0
    stall_s: float = 0.5
    steps: int = 6  # measured steps (at least; more for small batches, see min_samples)
    warmup: int = 8
    min_samples: int = 4_000  # measured trained samples, at least
    seed: int = 0

    @property
    def batch(self) -> int:
        return max(1, round(self.workers * self.groups_per_worker))

    @property
    def mode(self) -> str:
        return "sync" if self.eta == 0 else "async"

    @property
    def warmup_steps(self) -> int:
        """Warm-up before measuring: a trainer-bound run fills its ready queue up to the
        budget, η more steps, before it is in steady state."""
        p_roll, p_train, _ = periods(self)
        trainer_bound = self.eta > 0 and p_train > p_roll
        return self.warmup + (self.eta if trainer_bound else 0)

    @property
    def measured_steps(self) -> int:
        return max(self.steps, math.ceil(self.min_samples / (self.batch * self.n)))

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        k = np.arange(1, self.len_buckets + 1, dtype=np.float64)
        p = k ** -self.zipf_a
        return (k * self.len_unit).astype(np.int64), p / p.sum()

    def decode_s(self, b: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * b


def model(cfg: SimConfig) -> dict[str, float]:
    """Predicted step time, regime and mean staleness (see the module docstring)."""
    values, pmf = cfg.lengths()
    L = values.astype(np.float64)
    mean, m2 = float(pmf @ L), float(pmf @ L ** 2)
    B, n, c, W = cfg.batch, cfg.n, cfg.slots, cfg.workers
    K = B * n * mean
    p_roll, p_train, train_s = periods(cfg)
    out = {"P_roll": p_roll, "P_train": p_train, "T": train_s}
    if cfg.eta == 0:
        out.update(regime=0.0, S=0.0, S_inf=0.0, finite=0.0, P=math.nan)
        return out
    if p_roll >= p_train:
        P = p_roll
        tau = P * W * c / (B * n * mean)
        delta = P / (B * n)
        waiting = _sibling_wait(values, pmf, n, tau, delta)
        inflight = W * c * m2 / (2 * mean)
        S_inf = (inflight + B / P * waiting + B * n * mean * p_train / (P - cfg.stall_s)) / K
        finite = (1 + (m2 - mean**2) / (n * mean**2)) / (2 * B)  # E[G²]/(2E[G]) / K: the take follows a completion
        out.update(regime=1.0, S=S_inf - finite, S_inf=S_inf, finite=finite, P=P)
    else:
        P = p_train
        S = cfg.eta - _updates_seen(cfg, values, pmf, P)
        out.update(regime=2.0, S=S, S_inf=S, finite=0.0, P=P)
    return out


def periods(cfg: SimConfig) -> tuple[float, float, float]:
    """(rollout-bound step time, trainer-bound step time, train seconds a step)."""
    values, pmf = cfg.lengths()
    K = cfg.batch * cfg.n * float(pmf @ values)
    train_s = cfg.train_base_s + K / cfg.train_tps
    p_roll = K * cfg.decode_s(cfg.slots) / (cfg.workers * cfg.slots) + cfg.stall_s
    return p_roll, train_s + cfg.publish_s, train_s


def _sibling_wait(values: np.ndarray, pmf: np.ndarray, n: int, tau: float, delta: float) -> float:
    """E[Σ_i L_i·(C − e_i)]: token-seconds a group's finished members wait for its last one,
    members started ``i·delta`` apart, ending at ``e_i = i·delta + L_i·tau``, ``C = max e_i``."""
    L = values.astype(np.float64)
    cdf = np.cumsum(pmf)
    grid = np.linspace(0.0, (n - 1) * delta + L[-1] * tau, 4097)
    step = grid[1] - grid[0]

    def F(i: int, x: np.ndarray) -> np.ndarray:  # P(e_i <= x)
        k = np.searchsorted(L * tau + i * delta, x, side="right")
        return np.where(k > 0, cdf[np.maximum(k - 1, 0)], 0.0)

    Fs = [F(i, grid) for i in range(n)]
    total = 0.0
    for i in range(n):
        others = np.prod([Fs[j] for j in range(n) if j != i], axis=0)  # P(max of the others <= x)
        surv = 1.0 - others
        # E[max(a, Y)] = a + ∫_a^∞ P(Y > y) dy, for each length of member i
        tail = np.concatenate([np.cumsum(surv[::-1])[::-1] * step, [0.0]])
        for l_val, p in zip(L, pmf):
            a = i * delta + l_val * tau
            idx = min(len(grid), int(math.ceil(a / step)))
            total += p * l_val * (tail[idx] if idx < len(tail) else 0.0)
    return total


def _updates_seen(cfg: SimConfig, values: np.ndarray, pmf: np.ndarray, P: float) -> float:
    """Trainer-bound: the token-mean number of weight updates a cohort's sequence saw before
    producing each token, from the cohort's fluid decode timeline (cohort starts right after
    a stall; the next updates land ``P`` apart, each after a ``stall`` pause)."""
    depth = np.arange(int(values[-1]))
    surv = np.array([pmf[values > j].sum() for j in depth])  # P(L > j)
    t = np.cumsum(cfg.decode_s(cfg.slots * surv))  # time the cohort reaches depth j+1 (no pauses)
    k = np.zeros_like(t)
    pauses = 0.0
    for m in range(1, 10_000):
        land = m * P - cfg.stall_s  # when the m-th update's pause begins, cohort time
        after = t + pauses >= land
        if not after.any():
            break
        k += after
        pauses += cfg.stall_s
    return float((surv * k).sum() / (pmf @ values))
