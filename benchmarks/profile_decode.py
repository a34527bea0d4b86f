"""Where an embedded-engine decode step spends its time: the top CUDA kernels of a few
steady-state decode steps (torch.profiler), for tuning toward the memory roofline.

    python benchmarks/profile_decode.py --device cuda [--batch 64] [--context 384]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import build_model  # noqa: E402
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
    args = ap.parse_args()
    model = build_model(args.preset)
    engine = EmbeddedEngine(model, config=EngineConfig(
        max_batch_size=args.batch, max_seq_len=args.prompt_len + args.new_tokens + 8, device=args.device,
        decode_attention=args.decode_attention))
    engine.start()
    g = torch.Generator().manual_seed(0)
    reqs = [GenerateRequest(rid=f"r{i}", input_ids=torch.randint(5, 1000, (args.prompt_len,), generator=g).tolist(),
                            sampling=SamplingParams(max_new_tokens=args.new_tokens, seed=i, ignore_eos=True))
            for i in range(args.batch)]
    await asyncio.gather(*(engine.generate(r) for r in reqs[:2]))  # warm-up: compile, graphs
    tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
    while (engine.progress("r0") or 0) < args.new_tokens // 2:
        await asyncio.sleep(0.01)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = engine.progress("r0") or 0
        while (engine.progress("r0") or 0) < start + 20:
            await asyncio.sleep(0.001)
        steps = (engine.progress("r0") or 0) - start
    await asyncio.gather(*tasks)
    await engine.close()
    print(f"{steps} decode steps profiled at batch {args.batch}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    asyncio.run(main())
