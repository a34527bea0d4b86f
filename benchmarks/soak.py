"""Soak: thousands of async steps with a tiny model; memory must stay flat, the ledger exact.

    python benchmarks/soak.py [--steps 2000] [--quick]
    python benchmarks/soak.py --chaos [--steps 1000] [--kills 25]

Builds a tiny random checkpoint and a task in a temp dir, runs the full runtime (local Ray,
async mode, partial rollouts, two rollout workers, trajectory dumps), then reports: steps,
RSS of every process at the start (after a warm-up) and the end, trajectories processed,
lost (ledger does not sum) and duplicated (an id trained twice, from the dump). Appends the
figures to benchmarks/log/soak.md.

``--chaos`` runs ``miles train`` against a Ray cluster the script owns and SIGKILLs
``--kills`` rollout workers, reward workers and drivers each at random steps, resuming the
driver from its checkpoint every time (``benchmarks/chaos.py``); it reports the ledger, the
history's duplicates, prompts drawn vs groups admitted, the staleness bound, what each
resume carried over, and RSS by process role over the run.
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
    parser.add_argument("--chaos", action="store_true", help="kill workers, reward workers and drivers; resume")
    parser.add_argument("--kills", type=int, default=25, help="--chaos: kills of each kind")
    parser.add_argument("--seed", type=int, default=0, help="--chaos: the kill schedule's seed")
    args = parser.parse_args()
    if args.chaos:
        return chaos_main(args.steps if args.steps != 2000 else 1000, args.kills, args.seed)
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


CHAOS_ETA = 2


def chaos_flags(inputs: dict[str, str]) -> list[str]:
    """``miles train`` flags of the chaos run: a tiny model, very short steps, async η=2 with
    partial rollouts, two rollout and two reward workers, every trajectory dumped."""
    return ["--hf-checkpoint", inputs["ckpt"], "--prompt-data", inputs["data"], "--custom-rm-path", inputs["rm"],
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "16",
            "--mode", "async", "--max-staleness", str(CHAOS_ETA), "--partial-rollout",
            "--num-rollout-workers", "2", "--num-reward-workers", "2", "--dump-trajectories", "--lr", "1e-5",
            "--max-batch-size", "16", "--max-worker-restarts", "1000", "--keep-checkpoints", "2",
            "--dev", "health_check_interval_s=0.5"]


def chaos_report(res, command: str) -> str:
    from benchmarks.chaos import rss_table

    s, led = res.summary, res.summary["ledger"]
    return "\n".join([
        f"## soak --chaos — {datetime.date.today().isoformat()}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()} "
        f"(CPU; tiny 1-layer model; async η={CHAOS_ETA}, partial rollouts, 2 rollout + 2 reward workers, "
        f"a checkpoint every step; shared machine)",
        "",
        f"status {s['status']}; steps {res.steps} in {res.elapsed_s:.0f} s over {res.sessions} driver sessions; "
        f"kills: rollout workers {res.kills['rollout']}, reward workers {res.kills['reward']}, "
        f"drivers {res.kills['driver']}",
        f"ledger_ok {s['ledger_ok']}; admitted {led['admitted']}, trained {led['trained']}, dropped {led['dropped']}, "
        f"live {led['admitted'] - led['trained'] - sum(led['dropped'].values())}; lost {res.lost}; "
        f"duplicated {res.duplicated} (history rows {res.trained_rows}); prompts drawn {res.prompts_drawn}, "
        f"groups admitted {res.groups_admitted}; released leases {led['released']}, expired {led['expired']}",
        f"staleness max {res.staleness_max:g} (bound {res.max_staleness}); carried over by resumes: "
        f"{res.carried['partial']} partial, {res.carried['in_flight']} in flight "
        f"({res.carried['in_flight_prefix']} of them with a prefix); verdict {'OK' if res.ok else 'BROKEN'}",
        "",
        "RSS (MiB) by process role over the run (rollout_workers: the largest one; each driver session "
        "starts its own trainer, buffer and workers):",
        "",
        *rss_table(res),
        "",
    ])


def chaos_main(steps: int, kills: int, seed: int) -> None:
    from benchmarks.chaos import run_chaos

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = make_inputs(root)
        res = run_chaos(root, chaos_flags(inputs), steps=steps, kills=kills, max_staleness=CHAOS_ETA, seed=seed)
    report = chaos_report(res, f"python benchmarks/soak.py --chaos --steps {steps} --kills {kills} --seed {seed}")
    print(report)
    with open(ROOT / "benchmarks" / "log" / "soak.md", "a") as fh:
        fh.write("\n" + report)
    if not res.ok:
        raise SystemExit("soak --chaos: accounting broken")


if __name__ == "__main__":
    main()
