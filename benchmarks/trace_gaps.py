"""Where a profiled GPU step's time goes, from its Chrome trace: kernel time by kind, and the
GPU's idle gaps with the host ops that ran across them.

Why: ``torch.profiler``'s tables add kernel times up but say nothing about the time the GPU
sat idle, which is what separates a step's wall time from its kernel time (~20% of the
trainer's H200 step, 2026-11-30 20:23). A gap is a span with no kernel, copy or memset on any
stream; the host ops that overlap it (innermost first) say what the host was doing instead.

Usage: python benchmarks/trace_gaps.py TRACE.json[.gz] [--min-gap-us 200] [--top 25]
(prints only; the trace comes from ``benchmarks/trainer.py --profile --trace-dir DIR``)
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
KINDS = [  # (kind, pattern on the kernel's name), first match wins
    ("gemm", r"gemm|gemv|cutlass|sm90_xmma|nvjet|matmul|splitk"),
    ("attention", r"flash|fmha|cudnn|attention|sdpa"),
    ("optimizer", r"adam|multi_tensor|foreach|l2norm|clip"),
    ("copy/memset", r"^Memcpy|^Memset|copy_kernel|CatArrayBatched"),
    ("triton (compiled)", r"^triton_"),
    ("reduction", r"reduce_kernel|Reduce"),
    ("elementwise (eager)", r"elementwise|vectorized|unrolled|index"),
]


def load(path: Path) -> list[dict[str, Any]]:
    raw = gzip.open(path, "rt") if path.suffix == ".gz" else path.open()
    with raw as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return kind
    return "other"


def merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def analyse(events: list[dict[str, Any]], min_gap_us: float, top: int) -> str:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    if not gpu:
        return "no GPU events in this trace"
    spans = merge([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    start = min(min(e["ts"] for e in gpu), min((e["ts"] for e in host), default=float("inf")))
    end = max(max(e["ts"] + e["dur"] for e in gpu), max((e["ts"] + e["dur"] for e in host), default=0.0))
    busy = sum(b - a for a, b in spans)
    lines = [f"span {(end - start) / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms ({busy / (end - start):.1%}), "
             f"{len(gpu)} GPU events"]
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        by_kind[kind_of(e["name"])] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    total = sum(by_kind.values())
    lines.append("\nkernel time by kind:")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {k:22s} {v / 1e3:9.1f} ms  {v / total:6.1%}")
    lines.append(f"\ntop {top} kernels by time:")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / 1e3:8.1f} ms {n:6d}×  {t / n:8.1f} µs  {name[:110]}")
    gaps = [(spans[i][1], spans[i + 1][0]) for i in range(len(spans) - 1)]
    gaps = [(start, spans[0][0])] + gaps + [(spans[-1][1], end)]
    idle = sum(b - a for a, b in gaps)
    big = [(a, b) for a, b in gaps if b - a >= min_gap_us]
    lines.append(f"\nidle {idle / 1e3:.1f} ms in all; {len(big)} gaps ≥ {min_gap_us:.0f} µs hold "
                 f"{sum(b - a for a, b in big) / 1e3:.1f} ms. The largest, with the host ops across them:")
    host.sort(key=lambda e: e["ts"])
    for a, b in sorted(big, key=lambda g: g[0] - g[1])[:top]:
        over = [e for e in host if e["ts"] < b and e["ts"] + e["dur"] > a]
        inner = sorted(over, key=lambda e: e["dur"])[:4]
        names = ", ".join(f"{e['name'][:40]} ({e['dur'] / 1e3:.1f} ms)" for e in inner)
        lines.append(f"  {(b - a) / 1e3:7.2f} ms at +{(a - start) / 1e3:8.1f} ms: {names}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--min-gap-us", type=float, default=200.0)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(analyse(load(args.trace), args.min_gap_us, args.top))


if __name__ == "__main__":
    main()
