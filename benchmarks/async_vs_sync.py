"""Sync vs one-step-off vs async (η = 1, 2, 4, 8), with and without partial rollouts; and
AReaL's staleness sweep (``--sweep``: η = 0, 1, 2, 4, 8, 16, ∞ with and without partial
rollouts, kept vs recomputed KV across updates, final reward on the held-out countdown set).

    python benchmarks/async_vs_sync.py [--quick] [--steps N]            # CPU: the countdown task
    python benchmarks/async_vs_sync.py --device cuda [--steps N]        # GPU: 0.5B Qwen3 shape, random weights
    python benchmarks/async_vs_sync.py --device cuda --workload countdown --sweep   # GPU: the staleness sweep
    python benchmarks/async_vs_sync.py --device cuda --disaggregated    # trainer GPU 0, engine GPU 1 (NCCL)
    python benchmarks/async_vs_sync.py --device cuda --disaggregated --lanes 2   # 4 GPUs: two configs at a time

Every configuration trains the same number of samples (steps × B groups × n samples) on the
same task and hardware, one after another in ONE process (one Ray cluster) — or, with
``--lanes N`` on a machine with N times the GPUs a config needs, in N concurrent lanes of
one run, each a child process with its own Ray cluster on its own GPUs — and the table
reports each one's trained samples/s and tokens/s as a ratio to sync, its final reward, how
long the trainer waited for data, and the share of step time the buffer (its own measured
busy time) and the admission loop took.

CPU: the countdown example (long-tailed answers: median 16 tokens, longest 400), starting
from its SFT warm-up (made and cached under runs/countdown by the example's own scripts).
GPU (--device cuda): a Qwen3-0.6B-shaped model with RANDOM weights — fine for throughput,
meaningless for reward — trainer and engine colocated on one GPU (CUDA IPC weights), or with
--disaggregated on two GPUs of their own (NCCL weights); response lengths are
long-tailed by construction (each prompt carries a Zipf-distributed length, up to
--max-len tokens, that a custom generate function enforces with EOS ignored).
Throughput is measured from the end of step 1 to the end of the last step, so actor start-up
and the first weight load are excluded — and so is an async run's head start: trajectories
finished before that span (while the first step waited or compiled) and trained in it are
not credited to it (``measure``).

The sweep (``--sweep``; ``--etas``, ``--no-keep-etas`` choose its rows): each η with and
without ``--partial-rollout``, and at the ``--no-keep-etas`` the partial config once more with
``--no-keep-kv-cache-on-update`` (rows recompute their cache after each update instead of
decoding on KV an older policy wrote). On the countdown workload each config's final policy
(``--save-hf``) is scored on a fixed held-out set by vs_trl's evaluator (examples/countdown/
evaluate.py: the embedded engine, per-sample seeds, the same prompts and random numbers for
every config), beside the SFT start; on CUDA the countdown model is a larger SFT warm start
(``GPU_SFT``), trained once and cached. ``async_vs_sync_report.sweep_table`` lays the results out as AReaL's table:
trained tokens/s relative to η = 0 with and without partial rollouts, samples/s beside it,
held-out reward, mismatch KL and the mixed-version KV share.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.async_vs_sync_report import NO_KEEP, eta_name, report, write  # noqa: E402
from benchmarks.hostload import GpuUtilization  # noqa: E402

CONFIGS = [
    ("sync", dict(mode="sync")),
    ("one-step-off", dict(mode="one-step-off")),
    *[(f"async η={eta}", dict(mode="async", max_staleness=eta)) for eta in (1, 2, 4, 8)],
    *[(f"async η={eta} +partial", dict(mode="async", max_staleness=eta, partial_rollout=True)) for eta in (1, 2, 4, 8)],
]
SWEEP_ETAS = ("0", "1", "2", "4", "8", "16", "inf")  # AReaL's table (η = 0 is sync)
# The countdown warm start for a GPU (sft.py on the card, cached under runs/countdown/sft-gpu):
# 6 layers 512 wide, 14 M parameters, head_dim 128 (the engine's Triton decode attention wants a
# power of two), against the CPU's 0.3 M.
GPU_SFT = ["--device", "cuda", "--hidden-size", "512", "--num-layers", "6", "--steps", "1500",
           "--batch-tokens", "4096", "--lr", "1e-3"]
QUICK_SFT = ["--steps", "20", "--hidden-size", "32", "--num-layers", "1"]


def sweep_configs(etas: list[int | float], no_keep_etas: list[int | float]) -> list[tuple[str, dict]]:
    """The sweep's configs in table order: η = 0 is sync; each η > 0 without and with partial
    rollouts, and at the ``no_keep_etas`` the partial one once more without keeping the KV."""
    out: list[tuple[str, dict]] = []
    for eta in etas:
        if eta == 0:
            out.append(("sync", dict(mode="sync")))
            continue
        name, flags = f"async η={eta_name(eta)}", dict(mode="async", max_staleness=eta)
        out += [(name, flags), (f"{name} +partial", dict(flags, partial_rollout=True))]
        if eta in no_keep_etas:
            out.append((f"{name} +partial {NO_KEEP}", dict(flags, partial_rollout=True, keep_kv_cache_on_update=False)))
    return out


def slug(name: str) -> str:
    """A shell-friendly config name: 'async η=2 +partial' -> 'async_eta2_partial'."""
    return name.replace("η=", "eta").replace("∞", "inf").replace(" +", "_").replace(" ", "_")


# ---- GPU workload: long-tailed lengths from a random model -------------------------------


async def fixed_length_generate(sample, ctx):
    """Generate exactly ``sample.metadata['length']`` tokens (EOS ignored): a random-weight
    model never stops by itself, so the length distribution is imposed by the data."""
    from miles.rollout import apply_output

    want = int(sample.metadata["length"])
    request = ctx.request_for(sample, max_new_tokens=want - len(sample.response_tokens), ignore_eos=True)
    apply_output(sample, await ctx.engine.generate(request))
    return sample


def length_reward(sample) -> float:
    """A stand-in reward (the model is random): the share of even token ids."""
    tokens = sample.response_tokens
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def make_gpu_inputs(root: Path, max_len: int, tiny: bool = False) -> dict[str, str]:
    """The random-weight checkpoint and the Zipf-length prompts. ``tiny``: the same workload
    with a 2-layer, 64-wide model in float32 (``--workload zipf`` on the CPU), to reproduce
    the GPU run's scheduling dynamics (admission, staleness, prefills) at a small scale."""
    import torch

    from miles.models import CausalLM, ModelConfig, build_tiny_tokenizer, save_pretrained

    if tiny:
        cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=max_len + 128, tie_word_embeddings=True,
                          bos_token_id=2, eos_token_id=1, pad_token_id=0)
    else:
        cfg = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                          max_position_embeddings=max_len + 128, tie_word_embeddings=True,
                          bos_token_id=2, eos_token_id=1, pad_token_id=0)
    ckpt = root / ("ckpt-tiny" if tiny else "ckpt")
    if not (ckpt / "config.json").exists():
        torch.manual_seed(0)
        model = CausalLM(cfg).to(torch.float32 if tiny else torch.bfloat16)
        model.reset_parameters()
        save_pretrained(model, ckpt, tokenizer=build_tiny_tokenizer())
    data = root / f"data_{max_len}.jsonl"
    if not data.exists():  # written once, atomically: concurrent lanes read it
        rng = random.Random(0)
        tmp = data.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "w") as fh:
            for i in range(4096):
                length = min(max_len, int(16 * (1 + rng.paretovariate(1.2))))  # median ~30, tail to max_len
                fh.write(json.dumps({"input": f"prompt {i}:", "label": "", "metadata": {"length": length}}) + "\n")
        os.replace(tmp, data)
    return {"ckpt": str(ckpt), "data": str(data)}


