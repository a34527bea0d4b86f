"""Batch invariance of miles.models.invariant, bitwise: a row's output does not depend on the
number of rows or on the other rows; decode over a cache equals the full causal forward; and
the BLAS GEMM it replaces is not invariant (the reason it exists) in at least one shape."""

from __future__ import annotations

import pytest
import torch

from miles.models import invariant


def _split_k(x: torch.Tensor, w: torch.Tensor, parts: int = 2) -> torch.Tensor:
    """A split-K GEMM: partial products over halves of K, added at the end."""
    ks = x.shape[-1] // parts
    return sum(x[..., i * ks : (i + 1) * ks] @ w[:, i * ks : (i + 1) * ks].T for i in range(parts))


@pytest.mark.parametrize("K,N", [(64, 96), (200, 288), (384, 40)])
def test_linear_rows_are_bitwise_independent_of_the_batch(K: int, N: int) -> None:
    g = torch.Generator().manual_seed(K)
    x = torch.randn(150, K, generator=g)
    w = torch.randn(N, K, generator=g)
    full = invariant.linear(x, w)
    for rows in ([0], [3, 7], list(range(1, 150, 3)), list(range(150))[::-1]):
        assert torch.equal(invariant.linear(x[rows], w), full[rows])
    assert torch.equal(invariant.linear(x.view(10, 15, K), w), full.view(10, 15, N))
    assert (full - x @ w.T).abs().max() < 1e-4


def test_split_k_changes_the_sum() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(32, 512, generator=g), torch.randn(64, 512, generator=g)
    assert not torch.equal(_split_k(x, w), invariant.linear(x, w))


def test_decode_over_a_cache_equals_the_full_causal_forward() -> None:
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, T, D, keys = 2, 4, 2, 11, 16, 32
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, T, D, generator=g)
    v = torch.randn(B, Hkv, T, D, generator=g)
    pos = torch.arange(T).expand(B, T)
    full = invariant.attention(q, k, v, pos, keys)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (full - ref).abs().max() < 1e-5
    for t in (0, 4, T - 1):  # one query over the first t + 1 cached keys, one row of a batch of one
        one = invariant.attention(q[1:, :, t : t + 1], k[1:, :, : t + 1], v[1:, :, : t + 1], pos[1:, t : t + 1], keys)
        assert torch.equal(one[0, :, 0], full[1, :, t])
    prefix = invariant.attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], pos[:, :5], keys)  # a prefill
    assert torch.equal(prefix, full[:, :, :5])
