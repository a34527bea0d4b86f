"""Out-of-memory in the engine is a slowdown: the step's rows are parked, the batch shrinks.

When a prefill or decode step raises ``torch.OutOfMemoryError``, ``EngineOOM.recover`` hands
every request of that step back as an abort (``finish_reason="abort"``): the rollout worker
returns it to the buffer as a PARTIAL trajectory with the tokens it has — the path partial
rollouts already take — and it resumes later, re-prefilling its context. Then the engine's
admission cap (the most rows it runs at once) halves, and so does its prefill token budget
when a prefill ran out; the smaller limits stay for the rest of the run (a batch that ran out
once will again). The KV cache keeps its slots and shapes (a deterministic engine pads its
steps to the same rows as before), so only how many of them run changes.

Every row of the step is parked, not only the ones over the new cap: an OOM can come from
anywhere inside a step (the forward, the sampler's float32 logits), after some of the rows'
bookkeeping moved on, and a row that leaves the engine takes none of that state with it —
its tokens, log-probs and versions so far are exactly what was appended. With seeded
sampling (a draw per response position) a resumed row draws the same tokens it would have.

Only an OOM with one row in the step is fatal: the engine fails that request and every later
one with a message naming the knobs (``EngineOOMError``), and the rollout worker reports it,
so the driver stops the run with it. Counted in ``mem/engine_oom_recovered`` (the driver adds
it into ``mem/oom_recovered`` with the trainer's).

``inject_oom_steps`` (``EngineConfig``, a developer setting) is the test seam: the engine
raises at those step numbers as a GPU that ran out would.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class EngineOOMError(MemoryError):
    """One request alone does not fit in the engine's memory."""


def fatal_message(rows: int, longest: int, phase: str, exc: BaseException) -> str:
    return (f"the engine ran out of memory in a {phase} step of {rows} row ({longest} tokens of context): "
            f"raise --engine-mem-fraction (or lower --train-memory-margin-bytes), lower --max-batch-size, "
            f"--rollout-max-response-len or --max-seq-len, use --kv-cache-dtype fp8_e4m3, or free the "
            f"trainer's memory while it waits (--offload-train, --lora-rank) [{exc}]")


class EngineOOM:
    """The engine's admission limits and its OOM bookkeeping (stepping thread only)."""

    def __init__(self, max_batch_size: int, max_prefill_tokens: int, inject_steps: list[int] | None = None) -> None:
        self.batch_limit = max_batch_size  # rows the engine runs at once (halved on an OOM)
        self.prefill_limit = max_prefill_tokens  # padded tokens of one prefill admission
        self.recovered = 0
        self.fatal: str | None = None  # set once one row did not fit: every request fails with it
        self.steps = 0
        self.inject = set(inject_steps or ())

    def tick(self) -> None:
        """Count one engine step; raise where the test seam says so."""
        self.steps += 1
        if self.steps in self.inject:
            raise torch.OutOfMemoryError(f"injected out-of-memory at engine step {self.steps}")

    def recover(self, rows: int, longest: int, phase: str, exc: BaseException) -> bool:
        """Shrink the limits after an OOM in a step of ``rows`` rows; False when it was fatal."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if rows <= 1:
            self.fatal = fatal_message(rows, longest, phase, exc)
            log.error("%s", self.fatal)
            return False
        self.batch_limit = max(1, min(self.batch_limit, rows) // 2)
        if phase == "prefill":
            self.prefill_limit = max(1, self.prefill_limit // 2)
        self.recovered += 1
        log.warning("engine out of memory in a %s step of %d rows: parked them as partial rollouts; "
                    "now at most %d rows at once, %d prefill tokens [%s]", phase, rows, self.batch_limit,
                    self.prefill_limit, exc)
        return True
