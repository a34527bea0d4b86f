"""A decode layer's four GEMMs: the split-K Triton kernel (``miles.kernels.decode_gemm``)
against cuBLAS, at the Qwen3-0.6B shapes, inside CUDA graphs (as the engine replays them),
with a sweep of the Triton launch.

Why: at batch 64 a 0.5B decode step sat at 43-45% of its memory roofline on the H200 (engine,
2026-12-01 03:16 and 06:36); the profile put ~30% of the step in four small-M cuBLAS GEMMs at
~34% of the copy bandwidth. The first form of the kernel (RMSNorm and SiLU·up fused into
its operand loads, 06:22) lost 2-5x to cuBLAS; this one only splits K.

    python benchmarks/decode_gemm.py [--batch 64 256] [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_attention import time_us  # noqa: E402
from benchmarks.engine import copy_bandwidth, machine  # noqa: E402
from benchmarks.trainer import record_section  # noqa: E402
from miles.kernels import decode_gemm  # noqa: E402

HIDDEN, Q, KVD, INTER = 1024, 2048, 1024, 3072  # Qwen3-0.6B: 16 q heads, 8 kv heads × 128
SHAPES = {  # name: (N, K, residual): the o and down projections add the residual stream
    "qkv": (Q + 2 * KVD, HIDDEN, False),
    "o (+residual)": (HIDDEN, Q, True),
    "gate_up": (2 * INTER, HIDDEN, False),
    "down (+residual)": (HIDDEN, INTER, True),
}
L2_FLUSH = 160 << 20  # bytes of weight copies cycled through (the H200's L2 is 50 MB)


def cycling(call, copies: list):
    """A no-argument function that passes the next of ``copies`` to ``call`` each time."""
    state = {"i": 0}

    def run():
        state["i"] += 1
        return call(copies[state["i"] % len(copies)])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="a few launches only")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")))
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev, 1 << 30)
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| batch | projection | MB of weights | cuBLAS µs | its GB/s | engine now µs | split-K, default launch µs | "
             "split-K, best launch µs | its GB/s | best launch (BM, BN, BK, SPLIT, warps, stages) | × engine now | "
             "max |Δ| |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    totals: dict[int, list[float]] = {}
    compiled_add = torch.compile(lambda x, w, r: r + F.linear(x, w), dynamic=False)
    for M, (name, (N, K, residual)) in itertools.product(args.batch, SHAPES.items()):
        x = torch.randn(M, K, device=dev, generator=g, dtype=torch.bfloat16)
        # several copies of the weights, cycled call by call: 20 calls of one matrix would read
        # it from the 50 MB L2 after the first, which a decode step (28 layers' weights and the
        # KV cache in between) never does
        copies = [(torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
                  for _ in range(max(2, -(-L2_FLUSH // (N * K * 2))))]
        r = torch.randn(M, N, device=dev, generator=g, dtype=torch.bfloat16) if residual else None
        cublas = time_us(cycling(lambda w: F.linear(x, w), copies), args.reps)
        # what the engine runs now: cuBLAS, and for the residual forms its add (which the engine
        # fuses with the next RMSNorm: the add alone is an upper bound of what it costs there)
        now = time_us(cycling(lambda w: compiled_add(x, w, r), copies), args.reps) if residual else cublas
        want = (r + F.linear(x, copies[0])) if residual else F.linear(x, copies[0])
        default = decode_gemm.launch_for(M, N, K)
        if args.quick:
            launches = [default, (64, 16, 64, 4, 4, 4), (64, 32, 64, 2, 4, 4), (64, 32, 128, 2, 4, 3),
                        (64, 64, 64, 2, 4, 4)]
        else:
            launches = list(itertools.product((64, 128), (16, 32, 64), (64, 128), (1, 2, 4, 8), (4,), (4,)))
        launches = sorted({default, *[ln for ln in launches if ln[0] <= max(16, M) and K % (ln[2] * ln[3]) == 0]})
        found = []
        for launch in launches:
            try:
                def fn(w, launch=launch):
                    return decode_gemm.linear(x, w, residual=r, launch=launch)
                err = (fn(copies[0]).float() - want.float()).abs().max().item()
                found.append((time_us(cycling(fn, copies), args.reps), launch, err))
            except Exception as exc:  # noqa: BLE001 - a launch that does not fit (shared memory) is skipped
                print(f"  {launch}: {type(exc).__name__}")
        base = next(f for f in found if f[1] == default)
        best = min(found)
        mb = N * K * 2 / 1e6
        totals.setdefault(M, [0.0, 0.0, 0.0])
        totals[M][0] += now
        totals[M][1] += base[0]
        totals[M][2] += best[0]
        lines.append(f"| {M} | {name} | {mb:.1f} | {cublas:.1f} | {mb * 1e3 / cublas:.0f} | {now:.1f} | {base[0]:.1f} | "
                     f"{best[0]:.1f} | {mb * 1e3 / best[0]:.0f} | {best[1]} | {now / best[0]:.2f}× | {best[2]:.3g} |")
        print(f"batch {M} {name}: cuBLAS {cublas:.1f} µs, now {now:.1f}; split-K default {base[0]:.1f}; " +
              ", ".join(f"{ln} {us:.1f}" for us, ln, _ in sorted(found)[:6]))
    for M, (now, base, best) in totals.items():
        lines.append(f"\nbatch {M}: a layer's four projections {now:.1f} µs now, {base:.1f} µs split-K at the default "
                     f"launches ({now / base:.2f}×), {best:.1f} µs at each one's best ({now / best:.2f}×); "
                     f"× 28 layers: {28 * (now - base) / 1e3:.2f} ms a step saved at the defaults")
    desc = (f"a Qwen3-0.6B layer's projections (bf16) with the elementwise work around them; µs a call in a CUDA "
            f"graph of 20 calls, each on another copy of the weights (none read from L2), median of {args.reps} "
            f"replays; GB/s = weight bytes / time; copy bandwidth {bw / 1e9:.0f} GB/s (read+write); 'engine now' = "
            f"cuBLAS, plus Inductor's residual add for the o and down projections")
    record_section("decode_gemm", machine(), desc, lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    main()