# ---- CPU workload: the countdown example ------------------------------------------------------


def make_cpu_inputs(quick: bool) -> dict[str, str]:
    """The countdown prompts and the CPU's SFT warm start (``countdown_inputs``)."""
    return countdown_inputs(quick, "cpu", 8, ROOT / "runs" / "async_vs_sync")


def countdown_inputs(quick: bool, device: str, eval_prompts: int, work: Path) -> dict[str, str]:
    """The countdown prompts, the SFT warm start (cached: the CPU's tiny model, ``GPU_SFT``'s
    on CUDA) and the fixed held-out set under ``work``, all from vs_trl's ``prepare``."""
    from benchmarks.vs_trl import prepare

    root = ROOT / "runs" / ("countdown-smoke" if quick else "countdown")
    if quick and not (root / "data" / "train.jsonl").is_file():
        subprocess.run([sys.executable, "examples/countdown/task.py", "--out-dir", str(root / "data"),
                        "--num-train", "64", "--num-eval", "4"], cwd=ROOT, check=True)
    gpu = device == "cuda" and not quick
    where = argparse.Namespace(data_dir=str(root / "data"), sft=str(root / ("sft-gpu" if gpu else "sft")),
                               out=str(work), eval_prompts=eval_prompts)
    paths = prepare(where, QUICK_SFT if quick else GPU_SFT if gpu else [])
    return {"ckpt": str(paths["sft"]), "data": str(paths["train"]), "eval": str(paths["eval"])}


