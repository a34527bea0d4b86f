"""Soak: thousands of async steps with a tiny model; memory must stay flat, the ledger exact.

    python benchmarks/soak.py [--steps 2000] [--quick]

Builds a tiny random checkpoint and a task in a temp dir, runs the full runtime (local Ray,
async mode, partial rollouts, two rollout workers, trajectory dumps), then reports: steps,
RSS of every process at the start (after a warm-up) and the end, trajectories processed,
lost (ledger does not sum) and duplicated (an id trained twice, from the dump). Appends the
figures to benchmarks/log/soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def make_inputs(root: Path) -> dict[str, str]:
    import torch

    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    torch.manual_seed(0)
    model = CausalLM(tiny_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, head_dim=8))
    model.reset_parameters()
    save_pretrained(model, root / "ckpt", tokenizer=build_tiny_tokenizer())
    with open(root / "data.jsonl", "w") as fh:
        for i in range(1000):
            fh.write(json.dumps({"input": f"say {i % 10}:", "label": str(i % 10)}) + "\n")
    (root / "rm.py").write_text("def reward(sample):\n    return float(sample.label in sample.response)\n")
    return {"ckpt": str(root / "ckpt"), "data": str(root / "data.jsonl"), "rm": f"{root / 'rm.py'}:reward"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="200 steps")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the start RSS is read")
    args = parser.parse_args()
    steps = 200 if args.quick else args.steps
    warmup = min(args.warmup, steps // 4)

    from miles.config import resolve
    from miles.driver import train
    from miles.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = make_inputs(root)
        out = root / "out"
        cfg = resolve({
            "hf_checkpoint": inputs["ckpt"], "prompt_data": inputs["data"], "custom_rm_path": inputs["rm"],
            "output_dir": str(out), "num_rollout": steps, "rollout_batch_size": 2, "n_samples_per_prompt": 4,
            "rollout_max_response_len": 16, "mode": "async", "max_staleness": 2, "partial_rollout": True,
            "num_rollout_workers": 2, "dump_trajectories": True, "progress": False, "lr": 1e-5,
            "max_batch_size": 16, "health_check_interval_s": 0.5,
        })
        start = time.monotonic()
        summary = asyncio.run(train(cfg))
        elapsed = time.monotonic() - start
        rows = read_metrics(out / "metrics.jsonl")
        ids: set[str] = set()
        duplicated = trained = 0
        with open(out / "trajectories.jsonl") as fh:
            for line in fh:
                tid = json.loads(line)["id"]
                trained += 1
                duplicated += tid in ids
                ids.add(tid)

    ledger = summary["ledger"]
    accounted = (ledger["queued"] + ledger["in_flight"] + ledger["partial"] + ledger["waiting"]
                 + ledger["ready"] + ledger["trained"] + sum(ledger["dropped"].values()))
    lost = ledger["admitted"] - accounted
    first = next(r for r in rows if r["step"] >= warmup)
    last = rows[-1]
    keys = ["mem/driver_rss_mb", "mem/trainer_rss_mb", "mem/worker_rss_mb", "mem/buffer_rss_mb"]
    table = [f"| {k.split('/')[1]} | {first.get(k, 0):.1f} | {last.get(k, 0):.1f} | "
             f"{(last.get(k, 0) - first.get(k, 0)):+.1f} |" for k in keys]
    report = "\n".join([
        f"## soak — {datetime.date.today().isoformat()}",
        "",
        f"Command: `python benchmarks/soak.py{' --quick' if args.quick else f' --steps {steps}'}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()} "
        f"(CPU; tiny 1-layer model; async η=2, partial rollouts, 2 rollout workers; shared machine)",
        "",
        f"steps {summary['steps']} in {elapsed:.0f} s; trajectories admitted {ledger['admitted']}, "
        f"trained {ledger['trained']} (dump rows {trained}); lost {lost}; duplicated {duplicated}; "
        f"ledger_ok {summary['ledger_ok']}; worker restarts {sum(summary['worker_restarts'].values())}",
        "",
        f"| process | RSS MiB at step {first['step']} | RSS MiB at step {last['step']} | change |",
        "|---|---|---|---|",
        *table,
        "",
    ])
    print(report)
    with open(ROOT / "benchmarks" / "log" / "soak.md", "a") as fh:
        fh.write("\n" + report)
    if lost or duplicated or not summary["ledger_ok"]:
        raise SystemExit("soak: accounting broken")


if __name__ == "__main__":
    main()
