"""A decode layer's four GEMMs: the fused Triton kernels (``miles.kernels.decode_gemm``) against
what the engine runs now (Inductor's norm / SiLU·up / residual kernels around cuBLAS GEMMs).

Why: at batch 64 a 0.5B decode step sat at 43% of its memory roofline on the H200 (engine,
2026-12-01 03:16); the profile put ~27% of the step in four small-M GEMMs at ~33% of the copy
bandwidth and ~10% in the elementwise kernels between them. This times each of a Qwen3-0.6B
layer's projections with its neighbouring elementwise work, both ways, inside CUDA graphs
(as the engine replays them), and sweeps the Triton launch.

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
from miles.models.fused import rms_norm  # noqa: E402

HIDDEN, Q, KVD, INTER, EPS = 1024, 2048, 1024, 3072, 1e-6  # Qwen3-0.6B: 16 q heads, 8 kv heads × 128
SHAPES = {  # name: (N, K, fused form)
    "qkv (norm)": (Q + 2 * KVD, HIDDEN, "norm"),
    "o (+residual)": (HIDDEN, Q, "residual"),
    "gate_up (norm)": (2 * INTER, HIDDEN, "norm"),
    "down (silu·up, +residual)": (HIDDEN, INTER, "silu_residual"),
}


L2_FLUSH = 160 << 20  # bytes of weight copies cycled through (the H200's L2 is 50 MB)


def cycling(call, copies: list):
    """A no-argument function that passes the next of ``copies`` to ``call`` each time."""
    state = {"i": 0}

    def run():
        state["i"] += 1
        return call(copies[state["i"] % len(copies)])
    return run


def reference(form: str):
    """The engine's current form of one projection, compiled as its fast path is."""
    def norm(x, w, nw, r):
        return F.linear(rms_norm(x, nw, EPS), w)

    def residual(x, w, nw, r):
        return r + F.linear(x, w)

    def silu_residual(x, w, nw, r):
        gate, up = x.chunk(2, dim=-1)
        return r + F.linear(F.silu(gate) * up, w)

    return torch.compile({"norm": norm, "residual": residual, "silu_residual": silu_residual}[form], dynamic=False)


def fused(form: str, launch):
    def run(x, w, nw, r):
        if form == "norm":
            return decode_gemm.linear(x, w, norm_weight=nw, eps=EPS, launch=launch)
        if form == "residual":
            return decode_gemm.linear(x, w, residual=r, launch=launch)
        return decode_gemm.linear(x, w, silu_up=True, residual=r, launch=launch)
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
    lines = ["| batch | projection | MB of weights | engine now µs | its GB/s | cuBLAS GEMM alone µs | "
             "fused, default launch µs | fused, best launch µs | its GB/s | best launch (BM, BN, BK, warps, stages) | "
             "× engine now | max |Δ| |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    totals: dict[int, list[float]] = {}
    for M, (name, (N, K, form)) in itertools.product(args.batch, SHAPES.items()):
        xk = 2 * K if form == "silu_residual" else K
        x = torch.randn(M, xk, device=dev, generator=g, dtype=torch.bfloat16)
        # several copies of the weights, cycled call by call: 20 calls of one matrix would read
        # it from the 50 MB L2 after the first, which a decode step (28 layers' weights and the
        # KV cache in between) never does
        copies = [(torch.randn(N, K, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
                  for _ in range(max(2, -(-L2_FLUSH // (N * K * 2))))]
        w = copies[0]
        nw = (torch.rand(K, device=dev, generator=g) + 0.5).to(torch.bfloat16)
        r = torch.randn(M, N, device=dev, generator=g, dtype=torch.bfloat16)
        ref_fn = reference(form)
        want = ref_fn(x, w, nw, r)
        now = time_us(cycling(lambda wi: ref_fn(x, wi, nw, r), copies), args.reps)
        xa = x[:, :K].contiguous()
        gemm = time_us(cycling(lambda wi: F.linear(xa, wi), copies), args.reps)
        default = decode_gemm.launch_for(M, N, K)
        if args.quick:
            launches = [default, (64, 32, 128, 4, 4), (64, 16, 256, 4, 4), (64, 64, 128, 4, 3), (64, 32, 256, 4, 3)]
        else:
            launches = list(itertools.product((32, 64, 128), (16, 32, 64), (128, 256), (4,), (3, 4, 5)))
            launches += [(64, 32, 128, 8, 4), (64, 64, 128, 8, 4), (64, 16, 256, 8, 4)]
        launches = sorted({default, *[ln for ln in launches if ln[0] <= max(16, M)]})
        found = []
        for launch in launches:
            try:
                fn = fused(form, launch)
                err = (fn(x, w, nw, r).float() - want.float()).abs().max().item()
                found.append((time_us(cycling(lambda wi: fn(x, wi, nw, r), copies), args.reps), launch, err))
            except Exception as exc:  # noqa: BLE001 - a launch that does not fit (shared memory) is skipped
                print(f"  {launch}: {type(exc).__name__}")
        base = next(f for f in found if f[1] == default)
        best = min(found)
        mb = N * K * 2 / 1e6
        totals.setdefault(M, [0.0, 0.0, 0.0])
        totals[M][0] += now
        totals[M][1] += base[0]
        totals[M][2] += best[0]
        lines.append(f"| {M} | {name} | {mb:.1f} | {now:.1f} | {mb * 1e3 / now:.0f} | {gemm:.1f} | {base[0]:.1f} | "
                     f"{best[0]:.1f} | {mb * 1e3 / best[0]:.0f} | {best[1]} | {now / best[0]:.2f}× | {best[2]:.3g} |")
        print(f"batch {M} {name}: now {now:.1f} µs, cuBLAS {gemm:.1f}; fused " +
              ", ".join(f"{ln} {us:.1f}" for us, ln, _ in sorted(found)[:6]))
    for M, (now, base, best) in totals.items():
        lines.append(f"\nbatch {M}: a layer's four projections {now:.1f} µs now, {base:.1f} µs fused at the default "
                     f"launches ({now / base:.2f}×), {best:.1f} µs at each one's best ({now / best:.2f}×); "
                     f"× 28 layers: {28 * (now - base) / 1e3:.2f} ms a step saved at the defaults")
    desc = (f"a Qwen3-0.6B layer's projections (bf16) with the elementwise work around them; µs a call in a CUDA "
            f"graph of 20 calls, each on another copy of the weights (none read from L2), median of {args.reps} "
            f"replays; GB/s = weight bytes / time; copy bandwidth {bw / 1e9:.0f} GB/s (read+write); 'engine now' = "
            f"the same math compiled by Inductor (dynamic=False)")
    record_section("decode_gemm", machine(), desc, lines, args.results, save=not args.no_record)


if __name__ == "__main__":
    main()