def held_out_reward(args: argparse.Namespace, eval_path: str, policy: Path | str, base: str) -> dict[str, float]:
    """A policy's reward on the fixed held-out countdown set: vs_trl's evaluator (the embedded
    engine on ``--device``, ``--eval-samples`` per prompt at T = 1, per-sample seeds), and the
    evaluation's standard error (binary rewards, samples taken as independent)."""
    import torch

    if str(ROOT / "examples" / "countdown") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples" / "countdown"))
    from evaluate import evaluate, load_policy, read_rows

    model, tokenizer = load_policy(policy, base)
    rows = read_rows(eval_path)
    t0 = time.monotonic()
    m = evaluate(model.eval(), tokenizer, rows, n=args.eval_samples, temperature=1.0,
                 max_new_tokens=args.eval_max_new_tokens, seed=0, device=args.device)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the next config's colocated memory plan sees the card as before
    p, n = m["reward_mean"], len(rows) * args.eval_samples
    return {"eval_reward": p, "eval_reward_se": (p * (1 - p) / n) ** 0.5, "eval_reward_long": m["reward_long"],
            "eval_s": time.monotonic() - t0}


def countdown_workload(args: argparse.Namespace, work: Path) -> tuple[dict[str, str], int, dict[str, Any], str]:
    """The countdown runs' inputs, steps, base flags and description. On CUDA: ``GPU_SFT``'s
    warm start, 12 steps of B = 16 groups, colocated as the Zipf config (or disaggregated)."""
    gpu = args.device == "cuda"
    args.eval_prompts = args.eval_prompts or (4 if args.quick else 256)
    args.eval_samples = args.eval_samples or (2 if args.quick else 4)
    args.eval_max_new_tokens = 24 if args.quick else 420
    inputs = countdown_inputs(args.quick, args.device, args.eval_prompts, work)
    steps = args.steps or (3 if args.quick else 12 if gpu else 24)
    groups = args.groups or (2 if args.quick else 16 if gpu else 8)
    n = 2 if args.quick else 8
    base = dict(hf_checkpoint=inputs["ckpt"], prompt_data=inputs["data"],
                custom_rm_path=f"{ROOT / 'examples' / 'countdown' / 'reward.py'}:reward",
                rollout_batch_size=groups, n_samples_per_prompt=n,
                rollout_max_response_len=args.eval_max_new_tokens, lr=2e-4, use_tis=True)
    if not gpu:
        return inputs, steps, base, "countdown task from its SFT warm-up (tiny model, CPU)"
    # uncompiled: a 14 M-parameter model's steps are launch-bound, and each config would pay the compile again
    base.update(device="cuda", actor_num_gpus_per_node=1, colocate=not args.disaggregated,
                rollout_num_gpus=1 if args.disaggregated else 0, compile=False,
                max_batch_size=groups * n, max_inflight_per_worker=groups * n)
    where = "trainer and engine on GPUs of their own" if args.disaggregated else "colocated on one GPU"
    return inputs, steps, base, (f"countdown task from its SFT warm-up trained on the GPU ({' '.join(GPU_SFT[2:])}), "
                                 f"RL in bf16, uncompiled, {where}")


