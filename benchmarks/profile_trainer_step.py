"""vs_trl's trainer step in-process (no Ray), timed and profiled: where a CPU step goes.

    python benchmarks/profile_trainer_step.py                    # the async config's step
    python benchmarks/profile_trainer_step.py --serial --padded  # without the pool / unpadding
    python benchmarks/profile_trainer_step.py --profile          # + torch.profiler's op table

The trainer is built by ``build_policy_trainer`` from the flags benchmarks/vs_trl.py gives
``miles train`` (``--mode``, extra ``--miles-args``), on the countdown SFT checkpoint vs_trl
caches (runs/countdown/sft; run vs_trl once first). Its batches are real rollouts of that
checkpoint: --batches × 16 prompts × 8 samples, 64 new tokens, T = 1, generated once by the
embedded engine and cached in runs/profile_trainer_step/. Each batch is trained --repeats
times; the figure is the mean over batches of each batch's fastest step (wall clock), which
a busy shared host disturbs least. ``--serial`` and ``--padded`` switch off the CPU trainer's
micro-batch pool (``miles.trainers.parallel``) and unpadded forward (``logprobs.unpads``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import random
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples" / "countdown"), str(ROOT / "benchmarks")]
SFT = ROOT / "runs" / "countdown" / "sft"
DATA = ROOT / "runs" / "countdown" / "data" / "train.jsonl"
CACHE = ROOT / "runs" / "profile_trainer_step"


def trainer(mode: str, extra: str) -> Any:
    import vs_trl
    from miles.actors.factory import build_policy_trainer
    from miles.config import parse_args

    args = types.SimpleNamespace(steps=90, prompts=16, samples=8, max_new_tokens=64, lr=1e-4, eval_every=15,
                                 miles_args=extra)
    cmd = vs_trl.miles_command(args, {"sft": SFT, "train": DATA}, mode, 0, CACHE / "run")
    return build_policy_trainer(parse_args(cmd[4:]))


def rollouts(n: int) -> list[list[list[Any]]]:
    """n batches of 16 groups × 8 trajectories, with rewards (cached)."""
    path = CACHE / f"rollouts_{n}.pkl"
    if path.exists():
        return pickle.loads(path.read_bytes())
    from reward import reward

    from miles.engines import EmbeddedEngine
    from miles.engines.config import EngineConfig
    from miles.models import load_pretrained, load_tokenizer
    from miles.types import GenerateRequest, SamplingParams, Trajectory

    tok = load_tokenizer(SFT)
    engine = EmbeddedEngine(load_pretrained(SFT).eval(), config=EngineConfig(max_batch_size=128, max_seq_len=512, seed=0),
                            tokenizer=tok)
    rows = [json.loads(line) for line in open(DATA) if line.strip()]
    rng = random.Random(0)

    async def one(b: int, i: int, j: int, row: dict) -> Trajectory:
        ids = tok.encode(row["input"])
        sp = SamplingParams(max_new_tokens=64, temperature=1.0, seed=b * 100_000 + i * 97 + j)
        out = await engine.generate(GenerateRequest(rid=f"{b}-{i}-{j}", input_ids=ids, sampling=sp))
        score = reward(types.SimpleNamespace(response=tok.decode(out.output_ids), label=row["label"]))
        n_out = len(out.output_ids)
        return Trajectory(id=f"{b}-{i}-{j}", prompt_id=f"{b}-{i}", group_id=f"{b}-{i}", index_in_group=j,
                          prompt_tokens=ids, response_tokens=list(out.output_ids), logprobs=list(out.logprobs),
                          versions=[0] * n_out, loss_mask=[1] * n_out, reward=float(score))

    async def run() -> list[list[list[Trajectory]]]:
        batches = []
        for b in range(n):
            prompts = rng.sample(rows, 16)
            batches.append([list(await asyncio.gather(*(one(b, i, j, r) for j in range(8))))
                            for i, r in enumerate(prompts)])
        await engine.close()
        return batches

    batches = asyncio.run(run())
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(batches))
    return batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--miles-args", default="", help="extra `miles train` flags (one string)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--serial", action="store_true", help="no micro-batch pool")
    p.add_argument("--padded", action="store_true", help="the padded forward")
    p.add_argument("--profile", action="store_true", help="torch.profiler over one pass of the batches")
    args = p.parse_args()
    torch.set_num_threads(1)  # as vs_trl's trainer actor on 2 cores
    from miles.trainers import embedded, logprobs

    if args.serial:
        embedded.cpu_helpers = lambda device: 0
    if args.padded:
        logprobs.unpads = lambda *a: False
    batches = rollouts(args.batches)
    tr = trainer(args.mode, args.miles_args)

    def step(i: int) -> dict[str, float]:
        batch = batches[i % len(batches)]
        for t in (t for g in batch for t in g):  # the trainer's version, as a fresh rollout's
            t.versions = [tr.version] * len(t.response_tokens)
            t.kv_versions = list(t.versions)
        return tr.train_step(batch)

    for i in range(len(batches)):  # warm-up: allocator, first-call costs
        step(i)
    best: dict[int, float] = {}
    for i in range(len(batches) * args.repeats):
        start = time.perf_counter()
        step(i)
        k = i % len(batches)
        best[k] = min(best.get(k, float("inf")), time.perf_counter() - start)
    figures = [round(best[k], 4) for k in sorted(best)]
    print(f"step s (mean of per-batch fastest): {sum(figures) / len(figures):.4f}  per batch {figures}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(len(batches)):
                step(i)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
