"""Cutting a batch of sequences of different lengths into padded groups.

A padded forward costs (rows × longest row) plus a fixed cost per forward (kernel launches,
Python). In RL's long-tailed batches, filling groups greedily pads dozens of short rows to
one long row; the cut here is the cheapest for the longest-first order. The trainer's
micro-batches (``miles.trainers.batching``) and the engine's prefills (``miles.engines``)
both use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cut_by_length(rows: Sequence[int], lengths: Sequence[int], *, max_rows: int | None,
                  max_tokens: int | None, cost: float) -> list[list[int]]:
    """``rows`` (indices into ``lengths``) sorted longest first and cut into the consecutive
    groups that minimise Σ (rows × longest) + ``cost`` per group, with at most ``max_rows``
    rows and ``max_tokens`` padded tokens per group (a single longer row still gets a group
    of its own). Dynamic programming, exact for that order; O(n²) vectorised steps."""
    order = sorted(rows, key=lambda r: -lengths[r])
    n = len(order)
    if n == 0:
        return []
    lens = np.array([lengths[r] for r in order], dtype=np.float64)
    best = np.zeros(n + 1)  # best[j]: the cheapest cut of the first j rows of ``order``
    start = np.zeros(n + 1, dtype=np.int64)  # where that cut's last group starts
    for j in range(1, n + 1):
        count = j - np.arange(j)  # a last group of rows i..j-1, for every i < j
        padded = count * lens[:j]  # its longest row is row i (sorted)
        ok = np.ones(j, dtype=bool)
        if max_rows is not None:
            ok &= count <= max_rows
        if max_tokens is not None:
            ok &= (padded <= max_tokens) | (count == 1)
        total = np.where(ok, best[:j] + padded + cost, np.inf)
        start[j] = int(np.argmin(total))
        best[j] = total[start[j]]
    groups, j = [], n
    while j > 0:
        groups.append(order[start[j] : j])
        j = int(start[j])
    return groups[::-1]
