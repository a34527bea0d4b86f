"""What one full cyclic-GC pass costs an actor process that holds trajectories, with
CPython's defaults and with miles' GC policy (``miles.utils.gcpolicy``), side by side.

    python benchmarks/gc_pass.py [--held 512 2048] [--length 2048] [--no-record]

Each variant runs in a fresh subprocess (the policy changes the whole process's collector).
The subprocess imports what an actor imports (torch, Ray, miles). It installs the policy or
not, then holds ``--held`` finished trajectories of ``--length`` response tokens, as a replay
buffer does, and times ``gc.collect()`` (best of 3).
Why: a full pass stops every thread of the process while it runs. On the H200 sweep of
2026-11-30 09:23, one pass in the buffer actor took 140-183 ms. The policy's freeze at install
takes start-up's objects out of every later pass. Appends a section to benchmarks/log/gc_pass.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.trainer import record_section  # noqa: E402

CHILD = textwrap.dedent("""
    import gc, json, random, sys, time
    import torch, ray  # noqa: F401  (what an actor process has imported)
    import miles.actors, miles.buffers, miles.driver  # noqa: F401
    from miles.types import Trajectory
    from miles.utils import gcpolicy

    policy, held, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if policy == "gcpolicy":
        gcpolicy.install(every_s=3600.0)  # its own clock stays out of the measurement
    rng = random.Random(0)
    keep = []
    for i in range(held):
        t = Trajectory(id=f"t{i}", prompt_id=f"p{i // 8}", group_id=f"g{i // 8}",
                       prompt_tokens=[rng.randrange(300, 150000) for _ in range(64)])
        t.append([rng.randrange(300, 150000) for _ in range(length)], [-0.5] * length, 0, kind="model")
        keep.append(t)
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        passes.append(time.perf_counter() - start)
    print(json.dumps({"pass_ms": 1e3 * min(passes), "tracked": len(gc.get_objects()),
                      "frozen": gc.get_freeze_count()}))
""")


def run(policy: str, held: int, length: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, policy, str(held), str(length)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "log" / "gc_pass.md"))
    args = ap.parse_args()

    lines = ["| held trajectories | tokens each | default pass ms | gcpolicy pass ms | default ÷ gcpolicy | "
             "tracked objects (default) | tracked (gcpolicy) | frozen (gcpolicy) |",
             "|---|---|---|---|---|---|---|---|"]
    for held in args.held:
        default, policy = run("default", held, args.length), run("gcpolicy", held, args.length)
        ratio = default["pass_ms"] / max(policy["pass_ms"], 1e-6)
        lines.append(f"| {held} | {args.length} | {default['pass_ms']:.1f} | {policy['pass_ms']:.1f} | {ratio:.1f}× | "
                     f"{default['tracked']:.0f} | {policy['tracked']:.0f} | {policy['frozen']:.0f} |")
    lines += ["", "A pass is `gc.collect()` in a process that imported torch, Ray and miles and holds the "
              "trajectories (best of 3). 'gcpolicy' installed the policy before the trajectories existed: "
              "its freeze took the imports' objects out of every later pass; the held trajectories are newer, "
              "as a buffer's are."]
    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    setup = f"held trajectories: {args.held}, {args.length} response tokens + 64 prompt tokens each"
    record_section("gc_pass", machine, setup, lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    main()
