"""Agentic rollouts: episodes/s and rollout-worker utilization, async vs sync, one process.

    python benchmarks/agentic.py [--quick] [--rounds N] [--device cuda] [--results benchmarks/RESULTS.md]

The task has a long-tailed number of turns: each episode runs ``min(⌊Pareto(α)⌋, cap)``
turns (about half end after one turn, a few percent run to the cap), drawn per sample from
a fixed seed, so both modes see the same episodes. Every environment step waits
``--step-ms`` (a tool or API call); every model turn is up to ``--turn-tokens`` tokens
(tiny random model, so the model's text does not matter; rewards are a hash of it).

Two modes, the same flags otherwise, run alternately (sync, async, sync, async, …) in one
process on one local Ray cluster, so load from other jobs on a shared machine hits both:

* sync — ``--mode sync`` without partial rollout: every episode of a batch finishes on the
  weights it started with before the update; the next batch starts after it;
* async — ``--mode async --max-staleness 2 --partial-rollout --stale-policy mask``:
  episodes run on across weight updates (each token records its version); the trainer
  takes a batch as soon as one is ready; tokens beyond the bound are masked.

Figures, per mode (median over rounds):

* trained episodes/s — episodes trained / wall time of the train loop, steps after the
  first (the first includes start-up); trained tokens/s the same for response tokens;
* rolled-out episodes/s — episodes the worker finished / its active window;
* busy — the fraction of that window with at least one episode in flight;
* slot occupancy — mean episodes in flight / ``--max-inflight-per-worker``;
* staleness — mean trainer-minus-token version of trained loss tokens; masked tokens.

Goal: async ≥ 2× sync trained episodes/s (ROLL Flash reports 2.72× on agentic tasks).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL = 2.0
MODES = {
    "sync": ["--mode", "sync"],
    "async": ["--mode", "async", "--max-staleness", "2", "--partial-rollout", "--stale-policy", "mask"],
}


class LongTailEnv:
    """The benchmark's environment (loaded by the rollout workers from this file)."""

    def __init__(self, alpha: float = 1.1, cap: int = 40, step_ms: float = 20.0) -> None:
        self.alpha, self.cap, self.step_s = alpha, cap, step_ms / 1000
        self.turns = 1
        self.n = 0

    def reset(self, sample: Any) -> str:
        rng = random.Random(f"{sample.label}:{sample.index_in_group}")
        self.turns = min(int(rng.paretovariate(self.alpha)), self.cap)
        return ""

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.n += 1
        await asyncio.sleep(self.step_s)
        done = self.n >= self.turns
        reward = hashlib.blake2b(action.encode(errors="replace"), digest_size=1).digest()[0] / 255 if done else 0.0
        return "ok\n", reward, done, {}


def prepare(root: Path, prompts: int) -> tuple[Path, Path]:
    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    ckpt = root / "ckpt"
    save_pretrained(CausalLM(tiny_config()), ckpt, tokenizer=build_tiny_tokenizer())
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"input": f"task {i}:", "label": i}) + "\n" for i in range(prompts)))
    return ckpt, data


def run_mode(mode: str, out: Path, ckpt: Path, data: Path, args: argparse.Namespace) -> dict[str, float]:
    from miles.cli import main as miles_main

    env_kwargs = json.dumps({"alpha": args.alpha, "cap": args.cap, "step_ms": args.step_ms})
    argv = ["train", "--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--output-dir", str(out),
            "--env-path", f"{Path(__file__).resolve()}:LongTailEnv", "--env-kwargs", env_kwargs,
            "--env-turn-template", "raw", "--max-turns", str(args.cap), "--max-turn-tokens", str(args.turn_tokens),
            "--rollout-max-response-len", "1000", "--rollout-batch-size", str(args.batch),
            "--n-samples-per-prompt", str(args.n), "--num-rollout", str(args.steps), "--lr", "1e-5",
            "--max-inflight-per-worker", str(args.inflight), "--max-batch-size", str(args.inflight),
            "--no-progress", *MODES[mode], *_device_flags(args.device)]
    if miles_main(argv) != 0:
        raise RuntimeError(f"{mode} run failed; see {out}")
    return summarize(out, args.inflight)


