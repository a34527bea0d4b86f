"""Changed-tensors-only updates (``--weight-update-changed-only``).

For partially frozen or LoRA-style training most tensors never change; sending them every
version wastes the transport. The trainer fingerprints every exported tensor where it lives
(on its GPU: a few reductions, one read-back per bucket) and sends only the tensors whose
fingerprint differs from the last published one. The update says which version it builds
on (``base_version``); a worker whose engine is not exactly there cannot apply it and gets a
full update instead (the broadcaster's resync), so a skipped or failed delivery never leaves
an engine with a silent mix of versions.

The fingerprint of a tensor is two 64-bit checksums of its raw bits read as integers: their
sum and their position-weighted sum (wrapping arithmetic, so exact and order-independent).
A change goes unnoticed only if its deltas cancel in both sums — not something an optimizer
step does. A tensor that stays bitwise equal (frozen) is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from miles.transports.base import NamedTensors

Fingerprint = tuple[int, int]
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22
_MOD = 65521  # position weights cycle through 1..65521 (a prime), keeping products small


def _checksums(t: Tensor) -> Tensor:
    """[2] int64 on ``t``'s device: sum and position-weighted sum of the bits."""
    words = t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + w.numel(), device=t.device, dtype=torch.int64) % _MOD + 1
        out[0] += w.sum()
        out[1] += (w * pos).sum()
    return out


def fingerprints(tensors: NamedTensors) -> dict[str, Fingerprint]:
    if not tensors:
        return {}
    sums = torch.stack([_checksums(t) for _, t in tensors]).cpu().tolist()  # one read-back
    return {name: (int(a), int(b)) for (name, _), (a, b) in zip(tensors, sums)}


class ChangeTracker:
    """The fingerprints of the last published version, and which tensors differ from them."""

    def __init__(self) -> None:
        self.version = -1  # the version ``prints`` describe (-1: nothing published yet)
        self.prints: dict[str, Fingerprint] = {}

    def select(self, plans: Sequence[NamedTensors], *, full: bool) -> tuple[list[NamedTensors], dict[str, Fingerprint]]:
        """The buckets to send (only changed tensors unless ``full``), and every tensor's new
        fingerprint (for ``commit`` once the update is out)."""
        kept: list[NamedTensors] = []
        prints: dict[str, Fingerprint] = {}
        for plan in plans:
            now = fingerprints(plan)
            prints.update(now)
            bucket = plan if full else [(n, t) for n, t in plan if self.prints.get(n) != now[n]]
            if bucket:
                kept.append(bucket)
        return kept, prints

    def commit(self, version: int, prints: dict[str, Fingerprint]) -> None:
        self.version, self.prints = version, prints

    def reset(self) -> None:
        self.version, self.prints = -1, {}
