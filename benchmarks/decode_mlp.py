"""The decode step's gate/up projection and SiLU·up: the engine's two launches (cuBLAS GEMM,
then the compiled SiLU·up kernel) against one Triton GEMM that writes ``silu(gate) * up``
from registers (``miles.kernels.gate_up``), side by side in one process.

Why: a decode layer's small kernels cost ~1.4-1.9 µs each whatever their bytes (the SiLU·up
kernel 1.9 µs a layer at batch 64 on the H200, 2026-12-02 00:11), and a GEMM's cost at these
sizes is mostly fixed, so a GEMM that absorbs the SiLU·up might save most of that kernel.

Each case is timed in a CUDA graph of 20 calls, each on its own copy of the weight (none
read from L2), median of 10 replays by CUDA events; every launch of the sweep is timed, and
the fused output is checked against the two-launch path.

    python benchmarks/decode_mlp.py [--batch 16 32 64 128 256] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import graph_us, machine  # noqa: E402
from benchmarks.trainer import record_section  # noqa: E402
from miles.kernels import gate_up as kernel  # noqa: E402
from miles.models.fused import compile_fast_path  # noqa: E402

HIDDEN, INTER = 1024, 3072  # Qwen3-0.6B's MLP
COPIES = 20


def launches(quick: bool) -> list[tuple[int, int, int, int, int]]:
    """The kernel's default launches, with one more (``quick``) or the whole sweep."""
    defaults = {launch for _, launch in kernel.LAUNCHES}
    if quick:
        return sorted(defaults | {(64, 16, 128, 4, 4)})
    sweep = [(bm, bn, bk, w, s) for bm, bn, bk, w, s in itertools.product((16, 32, 64), (16, 32, 64), (64, 128, 256),
                                                                        (4, 8), (3, 4, 5))
             if not (w == 8 and bm * bn < 64 * 32) and bk * (bm + 2 * bn) * 2 * s <= 200_000]
    return sorted(defaults | set(sweep))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "decode_mlp.md"))
    args = ap.parse_args()
    fast = compile_fast_path("bench")
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) / 32
               for _ in range(COPIES)]
    rows, verdicts = [], []
    for batch in args.batch:
        x = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        gemm = graph_us([lambda w=w: F.linear(x, w) for w in weights])
        now = graph_us([lambda w=w: fast.silu_mul(F.linear(x, w)) for w in weights])
        ref = fast.silu_mul(F.linear(x, weights[0])).float()
        found = {}
        for launch in launches(args.quick):
            try:
                out = kernel.gate_up_silu(x, weights[0], launch)
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile (shared memory) is skipped
                print(f"batch {batch} launch {launch}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            err = (out.float() - ref).abs().max().item()
            found[launch] = (graph_us([lambda w=w, launch=launch: kernel.gate_up_silu(x, w, launch)
                                       for w in weights]), err)
        best = min(found, key=lambda k: found[k][0])
        default = found.get(kernel.default_launch(batch), (float("nan"), float("nan")))
        rows.append((batch, gemm, now, default[0], best, *found[best]))
        verdicts.append(f"batch {batch}: fused at its best launch {found[best][0]:.1f} µs against the engine's "
                        f"{now:.1f} µs ({now / found[best][0]:.2f}×); per layer × 28: "
                        f"{(now - found[best][0]) * 28:.0f} µs a step")
        top = sorted(found, key=lambda k: found[k][0])[:6]
        verdicts.append(f"batch {batch}, the six best launches (BM, BN, BK, warps, stages): "
                        + ", ".join(f"{k} {found[k][0]:.1f}" for k in top))
    header = ["batch", "cuBLAS GEMM alone µs", "engine now (GEMM + SiLU·up) µs", 'fused, default launch µs',
              "fused, best launch", "its µs", "max |Δ| against the engine's"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch, gemm, now, default, best, us, err in rows:
        lines.append(f"| {batch} | {gemm:.1f} | {now:.1f} | {default:.1f} | {best} | {us:.1f} | {err:.4f} |")
    desc = (f"a Qwen3-0.6B MLP's gate/up projection ({2 * INTER}×{HIDDEN}, bf16, 12.6 MB) and SiLU·up; µs a call in a "
            f"CUDA graph of {COPIES} calls each on its own weight copy, median of 10 replays; 'engine now' = cuBLAS, "
            "then the compiled SiLU·up kernel; 'fused' = miles.kernels.gate_up (one Triton GEMM)")
    record_section("decode_mlp", machine(), desc, lines + [""] + [f"- {v}" for v in verdicts], args.results,
                   save=not args.no_record)


if __name__ == "__main__":
    main()
