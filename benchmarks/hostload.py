"""What the machine did while a benchmark ran: the host's CPU beyond the run, the GPUs' utilization.

A run that uses every core (miles async on 2 cores) slows down by whatever else the host
runs, while one that leaves cores idle (miles sync, waiting on its engine) absorbs it; a
ratio between two such runs means little unless both had the host to themselves.
``HostLoad`` samples, through psutil (as ``benchmarks/chaos.py`` finds Ray's processes), the
host's busy and stolen CPU time and the CPU time of a child's process tree (every
descendant, Ray's workers included, each at the most it was seen to have). What the host was
busy with beyond the tree is the other load, in cores; steal is 0 where the OS has no such
count. ``GpuUtilization`` reads ``nvidia-smi`` over the span a run's throughput is measured on.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


def _host_cpu() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of all CPUs since boot."""
    import psutil  # at use: async_vs_sync imports this module on machines without psutil

    t = psutil.cpu_times()
    busy = t.user + t.system + sum(getattr(t, f, 0.0) for f in ("nice", "irq", "softirq"))
    return busy, getattr(t, "steal", 0.0)


class HostLoad:
    """Samples every ``every_s`` from ``start(pid)`` to ``stop()``; ``result()`` is a dict."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self._seen: dict[int, float] = {}  # pid of the tree -> the most CPU seconds it was seen to have
        self._before: dict[int, float] = {}  # what the tree had at start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start: tuple[float, float, float] | None = None
        self._end: tuple[float, float, float] | None = None

    def _sample(self, root: Any) -> None:
        import psutil

        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            return  # the root has ended: its tree's counts are those last seen
        for proc in tree:
            try:
                t = proc.cpu_times()
            except psutil.Error:
                continue
            self._seen[proc.pid] = max(self._seen.get(proc.pid, 0.0), t.user + t.system)

    def start(self, pid: int) -> None:
        import psutil

        try:
            root = psutil.Process(pid)
        except psutil.Error:
            return  # ended before it could be watched: result() says None
        self._sample(root)
        self._before = dict(self._seen)
        self._start = (time.monotonic(), *_host_cpu())

        def loop() -> None:
            while not self._stop.wait(self.every_s):
                self._sample(root)

        self._thread = threading.Thread(target=loop, name="hostload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._end = (time.monotonic(), *_host_cpu())

    def result(self) -> dict[str, Any]:
        """``ours_cpu_s``: CPU seconds of the tree; ``other_cores``: the host's busy time beyond
        it, per second of the run (a process that ended between two samples loses its last
        ``every_s`` to this figure); ``steal_frac``: stolen share of the host's CPU time."""
        if self._start is None or self._end is None:
            return {"wall_s": None, "ours_cpu_s": None, "other_cores": None, "steal_frac": None}
        wall = self._end[0] - self._start[0]
        busy = self._end[1] - self._start[1]
        steal = self._end[2] - self._start[2]
        ours = sum(cpu - self._before.get(pid, 0.0) for pid, cpu in self._seen.items())
        cpus = os.cpu_count() or 1
        return {"wall_s": wall, "ours_cpu_s": ours, "other_cores": max(0.0, busy - ours) / max(wall, 1e-9),
                "steal_frac": steal / max(wall * cpus, 1e-9)}


class GpuUtilization:
    """Each GPU's utilization (``nvidia-smi``, every 250 ms) while a run is between the end of
    its first step and the end of its last: the samples taken while ``metrics.jsonl`` holds 1
    to ``steps - 1`` lines, the span the throughput is measured over."""

    def __init__(self, metrics: Path, steps: int) -> None:
        self.metrics, self.steps = metrics, steps
        self.samples: dict[int, list[float]] = {}
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "250"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _rows(self) -> int:
        try:
            with open(self.metrics) as fh:
                return sum(1 for _ in fh)
        except FileNotFoundError:
            return 0

    def _read(self) -> None:
        # nvidia-smi numbers GPUs physically; a lane sees its own as 0, 1 (CUDA_VISIBLE_DEVICES)
        visible = [int(x) for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip().isdigit()]
        for line in self.proc.stdout:
            index, _, util = line.partition(",")
            if not (index.strip().isdigit() and util.strip().isdigit() and 1 <= self._rows() < self.steps):
                continue
            gpu = int(index)
            if visible:
                if gpu not in visible:
                    continue
                gpu = visible.index(gpu)
            self.samples.setdefault(gpu, []).append(float(util))

    def stop(self) -> dict[int, float]:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        return {i: statistics.fmean(v) for i, v in sorted(self.samples.items()) if v}
