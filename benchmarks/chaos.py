"""Chaos for ``benchmarks/soak.py --chaos``: a long run that loses processes and loses nothing.

The harness owns a Ray cluster (it started it, so every Ray process is its descendant and
nothing of another job can be hit) and runs ``miles train --address`` against it as a
subprocess with a checkpoint every step. At steps drawn at random it SIGKILLs one of:

- a rollout worker (the driver's health check returns its leases and starts a replacement),
- a reward worker (Ray restarts it; a reward call that fails drops its sample, counted),
- the driver itself (its actors die with it; the harness starts ``miles train --load``).

At the end it reads the outputs: the ledger must balance (0 lost), no trajectory may be
trained twice in the run's history (each step's batch counts once: the last session that
trained it, since a resume repeats the steps after its checkpoint), the prompts drawn from
the data (the checkpoint's cursor) must equal the groups admitted, every trained token must
be within the staleness bound, and RSS is sampled per process role over the whole run.
At each resume it counts what the checkpoint carried over: partial trajectories and
generations in flight (with and without a prefix) that the new run resumes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("rollout", "reward", "driver")
ROLES = {  # process title fragment → role
    "ray::_RolloutWorkerActor": "rollout_workers",
    "ray::_RewardActor": "reward_workers",
    "ray::_PolicyTrainerActor": "trainer",
    "ray::_BufferActor": "buffer",
    "ray::WeightBroadcaster": "broadcaster",
    "gcs_server": "gcs_server",
    "raylet": "raylet",
}


@dataclass
class ChaosResult:
    steps: int = 0
    sessions: int = 0
    kills: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    elapsed_s: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    trained_rows: int = 0
    prompts_drawn: int = 0
    groups_admitted: int = 0
    staleness_max: float = 0.0
    max_staleness: int = 0
    carried: dict[str, int] = field(default_factory=lambda: {"partial": 0, "in_flight_prefix": 0, "in_flight": 0})
    rss: list[dict[str, float]] = field(default_factory=list)  # samples: t, step, MiB by role
    log: list[str] = field(default_factory=list)  # one line per kill

    @property
    def ok(self) -> bool:
        return (self.summary.get("status") == "completed" and bool(self.summary.get("ledger_ok"))
                and self.lost == 0 and self.duplicated == 0 and self.prompts_drawn == self.groups_admitted
                and self.trained_rows == self.summary["ledger"]["trained"]
                and self.staleness_max <= self.max_staleness)


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _ray_procs(role: str) -> list[psutil.Process]:
    """This harness's Ray processes of one role (its descendants only)."""
    frag = next(k for k, v in ROLES.items() if v == role)
    out = []
    for p in psutil.Process().children(recursive=True):
        cmd = _cmd(p)
        if cmd.startswith(frag) or (not frag.startswith("ray::") and frag in cmd.split(" ")[0]):
            out.append(p)
    return out


def rss_sample(driver: subprocess.Popen | None) -> dict[str, float]:
    sample: dict[str, float] = {}
    for p in psutil.Process().children(recursive=True):
        cmd = _cmd(p)
        role = next((r for frag, r in ROLES.items()
                     if cmd.startswith(frag) or (not frag.startswith("ray::") and frag in cmd.split(" ")[0])), None)
        if driver is not None and p.pid == driver.pid:
            role = "driver"
        if role is None:
            continue
        try:
            mb = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        if role == "rollout_workers":  # one figure per worker: the largest
            sample[role] = max(sample.get(role, 0.0), mb)
        else:
            sample[role] = sample.get(role, 0.0) + mb
    return sample


