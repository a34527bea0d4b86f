"""benchmarks/hostload.py: the CPU a child's process tree used is counted as its own, grandchildren included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.hostload import HostLoad  # noqa: E402

# Each process spins until it has used 0.3 s of CPU past the point where it starts to spin
# (fixed however loaded the host is, only the wall time stretches), then sleeps a second so
# the sampler sees its final count before it ends. The child starts spinning, and starts the
# grandchild, only once the sampler has taken its baseline (a line on stdin), so none of the
# spin can fall into the baseline.
SPIN = "import time\nt0 = time.process_time()\nwhile time.process_time() - t0 < 0.3: pass\ntime.sleep(1.0)\n"
TREE = ("import subprocess, sys\n"
        "sys.stdin.readline()\n"
        f"g = subprocess.Popen([sys.executable, '-c', {SPIN!r}])\n"
        f"exec({SPIN!r})\n"
        "g.wait()\n")


def test_the_tree_s_cpu_is_its_own_and_figures_are_in_range() -> None:
    load = HostLoad(every_s=0.05)
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, text=True)
    load.start(proc.pid)
    proc.communicate("go\n")
    assert proc.returncode == 0
    load.stop()
    got = load.result()
    assert got["ours_cpu_s"] >= 0.55  # two processes, 0.3 s each, less the clocks' rounding
    assert got["wall_s"] > 0
    assert got["other_cores"] >= 0
    assert 0 <= got["steal_frac"] <= 1


def test_no_samples_give_none() -> None:
    assert HostLoad().result() == {"wall_s": None, "ours_cpu_s": None, "other_cores": None, "steal_frac": None}
