"""Process facts for metrics: current resident memory (not the peak getrusage reports)."""

from __future__ import annotations

import os
import time


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc; 0.0 where unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def process_start_monotonic() -> float:
    """This process's start on the ``time.monotonic()`` clock (Linux /proc: its start in
    clock ticks since boot; CLOCK_MONOTONIC counts from boot too), so start-up reports can
    include interpreter start and imports; ``time.monotonic()`` where unavailable."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic()
