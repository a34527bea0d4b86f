"""Goodness-of-fit helpers for the sampling tests (no scipy: torch's incomplete gamma)."""

from __future__ import annotations

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs``; categories expected to
    hold fewer than ``min_expected`` samples are pooled into one."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = counts.sum()
    expected = n * probs
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if bool(((obs > 0) & (exp <= 0)).any()):
        return 0.0
    chi2 = (((obs - exp) ** 2) / exp).sum()
    dof = max(int(keep.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), chi2 / 2.0))