class _Tail:
    """The newest ``step`` in metrics.jsonl, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.step = path, 0, 0

    def poll(self) -> int:
        if not self.path.exists():
            return self.step
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            data = fh.read()
        end = data.rfind(b"\n")
        if end < 0:
            return self.step
        self.offset += end + 1
        for line in data[:end].splitlines():
            try:
                self.step = int(json.loads(line)["step"])
            except (ValueError, KeyError):
                pass
        return self.step


def _by_step(path: Path, starts: list[int]) -> dict[int, list[dict[str, Any]]]:
    """Rows of a JSONL output keyed by step, each step from the last session that wrote it
    (``starts``: the file's size when each session began)."""
    out: dict[int, list[dict[str, Any]]] = {}
    if not path.exists():
        return out
    data = path.read_bytes()
    bounds = [*starts, len(data)]
    for s in range(len(starts)):
        session: dict[int, list[dict[str, Any]]] = {}
        for line in data[bounds[s]:bounds[s + 1]].splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut by a SIGKILL
                continue
            session.setdefault(int(row["step"]), []).append(row)
        out.update(session)
    return out


def _carried(ck: Path) -> dict[str, int]:
    """What the newest checkpoint under ``ck`` holds that is not finished."""
    import msgspec

    from miles.buffers.records import IN_FLIGHT, PARTIAL
    from miles.checkpoint import resolve_checkpoint

    state = msgspec.msgpack.decode((resolve_checkpoint(ck) / "run.msgpack").read_bytes())
    recs = state["buffer"]["records"]
    return {"partial": sum(r[1] == PARTIAL for r in recs),
            "in_flight_prefix": sum(r[1] == IN_FLIGHT and r[3][0] > 0 for r in recs),
            "in_flight": sum(r[1] == IN_FLIGHT for r in recs)}


def run_chaos(root: Path, argv: list[str], *, steps: int, kills: int, max_staleness: int, seed: int = 0,
              rss_every_s: float = 5.0, timeout_s: float = 7200.0, log=print) -> ChaosResult:
    """Run ``miles train`` (``argv``: its flags without --num-rollout/--save/--load/--output-dir/
    --address) to ``steps`` steps under ``kills`` SIGKILLs of each kind, at random steps."""
    import ray

    own = not ray.is_initialized()
    if own:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    address = ray.get_runtime_context().gcs_address
    out, ck = root / "out", root / "ck"
    rng = random.Random(seed)
    lo, hi = min(5, steps - 1), max(steps - 2, 1)
    plan = {k: sorted(rng.randint(lo, hi) for _ in range(kills)) for k in KINDS}
    base = [sys.executable, "-m", "miles", "train", *argv, "--num-rollout", str(steps), "--output-dir", str(out),
            "--save", str(ck), "--save-interval", "1", "--address", address, "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = ChaosResult(max_staleness=max_staleness)
    tail = _Tail(out / "metrics.jsonl")
    starts: dict[str, list[int]] = {"metrics.jsonl": [], "trajectories.jsonl": []}
    start = last_rss = time.monotonic()
    logf = open(root / "driver.log", "ab")
    try:
        while True:
            for name, offs in starts.items():
                offs.append((out / name).stat().st_size if (out / name).exists() else 0)
            resume = (ck / "latest").is_file()
            if resume:
                for k, v in _carried(ck).items():
                    res.carried[k] += v
            proc = subprocess.Popen(base + (["--load", str(ck)] if resume else []), env=env, stdout=logf,
                                    stderr=subprocess.STDOUT)
            res.sessions += 1
            killed_driver = False
            while proc.poll() is None:
                assert time.monotonic() - start < timeout_s, "chaos run timed out"
                step = tail.poll()
                now = time.monotonic()
                if now - last_rss >= rss_every_s:
                    res.rss.append({"t": now - start, "step": float(step), **rss_sample(proc)})
                    last_rss = now
                due = [k for k in KINDS if plan[k] and plan[k][0] <= step]
                if not due:
                    time.sleep(0.1)
                    continue
                kind = rng.choice(due)
                if kind == "driver":
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    killed_driver = True
                else:
                    victims = _ray_procs("rollout_workers" if kind == "rollout" else "reward_workers")
                    if not victims:  # being replaced right now: try again shortly
                        time.sleep(0.1)
                        continue
                    try:
                        rng.choice(victims).send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess:
                        continue
                plan[kind].pop(0)
                res.kills[kind] += 1
                res.log.append(f"t={time.monotonic() - start:.0f}s step {step}: killed a {kind}")
                log(f"[chaos] {res.log[-1]} ({dict(res.kills)})")
            if killed_driver:
                _wait_actors_gone()
                continue
            if proc.returncode != 0:
                logf.flush()
                tail = (root / "driver.log").read_bytes()[-4000:].decode(errors="replace")
                raise RuntimeError(f"miles train exited {proc.returncode}; the end of its log:\n{tail}")
            break
    finally:
        logf.close()
        if own:
            ray.shutdown()
    res.elapsed_s = time.monotonic() - start
    _account(res, out, ck, starts)
    return res


def _wait_actors_gone(timeout: float = 60.0) -> None:
    """A dead driver's actors are reaped by Ray; the next session waits for that (the CPUs
    they held go back), so a resume never queues behind a ghost."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_ray_procs(r) for r in ("trainer", "buffer")):
        time.sleep(0.2)


def _account(res: ChaosResult, out: Path, ck: Path, starts: dict[str, list[int]]) -> None:
    import msgspec

    from miles.checkpoint import resolve_checkpoint

    res.summary = json.loads((out / "summary.json").read_text())
    res.steps = int(res.summary["steps"])
    ledger = res.summary["ledger"]
    accounted = (ledger["queued"] + ledger["in_flight"] + ledger["partial"] + ledger["waiting"]
                 + ledger["ready"] + ledger["trained"] + sum(ledger["dropped"].values()))
    res.lost = ledger["admitted"] - accounted
    trajs = _by_step(out / "trajectories.jsonl", starts["trajectories.jsonl"])
    ids = [r["id"] for s in range(1, res.steps + 1) for r in trajs.get(s, [])]
    res.trained_rows, res.duplicated = len(ids), len(ids) - len(set(ids))
    metrics = _by_step(out / "metrics.jsonl", starts["metrics.jsonl"])
    res.staleness_max = max((r.get("buffer/staleness_max", 0.0) for rows in metrics.values() for r in rows),
                            default=0.0)
    state = msgspec.msgpack.decode((resolve_checkpoint(ck) / "run.msgpack").read_bytes())
    data = state["data"]
    res.prompts_drawn = data["epoch"] * data["num_rows"] + data["position"]
    res.groups_admitted = ledger["groups"]["admitted"]


def rss_table(res: ChaosResult, rows: int = 11) -> list[str]:
    """RSS (MiB) by role at evenly spaced samples over the run."""
    if not res.rss:
        return ["(no RSS samples)"]
    roles = ["driver", "trainer", "rollout_workers", "reward_workers", "buffer", "broadcaster", "raylet", "gcs_server"]
    idx = sorted({round(i * (len(res.rss) - 1) / max(rows - 1, 1)) for i in range(rows)})
    lines = ["| t (s) | step | " + " | ".join(roles) + " |", "|---" * (len(roles) + 2) + "|"]
    for i in idx:
        s = res.rss[i]
        lines.append(f"| {s['t']:.0f} | {s['step']:.0f} | " + " | ".join(f"{s.get(r, 0.0):.0f}" for r in roles) + " |")
    return lines
