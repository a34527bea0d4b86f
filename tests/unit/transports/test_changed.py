"""Changed-tensors-only updates: fingerprints notice any change an optimizer makes, and the
tracker keeps exactly the changed tensors."""

from __future__ import annotations

import torch

from miles.transports.changed import ChangeTracker, fingerprints


def test_fingerprints_see_one_bit_and_a_swap() -> None:
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    base = fingerprints([("t", t)])["t"]
    assert fingerprints([("t", t.clone())])["t"] == base  # bitwise equal: same print
    bit = t.clone()
    bit.view(torch.int32)[500] ^= 1  # the lowest mantissa bit of one element
    assert fingerprints([("t", bit)])["t"] != base
    swapped = t.clone()
    swapped[[3, 700]] = swapped[[700, 3]]  # same values, same sum: the positions tell
    assert fingerprints([("t", swapped)])["t"] != base
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.bool):
        x = t.to(dtype)
        assert fingerprints([("x", x)]) == fingerprints([("x", x.clone())])


def test_fingerprints_span_chunks_and_scalars() -> None:
    big = torch.zeros((1 << 22) + 5, dtype=torch.bfloat16)
    base = fingerprints([("big", big)])["big"]
    big[-1] = 1.0  # past the first chunk
    assert fingerprints([("big", big)])["big"] != base
    assert fingerprints([("s", torch.tensor(1.0))]) != fingerprints([("s", torch.tensor(2.0))])


def test_tracker_keeps_changed_tensors_only() -> None:
    weights = {f"w{i}": torch.randn(8, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    plans = [[(n, weights[n]) for n in ("w0", "w1", "w2")], [(n, weights[n]) for n in ("w3", "w4", "w5")]]
    tracker = ChangeTracker()
    kept, prints = tracker.select(plans, full=True)
    assert kept == plans and len(prints) == 6
    tracker.commit(1, prints)
    weights["w1"].add_(1e-3)
    weights["w5"].mul_(2)
    kept, prints = tracker.select(plans, full=False)
    assert [[n for n, _ in b] for b in kept] == [["w1"], ["w5"]]
    assert kept[0][0][1] is weights["w1"]  # the export's tensors, not copies
    tracker.commit(2, prints)
    kept, _ = tracker.select(plans, full=False)
    assert kept == []  # nothing changed since version 2
    assert tracker.version == 2
    tracker.reset()
    assert tracker.version == -1 and tracker.select(plans, full=False)[0] == plans
