"""A decode step's token draw: the torch path against the fused Triton sampler, side by side.

Why: the draw over a 152k vocabulary was ~1.1 ms of a 5.3 ms batch-256 decode step on the
H200 as ~15 torch kernels (profile of 2026-12-01), and the first fused version still took
~80 µs at batch 64, well above the ~5 µs it takes to read the logits once: the per-entry
hash, logs and division are the cost. This times, with CUDA events on one process's GPU,
the torch draw (``sample`` + the finiteness check + the stack the stepper copies back, as
the stepper ran it) and the fused draw at several launch shapes, for plain (T = 1), tempered
and unseeded rows, and reports each in µs and in GB/s of logits read. Those eager calls
include host launch time; the kernel alone is also timed inside a CUDA graph (as the decode
graph runs it), with its per-lane reductions against the first form's per-block ones.

    python benchmarks/sampling.py [--batch 64 256] [--vocab 151936]   (CUDA; appends to benchmarks/log/sampling.md)
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine import graph_us, machine  # noqa: E402
from miles.engines.sampling import SamplingBatch, fused_sample, row_key, sample  # noqa: E402
from miles.kernels import sampling as kernel  # noqa: E402


def timed(fn, iters: int = 50) -> float:
    """Median µs of ``fn`` over ``iters`` calls (CUDA events around each)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


FORMER = dict(block=2048, chunk=8192, warps=4)  # the launch and form before 2026-12-01 19:44
CALLS = 20  # calls a CUDA graph holds (benchmarks.engine.graph_us)


def torch_draw(logits: torch.Tensor, batch: SamplingBatch, gen: torch.Generator) -> torch.Tensor:
    """What the stepper ran before the fused sampler (float32 logits from the graph)."""
    tokens, logprobs = sample(logits.float(), batch, gen)
    finite = torch.isfinite(logits).all(dim=-1)
    return torch.stack([tokens.double(), logprobs.double(), finite.double()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--results", default=str(Path(__file__).parent / "log" / "sampling.md"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    shapes = [(b, c, w) for b in (1024, 2048, 4096) for c in (4096, 8192, 16384) for w in (4, 8) if c >= b]
    lines = ["| batch | rows | torch µs | fused µs (default launch) | × | best launch (block, chunk, warps; in a graph) | its µs | GB/s of logits |",
             "|---|---|---|---|---|---|---|---|"]
    graph_lines = ["| batch | rows | per-lane µs (default launch, in a graph) | per-block µs, same launch | "
                   "per-block µs, former launch (2048, 8192, 4) | × former | GB/s of logits |",
                   "|---|---|---|---|---|---|---|"]
    launch_lines: list[str] = []
    for n in args.batch:
        logits = (torch.randn(n, args.vocab, device=dev) * 3).to(torch.bfloat16)
        gb = logits.numel() * logits.element_size() / 1e9
        for label, temp, seeded in (("T=1, seeded", 1.0, True), ("T=0.7, seeded", 0.7, True),
                                    ("T=1, unseeded", 1.0, False)):
            batch = SamplingBatch([temp] * n, [1.0] * n, [-1] * n,
                                  [row_key(i, 100) if seeded else None for i in range(n)])
            t_torch = timed(lambda: torch_draw(logits.float(), batch, gen))
            t_fused = timed(lambda: fused_sample(logits, batch, gen))
            temps = torch.full((n,), temp, device=dev)
            keys = torch.tensor([row_key(i, 100) for i in range(n)], device=dev)
            per_shape = {s: graph_us([lambda s=s: kernel.sample(logits, temps, keys, block=s[0], chunk=s[1],
                                                                warps=s[2])] * CALLS) for s in shapes}
            best = min(per_shape, key=per_shape.get)
            # the kernel alone as the decode graph runs it: per-lane reductions (the default)
            # against a reduction across the program every block (the first form)
            in_graph = {lanes: graph_us([lambda lanes=lanes: kernel.sample(logits, temps, keys, lanes=lanes)] * CALLS)
                        for lanes in (True, False)}
            former = graph_us([lambda: kernel.sample(logits, temps, keys, lanes=False, **FORMER)] * CALLS)
            graph_lines.append(f"| {n} | {label} | {in_graph[True]:.1f} | {in_graph[False]:.1f} | {former:.1f} | "
                               f"{former / in_graph[True]:.2f}× | {gb / (in_graph[True] * 1e-6):.0f} |")
            print(graph_lines[-1], flush=True)
            lines.append(f"| {n} | {label} | {t_torch:.1f} | {t_fused:.1f} | {t_torch / t_fused:.1f}× | {best} | "
                         f"{per_shape[best]:.1f} | {gb / (per_shape[best] * 1e-6):.0f} |")
            print(lines[-1], flush=True)
            launch_lines.append(f"- batch {n}, {label}, every launch (per-lane, µs in a graph): " +
                                ", ".join(f"{s} {t:.1f}" for s, t in sorted(per_shape.items(), key=lambda x: x[1])))
            print(launch_lines[-1], flush=True)
    torch_note = ("torch µs: the stepper's former draw on the float32 copy of the logits (the graph "
                  "used to write them so); fused µs: `fused_sample` on the bf16 logits, key upload included")
    print(torch_note)
    print("\n".join(graph_lines))
    if args.no_record:
        return
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    cmd = "python benchmarks/sampling.py " + " ".join(sys.argv[1:])
    section = [f"\n## sampling — {stamp}", "", f"Command: `{cmd}`  ", f"Machine: {machine()}  ",
               f"vocabulary {args.vocab}, bf16 logits; median of 50 calls each, CUDA events; {torch_note}.", "",
               *lines, "", f"The kernel alone at its default launch (block {kernel.BLOCK}, chunk {kernel.CHUNK}, "
               f"{kernel.WIDE_CHUNK} from {kernel.WIDE} rows, {kernel.WARPS} warps), {CALLS} calls captured in a CUDA graph, "
               "median of 10 replays:", "", *graph_lines, "", *launch_lines, ""]
    with open(args.results, "a") as f:
        f.write("\n".join(section))


if __name__ == "__main__":
    main()
