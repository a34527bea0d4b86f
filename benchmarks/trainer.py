"""Embedded trainer throughput: training tokens/s and MFU.

    python benchmarks/trainer.py [--quick]                      # tiny model, CPU, float32
    python benchmarks/trainer.py --device cuda --preset 0.5b    # Qwen3-0.6B shape, bf16
    python benchmarks/trainer.py --device cuda --preset 0.5b --compile
    (out of memory on a smaller GPU: --max-tokens 8192; fewer sequences per step: --seqs 32)

Each variant runs full ``EmbeddedTrainer.train_step`` calls (GRPO loss, TIS on, AdamW,
grad clipping) on random-token trajectories, side by side in one process:

- ``fused``: the trainer's default LM head + log-softmax (``miles.trainers.logprobs``);
- ``plain``: the model's float32 logits + ``token_logprobs`` (what the fused path replaces);
- ``fused+compile`` (with ``--compile``): decoder layers under ``torch.compile``.

FLOPs per train step (stated, not measured), for a dense model:

    6 · N_layers_params · all_tokens      (q/k/v/o and MLP matmuls; fwd + bwd = 3 × 2)
  + 6 · V · H · response_tokens           (LM head, only where log-probs are taken)
  + 6 · L · n_heads · head_dim · S² / 2   per sequence of length S (causal QKᵀ and AV)

MFU = FLOPs / step time / peak. GPU peak: the dense bf16 figure of the detected part
(H100/H200: 989 TFLOP/s; override with --peak-tflops). CPU: there is no datasheet figure for
a shared VM, so the peak is the float32 matmul rate measured in this same run.
Prints a table and appends a section to benchmarks/log/trainer.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import sys
import time
from typing import Any
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.models import CausalLM, ModelConfig, tiny_config  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402
from miles.types import Trajectory  # noqa: E402

GOAL_MFU = 0.35
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}

PRESETS = {
    # name: (model config, seq len, prompt len, sequences per step, max tokens per micro-batch)
    "tiny": (lambda: tiny_config(vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32), 256, 32, 16, 2048),
    "0.5b": (lambda: ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 tie_word_embeddings=True, max_position_embeddings=40960),
             2048, 256, 64, 16384),
}


def step_flops(cfg: ModelConfig, model: CausalLM, seq_len: int, prompt_len: int, num_seqs: int) -> float:
    layer_params = sum(p.numel() for n, p in model.named_parameters()
                       if n.startswith("model.layers.") and p.ndim == 2)
    resp = seq_len - prompt_len
    dense = 6.0 * layer_params * seq_len * num_seqs
    head = 6.0 * cfg.vocab_size * cfg.hidden_size * resp * num_seqs
    attn = 6.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len**2 / 2 * num_seqs
    return dense + head + attn


def make_groups(vocab: int, seq_len: int, prompt_len: int, num_seqs: int, group: int = 8) -> list[list[Trajectory]]:
    g = torch.Generator().manual_seed(0)
    groups = []
    for gi in range(max(1, num_seqs // group)):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        members = []
        for j in range(min(group, num_seqs)):
            resp = torch.randint(3, vocab, (seq_len - prompt_len,), generator=g).tolist()
            t = Trajectory(id=f"{gi}-{j}", prompt_id=str(gi), group_id=str(gi), prompt_tokens=prompt)
            t.append(resp, (-5.0 - torch.rand(len(resp), generator=g)).tolist(), 0)
            t.reward = float(j % 2)
            members.append(t)
        groups.append(members)
    return groups


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """Best of a few timed square matmuls (the best trial is the least disturbed by load)."""
    return max(_matmul_rate(device, dtype) for _ in range(3))


def _matmul_rate(device: str, dtype: torch.dtype) -> float:
    n = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 50 if device.startswith("cuda") else 5
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


class Variant:
    """One trainer configuration under test."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        make_cfg, self.seq_len, self.prompt_len, _, max_tokens = PRESETS[args.preset]
        self.name, self.args, self.cfg = name, args, make_cfg()
        torch.manual_seed(0)
        with torch.device(args.device):
            self.model = CausalLM(self.cfg)
        tcfg = TrainerConfig(
            lr=1e-6, device=args.device, dtype=args.dtype, compile="compile" in name,
            max_tokens_per_micro_batch=args.max_tokens or max_tokens,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        self.trainer = EmbeddedTrainer(self.model, config=tcfg, algo=AlgorithmConfig(use_tis=True))
        self.trainer.fused_logprobs = name != "plain"
        self.times: list[float] = []
        self.loss = float("nan")

    def step(self, groups: list[list[Trajectory]], timed: bool) -> None:
        sync(self.args.device)
        t0 = time.perf_counter()
        self.loss = self.trainer.train_step(groups)["train/loss"]
        sync(self.args.device)
        if timed:
            self.times.append(time.perf_counter() - t0)

    def result(self, groups: list[list[Trajectory]], peak_mem_gb: float) -> dict[str, float]:
        num_seqs = sum(len(g) for g in groups)
        step_s = statistics.median(self.times)
        flops = step_flops(self.cfg, self.model, self.seq_len, self.prompt_len, num_seqs)
        return {"step_s": step_s, "tokens_per_s": self.seq_len * num_seqs / step_s,
                "tflops": flops / step_s / 1e12, "peak_mem_gb": peak_mem_gb, "loss": self.loss}

    def close(self) -> None:
        del self.trainer, self.model
        if self.args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def print_profile(title: str, run: Any, device: str, rows: int = 15, trace: str | None = None) -> None:
    """Profile one call of ``run`` (torch.profiler) and print its top ops by device time (on
    CUDA) and by host time: where a train step goes, for the MFU work. ``trace``: also write
    the step's Chrome trace there (gzipped when the name ends in .gz), for the GPU's idle gaps
    and the kernels' timeline, which the tables do not show."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        run()
        sync(device)
    print(f"\n### profile: {title}, one step of {time.perf_counter() - t0:.3f} s")
    table = prof.key_averages()
    for key in (["cuda_time_total"] if len(activities) > 1 else []) + ["self_cpu_time_total"]:
        print(table.table(sort_by=key, row_limit=rows, max_name_column_width=50))
    if trace:
        prof.export_chrome_trace(trace)
        print(f"trace: {trace}")


def trace_path(args: argparse.Namespace, name: str) -> str | None:
    return f"{args.trace_dir}/trainer_{name.replace('+', '_')}.json.gz" if args.trace_dir else None


def run_variants(names: list[str], args: argparse.Namespace, groups: list[list[Trajectory]]) -> dict[str, dict]:
    """GPU: one variant after another (stable clocks; one model in memory at a time).
    CPU: all variants built, then their steps interleaved round-robin and the median taken,
    so that load from other jobs on a shared machine hits every variant alike."""
    gpu = args.device.startswith("cuda")
    rows: dict[str, dict] = {}
    if gpu:
        for name in names:
            torch.cuda.reset_peak_memory_stats()
            try:
                v = Variant(name, args)
                for i in range(args.warmup + args.steps):
                    v.step(groups, timed=i >= args.warmup)
                if args.profile:
                    print_profile(f"{name} trainer", lambda: v.step(groups, timed=False), args.device,
                                  trace=trace_path(args, name))
            except torch.cuda.OutOfMemoryError:
                print(f"{name}: out of GPU memory (try a smaller --max-tokens)", file=sys.stderr)
                rows[name] = {"step_s": float("nan"), "tokens_per_s": float("nan"), "tflops": float("nan"),
                              "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30, "loss": float("nan")}
                v = None
                torch.cuda.empty_cache()
                continue
            rows[name] = v.result(groups, torch.cuda.max_memory_allocated() / 2**30)
            v.close()
        return rows
    variants = [Variant(name, args) for name in names]
    for i in range(args.warmup + args.steps):
        for v in variants:
            v.step(groups, timed=i >= args.warmup)
    for v in variants if args.profile else []:
        print_profile(f"{v.name} trainer", lambda: v.step(groups, timed=False), args.device,
                      trace=trace_path(args, v.name))
    return {v.name: v.result(groups, 0.0) for v in variants}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> str:
    cpu = f"{cpu_name()} ({os.cpu_count()} cores visible)"
    desc = f"{platform.platform()}, {cpu}, Python {platform.python_version()}, torch {torch.__version__}"
    if device.startswith("cuda"):
        desc += f", GPU {torch.cuda.get_device_name()}"
    return desc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seqs", type=int, default=None, help="sequences per train step")
    p.add_argument("--max-tokens", type=int, default=None, help="max padded tokens per micro-batch")
    p.add_argument("--compile", action="store_true", help="also run the torch.compile variant")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile one more step of each variant (top ops by device and host time)")
    p.add_argument("--trace-dir", default=None, help="with --profile: write each variant's Chrome trace here")
    p.add_argument("--only", nargs="+", default=None, help="run only these variants (plain is the ratio's base)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the peak used for MFU")
    p.add_argument("--quick", action="store_true", help="fewer steps (smoke mode)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/log/trainer.md")
    args = p.parse_args()
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        sys.exit("--device cuda but CUDA is not available")
    args.preset = args.preset or ("0.5b" if gpu else "tiny")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.steps = args.steps or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    make_cfg, seq_len, prompt_len, num_seqs, _ = PRESETS[args.preset]
    if args.seqs:
        num_seqs = args.seqs
    if args.quick and not gpu:
        num_seqs = min(num_seqs, 8)
    vocab = make_cfg().vocab_size
    groups = make_groups(vocab, seq_len, prompt_len, num_seqs)

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    measured = matmul_peak(args.device, dtype)
    if args.peak_tflops:
        peak, peak_src = args.peak_tflops * 1e12, "given"
    elif gpu:
        name = torch.cuda.get_device_name()
        found = [v for k, v in PEAK_BF16.items() if k in name]
        peak, peak_src = (found[0], f"{name} datasheet bf16 dense") if found else (measured, "measured matmul")
    else:
        peak, peak_src = measured, "measured fp32 matmul, same run"

    variants = ["fused", "plain"] + (["fused+compile"] if args.compile else [])
    if args.only:
        unknown = sorted(set(args.only) - set(variants))
        if unknown:
            sys.exit(f"--only: unknown variant(s) {unknown}; choose from {variants}")
        variants = [v for v in variants if v in args.only]
    rows = run_variants(variants, args, groups)
    if not gpu and not args.peak_tflops:  # re-measure after the runs; keep the best
        measured = max(measured, matmul_peak(args.device, dtype))
        peak = measured

    base_name = "plain" if "plain" in rows else next(iter(rows))  # --only may leave plain out
    base = rows[base_name]
    vs = f"vs {base_name}"[:9]
    head = f"{'variant':<26}{'step s':>9}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{vs:>10}{'peak GB':>9}"
    lines = [head, "-" * len(head)]
    for v, r in rows.items():
        lines.append(f"{v:<26}{r['step_s']:>9.3f}{r['tokens_per_s']:>12.0f}{r['tflops']:>10.3f}"
                     f"{r['tflops'] * 1e12 / peak:>8.1%}{base['step_s'] / r['step_s']:>9.2f}x"
                     f"{r['peak_mem_gb']:>9.1f}")
    table = "\n".join(lines)
    tokens = seq_len * sum(len(g) for g in groups)
    best = max((r["tflops"] for r in rows.values() if r["tflops"] == r["tflops"]), default=0.0) * 1e12 / peak
    info = (f"preset {args.preset} ({dtype}), {sum(len(g) for g in groups)} sequences × {seq_len} tokens "
            f"(prompt {prompt_len}) = {tokens} tokens per train step, {args.steps} timed steps (median) after "
            f"{args.warmup} warm-up; peak {peak / 1e12:.3f} TFLOP/s ({peak_src}); "
            f"measured {args.dtype} matmul {measured / 1e12:.3f} TFLOP/s")
    print(info)
    print(table)
    goal = (f"goal ≥ {GOAL_MFU:.0%} MFU in bf16 on the H200: {'MET' if best >= GOAL_MFU else 'NOT met'} "
            f"(best {best:.1%})") if gpu else "no CPU goal; the MFU goal applies to the H200 run"
    print(goal)
    if not args.no_append:
        append(args, info, table, goal)


def append(args: argparse.Namespace, info: str, table: str, goal: str) -> None:
    path = Path(__file__).resolve().parent / "log" / "trainer.md"
    cmd = "python benchmarks/trainer.py " + " ".join(sys.argv[1:])
    text = (
        f"\n## trainer — {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
        f"Command: `{cmd.strip()}`  \nMachine: {machine(args.device)}"
        f"{' (shared with other jobs: variants interleaved step by step in one process, median step; compare the ratios)' if not args.device.startswith('cuda') else ''}\n\n"
        f"{info}\n\n```\n{table}\n```\n\n{goal}. FLOPs = 6·N_layers·tokens + 6·V·H·response tokens "
        f"+ causal attention 6·L·heads·head_dim·S²/2 per sequence (see the script's docstring).\n"
    )
    append_section(path, text)


def record_section(script: str, machine: str, setup: str, lines: list[str], results: str | Path, *,
                   save: bool = True) -> str:
    """Print a benchmark's section — title with the time, the command that ran, the machine,
    one setup line, then ``lines`` (its tables and verdicts) — and append it to ``results``
    unless ``save`` is False. Returns the text."""
    report = "\n".join([
        f"## {script} — {dt.datetime.now():%Y-%m-%d %H:%M}", "",
        f"Command: `python benchmarks/{script}.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {machine}  ", setup, "", *lines, ""])
    print(report)
    if save:
        append_section(Path(results), "\n" + report)
    return report


def append_section(path: Path, text: str) -> None:
    """Append a section to a benchmark log file (created with its title if missing)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {path.stem} — raw sections, newest last\n")
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
