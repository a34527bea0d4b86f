"""Out-of-memory in the trainer is a slowdown: the step restarts with micro-batches half as big.

``OOMGuard.run(step)`` calls ``step(config)``, the accumulation of one optimizer step under
the micro-batch limits of ``config``. On ``torch.OutOfMemoryError`` the partial gradients
are dropped (the caller's ``reset``), the limits shrink to half the largest micro-batch that
the plan made (rows and padded tokens), and the step runs again from its first micro-batch:
the loss denominators are the mini-batch's, so the step trains the same tokens with the
same weights per token, only cut finer. The smaller limits stay for the rest of the run (a
batch that ran out of memory once will again). Only a micro-batch of one sequence that
does not fit fails, with ``TrainerOOMError`` naming the knobs.

``hook`` is the test seam: called with each micro-batch's rows before its forward; a test
makes it raise ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
import torch

from miles.trainers.config import TrainerConfig

T = TypeVar("T")


class TrainerOOMError(MemoryError):
    """A single sequence does not fit in the trainer's memory."""


class OOMGuard:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config  # the current (possibly reduced) micro-batch limits
        self.recovered = 0  # OOMs turned into a retry, over the run
        self.hook: Callable[[Sequence[int]], None] | None = None

    def check(self, rows: Sequence[int]) -> None:
        if self.hook is not None:
            self.hook(rows)

    def run(self, step: Callable[[TrainerConfig], T], plan: Callable[[TrainerConfig], list[list[int]]],
            seq_lens: Sequence[int], reset: Callable[[], None]) -> T:
        while True:
            try:
                return step(self.config)
            except torch.OutOfMemoryError as exc:
                reset()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                micro = plan(self.config)
                rows = max(len(m) for m in micro)
                tokens = max(len(m) * max(seq_lens[r] for r in m) for m in micro)
                if rows <= 1:
                    longest = max(seq_lens[r] for m in micro for r in m)
                    raise TrainerOOMError(
                        f"the trainer ran out of memory on a micro-batch of one sequence ({longest} tokens): "
                        f"turn on --gradient-checkpointing, lower --rollout-max-response-len, or train "
                        f"fewer weights with --lora-rank (or --offload-train when colocated) [{exc}]") from None
                self.config = msgspec.structs.replace(
                    self.config, micro_batch_size=max(1, rows // 2),
                    max_tokens_per_micro_batch=max(1, tokens // 2))
                self.recovered += 1
