"""Decode with a long tail: one long row among many short ones, with and without the split
KV read (``EngineConfig.decode_split``), side by side in one process.

A decode step reads every row's KV cache up to the batch's longest context, so in RL's
long-tailed batches most of that read is padding. With the split, every row reads the short
range and only the long rows read the rest (``DecodeAttention``). Each case runs the same
requests through engines that differ only in ``decode_split`` (on CUDA also engines whose
CUDA graphs read the padded range, sdpa and matmul, and the length-aware Triton kernel's,
``decode_attention="triton"``), best of 3 after a warm-up. The same prompts are also
prefilled alone: each admission padded to its longest prompt, or grouped by length (the
engine's default).

    python benchmarks/long_tail_decode.py                         # CPU: tiny and small presets
    python benchmarks/long_tail_decode.py --device cuda --preset 0.5b
Appends a section to benchmarks/log/long_tail_decode.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import build_model, machine  # noqa: E402
from benchmarks.trainer import record_section  # noqa: E402
import miles.engines.stepper as stepper  # noqa: E402
from miles.engines import EmbeddedEngine, EngineConfig  # noqa: E402
from miles.engines.stepper import PREFILL_COST  # noqa: E402
from miles.types import GenerateRequest, SamplingParams  # noqa: E402


async def timed(model: torch.nn.Module, cfg: EngineConfig, prompts: list[list[int]], new: int,
                repeats: int) -> tuple[float, float]:
    """(best seconds for the batch, share of the KV positions read that rows attend to)."""
    engine = EmbeddedEngine(model, config=cfg)
    engine.start()

    def batch(tag: str) -> list[GenerateRequest]:
        return [GenerateRequest(rid=f"{tag}{i}", input_ids=p,
                                sampling=SamplingParams(max_new_tokens=new, seed=i, ignore_eos=True))
                for i, p in enumerate(prompts)]

    await asyncio.gather(*(engine.generate(r) for r in batch("warm")))
    best = float("inf")
    for rep in range(repeats):
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        await asyncio.gather(*(engine.generate(r) for r in batch(f"r{rep}")))
        best = min(best, time.perf_counter() - start)
    useful = engine.runner.kv_useful / max(engine.runner.kv_read, 1)
    await engine.close()
    del engine  # its KV cache (28 GiB at batch 256 on the 0.5B shape) before the next engine's
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return best, useful


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", nargs="*", default=None)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "long_tail_decode.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    presets = args.preset or (["0.5b"] if cuda else ["tiny", "small"])
    # (batch, long rows, long prompt, short prompt)
    cases = [(64, 1, 2000, 60), (256, 4, 2000, 60)] if cuda else [(32, 1, 1500, 30), (64, 1, 2000, 60)]
    g = torch.Generator().manual_seed(0)
    rows, prefill_rows = [], []
    for preset in presets:
        model = build_model(preset)
        for n, n_long, long_len, short_len in cases:
            prompts = [torch.randint(5, 250, (long_len if i < n_long else short_len,), generator=g).tolist()
                       for i in range(n)]
            base = dict(max_batch_size=n, max_seq_len=long_len + args.new_tokens + 16, device=args.device,
                        decode_attention="matmul")
            variants = {"no split": dict(decode_split=False, cuda_graphs=False),
                        "split": dict(decode_split=True, cuda_graphs=False)}
            if cuda:  # CUDA graphs that read the padded range, and the length-aware triton kernel's
                variants = {"graphs sdpa (padded)": dict(decode_split=False, decode_attention="sdpa"),
                            "graphs matmul (padded)": dict(decode_split=False), **variants,
                            "graphs triton": dict(decode_attention="triton")}
            out = {}
            for name, extra in variants.items():
                out[name] = await timed(model.to(args.device), EngineConfig(**{**base, **extra}), prompts,
                                        args.new_tokens, args.repeats)
            # the same prompts prefilled as admitted (each admission padded to its longest
            # prompt, as before), or grouped by length (the engine's default, miles.utils.cuts)
            for name, cost in (("padded to the longest", 1e18), ("grouped by length", PREFILL_COST)):
                stepper.PREFILL_COST = cost
                sec, _ = await timed(model.to(args.device), EngineConfig(**base), prompts, 1, args.repeats)
                prefill_rows.append((preset, n, n_long, long_len, short_len, name, sec))
            stepper.PREFILL_COST = PREFILL_COST
            ref = out["no split"][0]
            for name, (sec, useful) in out.items():
                rows.append((preset, n, n_long, long_len, short_len, name, sec, n * args.new_tokens / sec,
                             useful, ref / sec))
                print(f"{preset} batch {n} ({n_long} × {long_len} + {n - n_long} × {short_len} prompt tokens): "
                      f"{name}: {sec * 1000:.0f} ms, KV read useful {useful:.0%}, {ref / sec:.2f}× no split", flush=True)
    lines = ["| preset | batch | prompts | variant | s | tok/s | KV read useful | × no split |",
             "|---|---|---|---|---|---|---|---|"]
    for preset, n, n_long, long_len, short_len, name, sec, tps, useful, ratio in rows:
        lines.append(f"| {preset} | {n} | {n_long} × {long_len} + {n - n_long} × {short_len} | {name} | "
                     f"{sec:.3f} | {tps:.0f} | {useful:.0%} | {ratio:.2f}× |")
    one = {r[:5]: r[6] for r in prefill_rows if r[5] == "padded to the longest"}
    lines += ["", "Prefill alone (the same prompts, 1 new token each):", "",
              "| preset | batch | prompts | variant | s | × padded |", "|---|---|---|---|---|---|"]
    for preset, n, n_long, long_len, short_len, name, sec in prefill_rows:
        lines.append(f"| {preset} | {n} | {n_long} × {long_len} + {n - n_long} × {short_len} | {name} | "
                     f"{sec:.3f} | {one[(preset, n, n_long, long_len, short_len)] / sec:.2f}× |")
    record_section("long_tail_decode", machine(), (
        f"{args.new_tokens} new tokens per request, sampling at temperature 1, matmul decode attention; "
        "best of 3 after a warm-up; all variants in one process."), lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    asyncio.run(main())
