"""The Triton decode attention's launch settings, swept, for a 16-bit and an 8-bit KV cache.

Why: an engine with an fp8 KV cache (``--kv-cache-dtype fp8_e4m3``) reads half the bytes per
decode step, yet on the H200 (engine.py, 2026-12-01 02:58) its batch-256 step took as long as
the bf16 cache's with the same launch (CHUNK 256, BLOCK_N 64, 4 warps, 3 stages): the launch
tuned for 16-bit tiles did not turn the smaller read into time. This times one layer's
``decode_attention`` (the decode step's form: the new K/V written by the kernel) at the
Qwen3-0.6B shape for each (CHUNK, BLOCK_N, num_warps, num_stages), both cache dtypes, side
by side in one process, against the copy bandwidth measured in the same run.

Found (H200, 2026-12-01 03:06-03:11): the bf16 cache's layer runs at 3.1 / 3.7 TB/s (batch
64 / 256), near the copy bandwidth; the fp8 cache's at half that, in ~the same time (1.05-1.07x
at each one's best launch). Its step is bound by something other than the bytes it reads;
neither transposed dots nor CUDA-core products (both tried as launch modes) changed that.

Since 2026-12-02 04:03 an 8-bit cache stores V transposed and its dots run in float16. The
`--caches` forms `fp8_e4m3/v-rows` and `/bf16-dots` time the layouts and dots before that
(1.16-1.29x slower a layer).

Beside the sweep, 512-position chunks in wide grids (the launch before 2026-12-02) are timed:
what 1024-position chunks buy (1.03-1.08x at 2026-12-02 00:10).
``--lengths spread`` gives the rows lengths spread evenly over the cache (mean ``--context``,
RL's uneven batches) instead of one length.

    python benchmarks/decode_attention.py [--batch 64 256] [--context 384] [--quick] [--rope]
                                          [--caches bf16 fp8_e4m3] [--chunks 128 256 512 1024]
                                          [--lengths uniform spread] [--cache-len 641]
                                          [--shared-cache]

Appends a section to benchmarks/log/decode_attention.md (``--no-record`` to skip).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import copy_bandwidth, graph_us, machine  # noqa: E402
from benchmarks.trainer import record_section  # noqa: E402
from miles.engines.kv_cache import positions_last  # noqa: E402
from miles.kernels import decode_attention as kernel  # noqa: E402

KV, G, D = 8, 2, 128  # Qwen3-0.6B: 8 KV heads, 16 query heads, head dim 128
CALLS = 20  # calls a CUDA graph holds (benchmarks.engine.graph_us)


def row_lengths(rows: int, context: int, cache_len: int, kind: str) -> torch.Tensor:
    """Every row at ``context``, or (``spread``) lengths spread evenly around it up to the
    cache's last position, in shuffled order."""
    if kind == "uniform":
        return torch.full((rows,), context, device="cuda")
    lo = max(1, 2 * context - (cache_len - 1))
    spread = torch.linspace(lo, 2 * context - lo, rows).round().long()
    return spread[torch.randperm(rows, generator=torch.Generator().manual_seed(0))].cuda()


# a cache form: (storage dtype, V stored transposed as KVCache stores an 8-bit V, float16 dots)
CACHES = {"bf16": (torch.bfloat16, False, False), "fp8_e4m3": (torch.float8_e4m3fn, True, True),
          "fp8_e4m3/v-rows": (torch.float8_e4m3fn, False, True),
          "fp8_e4m3/bf16-dots": (torch.float8_e4m3fn, True, False),
          "fp8_e4m3/v-rows/bf16-dots": (torch.float8_e4m3fn, False, False)}


