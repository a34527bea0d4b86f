"""Megatron trainer vs embedded trainer: training tokens/s and MFU on the same model and GPU.

    python benchmarks/megatron_trainer.py --device cuda            # Qwen3-0.6B shape, bf16
    python benchmarks/megatron_trainer.py --device cuda --quick    # fewer steps and sequences
    (out of memory: --max-tokens 8192; smaller steps: --seqs 32)

Both variants run full ``train_step`` calls (GRPO loss, TIS on, AdamW, grad clipping 1.0) on
the same random-token trajectories and the same initial weights (random, seed 0), one after
the other in this process (one model in GPU memory at a time), median over the timed steps:

- ``embedded``: ``EmbeddedTrainer`` (fp32 parameters, bf16 autocast, fused LM-head log-probs);
- ``megatron``: ``MegatronTrainer`` on one GPU (megatron-core GPTModel, local layer spec with
  SDPA core attention — or Transformer Engine's spec when it is installed —, bf16 parameters
  with fp32 master weights, Megatron DDP + optimizer + schedule);
- ``megatron+recompute`` (with ``--recompute``): full activation recomputation.

FLOPs per step and the MFU peak are those of ``benchmarks/trainer.py`` (6·N·tokens + LM head at
response positions + causal attention; H200 bf16 dense peak 989 TFLOP/s). Megatron needs CUDA:
on a machine without it this script says so and exits. Prints a table and appends a section to
benchmarks/log/megatron_trainer.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.algorithms import AlgorithmConfig  # noqa: E402
from miles.models import CausalLM  # noqa: E402
from miles.trainers import EmbeddedTrainer, TrainerConfig  # noqa: E402


def _trainer_bench() -> Any:
    """benchmarks/trainer.py as a module: presets, FLOPs formula, peaks, machine line."""
    spec = importlib.util.spec_from_file_location("bench_trainer", ROOT / "benchmarks" / "trainer.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


B = _trainer_bench()


def build(name: str, args: argparse.Namespace, state: dict[str, torch.Tensor]) -> Any:
    make_cfg, *_rest, max_tokens = B.PRESETS[args.preset]
    cfg = make_cfg()
    tcfg = TrainerConfig(lr=1e-6, device="cuda", dtype="bfloat16",
                         max_tokens_per_micro_batch=args.max_tokens or max_tokens,
                         gradient_checkpointing=name.endswith("recompute"))
    algo = AlgorithmConfig(use_tis=True)
    if name == "embedded":
        model = CausalLM(cfg).to("cuda")
        model.load_state_dict(state)
        return EmbeddedTrainer(model, config=tcfg, algo=algo)
    from miles.trainers.megatron import MegatronConfig, MegatronTrainer

    return MegatronTrainer(cfg, config=tcfg, algo=algo, megatron=MegatronConfig(), weights=state)


def run(name: str, args: argparse.Namespace, state: dict, groups: list, layer_params: int) -> dict[str, float]:
    _, seq_len, prompt_len, _, _ = B.PRESETS[args.preset]
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times: list[float] = []
    loss = float("nan")
    try:
        trainer = build(name, args, state)
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = trainer.train_step(groups)["train/loss"]
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        del trainer
    except torch.cuda.OutOfMemoryError:
        print(f"{name}: out of GPU memory (try a smaller --max-tokens)", file=sys.stderr)
    peak_gb = torch.cuda.max_memory_allocated() / 2**30
    gc.collect()
    torch.cuda.empty_cache()
    if not times:
        return {"step_s": float("nan"), "tokens_per_s": float("nan"), "tflops": float("nan"),
                "peak_mem_gb": peak_gb, "loss": float("nan")}
    num_seqs = sum(len(g) for g in groups)
    cfg = B.PRESETS[args.preset][0]()
    flops = (6.0 * layer_params * seq_len * num_seqs
             + 6.0 * cfg.vocab_size * cfg.hidden_size * (seq_len - prompt_len) * num_seqs
             + 6.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len**2 / 2 * num_seqs)
    step_s = statistics.median(times)
    return {"step_s": step_s, "tokens_per_s": seq_len * num_seqs / step_s, "tflops": flops / step_s / 1e12,
            "peak_mem_gb": peak_gb, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", choices=sorted(B.PRESETS), default="0.5b")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--seqs", type=int, default=None, help="sequences per train step")
    p.add_argument("--max-tokens", type=int, default=None, help="max padded tokens per micro-batch")
    p.add_argument("--recompute", action="store_true", help="also run Megatron with full recomputation")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the peak used for MFU")
    p.add_argument("--quick", action="store_true", help="fewer steps and sequences (smoke mode)")
    p.add_argument("--no-append", action="store_true", help="do not append to benchmarks/log/megatron_trainer.md")
    args = p.parse_args()
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        sys.exit("the Megatron trainer needs CUDA: run `python benchmarks/megatron_trainer.py --device cuda` "
                 "on a GPU machine (pip install miles[megatron])")
    args.steps = args.steps or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    torch.backends.cuda.matmul.allow_tf32 = True
    make_cfg, seq_len, prompt_len, num_seqs, _ = B.PRESETS[args.preset]
    num_seqs = args.seqs or (16 if args.quick else num_seqs)
    cfg = make_cfg()
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = CausalLM(cfg)  # the shared initial weights (fp32, on the CPU)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layer_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers.") and p.ndim == 2)
    del model
    groups = B.make_groups(cfg.vocab_size, seq_len, prompt_len, num_seqs)

    name = torch.cuda.get_device_name()
    found = [v for k, v in B.PEAK_BF16.items() if k in name]
    peak, peak_src = ((args.peak_tflops * 1e12, "given") if args.peak_tflops else
                      (found[0], f"{name} datasheet bf16 dense") if found else
                      (B.matmul_peak("cuda", torch.bfloat16), "measured bf16 matmul"))
    variants = ["embedded", "megatron"] + (["megatron+recompute"] if args.recompute else [])
    rows = {v: run(v, args, state, groups, layer_params) for v in variants}

    head = f"{'variant':<20}{'step s':>9}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'vs embedded':>13}{'peak GB':>9}"
    lines = [head, "-" * len(head)]
    base = rows["embedded"]["step_s"]
    for v, r in rows.items():
        lines.append(f"{v:<20}{r['step_s']:>9.3f}{r['tokens_per_s']:>12.0f}{r['tflops']:>10.2f}"
                     f"{r['tflops'] * 1e12 / peak:>8.1%}{base / r['step_s']:>12.2f}x{r['peak_mem_gb']:>9.1f}")
    table = "\n".join(lines)
    tokens = seq_len * num_seqs
    import megatron.core as mcore

    from miles.trainers.megatron.model import te_available

    info = (f"preset {args.preset} (bf16), {num_seqs} sequences × {seq_len} tokens (prompt {prompt_len}) = {tokens} "
            f"tokens per train step, {args.steps} timed steps (median) after {args.warmup} warm-up; peak "
            f"{peak / 1e12:.0f} TFLOP/s ({peak_src}); megatron-core {mcore.__version__}, "
            f"{'Transformer Engine spec' if te_available() else 'local spec + SDPA core attention'}")
    ratio = rows["megatron"]["tokens_per_s"] / rows["embedded"]["tokens_per_s"]
    verdict = f"Megatron / embedded tokens/s on this GPU: {ratio:.2f}x"
    print(info)
    print(table)
    print(verdict)
    if not args.no_append:
        append(args, info, table, verdict)


def append(args: argparse.Namespace, info: str, table: str, verdict: str) -> None:
    path = ROOT / "benchmarks" / "log" / "megatron_trainer.md"
    cmd = "python benchmarks/megatron_trainer.py " + " ".join(sys.argv[1:])
    text = (f"\n## megatron_trainer — {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Command: `{cmd.strip()}`  \nMachine: {B.machine('cuda')}\n\n{info}\n\n```\n{table}\n```\n\n"
            f"{verdict}. Variants run one after the other in one process (same weights, same batch); "
            f"FLOPs as in benchmarks/trainer.py.\n")
    B.append_section(path, text)


if __name__ == "__main__":
    main()
