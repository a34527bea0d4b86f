"""The trainer on RL's long-tailed batches: how micro-batches are cut, side by side.

    python benchmarks/trainer_long_tail.py                                  # CPU, tiny model
    python benchmarks/trainer_long_tail.py --device cuda --preset 0.5b      # H200

A step's batch is 256 trajectories whose response lengths follow the GPU async benchmark's
Zipf law (median ~30 tokens, a few up to --max-len). Two planners cut the same batches,
their train steps interleaved in one process (with ``--compile``, a third variant runs the
balanced plan with the trainer's decoder layers under ``torch.compile``):

- ``greedy``: the previous planner, reproduced here as the baseline — rows longest first,
  each micro-batch filled up to the limits, so the first ones pad dozens of short rows to
  a long one;
- ``balanced``: ``miles.trainers.batching.plan_micro_batches`` — the same order cut where
  padded tokens + a per-micro-batch cost (the device's, ``micro_batch_cost``) are smallest.

Reports padded tokens per step, the median step time and trained (real) tokens/s, and
appends them to benchmarks/log/trainer_long_tail.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import miles.trainers.batching as batching  # noqa: E402
from benchmarks.trainer import PRESETS, machine, print_profile, record_section, sync  # noqa: E402
from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.models import CausalLM  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402
from miles.trainers.batching import micro_batch_cost, plan_micro_batches  # noqa: E402
from miles.types import Trajectory  # noqa: E402


def greedy_plan(rows, seq_lens, *, micro_batch_size, max_tokens, **_):
    """The planner before the balanced one (the baseline): longest first, filled greedily."""
    plan: list[list[int]] = []
    for r in sorted(rows, key=lambda r: -seq_lens[r]):
        if plan:
            cur = plan[-1]
            fits_rows = micro_batch_size is None or len(cur) < micro_batch_size
            if fits_rows and (max_tokens is None or (len(cur) + 1) * seq_lens[cur[0]] <= max_tokens):
                cur.append(r)
                continue
        plan.append([r])
    return plan


PLANNERS = {"greedy": greedy_plan, "balanced": plan_micro_batches}


def make_batch(rng: random.Random, vocab: int, max_len: int, prompt: int = 6) -> list[list[Trajectory]]:
    groups = []
    for gi in range(32):
        members = []
        ids = [rng.randrange(3, vocab) for _ in range(prompt)]
        for j in range(8):
            n = min(max_len, int(16 * (1 + rng.paretovariate(1.2))))
            t = Trajectory(id=f"{gi}-{j}", prompt_id=str(gi), group_id=str(gi), prompt_tokens=ids)
            t.append([rng.randrange(3, vocab) for _ in range(n)], [-5.0] * n, 0)
            t.reward = float(j % 2)
            members.append(t)
        groups.append(members)
    return groups


def padded_tokens(plan, groups, max_tokens, device: str) -> tuple[int, int, int]:
    lens = [len(t.prompt_tokens) + len(t.response_tokens) for g in groups for t in g]
    mbs = plan(range(len(lens)), lens, micro_batch_size=None, max_tokens=max_tokens, cost=micro_batch_cost(device))
    return sum(len(m) * max(lens[r] for r in m) for m in mbs), sum(lens), len(mbs)


def profile_steps(trainers: dict[str, EmbeddedTrainer], batch: list[list[Trajectory]], device: str) -> None:
    """Where a step's time goes, per planner: the top ops by device time and by host time."""
    for name, trainer in trainers.items():
        batching.plan_micro_batches = PLANNERS[name]
        print_profile(f"{name} planner", lambda: trainer.train_step(batch), device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--max-len", type=int, default=None, help="longest response (default: 2048 GPU, 512 CPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="padded tokens per micro-batch (default 32768 GPU, none CPU)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one more step of each planner (torch.profiler: top ops by device and host time)")
    ap.add_argument("--compile", action="store_true",
                    help="also run the balanced planner with the trainer under torch.compile (TrainerConfig.compile)")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "trainer_long_tail.md"))
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    preset = args.preset or ("0.5b" if cuda else "tiny")
    max_len = args.max_len or (2048 if cuda else 512)
    max_tokens = args.max_tokens or (32768 if cuda else None)
    make_cfg = PRESETS[preset][0]
    cfg = make_cfg()
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, max_len + 64)
    rng = random.Random(0)
    batches = [make_batch(rng, min(cfg.vocab_size, 50000), max_len) for _ in range(args.steps + 1)]
    # variant → (planner, compiled trainer)
    variants = {name: (name, False) for name in PLANNERS}
    if args.compile:
        variants["balanced+compile"] = ("balanced", True)
    trainers = {}
    for name, (_, compiled) in variants.items():
        torch.manual_seed(0)
        with torch.device(args.device):
            model = CausalLM(cfg)
        tcfg = TrainerConfig(lr=1e-6, device=args.device, max_tokens_per_micro_batch=max_tokens, compile=compiled)
        trainers[name] = EmbeddedTrainer(model, config=tcfg, algo=AlgorithmConfig())
    times: dict[str, list[float]] = {name: [] for name in variants}
    first: dict[str, float] = {}
    for i, batch in enumerate(batches):  # the first batch warms up (and compiles); variants interleaved
        for name, trainer in trainers.items():
            batching.plan_micro_batches = PLANNERS[variants[name][0]]
            sync(args.device)
            t0 = time.perf_counter()
            trainer.train_step(batch)
            sync(args.device)
            if i:
                times[name].append(time.perf_counter() - t0)
            else:
                first[name] = time.perf_counter() - t0
    if args.profile:
        profile_steps({name: trainers[name] for name in PLANNERS}, batches[-1], args.device)
    batching.plan_micro_batches = plan_micro_batches
    rows = []
    for name, (planner, _) in variants.items():
        pad = [padded_tokens(PLANNERS[planner], b, max_tokens, args.device) for b in batches[1:]]
        padded, real, mbs = (statistics.fmean(p[k] for p in pad) for k in range(3))
        step = statistics.median(times[name])
        rows.append((name, mbs, padded, real, first[name], step, real / step))
    base = rows[0][5]
    lines = ["| variant | micro-batches | padded tokens | real tokens | padding | first step s | step s (median) | "
             "real tokens/s | × greedy |", "|---|---|---|---|---|---|---|---|---|"]
    for name, mbs, padded, real, first_s, step, tps in rows:
        lines.append(f"| {name} | {mbs:.1f} | {padded:.0f} | {real:.0f} | {1 - real / padded:.0%} | {first_s:.2f} | "
                     f"{step:.3f} | {tps:.0f} | {base / step:.2f}× |")
    record_section("trainer_long_tail", machine(args.device), (
        f"preset {preset}; 256 trajectories a step (32 groups × 8), Zipf response lengths ≤ {max_len}, "
        f"max tokens per micro-batch {max_tokens}; {args.steps} steps per variant after a warm-up step "
        "('first step s', which includes any compilation), interleaved."),
        lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    main()
