"""Time to the first trained step, as a new user meets it: ``miles train`` in a process of its
own on a Qwen3-0.6B-shaped checkpoint (random weights), colocated on one GPU, run twice one
after the other: the second run finds the first one's compiled artefacts in torch's on-disk
caches (inductor's FX graph and autotuning caches, AOTAutograd's).

    python benchmarks/first_step.py --device cuda [--steps 6] [--results benchmarks/log/first_step.md]

Figures per run: seconds from the process's launch to the first line of ``metrics.jsonl`` (the
first trained step), ``summary.json``'s ``startup`` (actors built, trainer and worker init), and
the median of the later steps' times (the gaps between consecutive ``wall_time`` values, what
a user waits). Goal (issue #37): ≤ 30 s to the first step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_once(args: argparse.Namespace, inputs: dict[str, str], name: str, extra: list[str]) -> dict[str, Any]:
    out = ROOT / "runs" / "first_step" / name.replace(" ", "_")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    task = (["--input-key", "input", "--custom-rm-path", "benchmarks/async_vs_sync.py:length_reward"]
            if args.device == "cuda" else ["--custom-rm-path", "examples/countdown/reward.py:reward"])
    cmd = [sys.executable, "-m", "miles", "train", "--hf-checkpoint", inputs["ckpt"], "--prompt-data", inputs["data"],
           *task, "--device", args.device, "--num-rollout", str(args.steps), "--rollout-max-response-len", str(args.max_len),
           "--output-dir", str(out), *extra]
    if args.device == "cuda":
        cmd += ["--colocate", "--actor-num-gpus-per-node", "1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = None
    metrics = out / "metrics.jsonl"
    log: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size > 0:
            first = time.monotonic() - t0
        time.sleep(0.05)
    reader.join(5)
    total = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: miles train failed (rc {proc.returncode}):\n" + "".join(log[-40:]))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    walls = [r["wall_time"] for r in rows]
    gaps = [b - a for a, b in zip(walls[1:], walls[2:])]  # steps after the second: steady state
    return {"name": name, "first_step_s": first, "total_s": total, "steps": len(rows),
            "later_step_s": statistics.median(gaps) if gaps else float("nan"),
            "startup": summary.get("startup", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=256, help="--rollout-max-response-len")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "log" / "first_step.md"))
    args = ap.parse_args()
    from benchmarks.async_vs_sync import make_cpu_inputs, make_gpu_inputs

    work = ROOT / "runs" / "first_step"
    work.mkdir(parents=True, exist_ok=True)
    inputs = make_gpu_inputs(work, 2048) if args.device == "cuda" else make_cpu_inputs(True)
    runs = [run_once(args, inputs, "first run", []), run_once(args, inputs, "second run", [])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = ["| run | first trained step s | later step s (median) | actors built s | trainer init s | "
             "worker init s |", "|---|---|---|---|---|---|"]
    for r in runs:
        s = r["startup"]
        lines.append(f"| {r['name']} | {r['first_step_s']:.1f} | {r['later_step_s']:.2f} | {s.get('startup_s', float('nan')):.1f} | "
                     f"{s.get('trainer_init_s', float('nan')):.1f} | {s.get('worker_init_s_max', float('nan')):.1f} |")
    text = "\n".join([
        f"\n## first_step — {datetime.date.today().isoformat()} ({args.device})\n",
        f"Command: `python benchmarks/first_step.py --device {args.device} --steps {args.steps} --max-len {args.max_len}` (commit {commit})  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}  ",
        "Workload: `miles train` in its own process, "
        f"{'Qwen3-0.6B shape (random weights), colocated on one GPU' if args.device == 'cuda' else 'the countdown smoke model'}"
        ", sync, defaults otherwise; "
        "time from the process's launch to the first line of metrics.jsonl.\n",
        *lines, "",
        f"Goal: first trained step ≤ 30 s ({runs[0]['first_step_s']:.1f} s, and {runs[1]['first_step_s']:.1f} s "
        "with the first run's caches).\n",
    ])
    print(text)
    print(json.dumps(runs))
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
