"""benchmarks/hostload.py: the CPU a child's process tree used is counted as its own, grandchildren included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.hostload import HostLoad  # noqa: E402

# A child that starts a grandchild, and each spins until it has used 0.3 s of CPU (fixed
# however loaded the host is, only the wall time stretches), then sleeps a second so the
# sampler sees its final count before it ends.
SPIN = "import time\nwhile time.process_time() < 0.3: pass\ntime.sleep(1.0)\n"
TREE = ("import subprocess, sys\n"
        f"g = subprocess.Popen([sys.executable, '-c', {SPIN!r}])\n"
        f"exec({SPIN!r})\n"
        "g.wait()\n")


@pytest.mark.skipif(not HostLoad.available(), reason="needs Linux /proc")
def test_the_tree_s_cpu_is_its_own_and_figures_are_in_range() -> None:
    load = HostLoad(every_s=0.05)
    proc = subprocess.Popen([sys.executable, "-c", TREE])
    load.start(proc.pid)
    assert proc.wait() == 0
    load.stop()
    got = load.result()
    assert got["ours_cpu_s"] >= 0.55  # two processes, 0.3 s each, less the ticks' rounding
    assert got["wall_s"] > 0
    assert got["other_cores"] >= 0
    assert 0 <= got["steal_frac"] <= 1


def test_no_samples_give_none() -> None:
    assert HostLoad().result() == {"wall_s": None, "ours_cpu_s": None, "other_cores": None, "steal_frac": None}
