"""The decode step's K/V cache write inside the attention kernel against two index_put launches.

Why: the 17:29 decode profile (benchmarks/RESULTS.md, 2026-11-30) had the two K/V cache writes
of every layer at ~8 µs together (131 KB each: launch latency), 9% of a 0.5B batch-64 step.
``decode_attention(..., new_kv=...)`` writes them from inside ``_partial``. This times one
layer's cache write + attention both ways, 28 layers captured in a CUDA graph as the engine
replays them, best of 5 × 10 replays, on the 0.5B shapes (8 KV heads, GQA group 2, head dim
128, a 2048-position cache) at three batch × context points.

Usage (CUDA only; prints only, figures copied to benchmarks/log/): python benchmarks/decode_kv_write.py
"""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from miles.kernels import decode_attention as K  # noqa: E402

LAYERS, KV, G, D, POSITIONS = 28, 8, 2, 128, 2048


def time_layers(fn) -> float:
    """µs per layer of ``fn``: LAYERS calls captured in one CUDA graph, best of 5 × 10 replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and triton's compile) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 10 / LAYERS * 1e3)
    return best


def main() -> None:
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    for n, ctx in ((64, 288), (64, 1024), (256, 384)):
        kc = torch.randn(n, KV, POSITIONS, D, device=dev, dtype=dtype)
        vc = torch.randn_like(kc)
        q = torch.randn(n, KV, G, D, device=dev, dtype=dtype)
        k, v = torch.randn(n, KV, 1, D, device=dev, dtype=dtype), torch.randn(n, KV, 1, D, device=dev, dtype=dtype)
        pos = torch.full((n,), ctx - 1, device=dev)
        rows = torch.arange(n, device=dev)
        scale = 1 / math.sqrt(D)

        def index_put_then_kernel() -> torch.Tensor:
            kc[rows, :, pos] = k[:, :, 0]
            vc[rows, :, pos] = v[:, :, 0]
            return K.decode_attention(q, kc, vc, pos + 1, scale, POSITIONS)

        def kernel_writes() -> torch.Tensor:
            return K.decode_attention(q, kc, vc, pos + 1, scale, POSITIONS, new_kv=(k[:, :, 0], v[:, :, 0]))

        diff = (index_put_then_kernel().float() - kernel_writes().float()).abs().max().item()
        old, new = time_layers(index_put_then_kernel), time_layers(kernel_writes)
        print(f"batch {n}, context {ctx}: index_put + kernel {old:.1f} µs a layer, the kernel writing "
              f"{new:.1f} µs ({old / new:.2f}×); outputs differ by at most {diff:.2g} (bf16)")


if __name__ == "__main__":
    main()
