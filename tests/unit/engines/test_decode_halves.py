"""A decode step run as two halves (``decode_halves_min_batch``'s building block, on the CPU):
rows ``[h, n)`` through ``decode_eager(first_slot=h)`` read and write the same cache slots as
the whole batch does, so the two halves give the whole step's logits and cache contents."""

from __future__ import annotations

import torch

from miles.engines import EngineConfig
from miles.engines.runner import ModelRunner

from .helpers import make_model


def test_two_halves_equal_the_whole_batch() -> None:
    runs = []
    for halves in (False, True):
        runner = ModelRunner(make_model(), EngineConfig(max_batch_size=6, max_seq_len=128, kv_block=16))
        g = torch.Generator().manual_seed(0)
        runner.cache.k.copy_(torch.randn(runner.cache.k.shape, generator=g))
        runner.cache.v.copy_(torch.randn(runner.cache.v.shape, generator=g))
        tokens, positions = torch.tensor([5, 9, 11, 3, 7, 2]), torch.tensor([4, 40, 17, 0, 63, 9])
        with torch.no_grad():
            if halves:
                a = runner.decode_eager(tokens[:2], positions[:2], 64)
                b = runner.decode_eager(tokens[2:], positions[2:], 64, first_slot=2)
                logits = torch.cat([a.logits, b.logits])
            else:
                logits = runner.decode_eager(tokens, positions, 64).logits
        fresh = torch.randn(runner.cache.k.shape, generator=torch.Generator().manual_seed(0))
        assert not torch.allclose(runner.cache.k[:, range(6), :, positions], fresh[:, range(6), :, positions])
        runs.append((logits, runner.cache.k.clone(), runner.cache.v.clone()))
    (whole, k1, v1), (halves, k2, v2) = runs
    assert (whole - halves).abs().max().item() < 1e-5
    # each row wrote its new K/V at its own slot (a GEMM of 4 rows may round unlike one of 6)
    assert torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)


def test_a_cache_view_from_a_slot_shares_memory() -> None:
    runner = ModelRunner(make_model(), EngineConfig(max_batch_size=4, max_seq_len=32, kv_block=16))
    view = runner.cache.rows_from(1)
    view.k[0, 0].fill_(3.0)
    assert view.num_slots == 3 and torch.all(runner.cache.k[0, 1] == 3.0) and torch.all(runner.cache.k[0, 0] == 0)
