"""Where an embedded-engine decode step spends its time: the top CUDA kernels of a few
steady-state decode steps (torch.profiler), for tuning toward the memory roofline.

    python benchmarks/profile_decode.py --device cuda [--batch 64] [--config FIELD=VALUE,...]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import build_model, parse_side  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="0.5b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=320)
    ap.add_argument("--decode-attention", default="auto")
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--config", default="", metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="EngineConfig fields of the engine profiled (e.g. decode_fused_mlp=false)")
    args = ap.parse_args()
    fields = parse_side(f"profiled:{args.config}")[1] if args.config else {}
    model = build_model(args.preset)
    engine = EmbeddedEngine(model, config=EngineConfig(
        max_batch_size=args.batch, max_seq_len=args.prompt_len + args.new_tokens + 8, device=args.device,
        decode_attention=args.decode_attention, **fields))
    engine.start()
    g = torch.Generator().manual_seed(0)
    reqs = [GenerateRequest(rid=f"r{i}", input_ids=torch.randint(5, 1000, (args.prompt_len,), generator=g).tolist(),
                            sampling=SamplingParams(max_new_tokens=args.new_tokens, seed=i, ignore_eos=True))
            for i in range(args.batch)]
    await asyncio.gather(*(engine.generate(r) for r in reqs[:2]))  # warm-up: compile, graphs
    tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
    while (engine.progress("r0") or 0) < args.new_tokens // 2:
        await asyncio.sleep(0.01)
    stats = engine.stepper.stats
    # unprofiled first: the wall time of a step, and how much of it the host waited for the device
    start, t0, w0 = engine.progress("r0") or 0, time.perf_counter(), stats.device_wait_s
    while (engine.progress("r0") or 0) < start + 20:
        await asyncio.sleep(0.001)
    steps = (engine.progress("r0") or 0) - start
    wall, wait = (time.perf_counter() - t0) / steps, (stats.device_wait_s - w0) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = engine.progress("r0") or 0
        while (engine.progress("r0") or 0) < start + 20:
            await asyncio.sleep(0.001)
        steps = (engine.progress("r0") or 0) - start
    await asyncio.gather(*tasks)
    await engine.close()
    print(f"unprofiled: {1e3 * wall:.3f} ms a step, of which the host waited for the device {1e3 * wait:.3f} ms "
          f"({100 * wait / wall:.0f}%: near 0 means the host's work bounds the step)")
    print(f"{steps} decode steps profiled at batch {args.batch}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    asyncio.run(main())