def _device_flags(device: str) -> list[str]:
    if device == "cpu":
        return []
    return ["--device", device, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--colocate"]


def summarize(out: Path, inflight: int) -> dict[str, float]:
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    worker = summary["workers"][0]
    steady = steps[1:] or steps
    wall = sum(s["perf/step_s"] for s in steady)
    window = worker.get("env/window_s", 0.0) or 1e-9
    ended = worker.get("env/episodes_completed", 0.0) + worker.get("env/episodes_truncated", 0.0)
    return {
        "trained_eps": sum(s["perf/trained_samples"] for s in steady) / wall,
        "trained_tps": sum(s["perf/trained_tokens"] for s in steady) / wall,
        "rolled_eps": ended / window,
        "busy": worker.get("env/busy_s", 0.0) / window,
        "slots": worker.get("env/episode_s", 0.0) / (window * inflight),
        "staleness": statistics.fmean(s["buffer/staleness_mean"] for s in steady),
        "masked_tokens": float(summary["ledger"]["masked_tokens"]),
        "turns": worker.get("env/turns_per_episode", 0.0),
        "step_s": statistics.median(s["perf/step_s"] for s in steady),
        "ledger_ok": float(summary["ledger_ok"]),
    }


def machine() -> str:
    import torch

    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round of fewer steps (smoke)")
    ap.add_argument("--rounds", type=int, default=2, help="sync/async pairs, alternated")
    ap.add_argument("--steps", type=int, default=16, help="train steps per run")
    ap.add_argument("--batch", type=int, default=8, help="groups per train step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--inflight", type=int, default=64, help="episodes in flight per worker")
    ap.add_argument("--alpha", type=float, default=1.1, help="Pareto tail index of the turn count")
    ap.add_argument("--cap", type=int, default=40, help="most turns per episode")
    ap.add_argument("--step-ms", type=float, default=20.0, help="latency of one env step")
    ap.add_argument("--turn-tokens", type=int, default=8, help="most tokens per model turn")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 6
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(include_dashboard=False, num_cpus=max(os.cpu_count() or 2, 2), _node_ip_address="127.0.0.1",
             log_to_driver=False)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        with tempfile.TemporaryDirectory(prefix="miles-agentic-") as tmp:
            ckpt, data = prepare(Path(tmp), prompts=args.batch * (args.steps + 4) * 4)
            for r in range(args.rounds):
                for mode in MODES:
                    results[mode].append(run_mode(mode, Path(tmp) / f"{mode}{r}", ckpt, data, args))
                    print(f"round {r} {mode}: {results[mode][-1]}", flush=True)
    finally:
        ray.shutdown()
    report(results, args)


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in results.items()}
    ratio = med["async"]["trained_eps"] / med["sync"]["trained_eps"]
    rolled = med["async"]["rolled_eps"] / med["sync"]["rolled_eps"]
    tokens = med["async"]["trained_tps"] / med["sync"]["trained_tps"]
    head = ("| mode | trained episodes/s | trained tokens/s | rolled-out episodes/s | busy | slot occupancy "
            "| median step s "
            "| staleness mean | masked tokens | turns per ended episode | ledger ok |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for m, x in med.items():
        lines.append(f"| {m} | {x['trained_eps']:.1f} | {x['trained_tps']:,.0f} | {x['rolled_eps']:.1f} | {x['busy']:.0%} "
                     f"| {x['slots']:.0%} "
                     f"| {x['step_s']:.2f} | {x['staleness']:.2f} | {x['masked_tokens']:,.0f} | {x['turns']:.2f} "
                     f"| {'yes' if x['ledger_ok'] == 1.0 else 'NO'} |")
    per_round = ", ".join(f"{a['trained_eps'] / b['trained_eps']:.2f}×"
                          for a, b in zip(results["async"], results["sync"]))
    verdict = "met" if ratio >= GOAL else "NOT met"
    command = "python benchmarks/agentic.py" + (" --quick" if args.quick else "") + (
        f" --device {args.device}" if args.device != "cpu" else "")
    text = "\n".join([
        f"\n## Agentic rollouts: async vs sync ({datetime.date.today().isoformat()})\n",
        f"Command: `{command}`  ",
        f"Machine: {machine()}; shared with other engineers' jobs while it ran, so absolute figures are noisy; "
        "the modes ran alternately in one process (median of "
        f"{args.rounds} round{'s' if args.rounds > 1 else ''}), compare the ratios.  ",
        f"Task: tiny random model, {args.batch} groups × {args.n} samples per step, {args.steps} steps per run; "
        f"turns per episode min(⌊Pareto({args.alpha})⌋, {args.cap}), {args.step_ms:g} ms per env step, ≤ "
        f"{args.turn_tokens} tokens per model turn, ≤ {args.inflight} episodes in flight. sync = `--mode sync`; "
        "async = `--mode async --max-staleness 2 --partial-rollout --stale-policy mask`.\n",
        *lines,
        "",
        f"Goal (async ≥ {GOAL:g}× sync trained episodes/s): **{verdict}** — {ratio:.2f}× "
        f"(per round: {per_round}; trained tokens/s: {tokens:.2f}×; rolled-out episodes/s: {rolled:.2f}×). "
        "Masked tokens: loss tokens older than the bound, kept as context. Async trains short "
        "episodes sooner than long ones (those arrive later, partly masked as stale), so over a short run its "
        "trained episodes are shorter on average: compare the tokens/s ratio too.\n",
    ])
    print(text)
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
