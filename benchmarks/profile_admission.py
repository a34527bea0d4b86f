"""Where an engine's time goes when short prompts keep arriving while it decodes.

Why: in the GPU async_vs_sync runs (RESULTS.md, 2026-11-30 20:09) the engine of the partial-
rollout configs spent ~60% of its busy time in the 'prefill' phase while its GPU was busy only
34-40% of the time, although the prompts are ~5 tokens long. This script reproduces that
pattern (an RL rollout: many short prompts, long-tailed response lengths, a full continuous
batch) and splits each admission into its parts: the drain of the step in flight, the prefill
forward's host time, and the wait for its first-token sample. It then times a bare prefill
forward by rows (host launch time and wall time with the device), and prints the profiler's top
host ops of one.

Usage: python benchmarks/profile_admission.py --device cuda [--requests 768 --slots 256]
Prints only (nothing is appended to benchmarks/log/).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import PRESETS, build_model  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.runner import ModelRunner  # noqa: E402
from miles.engines.stepper import Stepper  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402

TIMES: dict[str, list[float]] = defaultdict(list)


def _timed(cls: type, name: str, key: str) -> None:
    """Wrap ``cls.name`` so every call's host wall time lands in TIMES[key]."""
    fn = getattr(cls, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[key].append(time.perf_counter() - t)

    setattr(cls, name, wrapper)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def rollout(engine: EmbeddedEngine, prompts: list[list[int]], lengths: list[int]) -> float:
    reqs = [GenerateRequest(rid=f"r{i}-{time.monotonic_ns()}", input_ids=p, sampling=SamplingParams(
        max_new_tokens=n, temperature=1.0, ignore_eos=True)) for i, (p, n) in enumerate(zip(prompts, lengths))]
    t = time.perf_counter()
    await asyncio.gather(*(engine.generate(r) for r in reqs))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS))
    ap.add_argument("--requests", type=int, default=768)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args()
    device = torch.device(args.device)
    preset = args.preset or ("0.5b" if device.type == "cuda" else "tiny")
    model = build_model(preset)
    V = model.config.vocab_size
    cfg = EngineConfig(max_batch_size=args.slots, max_seq_len=args.prompt_len + args.max_len + 1,
                       device=args.device, dtype="bfloat16" if device.type == "cuda" else "float32")
    engine = EmbeddedEngine(model, config=cfg)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(5, V, (args.requests, args.prompt_len), generator=g).tolist()
    # long-tailed: most short, a few up to max_len (Zipf-like: max_len / rank^0.8, shuffled)
    ranks = torch.randperm(args.requests, generator=g) + 1
    lengths = [max(8, int(args.max_len / float(r) ** 0.8)) for r in ranks]
    for cls, name, key in ((Stepper, "admit", "admit"), (Stepper, "drain", "drain"),
                           (Stepper, "_prefill_group", "prefill_group"), (ModelRunner, "prefill", "runner.prefill"),
                           (Stepper, "_process", "process"), (Stepper, "_launch_sample", "launch_sample")):
        _timed(cls, name, key)
    loop = asyncio.new_event_loop()
    print(f"preset {preset}, {args.requests} requests, {args.slots} slots, prompt {args.prompt_len}, "
          f"lengths 8..{args.max_len} (mean {sum(lengths) / len(lengths):.0f})")
    for label in ("warm-up", "measured"):
        TIMES.clear()
        before = dict(engine.stats_.phase_s)
        steps0 = engine.stats_.counters["decode_steps"]
        sync(device)
        wall = loop.run_until_complete(rollout(engine, prompts, lengths))
        sync(device)
        phases = {k: engine.stats_.phase_s[k] - before[k] for k in before}
        steps = engine.stats_.counters["decode_steps"] - steps0
        print(f"\n[{label}] wall {wall:.2f} s, {sum(lengths) / wall:.0f} tok/s, decode steps {steps}, phases (s): "
              + ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v))
        for key, ts in TIMES.items():
            print(f"  {key:16s} calls {len(ts):6d}  total {sum(ts):7.3f} s  mean {1e3 * sum(ts) / len(ts):7.2f} ms  "
                  f"max {1e3 * max(ts):7.2f} ms")
    # a bare prefill forward by rows: host launch time vs wall time with the device
    runner = engine.runner
    print("\nbare prefill forward (slots 0..n-1, logits of the last token):")
    for n in (1, 4, 16, 64, 256):
        if n > args.slots:
            continue
        seqs = [prompts[i % len(prompts)] for i in range(n)]
        for _ in range(3):
            runner.prefill(list(range(n)), seqs, logits=True)
        sync(device)
        host, wall = [], []
        for _ in range(10):
            t = time.perf_counter()
            runner.prefill(list(range(n)), seqs, logits=True)
            host.append(time.perf_counter() - t)
            sync(device)
            wall.append(time.perf_counter() - t)
        print(f"  rows {n:4d}: host {1e3 * min(host):7.2f} ms, with the device {1e3 * min(wall):7.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    seqs = [prompts[i] for i in range(16)]
    with profile(activities=acts) as prof:
        for _ in range(5):
            runner.prefill(list(range(16)), seqs, logits=True)
        sync(device)
    print("\nprofile of 5 prefill forwards of 16 rows, by host time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
    loop.run_until_complete(engine.close())


if __name__ == "__main__":
    main()
