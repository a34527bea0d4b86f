"""The replay buffer's per-trajectory cost inside a Ray actor against the same calls in-process.

Why: on the 2×H200 async runs the buffer actor's own work was ~29 µs a trajectory for
put_many, against 6–8 µs in ``benchmarks/buffer.py`` in-process, and its share of the span
stayed over the 1% goal in the partial-rollout configs. This runs one RL cycle (add 8 prompts
× 8 samples, lease, fill 70 tokens, put back 8 at a time, take the batch) through an actor and
in-process side by side, timing each method inside the callee as the real buffer actor does
(``miles.actors.ray_actors._timed``: wall time per method, CPU time in all).

``--gc`` picks the actor's garbage-collector setting: ``policy`` (miles' GC policy, as the real
buffer actor: full passes on a clock, timed apart as 'GC'), ``none`` (Python's default),
``off``, or a number N (``policy`` with a generation-0 threshold of N).

Measured on the CPU dev machine (2026-11-30, 200 cycles): the actor's calls cost 27–29 µs of
CPU a trajectory with the policy, 19–20 µs with no collector at all, against 11–14 µs for the
same calls in-process; so about a third of the gap is the young collections over each call's
freshly unpickled trajectories, and the rest the process (cold caches between Ray's calls).
Young passes on a 1-second clock instead of the automatic ones were tried and cost more in all
(each pass ~26 ms: 37 µs a trajectory with the passes counted), and gen-0 thresholds of 10,000
and 100,000 changed nothing beyond the noise.

Usage: python benchmarks/buffer_actor.py [--gc policy] [--cycles 200]   (prints only)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.buffer import _prompts, fill  # noqa: E402
from miles.actors.ray_actors import _timed  # noqa: E402
from miles.buffers import BufferConfig, ReplayBuffer  # noqa: E402

TIMED = ("add_prompts", "lease", "put_many", "get_batch")


class TimedBuffer(ReplayBuffer):
    """A ReplayBuffer whose methods are timed as the buffer actor's are."""

    def __init__(self, cfg: BufferConfig, gc_mode: str) -> None:
        super().__init__(cfg)
        if gc_mode != "none":
            from miles.utils import gcpolicy

            if gc_mode == "off":
                gc.disable()
            else:
                gcpolicy.install(young=gc_mode != "policy")  # N: policy-young with a gen-0 threshold N
                if gc_mode.isdigit():
                    _, middle, old = gc.get_threshold()
                    gc.set_threshold(int(gc_mode), middle, old)
        self.busy_by: dict[str, list[float]] = {}
        self.cpu_s = 0.0
        self.changes = 0

    def _bump(self) -> None:
        self.changes += 1

    def busy(self) -> tuple[dict[str, float], float]:
        from miles.utils import gcpolicy

        st = gcpolicy.stats()
        return {**{k: v[0] for k, v in self.busy_by.items()}, "GC": st["seconds"], "GC passes": st["count"]}, self.cpu_s


for _name in TIMED:
    setattr(TimedBuffer, _name, _timed(_name, changes=True))


def cycle(buf: Any, it: int, remote: bool, tokens: int = 70) -> None:
    import ray

    def call(method: str, *args: Any) -> Any:
        fn = getattr(buf, method)
        return ray.get(fn.remote(*args)) if remote else fn(*args)

    call("add_prompts", _prompts(8, it))
    leased = call("lease", "w", 64)
    for t in leased:
        fill(t, tokens, 0)
    for i in range(0, 64, 8):
        call("put_many", leased[i : i + 8], "w")
    call("get_batch", 8, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gc", default="policy", help="policy (the buffer actor's: timed full passes, no young ones) | "
                    "policy-young (timed full passes, automatic young ones) | none | off | N (gen-0 threshold)")
    ap.add_argument("--tokens", type=int, default=70, help="response tokens a trajectory")
    ap.add_argument("--cycles", type=int, default=200)
    args = ap.parse_args()
    import ray

    ray.init(include_dashboard=False, num_cpus=2, log_to_driver=False)
    cfg = BufferConfig(capacity=64 * 8, n_samples_per_prompt=8, max_staleness=4)
    actor = ray.remote(TimedBuffer).remote(cfg, args.gc)
    local = TimedBuffer(cfg, "none")
    for it in range(30):  # warm-up
        cycle(actor, it, True, args.tokens)
        cycle(local, it, False, args.tokens)
    before = ray.get(actor.busy.remote()), local.busy()
    for it in range(30, 30 + args.cycles):
        cycle(actor, it, True, args.tokens)
        cycle(local, it, False, args.tokens)
    after = ray.get(actor.busy.remote()), local.busy()
    n = args.cycles * 64
    print(f"µs per trajectory (actor GC: {args.gc}; in-process: Python's default)")
    for label, a, b in zip(("actor", "in-process"), before, after):
        per = {k: round(1e6 * (b[0][k] - a[0].get(k, 0.0)) / n, 1) for k in (*TIMED, "GC")}
        passes = b[0].get("GC passes", 0.0) - a[0].get("GC passes", 0.0)
        print(f"  {label:10s} wall {per}  CPU in all {1e6 * (b[1] - a[1]) / n:.1f}  (GC passes: {passes:.0f})")
    ray.shutdown()


if __name__ == "__main__":
    main()