# ---- the comparison ---------------------------------------------------------------------------


def measure(rows: list[dict]) -> dict[str, float]:
    """Throughput over the span from the end of the first row's step to the end of the last.

    An asynchronous run starts with a head start: while the trainer's first step waits (and,
    on CUDA, compiles), the engines already finish trajectories for the next η versions.
    Drawing that stock down in the span would count rollouts made before it, so the samples
    credited to the span are at most those the rollout side completed in it — trained plus
    the change of the ready stock (``buffer/ready``). The raw trained rate is kept beside it
    ('trained/s'); the steady rate is the smaller, the one the ratios use.
    """
    first, last = rows[0], rows[-1]
    span = last["wall_time"] - first["wall_time"]
    samples = sum(r["perf/trained_samples"] for r in rows[1:])
    tokens = sum(r["perf/trained_tokens"] for r in rows[1:])
    completed = samples + _delta(first, last, "buffer/ready")
    steady = min(1.0, completed / samples) if samples else 1.0
    step_time = sum(r["perf/step_s"] for r in rows[1:])
    tail = rows[-max(3, len(rows) // 4):]
    return {
        "samples_per_s": steady * samples / span,
        "tokens_per_s": steady * tokens / span,
        "trained_samples_per_s": samples / span,
        "stock_drawn": 1.0 - steady,  # the share of the trained samples that came from the head start
        "reward": statistics.fmean(r["rollout/reward_mean"] for r in tail),
        "wait_share": sum(r["perf/wait_for_data_s"] for r in rows[1:]) / step_time,
        "buffer_share": _delta(first, last, "perf/buffer_busy_s") / span,
        # the same calls' CPU time (no descheduling, no GIL waits; nan from code without it)
        "buffer_cpu_share": (_delta(first, last, "perf/buffer_cpu_s") / span if "perf/buffer_cpu_s" in last
                             else float("nan")),
        "admission_share": sum(r.get("perf/admission_s", 0) for r in rows[1:]) / span,
        "staleness_max": max(r["buffer/staleness_max"] for r in rows),
        "worker_busy": last.get("rollout/busy_s", 0.0),
        # every generated token (trained later, recycled or dropped too), over the same span
        "rollout_tokens_per_s": _delta(first, last, "rollout/tokens") / span,
        # CUDA graph captures the engines made over the span (each new batch × context shape)
        "capture_share": _delta(first, last, "engine/graph_capture_s") / span,
        # torch.compile's compiles of new shape variants in the engines' steps (the phase
        # they held: a first-met prefill shape's compile read as prefill time before)
        "compile_share": _delta(first, last, "engine/compile_s") / span,
        "warm_compile_s": last.get("engine/warm_compile_s", float("nan")),  # at start, before serving
        # the engines' mean prefill forward: fresh prompts are short, so its cost is per call
        "prefill_ms_per_forward": 1e3 * _delta_ratio(first, last, "engine/prefill_s", "engine/prefill_forwards"),
        # the engines' stepping threads over the span: the share spent with nothing to decode
        # (starved by the worker: leases, admission) and the mean rows a decode step carried
        "engine_idle": _delta_share(first, last, "engine/idle_s", "engine/busy_s"),
        "rows_per_step": _delta_ratio(first, last, "engine/decode_rows", "engine/decode_steps"),
        # the share of the engines' busy time spent prefilling (re-prefills of recycled partials)
        "engine_prefill": _delta_ratio(first, last, "engine/prefill_s", "engine/busy_s"),
        # where the prefilled tokens came from: fresh prompts, resumed partial rollouts, rows
        # recomputing their cache after an update that did not keep it (shares of all)
        **{f"prefill_{cause}": _delta_ratio(first, last, f"engine/prefill_tokens_{cause}", "engine/prefill_tokens")
           for cause in ("fresh", "resumed", "recompute")},
        "mixed_version_kv_frac": statistics.fmean(r.get("train/mixed_version_kv_frac", 0.0) for r in rows[1:])
        if len(rows) > 1 else float("nan"),
        "mismatch_kl": statistics.fmean(r.get("train/mismatch_kl_k1", float("nan")) for r in rows[1:])
        if len(rows) > 1 else float("nan"),
        # the workers over the span (summed over workers): seconds with room for work that
        # the buffer left empty, and seconds their event loops woke up late, per second
        "worker_starved": _delta(first, last, "rollout/starved_s") / span,
        "loop_lag": _delta(first, last, "rollout/loop_lag_s") / span,
        # the workers' put_many + lease calls per trajectory the buffer took back (each call
        # costs the buffer a fixed share on top of its per-trajectory work)
        "buffer_calls_per_traj": (_delta(first, last, "rollout/put_calls") + _delta(first, last, "rollout/lease_calls"))
        / max(_delta(first, last, "buffer/trained"), 1.0),
        "loop_lag_max_s": last.get("rollout/loop_lag_max_s", float("nan")),
        # share of the KV positions decode steps read that a row attends to (the rest is
        # padding up to the batch's longest context), cumulative over the run
        "kv_useful": last.get("engine/kv_read_useful_frac", float("nan")),
        # shape classes of the engines' seeded draw that run fused on CUDA (4 expected; fewer
        # made the 11:22 sweep of 2026-11-30 sample eagerly, 10.6-12.2k rollout tok/s not 15-18k)
        "fused_draw_classes": last.get("engine/fused_draw_classes", float("nan")),
        # graphs the compiled trainer built after step 1 (a mid-run recompile: a step of seconds)
        "trainer_recompiles": _delta(first, last, "perf/compiled_graphs"),
        "train_step_max_s": max(r["perf/train_step_s"] for r in rows[1:]) if len(rows) > 1 else float("nan"),
    }


def _delta(first: dict, last: dict, key: str) -> float:
    """How much the cumulative metric ``key`` grew between two metric rows (0 where absent)."""
    return last.get(key, 0.0) - first.get(key, 0.0)


def _delta_ratio(first: dict, last: dict, num: str, den: str) -> float:
    """Change of ``num`` over change of ``den`` between two metric rows (nan without both)."""
    if num not in last or den not in last:
        return float("nan")
    d = _delta(first, last, den)
    return _delta(first, last, num) / d if d > 0 else float("nan")


def _delta_share(first: dict, last: dict, part: str, other: str) -> float:
    """The share of ``part`` in ``part`` + ``other`` over the span between two metric rows."""
    if part not in last or other not in last:
        return float("nan")
    p = _delta(first, last, part)
    total = p + _delta(first, last, other)
    return p / total if total > 0 else float("nan")


def buffer_parts(rows: list[dict]) -> str:
    """The replay buffer's busy time over the span, by method, largest first, with each
    method's longest single call so far (a burst shows which call it was)."""
    first, last = rows[0], rows[-1]
    prefix = "perf/buffer_busy_s/"
    parts = {k[len(prefix):]: last[k] - first.get(k, 0.0) for k in last if k.startswith(prefix)}
    return ", ".join(f"{m} {1e3 * v:.1f} ms (longest in the run {1e3 * last.get(f'perf/buffer_call_max_s/{m}', 0.0):.1f})"
                     for m, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v > 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny smoke version (CPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--max-len", type=int, default=None,
                        help="longest Zipf response (default 2048 on the GPU, 256 with --workload zipf on the CPU)")
    parser.add_argument("--workload", choices=("auto", "zipf", "countdown"), default="auto",
                        help="auto: the Zipf workload on CUDA, countdown on the CPU; zipf on the CPU runs the GPU "
                             "workload scaled down (2-layer 64-wide random model, --groups groups a step)")
    parser.add_argument("--groups", type=int, default=None,
                        help="groups a step (B; default 32 for the Zipf workload on the GPU, 16 for countdown on the GPU, "
                             "8 on the CPU)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="GPU: the trainer's --max-tokens-per-micro-batch (colocated, the engine's memory plan "
                             "reserves its activations; default 32768 on a card of 100 GiB or more, else 8192, "
                             "which leaves an 80 GB card room for the KV cache)")
    parser.add_argument("--disaggregated", action="store_true", help="GPU: trainer and engine on GPUs of their own")
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per config (seeds 1..N); the table gives the median and the spread")
    parser.add_argument("--only", nargs="*", default=None,
                        help="configs to run, by name or slug (sync, one-step-off, async_eta2, async_eta2_partial; default all)")
    parser.add_argument("--sweep", action="store_true",
                        help="AReaL's staleness sweep: η = --etas, each with and without partial rollouts (η = 0: sync), "
                             "the partial ones at --no-keep-etas also without keeping the KV across updates")
    parser.add_argument("--etas", nargs="+", default=list(SWEEP_ETAS), help="the sweep's η values (inf: unbounded)")
    parser.add_argument("--no-keep-etas", nargs="*", default=["2", "4"],
                        help="the sweep's η values whose partial config also runs with --no-keep-kv-cache-on-update")
    parser.add_argument("--eval-prompts", type=int, default=None,
                        help="countdown: held-out prompts the final policies are scored on (default 256, 4 with --quick)")
    parser.add_argument("--eval-samples", type=int, default=None, help="countdown: samples per held-out prompt (default 4, 2 with --quick)")
    parser.add_argument("--work", default=str(ROOT / "runs" / "async_vs_sync"), help="the runs' output directories go here")
    parser.add_argument("--compile", action="store_true",
                        help="the trainer's decoder layers under torch.compile in every config (--compile; "
                             "the engine compiles on CUDA either way)")
    parser.add_argument("--lanes", type=int, default=1,
                        help="GPU: run the configs in this many concurrent lanes, each on GPUs of its own "
                             "(2 with --disaggregated, else 1), one after another within a lane; one table")
    parser.add_argument("--json-out", default=None, help=argparse.SUPPRESS)  # a lane's results, for its parent
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "log" / "async_vs_sync.md"))
    args = parser.parse_args()
    if args.lanes < 1:
        parser.error(f"--lanes must be >= 1, got {args.lanes}")
    if args.lanes > 1 and args.device != "cuda":
        parser.error("--lanes needs --device cuda (lanes run on GPUs of their own)")
    from miles.scheduler import check_staleness

    try:
        args.etas = [check_staleness(e) for e in args.etas]
        args.no_keep_etas = [check_staleness(e) for e in args.no_keep_etas]
    except ValueError as exc:
        parser.error(f"--etas / --no-keep-etas: {exc}")

    from miles.config import resolve
    from miles.driver import train
    from miles.metrics import read_metrics

    gpu = args.device == "cuda"
    zipf = args.workload == "zipf" or (args.workload == "auto" and gpu)
    args.max_len = args.max_len or (2048 if gpu else 256)
    if gpu and args.micro_batch_tokens is None:
        import torch

        big = torch.cuda.get_device_properties(0).total_memory >= 100 * 2**30
        args.micro_batch_tokens = 32768 if big else 8192
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if zipf:
        inputs = make_gpu_inputs(work, args.max_len, tiny=not gpu)
        steps = args.steps or 12
        groups = args.groups or (32 if gpu else 8)
        base = dict(hf_checkpoint=inputs["ckpt"], prompt_data=inputs["data"], input_key="input",
                    custom_rm_path=f"{__file__}:length_reward",
                    custom_generate_function_path=f"{__file__}:fixed_length_generate",
                    rollout_batch_size=groups, n_samples_per_prompt=8, rollout_max_response_len=args.max_len,
                    max_seq_len=args.max_len + 64, max_batch_size=groups * 8, lr=1e-6,
                    max_inflight_per_worker=groups * 8)
        if gpu:
            base.update(device="cuda", actor_num_gpus_per_node=1, colocate=not args.disaggregated,
                        rollout_num_gpus=1 if args.disaggregated else 0,
                        max_tokens_per_micro_batch=args.micro_batch_tokens,
                        # the trainer compiles before the first step: a steady-state comparison, whose
                        # short span a background compile's switch would land in (first_step.py times that)
                        compile_warmup="inline")
            where = "trainer on GPU 0, engine on GPU 1" if args.disaggregated else "colocated on one GPU"
            what = (f"Qwen3-0.6B shape, random weights, bf16, {where}; Zipf lengths ≤ {args.max_len}; "
                    f"{args.micro_batch_tokens}-token micro-batches")
        else:
            what = f"2-layer 64-wide random model, float32, CPU; Zipf lengths ≤ {args.max_len} (the GPU workload scaled down)"
    else:
        inputs, steps, base, what = countdown_workload(args, work)
    catalogue = sweep_configs(args.etas, args.no_keep_etas) if args.sweep else CONFIGS
    by_name = {key: c for c in catalogue for key in (c[0], slug(c[0]))}
    unknown = [name for name in args.only or () if name not in by_name]
    if unknown:
        parser.error(f"--only {unknown}: known configs are {[slug(c[0]) for c in catalogue]}")
    configs = [by_name[name] for name in args.only] if args.only else catalogue  # in the order asked
    evaluated = None if zipf else inputs["eval"]
    if evaluated and args.json_out is None:  # the SFT start on the held-out set: every config's reference
        t0 = time.monotonic()
        args.sft_start = held_out_reward(args, evaluated, inputs["ckpt"], inputs["ckpt"])
        what += (f"; held-out set: {args.eval_prompts} prompts × {args.eval_samples} samples, T = 1, "
                 f"≤ {args.eval_max_new_tokens} tokens, scored on {args.device}")
        print(f"SFT start: held-out reward {args.sft_start['eval_reward']:.4f} "
              f"({time.monotonic() - t0:.0f} s with the data and the SFT)", flush=True)
    if args.lanes > 1:
        run_lanes(args, configs, steps, base, what, work)
        return
    results: dict[str, dict[str, float]] = {}
    running = [""]

    def on_term(signum: int, frame: Any) -> None:
        """A time limit (``timeout`` sends SIGTERM) keeps the configs that finished."""
        if results and args.json_out is None:
            write(report(results, args, steps, base, what,
                         interrupted=f"stopped by signal {signum} during {running[0]!r}"), args.results)
        os._exit(128 + signum)

    runs = [(f"{name} s{seed}" if args.seeds > 1 else name, name, extra, seed)
            for name, extra in configs for seed in range(1, args.seeds + 1)]
    for name, _config, extra, seed in runs:
        running[0] = name
        signal.signal(signal.SIGTERM, on_term)  # again each time: ray.init (in the first run) sets its own
        out = work / name.replace(" ", "_").replace("=", "").replace("+", "")
        flags = dict(base, output_dir=str(out), num_rollout=steps, progress=False, seed=seed, **extra)
        if args.compile:
            flags["compile"] = True
        if evaluated:  # the final policy, for the held-out evaluation
            flags["save_hf"] = str(out / "final")
        start = time.monotonic()
        (out / "metrics.jsonl").unlink(missing_ok=True)
        sampler = GpuUtilization(out / "metrics.jsonl", steps) if gpu else None
        summary = asyncio.run(train(resolve(flags)))
        rows = read_metrics(out / "metrics.jsonl")[-steps:]
        results[name] = measure(rows)
        print(f"{name}: buffer work over the span, by method: {buffer_parts(rows)}", flush=True)
        for index, util in (sampler.stop() if sampler else {}).items():
            results[name][f"gpu{index}_util"] = util
        results[name]["wall_s"] = time.monotonic() - start
        if evaluated:
            results[name].update(held_out_reward(args, evaluated, out / "final", inputs["ckpt"]))
        print(f"{name}: {results[name]['wall_s']:.0f} s run, {results[name].get('eval_s', 0.0):.0f} s evaluation",
              flush=True)
        results[name]["ledger_ok"] = float(summary["ledger_ok"])
        for key, value in summary.get("startup", {}).items():  # where the time before step 1 went
            results[name][key] = value
        print(f"{name}: {json.dumps({k: round(v, 4) for k, v in results[name].items()})}", flush=True)
        if gpu and results[name]["fused_draw_classes"] < 4:
            print(f"WARNING {name}: the engines' seeded draw is fused for only "
                  f"{results[name]['fused_draw_classes']:.0f} of 4 shape classes (eager draws slow decode)", flush=True)
        if args.json_out:  # after every config: a lane stopped later keeps what it finished
            tmp = Path(args.json_out).with_suffix(".tmp")
            tmp.write_text(json.dumps(results))
            os.replace(tmp, args.json_out)

    if args.json_out is None:
        write(report(results, args, steps, base, what), args.results)


def run_lanes(args: argparse.Namespace, configs: list, steps: int, base: dict[str, Any], what: str,
              work: Path) -> None:
    """The configs in ``args.lanes`` concurrent lanes, each a child run of this script on GPUs
    of its own (round robin: sync leads lane 0), then one table. Ten configs did not fit one
    10-minute device call one after another (2026-11-30: nine did); two lanes take half the
    time on four GPUs. The lanes share the host (CPUs, PCIe root), not a GPU."""
    import torch

    per = 2 if args.disaggregated else 1
    have = torch.cuda.device_count()
    if have < args.lanes * per:
        raise SystemExit(f"--lanes {args.lanes} needs {args.lanes * per} GPUs "
                         f"({per} per lane{' with --disaggregated' if per == 2 else ''}); this machine has {have}")
    (work / "lanes").mkdir(parents=True, exist_ok=True)
    procs: list[tuple[subprocess.Popen, Path]] = []
    plan: list[str] = []
    for i in range(args.lanes):
        lane = configs[i :: args.lanes]
        if not lane:
            continue
        out = work / "lanes" / f"lane{i}.json"
        out.unlink(missing_ok=True)
        gpus = ",".join(str(g) for g in range(i * per, (i + 1) * per))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--device", "cuda", "--steps", str(steps),
               "--max-len", str(args.max_len), "--micro-batch-tokens", str(args.micro_batch_tokens), "--json-out", str(out),
               "--workload", args.workload, "--work", str(work), "--only", *[slug(n) for n, _ in lane]]
        cmd += ["--disaggregated"] * args.disaggregated + ["--compile"] * args.compile + ["--quick"] * args.quick
        cmd += ["--groups", str(args.groups)] * (args.groups is not None)
        if args.sweep:
            cmd += ["--sweep", "--etas", *map(str, args.etas), "--no-keep-etas", *map(str, args.no_keep_etas)]
        if args.eval_prompts:
            cmd += ["--eval-prompts", str(args.eval_prompts), "--eval-samples", str(args.eval_samples)]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpus)), out))
        plan.append(f"GPUs {gpus}: {', '.join(n for n, _ in lane)}")

    def collect() -> dict[str, dict[str, float]]:
        got: dict[str, dict[str, float]] = {}
        for _, out in procs:
            if out.exists():
                got.update(json.loads(out.read_text()))
        return {name: got[name] for name, _ in configs if name in got}  # the table in config order

    def on_term(signum: int, frame: Any) -> None:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        results = collect()
        if results:
            write(report(results, args, steps, base, what, lanes=plan,
                         interrupted=f"stopped by signal {signum}"), args.results)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    codes = [proc.wait() for proc, _ in procs]
    results = collect()
    failed = [name for name, _ in configs if name not in results]
    write(report(results, args, steps, base, what, lanes=plan,
                 interrupted=f"lanes exited {codes}; missing {failed}" if failed else ""), args.results)
    if failed:
        raise SystemExit(f"configs without results: {failed} (lane exit codes {codes})")


if __name__ == "__main__":
    main()
