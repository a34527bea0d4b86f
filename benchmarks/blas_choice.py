"""Which cuBLAS path serves the decode step's projections fastest: torch's two BLAS
backends (``preferred_blas_library``: cuBLAS, cuBLASLt) × the weight's layout ([N, K] as
``nn.Linear`` stores it, or stored transposed [K, N]) × the residual add (after the GEMM, or
inside it with beta = 1, ``addmm_``), side by side in one process.

Why: at decode sizes a 4-13 MB GEMM costs 5-7 µs on the H200 whatever the kernel (mostly
fixed ramp and tail; benchmarks/RESULTS.md, decode_gemm, 2026-12-01), and the four of a
0.5B layer are ~24 µs of its ~60. Which kernel the library picks depends on the backend, the
operand layout and beta, so those are the cheap knobs left.

Each case is timed in a CUDA graph of 20 calls, each on its own copy of the weight (none
read from L2), median of 10 replays by CUDA events.

    python benchmarks/blas_choice.py [--batch 64 128 256]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import graph_us, machine  # noqa: E402

# A Qwen3-0.6B layer's projections: (name, N, K, residual added after it)
SHAPES = (("qkv", 4096, 1024, False), ("o", 1024, 2048, True), ("gate_up", 6144, 1024, False),
          ("down", 1024, 3072, True))
COPIES = 20


def case(batch: int, N: int, K: int, residual: bool, *, transposed: bool, in_gemm: bool,
         hot: bool = False) -> list[Callable[[], None]]:
    """``hot``: every call reads the same weight copy, which stays in L2 after the first."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, K, device="cuda", dtype=torch.bfloat16, generator=g)
    h = torch.randn(batch, N, device="cuda", dtype=torch.bfloat16, generator=g)
    weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / 32
               for _ in range(1 if hot else COPIES)] * (COPIES if hot else 1)
    if transposed:  # stored [K, N]; the GEMM reads it as is
        weights = [w.t().contiguous() for w in weights]
    calls = []
    for w in weights:
        wt = w if transposed else w.t()  # the [K, N] operand either way
        if residual and in_gemm:
            calls.append(lambda wt=wt: h.addmm_(x, wt))
        elif residual:
            calls.append(lambda wt=wt: h.add_(x @ wt))
        else:
            calls.append(lambda wt=wt: x @ wt)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "blas_choice.md"))
    args = ap.parse_args()
    backends = ("cublas", "cublaslt")
    variants = [(b, t, i) for b in backends for t in (False, True) for i in (False, True)]
    rows = []
    for batch in args.batch:
        for name, N, K, residual in SHAPES:
            found = {}
            for backend, transposed, in_gemm in variants:
                if in_gemm and not residual:
                    continue
                torch.backends.cuda.preferred_blas_library(backend)
                found[(backend, transposed, in_gemm)] = graph_us(case(batch, N, K, residual, transposed=transposed,
                                                                  in_gemm=in_gemm))
            torch.backends.cuda.preferred_blas_library("cublas")
            now = found[("cublas", False, residual)]  # the engine's: cuBLAS, [N, K], residual in the GEMM
            best = min(found, key=found.get)
            # the engine's case with its weight in L2: what is left of a call when no byte comes
            # from DRAM (its fixed cost: launch, ramp, tail)
            hot = graph_us(case(batch, N, K, residual, transposed=False, in_gemm=residual, hot=True))
            rows.append((batch, name, N * K * 2 / 1e6, now, found, best, hot))
    header = ["batch", "projection", "MB"] + [
        f"{b} {'[K,N]' if t else '[N,K]'}{' +res in GEMM' if i else ''} µs" for b, t, i in variants] + [
        "best", "× engine", "engine's, weight in L2 µs"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch, name, mb, now, found, best, hot in rows:
        cells = [f"{found[v]:.1f}" if v in found else "" for v in variants]
        label = f"{best[0]} {'[K,N]' if best[1] else '[N,K]'}{' +res' if best[2] else ''}"
        lines.append(f"| {batch} | {name} | {mb:.1f} | " + " | ".join(cells) +
                     f" | {label} | {now / found[best]:.2f}× | {hot:.1f} |")
    verdicts = []
    for batch in args.batch:
        mine = [r for r in rows if r[0] == batch]
        engine = sum(r[3] for r in mine)
        for variant in variants:
            if all(variant in r[4] or (variant[0], variant[1], False) in r[4] for r in mine):
                total = sum(r[4].get(variant, r[4].get((variant[0], variant[1], False))) for r in mine)
                verdicts.append(f"batch {batch}: {variant[0]}, weights {'[K,N]' if variant[1] else '[N,K]'}, residual "
                                f"{'in' if variant[2] else 'after'} the GEMM: a layer's four {total:.1f} µs against the "
                                f"engine's {engine:.1f} µs ({engine / total:.2f}×)")
        verdicts.append(f"batch {batch}: the engine's four with their weights in L2 {sum(r[6] for r in mine):.1f} µs "
                        f"against {engine:.1f} µs from DRAM: what an L2 prefetch could win at most")
    text = "\n".join(lines)
    print(text)
    print("\n".join(verdicts))
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    desc = (f"a Qwen3-0.6B layer's projections (bf16), µs a call in a CUDA graph of {COPIES} calls each on its own "
            "weight copy, median of 10 replays; '+res in GEMM' = h.addmm_(x, w) (beta = 1), otherwise the add "
            "follows the GEMM (o, down); × engine = the engine's case (cuBLAS, [N, K], residual in the GEMM) over the best")
    section = [f"\n## blas_choice — {stamp}", "", f"Command: `python benchmarks/blas_choice.py {' '.join(sys.argv[1:])}`  ",
               f"Machine: {machine()}  ", desc, "", text, ""] + [f"- {v}" for v in verdicts] + [""]
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write("\n".join(section))
    print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