def layer_cache(rows: int, cache_len: int, form: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's random K and V caches in the layout of ``form`` (``CACHES``)."""
    dtype, transposed, _ = CACHES[form]
    k, v = (torch.randn(rows, KV, cache_len, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    if transposed:
        v = positions_last(tuple(v.shape), v.device, dtype).copy_(v)
    return k, v


def sweep(rows: int, lengths: torch.Tensor, cache_len: int, form: str, forms: list, reps: int,
          rope: bool = False, shared_cache: bool = False) -> list[dict]:
    """Each launch of ``forms`` timed on the same caches of ``form``. A launch that does not
    fit is left out."""
    g = torch.Generator(device="cuda").manual_seed(0)
    # each call of a graph reads a cache of its own, as each layer of a step does: with one
    # cache for all calls, a batch-64 layer's ~100 MB was read partly from L2 (50 MB), and the
    # kernel measured 2.7-3.3 TB/s where the engine's profile found 2.5 (2026-12-01 21:14)
    caches = [layer_cache(rows, cache_len, form, g) for _ in range(1 if shared_cache else CALLS)]
    f16 = CACHES[form][2]
    # q, k, v as the engine's decode step hands them over: views of one qkv projection
    qkv = torch.randn(rows, KV * G + 2 * KV, D, device="cuda", generator=g, dtype=torch.bfloat16)
    q, k, v = qkv.split((KV * G, KV, KV), dim=1)
    q = q.view(rows, KV, G, D)
    tables = None
    if rope:  # the engine's default form: the kernel applies the q/k-norms and RoPE itself
        cos, sin = (torch.randn(rows, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        norms = (1 + 0.1 * torch.randn(2, D, device="cuda", generator=g)).to(torch.bfloat16)
        tables = kernel.Rope(cos, sin, norms[0], norms[1], 1e-6)
    nbytes = 2 * KV * int(lengths.sum()) * D * caches[0][0].element_size()
    found = []
    for launch in forms:
        calls = [lambda kc=kc, vc=vc: kernel.decode_attention(q, kc, vc, lengths, D ** -0.5, cache_len, new_kv=(k, v),
                                                               launch=launch, rope=tables, f16_dots=f16)
                 for kc, vc in (caches[i % len(caches)] for i in range(CALLS))]
        try:
            us = graph_us(calls, reps)
        except Exception as exc:  # noqa: BLE001 - a launch that does not fit (shared memory) is skipped
            print(f"  {launch}: {type(exc).__name__}")
            continue
        found.append(dict(launch=launch, us=us, gbs=nbytes / us / 1e3))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--context", type=int, default=384, help="every row's length (engine.py's mean context)")
    ap.add_argument("--cache-len", type=int, default=641, help="positions per slot (engine.py: 128 + 512 + 1)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="fewer launches: each chunk with BLOCK_N 32/64, 4 warps, 2/3 stages")
    ap.add_argument("--rope", action="store_true",
                    help="the engine's decode form: raw q/k projections, q/k-norm + RoPE in the kernel")
    ap.add_argument("--caches", nargs="+", default=["bf16", "fp8_e4m3"], choices=list(CACHES),
                    help="fp8_e4m3: as the engine stores it (V transposed, float16 dots); /v-rows: V "
                         "position-major (before 2026-12-02 04:00); /bf16-dots: bfloat16 dots")
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024],
                    help="the sweep's CHUNK values (with every BLOCK_N, warps and stages)")
    ap.add_argument("--lengths", nargs="+", default=["uniform"], choices=["uniform", "spread"])
    ap.add_argument("--shared-cache", action="store_true",
                    help="every call reads the same cache (the form of the runs before 2026-12-01 22:00: "
                         "at batch 64 partly from L2)")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "decode_attention.md"))
    args = ap.parse_args()
    if args.quick:
        launches = list(itertools.product(args.chunks, (32, 64), (4,), (2, 3)))
    else:
        launches = list(itertools.product(args.chunks, (32, 64, 128), (4, 8), (2, 3, 4)))
    bw = copy_bandwidth(torch.device("cuda"), 1 << 30)
    lines = ["| batch | lengths | cache | default launch | its µs | its GB/s | "
             "512-position chunks | its µs | best launch (CHUNK, BLOCK_N, warps, stages) | its µs | its GB/s | "
             "× default |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    best_of: dict[str, dict] = {}
    for rows, kind, name in itertools.product(args.batch, args.lengths, args.caches):
        dtype = CACHES[name][0]
        lengths = row_lengths(rows, args.context, args.cache_len, kind)
        default = kernel.default_launch(rows * KV, dtype)
        former = kernel.default_launch(rows * KV, dtype, chunk=512)  # the wide grids' launch before 2026-12-02
        forms = sorted({default, former, *launches})
        found = sweep(rows, lengths, args.cache_len, name, forms, args.reps, rope=args.rope,
                      shared_cache=args.shared_cache)
        base = next(r for r in found if r["launch"] == default)
        width_rule = next(r for r in found if r["launch"] == former)
        best = min(found, key=lambda r: r["us"])
        best_of[f"{rows}/{kind}/{name}"] = best
        lines.append(f"| {rows} | {kind} | {name} | {default} | {base['us']:.1f} | {base['gbs']:.0f} | "
                     f"{former} | {width_rule['us']:.1f} | {best['launch']} | "
                     f"{best['us']:.1f} | "
                     f"{best['gbs']:.0f} | {base['us'] / best['us']:.2f}× |")
        top = sorted(found, key=lambda r: r["us"])[:5]
        print(f"batch {rows} {kind} {name}: " + ", ".join(f"{r['launch']} {r['us']:.1f} µs" for r in top))
    for rows, kind, name in itertools.product(args.batch, args.lengths, args.caches):
        a, b = best_of.get(f"{rows}/{kind}/bf16"), best_of.get(f"{rows}/{kind}/{name}")
        if a and b and name != "bf16":
            lines.append(f"\nbatch {rows} ({kind}): {name} cache at its best launch {a['us'] / b['us']:.2f}× "
                         "the bf16 cache's best")
    form = ", q/k-norm + RoPE applied by the kernel to the raw projections" if args.rope else ""
    spread = " (spread: evenly over the cache, same mean)" if "spread" in args.lengths else ""
    reads = "every call on the same cache" if args.shared_cache else "each call on a cache of its own"
    desc = (f"one layer's decode attention (new K/V written by the kernel{form}), {KV} KV heads × group {G}, head dim "
            f"{D}, rows at {args.context} positions of {args.cache_len} on average{spread}; µs a call in a CUDA graph "
            f"of {CALLS} calls ({reads}), "
            f"median of {args.reps} replays by CUDA events; GB/s = K+V bytes read / time; copy bandwidth "
            f"{bw / 1e9:.0f} GB/s (read+write)")
    record_section("decode_attention", machine(), desc, lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    main()
