"""Process facts for metrics: current resident memory (not the peak getrusage reports)."""

from __future__ import annotations

import os


def rss_mb() -> float:
    """Resident set size of this process in MiB (Linux /proc; 0.0 where unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
