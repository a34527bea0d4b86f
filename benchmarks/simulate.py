"""miles at 1 to 1,000 rollout workers, in simulated time: throughput, staleness, buffer cost.

    python benchmarks/simulate.py --workers 1 10 100 1000 [--eta 0 1 2 4 8 16] [--no-record]

**What is real.** The replay buffer (``miles.buffers.ReplayBuffer``: leases, group assembly,
the staleness bound with the ``mask`` policy that partial rollouts use, the ledger) and the
scheduler (``miles.scheduler.Scheduler``: AReaL's admission budget) are the runtime's own
objects, called exactly as the driver and the rollout workers call them: the driver's
admission decision (``Scheduler.admit(buffer.ledger(), buffer.prompt_room())`` on a buffer
state change, answered at most every ``ADMISSION_COALESCE_S``, at once on a new version),
its train step (``get_batch(B, scheduler.version)``, train, ``buffer.set_version`` before the
publish, ``scheduler.on_version`` after it, and in ``sync`` mode after every worker applied
the weights), and the worker's one call per ``BUFFER_CALL_INTERVAL_S``: with free slots and no
lease in flight it returns what finished and leases (``put_and_lease_async``: ``put_many``,
then ``lease_or_wait``); a lease that finds nothing waits in the buffer up to ``LEASE_WAIT_S``,
woken by the buffer's own waiter list when work becomes leasable (``miles.buffers.waiting``:
a wake leases again through ``lease_or_wait``, as ``ReplayBuffer.lease_async`` does; the
deadline ends it with ``cancel_wait``), while what finishes meanwhile goes back in put-only
calls (``put_many``).

**What is modelled** (a heap of events in simulated time; nothing sleeps):

* a rollout worker is one engine decoding up to ``c`` sequences at once; a decode step of
  ``b`` sequences takes ``d(b) = d0 + d1·b`` seconds (memory-bound decode: the weights are
  read once a step, each sequence's KV cache once) and gives each sequence one token;
  between events every active sequence advances at ``1/d(b)`` tokens a second;
* response lengths are Zipf: ``L = unit·k`` with ``P(k) ∝ k^-a`` for ``k = 1..K``, drawn once
  per sample from a seeded generator, so every configuration sees the same samples;
* weight updates are in flight (``--partial-rollout``): at each publish every engine pauses
  ``stall`` seconds, then its sequences go on under the new version, each token recording it;
* the trainer takes ``t0 + tokens / train_tps`` seconds a step and ``publish`` seconds to
  publish the weights.

The batch grows with the cluster, as it does when users add workers: ``B = W·c/n`` groups
(one batch is one cluster's worth of concurrent sequences), so throughput can scale until
the trainer, whose speed is fixed, saturates.

**Reported.** Trained samples and tokens a second, trainer and worker utilization, the
token-level staleness distribution of every trained loss token (mean, p50, p90, max, masked
share), the check that no loss token is older than η, the exact ledger, and the wall cost
of every buffer and scheduler call (``perf_counter`` around each) per trajectory and as a
share of the simulated step time. Not included: Ray's per-call cost (the buffer is an actor
in a run; ``benchmarks/buffer_actor.py`` measures it), the buffer actor's timed full GC
passes (at most ``gcpolicy.MAX_SHARE`` of its time by construction; the run here, like the
actor, turns the young collections off), lease renewals, the driver's 50 ms long-poll
answers that carry no change, the wait of a waiting lease (it costs the buffer nothing while
it waits: its registration and every lease it makes are timed). Calls a step count round
trips: a waiting lease is one call however often it is woken.

**The closed-form model of mean staleness** that every row is checked against (the model
column: a rollout-bound formula from Little's law, a trainer-bound one from a cohort's decode
timeline) is derived in ``benchmarks/simulate_model.py``, beside ``SimConfig``;
``benchmarks/simulate_report.py`` holds ``Result``, the table and the verdicts.

Usage notes: ``--workers``/``--eta`` pick the grid; ``--train-tps`` (the trainer's speed)
moves the saturation point (``--train-tps 3e5`` saturates it at 1,000 workers). Each run
prints a table and appends a section to ``benchmarks/log/simulate.md`` (``--no-record``
skips it).
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import platform
import sys
import time
from itertools import compress
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.simulate_model import SimConfig, model  # noqa: E402
from benchmarks.simulate_report import Result, append_section, table, verdicts  # noqa: E402
from miles.buffers import BufferConfig, ReplayBuffer  # noqa: E402
from miles.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from miles.types import PromptSample, Status  # noqa: E402

# The runtime's pacing, as in miles.actors.rollout_worker / miles.actors.ray_actors (not
# imported: those modules pull in torch and Ray).
BUFFER_CALL_INTERVAL_S = 0.02  # a worker calls the buffer at most this often
ADMISSION_COALESCE_S = 0.025  # the driver's admission answers are at least this far apart
LEASE_WAIT_S = 10.0  # how long a lease that finds nothing waits in the buffer for work

_FINISH, _CALL, _TRAINED, _PUBLISHED, _APPLIED, _ADMIT, _WAKE, _DEADLINE = range(8)
PROMPT = [1] * 64


class _Worker:
    __slots__ = ("wid", "active", "ends", "V", "t", "paused_until", "marks", "outbox", "last_call",
                 "call_at", "epoch", "waiting", "ask", "wake", "busy_s")

    def __init__(self, wid: str) -> None:
        self.wid = wid
        self.active: dict[str, tuple] = {}  # trajectory id -> (trajectory, depth at start, prefix)
        self.ends: list[tuple[float, int, str]] = []  # heap of (depth at end, seq, id)
        self.V = 0.0  # decode depth: tokens every active sequence has gained since start
        self.t = 0.0  # the time V refers to
        self.paused_until = 0.0
        self.marks: list[tuple[float, int]] = [(-1.0, 0)]  # (depth, version from there on)
        self.outbox: list = []
        self.last_call = -math.inf
        self.call_at = math.inf  # the pending call's time (inf: none)
        self.epoch = 0  # invalidates scheduled finish events
        self.waiting = 0  # the waiting lease in flight (its number; 0: none)
        self.ask = 0  # how many it asks for
        self.wake: object = None  # its wake callable (the buffer calls it from inside a call)
        self.busy_s = 0.0  # slot-seconds spent decoding


class Simulation:
    """One configuration: the real buffer and scheduler, modelled engines and trainer."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.warm = cfg.warmup_steps
        c, B, n = cfg.slots, cfg.batch, cfg.n
        cap = (cfg.eta + 3) * B * n + cfg.workers * c
        self.buf = ReplayBuffer(
            BufferConfig(max_staleness=cfg.eta, stale_policy="mask", capacity=cap, n_samples_per_prompt=n,
                         lease_timeout_s=1e12),
            clock=lambda: self.now)
        self.sched = Scheduler(SchedulerConfig(mode=cfg.mode, max_staleness=cfg.eta, rollout_batch_size=B))
        values, pmf = cfg.lengths()
        self.rng = np.random.default_rng(cfg.seed)
        self.values, self.pmf = values, pmf
        self.len_of: list[int] = []
        self.workers = [_Worker(f"w{i}") for i in range(cfg.workers)]
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.next_prompt = 0
        self.version = 0  # the trainer's published version
        self.trainer_waiting = True
        self.trainer_busy_s = 0.0
        self.admit_at = math.inf
        self.admit_dirty = False
        self.last_admit = -math.inf
        self.cost: dict[str, float] = {}  # wall seconds (perf_counter) by call
        self.cpu: dict[str, float] = {}  # the same calls' CPU seconds (thread_time): a loaded machine's wall
        # time includes the time the process waited for a core
        self.calls = 0
        self.lapsed_waits = 0
        self.waits = 0  # waiting leases started (their numbers)
        self.steps_done = 0
        self.trained_ids: set[str] = set()
        self.duplicates = 0
        self.hist: dict[int, int] = {}
        self.loss_tokens = 0
        self.all_tokens = 0
        self.bound_held = True
        self.stale_max = 0
        self.shared: dict[int, tuple[list[int], list[float]]] = {}
        self.runs: dict[str, list[tuple[int, int]]] = {}  # trajectory id -> (version, tokens) runs
        self.held_tokens = 0  # tokens of finished samples not yet taken by the trainer
        self.at_bumps: list[float] = []  # tokens generated but not taken, at each measured bump
        self.window: dict[str, float] = {}

    # ---- helpers ----------------------------------------------------------------------
    def push(self, t: float, kind: int, obj: object = None, arg: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj, arg))

    def timed(self, name: str, fn, *args):
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args)
        self.cost[name] = self.cost.get(name, 0.0) + time.perf_counter() - t0
        self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c0
        return out

    def length(self, traj) -> int:
        idx = int(traj.prompt_id) * self.cfg.n + traj.index_in_group
        while idx >= len(self.len_of):
            self.len_of.extend(self.rng.choice(self.values, size=65536, p=self.pmf).tolist())
        return self.len_of[idx]

    def advance(self, w: _Worker) -> None:
        now = self.now
        start = w.t if w.t > w.paused_until else w.paused_until
        if now > start and w.active:
            b = len(w.active)
            w.V += (now - start) / (self.cfg.decode_base_s + self.cfg.decode_per_seq_s * b)
            w.busy_s += (now - start) * b
        w.t = now

    def schedule_finish(self, w: _Worker) -> None:
        w.epoch += 1
        if not w.ends:
            return
        b = len(w.active)
        dt = max(0.0, w.ends[0][0] - w.V) * (self.cfg.decode_base_s + self.cfg.decode_per_seq_s * b)
        self.push(max(self.now, w.paused_until) + dt, _FINISH, w, w.epoch)

    def request_call(self, w: _Worker, at: float | None = None) -> None:
        t = max(self.now if at is None else at, w.last_call + BUFFER_CALL_INTERVAL_S)
        if t < w.call_at:
            w.call_at = t
            self.push(t, _CALL, w)

    def request_admission(self, immediate: bool = False) -> None:
        t = self.now if immediate else max(self.now, self.last_admit + ADMISSION_COALESCE_S)
        if t < self.admit_at:
            self.admit_at = t
            self.push(t, _ADMIT)

    # ---- the worker -------------------------------------------------------------------
    def finish(self, w: _Worker, epoch: int) -> None:
        if epoch != w.epoch:
            return
        self.advance(w)
        while w.ends and w.ends[0][0] <= w.V + 1e-6:
            _, _, tid = heapq.heappop(w.ends)
            traj, v0, prefix = w.active.pop(tid)
            self.complete(w, traj, v0, prefix)
        self.schedule_finish(w)
        self.request_call(w)

    def complete(self, w: _Worker, traj, v0: float, prefix: int) -> None:
        """Fill in what the engine produced: tokens, and each token's version from the
        depth at which the worker's weight updates landed."""
        L = self.length(traj)
        new = L - prefix
        versions = list(traj.versions) if prefix else []
        marks = w.marks
        i = len(marks) - 1
        while marks[i][0] > v0:  # the version in force when this sequence started
            i -= 1
        done = 0
        runs = self.runs.pop(traj.id, [])  # (version, tokens) of what it generated before
        for j in range(i, len(marks)):
            nxt = marks[j + 1][0] if j + 1 < len(marks) else math.inf
            upto = new if nxt == math.inf else min(new, max(0, math.floor(nxt - v0 + 1e-6)))
            if upto > done:
                versions += [marks[j][1]] * (upto - done)
                runs.append((marks[j][1], upto - done))
                done = upto
            if done >= new:
                break
        self.runs[traj.id] = runs
        shared = self.shared.get(L)
        if shared is None:
            shared = self.shared[L] = ([7] * L, [-0.5] * L)
        traj.response_tokens, traj.logprobs = shared
        traj.versions = versions
        traj.loss_mask = [1] * L
        traj.status = Status.COMPLETED
        traj.reward = float(traj.index_in_group % 2)
        self.held_tokens += L
        w.outbox.append(traj)

    def call(self, w: _Worker) -> None:
        w.call_at = math.inf
        self.advance(w)
        free = self.cfg.slots - len(w.active)
        leasing = free > 0 and not w.waiting
        if not leasing and not w.outbox:
            return
        w.last_call = self.now
        batch, w.outbox = w.outbox, []
        self.calls += 1
        if leasing:
            self.waits += 1
            w.waiting, w.ask = self.waits, free
            w.wake = lambda w=w, k=self.waits: self.push(self.now, _WAKE, w, k)
            leased = self.timed("put_and_lease", self.put_and_lease, batch, w)
            if leased:
                self.answered(w, leased)
            else:
                self.push(self.now + LEASE_WAIT_S, _DEADLINE, w, w.waiting)
        else:
            self.timed("put_many", self.buf.put_many, batch, w.wid)
        if batch:
            self.request_admission()
            if self.trainer_waiting:
                self.take()

    def put_and_lease(self, batch: list, w: _Worker) -> list:
        """``ReplayBuffer.put_and_lease_async`` up to its first wait."""
        if batch:
            self.buf.put_many(batch, w.wid)
        return self.buf.lease_or_wait(w.wid, w.ask, w.wake)

    def woken(self, w: _Worker, wait: int) -> None:
        """The buffer woke a waiting lease: it leases again (or waits on)."""
        if w.waiting != wait:
            return
        self.advance(w)
        leased = self.timed("lease_wait", self.buf.lease_or_wait, w.wid, w.ask, w.wake)
        if leased:
            self.answered(w, leased)

    def lapsed(self, w: _Worker, wait: int) -> None:
        """A waiting lease's deadline: it answers nothing; the worker leases again at once."""
        if w.waiting != wait:
            return
        self.advance(w)
        self.timed("cancel_wait", self.buf.cancel_wait, w.wid)
        w.waiting = 0
        self.lapsed_waits += 1
        self.request_call(w)

    def answered(self, w: _Worker, leased: list) -> None:
        """The lease answered with work: the engine starts it; more free slots or finished
        work make the next call."""
        w.waiting = 0
        for traj in leased:
            traj.num_segments += 1
            prefix = len(traj.response_tokens)
            rem = self.length(traj) - prefix
            w.active[traj.id] = (traj, w.V, prefix)
            self.seq += 1
            heapq.heappush(w.ends, (w.V + rem, self.seq, traj.id))
        self.schedule_finish(w)
        if w.outbox or len(w.active) < self.cfg.slots:
            self.request_call(w)

    # ---- the driver -------------------------------------------------------------------
    def admit(self) -> None:
        self.admit_at = math.inf
        self.last_admit = self.now
        k = self.timed("admission", lambda: self.sched.admit(self.buf.ledger(), self.buf.prompt_room()))
        prompts = [PromptSample(prompt_id=str(self.next_prompt + i), prompt_tokens=PROMPT) for i in range(k)]
        self.next_prompt += k
        if prompts:
            self.timed("add_prompts", self.buf.add_prompts, prompts)  # wakes waiting leases

    def take(self) -> None:
        cfg = self.cfg
        version = self.sched.version
        groups = self.timed("get_batch", self.buf.get_batch, cfg.batch, version)
        if not groups:
            self.trainer_waiting = True
            return
        self.trainer_waiting = False
        tokens = 0
        measured = self.steps_done >= self.warm
        for group in groups:
            gid = group[0].group_id
            if gid in self.trained_ids:
                self.duplicates += 1
            self.trained_ids.add(gid)
            for traj in group:
                tokens += len(traj.response_tokens)
                self.held_tokens -= len(traj.response_tokens)
                if measured:
                    self.record(traj, version)
                else:
                    self.runs.pop(traj.id, None)
        train_s = cfg.train_base_s + tokens / cfg.train_tps
        self.trainer_busy_s += train_s + cfg.publish_s
        self.push(self.now + train_s, _TRAINED)

    def record(self, traj, version: int) -> None:
        """Per-token staleness of the trained loss tokens (and the bound check)."""
        runs = self.runs.pop(traj.id)
        mask = traj.loss_mask
        n_loss = mask.count(1)
        self.all_tokens += len(mask)
        self.loss_tokens += n_loss
        if n_loss != len(mask):  # the mask policy zeroed stale tokens: count what is left
            kept = list(compress(traj.versions, mask))
            runs = [(v, kept.count(v)) for v in sorted(set(kept))]
        hist = self.hist
        for v, cnt in runs:
            if cnt:
                hist[version - v] = hist.get(version - v, 0) + cnt
        if runs:
            oldest = min(v for v, cnt in runs if cnt)
            if version - oldest > self.cfg.eta:
                self.bound_held = False
            self.stale_max = max(self.stale_max, version - oldest)

    def trained(self) -> None:
        self.version += 1
        self.timed("set_version", self.buf.set_version, self.version)
        self.push(self.now + self.cfg.publish_s, _PUBLISHED)

    def published(self) -> None:
        cfg = self.cfg
        until = self.now + cfg.stall_s
        measured = self.steps_done >= self.warm
        untaken = self.held_tokens
        for w in self.workers:  # each engine commits the new weights: a decode pause
            self.advance(w)
            if measured:
                untaken += sum(min(w.V - v0, self.length(t) - p) for t, v0, p in w.active.values())
            w.paused_until = until
            if w.marks[-1][0] == w.V:
                w.marks[-1] = (w.V, self.version)
            else:
                w.marks.append((w.V, self.version))
            if w.active:
                oldest = min(v0 for _, v0, _ in w.active.values())
                while len(w.marks) > 1 and w.marks[1][0] <= oldest:
                    w.marks.pop(0)
            else:
                w.marks = w.marks[-1:]
            self.schedule_finish(w)
        if measured:
            self.at_bumps.append(untaken)
        if cfg.mode == "sync":  # the driver waits until every worker runs the new weights
            self.push(until, _APPLIED)
        else:
            self.applied()

    def applied(self) -> None:
        self.timed("on_version", self.sched.on_version, self.version)
        self.steps_done += 1
        if self.steps_done == self.warm:
            self.mark_window()
        self.request_admission(immediate=True)
        self.take()

    def mark_window(self) -> None:
        self.window = {"t": self.now, "calls": self.calls, "lapsed": self.lapsed_waits,
                       "trainer": self.trainer_busy_s, "busy": sum(w.busy_s for w in self.workers),
                       **{f"cost/{k}": v for k, v in self.cost.items()},
                       **{f"cpu/{k}": v for k, v in self.cpu.items()}}

    # ---- run ----------------------------------------------------------------------------
    def run(self) -> Result:
        cfg = self.cfg
        wall = time.perf_counter()
        end_step = self.warm + cfg.measured_steps
        self.admit()
        for w in self.workers:
            self.request_call(w)
        heap, pop = self.heap, heapq.heappop
        while heap and self.steps_done < end_step:
            t, _, kind, obj, arg = pop(heap)
            self.now = t
            if kind == _FINISH:
                self.finish(obj, arg)
            elif kind == _CALL:
                if t == obj.call_at:
                    self.call(obj)
            elif kind == _ADMIT:
                if t == self.admit_at:
                    self.admit()
            elif kind == _TRAINED:
                self.trained()
            elif kind == _PUBLISHED:
                self.published()
            elif kind == _WAKE:
                self.woken(obj, arg)
            elif kind == _DEADLINE:
                self.lapsed(obj, arg)
            else:
                self.applied()
        return self.result(time.perf_counter() - wall)

    def result(self, wall_s: float) -> Result:
        cfg, win = self.cfg, self.window
        for w in self.workers:
            self.advance(w)
        span = self.now - win["t"]
        steps = cfg.measured_steps
        samples = steps * cfg.batch * cfg.n
        ledger = self.buf.ledger()
        try:
            ledger.check()
            ok = ledger.groups.admitted == self.next_prompt and ledger.groups.trained == len(self.trained_ids)
        except AssertionError:
            ok = False
        costs = {k: v - win.get(f"cost/{k}", 0.0) for k, v in self.cost.items()}
        cpu = {k: v - win.get(f"cpu/{k}", 0.0) for k, v in self.cpu.items()}
        total, total_cpu = sum(costs.values()), sum(cpu.values())
        hist = self.hist
        tok = sum(hist.values())
        res = Result(
            cfg=cfg, samples_per_s=samples / span, tokens_per_s=self.loss_tokens / span, step_s=span / steps,
            trainer_util=min(1.0, (self.trainer_busy_s - win["trainer"]) / span),
            worker_util=(sum(w.busy_s for w in self.workers) - win["busy"]) / (span * cfg.workers * cfg.slots),
            staleness_mean=sum(k * v for k, v in hist.items()) / tok if tok else 0.0,
            staleness_hist=dict(sorted(hist.items())), staleness_max=self.stale_max,
            masked_frac=1 - self.loss_tokens / self.all_tokens if self.all_tokens else 0.0,
            bound_held=self.bound_held, ledger_ok=ok, duplicates=self.duplicates,
            admitted_groups=ledger.groups.admitted, trained_groups=ledger.groups.trained,
            buffer_s=costs, calls=self.calls - win["calls"], lapsed_waits=self.lapsed_waits - win["lapsed"],
            little=(sum(self.at_bumps) / len(self.at_bumps)) / (self.loss_tokens / steps) if self.at_bumps else 0.0,
            per_traj_us=total / samples * 1e6, overhead_frac=total / span, buffer_cpu_s=cpu,
            per_traj_cpu_us=total_cpu / samples * 1e6, overhead_cpu_frac=total_cpu / span, wall_s=wall_s, model=model(cfg))
        return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 10, 100, 1000])
    ap.add_argument("--eta", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--train-tps", type=float, default=SimConfig.train_tps)
    ap.add_argument("--steps", type=int, default=SimConfig.steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).resolve().parent / "log" / "simulate.md"))
    args = ap.parse_args()
    gc.disable()  # as the buffer actor runs (gcpolicy young=False): acyclic token lists
    results = []
    for W in args.workers:
        for eta in args.eta:
            cfg = SimConfig(workers=W, eta=eta, train_tps=args.train_tps, steps=args.steps, seed=args.seed)
            res = Simulation(cfg).run()
            gc.collect()
            results.append(res)
            print(table([res])[-1], flush=True)
    c = SimConfig(train_tps=args.train_tps)
    values, pmf = c.lengths()
    setup = (f"Setup: c = {c.slots} slots a worker, n = {c.n}, B = {c.groups_per_worker:g}·W groups; Zipf lengths "
             f"{c.len_unit}·k, k ≤ {c.len_buckets}, a = {c.zipf_a} (mean {pmf @ values:.0f}, max {values[-1]}); "
             f"decode d(b) = {c.decode_base_s * 1e3:g} ms + {c.decode_per_seq_s * 1e3:g} ms·b; train "
             f"{c.train_base_s:g} s + tokens / {c.train_tps:,.0f}/s; publish {c.publish_s:g} s; stall {c.stall_s:g} s; "
             f"{c.warmup} warm-up steps (+η when trainer-bound), then ≥ {c.steps} measured (≥ {c.min_samples:,} samples); seed {args.seed}. "
             f"η = 0 runs mode sync; the others async with in-flight updates and the mask policy. Model column: "
             f"'roll' = rollout-bound formula with its finite-batch term, 'train' = trainer-bound formula "
             f"(module docstring).")
    lines = table(results) + [""] + verdicts(results)
    report = "\n".join([f"## simulate — {time.strftime('%Y-%m-%d %H:%M')}", "",
                        f"Command: `python benchmarks/simulate.py {' '.join(sys.argv[1:])}`  ",
                        f"Machine: {platform.machine()} CPU, {platform.python_version()} (simulated time; wall "
                        f"costs are this machine's, shared with other jobs)  ", setup, "", *lines, ""])
    print(report)
    if not args.no_record:
        append_section(Path(args.results), "\n" + report)


if __name__ == "__main__":
    main()