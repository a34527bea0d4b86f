"""miles.scheduler: admission under the staleness budget (``staleness``).

The driver loop that uses it lives with the runtime; everything here is plain Python.
"""

from miles.scheduler.staleness import (
    MODES,
    UNBOUNDED,
    Scheduler,
    SchedulerConfig,
    admission,
    check_staleness,
    is_doomed,
    mask_stale_tokens,
    mode_staleness,
    within_bound,
)
from miles.types import loss_version_stats  # the token-level stats, beside Trajectory.validate

__all__ = [
    "MODES",
    "UNBOUNDED",
    "Scheduler",
    "SchedulerConfig",
    "admission",
    "check_staleness",
    "is_doomed",
    "loss_version_stats",
    "mask_stale_tokens",
    "mode_staleness",
    "within_bound",
]
