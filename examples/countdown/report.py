"""Prints what the countdown example measured: held-out reward before and after RL, the
training-reward curve's ends, the phase timings, and where the outputs are.

    python examples/countdown/report.py runs/countdown [--timings data=1,sft=80,...]

Reads OUT/eval_before.json and OUT/eval_after.json (``evaluate.py --json``), and
OUT/rl/metrics.jsonl and OUT/rl/eval.jsonl (the RL run's own outputs).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROWS = [
    ("reward_mean", "held-out reward (T=1)"),
    ("reward_short", "  countdowns < 20 numbers"),
    ("reward_long", "  long tail, >= 20 numbers"),
]


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--timings", default="", help="name=seconds,... for the phases that ran")
    args = parser.parse_args()
    out = Path(args.out)
    before = json.loads((out / "eval_before.json").read_text())
    after = json.loads((out / "eval_after.json").read_text())
    passes = sorted((k for k in before if k.startswith("pass@")), key=lambda k: int(k[5:]))
    print(f"\ncountdown example: outputs in {out}/")
    print(f"{'':30s} {'SFT (before RL)':>16s} {'after RL':>10s}")
    for key, label in ROWS + [(k, f"held-out {k}") for k in passes]:
        print(f"{label:30s} {before[key]:16.3f} {after[key]:10.3f}")
    steps = read_jsonl(out / "rl" / "metrics.jsonl")
    if steps:
        k = max(1, min(10, len(steps) // 4))
        first = statistics.fmean(r["rollout/reward_mean"] for r in steps[:k])
        last = statistics.fmean(r["rollout/reward_mean"] for r in steps[-k:])
        print(f"training reward, mean of the first / last {k} steps: {first:.3f} -> {last:.3f} "
              f"({len(steps)} steps)")
    evals = read_jsonl(out / "rl" / "eval.jsonl")
    if evals:
        curve = ", ".join(f"{e['step']}: {e['eval/reward_mean']:.2f}" for e in evals)
        print(f"in-run eval reward by step (eval.jsonl): {curve}")
    if args.timings:
        parts = [p.split("=") for p in args.timings.split(",") if p]
        total = sum(float(s) for _, s in parts)
        print("timings: " + ", ".join(f"{n} {float(s):.0f}s" for n, s in parts) + f"; total {total:.0f}s")
    print(f"curves: {out}/rl/curves.png   metrics: {out}/rl/metrics.jsonl   summary: {out}/rl/summary.json")


if __name__ == "__main__":
    main()
