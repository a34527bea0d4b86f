"""Replay-buffer throughput and memory: in-process and through one Ray actor.

    python benchmarks/buffer.py [--quick] [--no-ray] [--results benchmarks/log/buffer.md]

One cycle admits G prompts of n samples, leases them all, fills in a response of L tokens
per trajectory (the worker's job: not timed), puts them back with one ``put_many`` and
takes them out with one ``get_batch(G)``. Reported, per response length L:

* put+get: trajectories per second of ``put_many`` + ``get_batch`` time (the goal: at
  least 100,000/s in-process for short trajectories);
* cycle: the same including ``add_prompts`` and ``lease``;
* Ray: the same calls on one ``ray.remote(ReplayBuffer)`` actor, each a blocking
  round trip with the whole batch (trajectories travel pickled, as Ray sends them);
* memory: tracemalloc bytes per held trajectory (queued with no response, and ready with
  L-token responses), i.e. what capacity × this costs.

The figures are printed and a section is appended to benchmarks/log/buffer.md. The buffer is CPU-only
Python, so there is no --device flag.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.buffers import BufferConfig, ReplayBuffer  # noqa: E402
from miles.types import PromptSample, Segment, Status, Trajectory  # noqa: E402

GOAL = 100_000  # trajectories/s, in-process, short trajectories
LENGTHS = (1, 64, 1024)


def fill(traj: Trajectory, length: int, version: int) -> None:
    """What a worker does: a fresh response of ``length`` model tokens."""
    traj.response_tokens = list(range(length))
    traj.logprobs = [-0.5] * length
    traj.versions = [version] * length
    traj.loss_mask = [1] * length
    traj.segments = [Segment(0, length)]
    traj.num_segments = 1
    traj.status = Status.COMPLETED
    traj.reward = float(traj.index_in_group % 2)


def _prompts(k: int, it: int) -> list[PromptSample]:
    return [PromptSample(prompt_id=f"p{it}.{i}", prompt_tokens=[1, 2, 3, 4]) for i in range(k)]


def bench_inprocess(length: int, groups: int, n: int, iters: int) -> dict[str, float]:
    buf = ReplayBuffer(BufferConfig(capacity=groups * n, n_samples_per_prompt=n))
    t_admit = t_lease = t_put = t_get = 0.0
    moved = 0
    for it in range(iters):
        prompts = _prompts(groups, it)
        t0 = time.perf_counter()
        buf.add_prompts(prompts)
        t1 = time.perf_counter()
        leased = buf.lease("w", groups * n)
        t2 = time.perf_counter()
        for t in leased:
            fill(t, length, 0)
        t3 = time.perf_counter()
        buf.put_many(leased, "w")
        t4 = time.perf_counter()
        batch = buf.get_batch(groups, 0)
        t5 = time.perf_counter()
        assert len(batch) == groups
        t_admit += t1 - t0
        t_lease += t2 - t1
        t_put += t4 - t3
        t_get += t5 - t4
        moved += len(leased)
        del leased, batch  # free the trained trajectories outside the timed calls
    buf.ledger().check()
    return {
        "put_get_per_s": moved / (t_put + t_get),
        "cycle_per_s": moved / (t_admit + t_lease + t_put + t_get),
        "put_us": 1e6 * t_put / moved,
        "get_us": 1e6 * t_get / moved,
        "admit_lease_us": 1e6 * (t_admit + t_lease) / moved,
    }


def bench_ray(length: int, groups: int, n: int, iters: int) -> dict[str, float]:
    import ray

    actor = ray.remote(ReplayBuffer).remote(BufferConfig(capacity=groups * n, n_samples_per_prompt=n))
    ray.get(actor.ledger.remote())  # started
    t_cycle = t_pg = 0.0
    moved = 0
    for it in range(iters):
        prompts = _prompts(groups, it)
        t0 = time.perf_counter()
        ray.get(actor.add_prompts.remote(prompts))
        leased = ray.get(actor.lease.remote("w", groups * n))
        t1 = time.perf_counter()
        for t in leased:
            fill(t, length, 0)
        t2 = time.perf_counter()
        ray.get(actor.put_many.remote(leased, "w"))
        batch = ray.get(actor.get_batch.remote(groups, 0))
        t3 = time.perf_counter()
        assert len(batch) == groups
        t_pg += t3 - t2
        t_cycle += (t1 - t0) + (t3 - t2)
        moved += len(leased)
        del leased, batch
    ray.get(actor.ledger.remote()).check()
    ray.kill(actor)
    return {"put_get_per_s": moved / t_pg, "cycle_per_s": moved / t_cycle}


def bench_memory(length: int, count: int, n: int) -> dict[str, float]:
    """tracemalloc bytes per held trajectory: queued (no response) and ready (L tokens)."""
    gc.collect()
    tracemalloc.start()
    buf = ReplayBuffer(BufferConfig(capacity=count, n_samples_per_prompt=n))
    prompts = _prompts(count // n, 0)
    base = tracemalloc.get_traced_memory()[0]
    buf.add_prompts(prompts)
    queued = (tracemalloc.get_traced_memory()[0] - base) / count
    leased = buf.lease("w", count)
    for t in leased:
        fill(t, length, 0)
    buf.put_many(leased, "w")  # everything becomes ready
    del leased
    gc.collect()
    ready = (tracemalloc.get_traced_memory()[0] - base) / count
    tracemalloc.stop()
    assert buf.ledger().ready == count
    return {"queued_bytes": queued, "ready_bytes": ready}


def machine() -> str:
    try:
        import torch

        torch_v = torch.__version__
    except ImportError:  # the buffer does not need torch
        torch_v = "n/a"
    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} logical CPUs, Python {platform.python_version()}, torch {torch_v}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray actor runs")
    ap.add_argument("--groups", type=int, default=64, help="groups per put_many/get_batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "buffer.md"))
    args = ap.parse_args()
    per_call = args.groups * args.n
    budget = 20_000 if args.quick else 200_000  # trajectories per length, in-process
    rows = []
    for length in LENGTHS:
        iters = max(3, budget // per_call // (1 if length < 1024 else 8))
        ip = bench_inprocess(length, args.groups, args.n, iters)
        # the per-trajectory figure does not depend on the count; keep long ones small
        mem = bench_memory(length, 2048 if args.quick or length >= 1024 else 8192, args.n)
        rows.append({"length": length, "iters": iters, **ip, **mem})
    if not args.no_ray:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
        try:
            for row in rows:
                iters = max(3, row["iters"] // 10)
                ray_r = bench_ray(row["length"], args.groups, args.n, iters)
                row["ray_put_get_per_s"] = ray_r["put_get_per_s"]
                row["ray_cycle_per_s"] = ray_r["cycle_per_s"]
        finally:
            ray.shutdown()
    report(rows, args, per_call)


def report(rows: list[dict], args: argparse.Namespace, per_call: int) -> None:
    has_ray = "ray_put_get_per_s" in rows[0]
    head = ("| tokens | put+get traj/s | cycle traj/s | put µs/traj | get µs/traj | admit+lease µs/traj "
            + ("| Ray put+get traj/s | Ray cycle traj/s | in-process/Ray " if has_ray else "")
            + "| bytes/traj queued | bytes/traj ready |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [f"{r['length']}", f"{r['put_get_per_s']:,.0f}", f"{r['cycle_per_s']:,.0f}",
                 f"{r['put_us']:.2f}", f"{r['get_us']:.2f}", f"{r['admit_lease_us']:.2f}"]
        if has_ray:
            cells += [f"{r['ray_put_get_per_s']:,.0f}", f"{r['ray_cycle_per_s']:,.0f}",
                      f"{r['put_get_per_s'] / r['ray_put_get_per_s']:.1f}×"]
        cells += [f"{r['queued_bytes']:,.0f}", f"{r['ready_bytes']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    short = rows[0]["put_get_per_s"]
    verdict = "met" if short >= GOAL else "NOT met"
    summary = (f"Goal (in-process put+get ≥ {GOAL:,} trajectories/s for short trajectories): "
               f"**{verdict}** — {short:,.0f}/s for 1-token trajectories "
               f"({short / GOAL:.1f}× the goal).")
    if has_ray:
        longest = rows[-1]
        summary += (
            f" Through one Ray actor (blocking round trips of {per_call} trajectories): "
            f"{rows[0]['ray_put_get_per_s']:,.0f} short trajectories/s, and "
            f"{longest['ray_put_get_per_s'] * longest['length'] / 1e6:.1f}M response tokens/s "
            f"with {longest['length']}-token trajectories."
        )
    table = "\n".join(lines)
    print(table)
    print(summary)
    cmd = "python benchmarks/buffer.py " + " ".join(sys.argv[1:])
    section = "\n".join([
        f"## Replay buffer throughput and memory ({datetime.date.today().isoformat()})",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"Machine: {machine()}; shared with other engineers' jobs while it ran, so absolute "
        "figures are noisy; the in-process/Ray ratio comes from the same process run.  ",
        f"Setup: {args.groups} groups × {args.n} samples = {per_call} trajectories per "
        "put_many/lease/get_batch call; stale policy drop, η = 1; response lengths 1/64/1024 "
        "tokens; Ray = one `ray.remote(ReplayBuffer)` actor, blocking round trips, "
        "trajectories pickled by Ray. Memory: tracemalloc over 8,192 held trajectories "
        "(2,048 for 1024 tokens or with --quick); 'ready' includes the response lists "
        "themselves (Python lists of ints/floats; a float is a 24-byte object). "
        "Timed calls include the cyclic GC passes that happen to fall in them: the buffer's "
        "admit+lease work does not depend on response length, but GC passes over many long "
        "response lists do.",
        "",
        table,
        "",
        summary,
        "",
    ])
    path = Path(args.results)
    if not path.exists():
        path.write_text("# Benchmark results\n\nEach benchmark appends a section; newest last.\n\n")
    with path.open("a", encoding="utf-8") as fh:
        fh.write(section + "\n")
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
