"""What the machine did while a benchmark ran: the host's CPU beyond the run, the GPUs' utilization.

A run that uses every core (miles async on 2 cores) slows down by whatever else the host
runs, while one that leaves cores idle (miles sync, waiting on its engine) absorbs it; a
ratio between two such runs means little unless both had the host to themselves.
``HostLoad`` samples ``/proc`` while a child runs: the host's busy and stolen CPU time
(``/proc/stat``) and the CPU time of the child's process tree (every descendant, Ray's
workers included, each at the most it was seen to have). What the host was busy with beyond
the tree is the other load, in cores. Linux only; elsewhere the figures are None.
``GpuUtilization`` reads ``nvidia-smi`` over the span a run's throughput is measured on.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


def _host_ticks() -> tuple[int, int]:
    """(busy, stolen) ticks of all CPUs since boot: user, nice, system, irq, softirq; steal."""
    fields = [int(x) for x in (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, user + system ticks) for every process readable now."""
    out = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        out[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return out


class HostLoad:
    """Samples every ``every_s`` from ``start(pid)`` to ``stop()``; ``result()`` is a dict."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self._seen: dict[int, int] = {}  # pid of the tree -> its largest tick count seen
        self._before: dict[int, int] = {}  # ticks the tree's processes had at start
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start: tuple[float, int, int] | None = None
        self._end: tuple[float, int, int] | None = None

    @staticmethod
    def available() -> bool:
        return (PROC / "stat").is_file()

    def _sample(self, root: int) -> None:
        procs = _processes()
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in procs.items():
            children.setdefault(parent, []).append(pid)
        todo = [root]
        while todo:
            pid = todo.pop()
            if pid in procs:
                self._seen[pid] = max(self._seen.get(pid, 0), procs[pid][1])
                self._before.setdefault(pid, procs[pid][1] if self._start is None else 0)
            todo += children.get(pid, [])

    def start(self, pid: int) -> None:
        if not self.available():
            return
        self._sample(pid)
        self._start = (time.monotonic(), *_host_ticks())

        def loop() -> None:
            while not self._stop.wait(self.every_s):
                self._sample(pid)

        self._thread = threading.Thread(target=loop, name="hostload", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._end = (time.monotonic(), *_host_ticks())

    def result(self) -> dict[str, Any]:
        """``ours_cpu_s``: CPU seconds of the tree; ``other_cores``: the host's busy time beyond
        it, per second of the run (a process that ended between two samples loses its last
        ``every_s`` to this figure); ``steal_frac``: stolen share of the host's CPU time."""
        if self._start is None or self._end is None:
            return {"wall_s": None, "ours_cpu_s": None, "other_cores": None, "steal_frac": None}
        wall = self._end[0] - self._start[0]
        busy = (self._end[1] - self._start[1]) / TICK
        steal = (self._end[2] - self._start[2]) / TICK
        ours = sum(t - self._before.get(pid, 0) for pid, t in self._seen.items()) / TICK
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
