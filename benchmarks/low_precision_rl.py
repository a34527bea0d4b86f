"""Low precision in a real RL run: each quantization mode trains the countdown task, and its
held-out reward is set against bf16's (issue #40's "reward within noise of bf16").

    python benchmarks/low_precision_rl.py                        # 4 modes × 2 seeds, CPU
    python benchmarks/low_precision_rl.py --device cuda          # the same on a GPU
    python benchmarks/low_precision_rl.py --modes bf16 fp8 --seeds 0

The modes (``miles train`` flags; everything else is the same in every run):

- ``bf16``: no quantization (the baseline; on the CPU the engine and trainer run float32).
- ``rollout-fp8``: ``--rollout-quantization fp8``: the engines sample with FP8 weights and
  activations, the trainer stays in high precision; TIS corrects the gap.
- ``fp8``: ``--quantization fp8``: one FP8 quantizer (128 × 128 weight blocks, 1 × 128
  activation groups; partial edge blocks) in the engine and the trainer's forward.
- ``int4-qat``: ``--quantization int4-qat --int4-targets all-linear --int4-group-size G``
  (W4A16, straight-through gradients). The countdown model is dense, so the default target
  (MoE experts) would quantize nothing; G must divide every projection's input dimension
  (hidden 96, MLP 192: --int4-group-size 32 by default here).

Every run starts from the countdown example's SFT warm-up (a 0.3 M-parameter Qwen3-style
checkpoint, made and cached by examples/countdown/sft.py), trains ``--steps`` steps in
``--mode sync`` (no staleness: the only behaviour/trainer gap is the quantization) with the
same seed, prompts, sampling and optimiser, and ``--use-tis`` (token-level truncated IS,
clip 2) in every mode, so the modes differ in their quantization flags alone.

Afterwards ONE evaluator (examples/countdown/evaluate.py's ``evaluate``: the embedded engine
on the CPU, float32, per-sample seeds, so every checkpoint is scored on the same random
numbers) scores the SFT start and each run's final master weights on a fixed held-out set
(``--eval-prompts`` prompts drawn with the task's Zipf weights from the held-out starts,
``--eval-samples`` samples each, T = 1). For the modes in ``--served`` (int4-qat by default:
QAT's point is the quantized policy; FP8's gap is a tenth of INT4's and its CPU evaluation
slow) a second column scores the same weights as the mode serves them (the engine's
quantization applied to the evaluated model: quantize–dequantize on the CPU), the start too.

Reported per mode: held-out reward at start and end, the change against bf16 (paired by
seed: same data order and sampling seed) with bf16's seed spread, and from metrics.jsonl the
mean ``train/mismatch_kl_k1``/``k3`` (engine vs trainer log-probs, the trainer's proximal
log-probs being the pre-update weights) and the TIS ratio statistics. The raw section is
appended to benchmarks/log/low_precision.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = ROOT / "examples" / "countdown"
sys.path[:0] = [str(ROOT), str(COUNTDOWN)]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from benchmarks.vs_trl import prepare  # noqa: E402 - the same countdown inputs and held-out set as vs_trl

MODES = ("bf16", "rollout-fp8", "fp8", "int4-qat")
METRICS = ("train/mismatch_kl_k1", "train/mismatch_kl_k3", "train/tis_ratio_mean", "train/tis_ratio_max",
           "train/tis_clip_frac", "train/tis_ess")


def mode_flags(mode: str, group: int) -> list[str]:
    return {
        "bf16": [],
        "rollout-fp8": ["--rollout-quantization", "fp8"],
        "fp8": ["--quantization", "fp8"],
        "int4-qat": ["--quantization", "int4-qat", "--int4-targets", "all-linear", "--int4-group-size", str(group)],
    }[mode]


def served_spec(mode: str, group: int) -> Any:
    """The quantization the mode's engines sample with (None: none)."""
    from miles.models.quant import QuantConfig

    q = {"bf16": QuantConfig(), "rollout-fp8": QuantConfig(rollout_quantization="fp8"),
         "fp8": QuantConfig(quantization="fp8"),
         "int4-qat": QuantConfig(quantization="int4-qat", int4_targets="all-linear", int4_group_size=group)}[mode]
    return q.engine_spec()


# ---- inputs and runs ---------------------------------------------------------------------


def train_command(args: argparse.Namespace, inputs: dict[str, Path], mode: str, seed: int, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "miles", "train",
        "--hf-checkpoint", str(inputs["sft"]), "--prompt-data", str(inputs["train"]),
        "--custom-rm-path", f"{COUNTDOWN / 'reward.py'}:reward", "--output-dir", str(run_dir / "run"),
        "--num-rollout", str(args.steps), "--rollout-batch-size", str(args.prompts),
        "--n-samples-per-prompt", str(args.samples), "--rollout-max-response-len", str(args.max_new_tokens),
        "--rollout-temperature", "1.0", "--rollout-top-p", "1.0", "--rollout-top-k", "-1",
        "--advantage-estimator", "grpo", "--grpo-std-eps", "1e-4", "--grpo-std-level", "group",
        "--grpo-std-unbiased", "--loss-agg", "token-mean", "--kl-coef", "0",
        "--lr", str(args.lr), "--weight-decay", "0", "--clip-grad", "1.0", "--use-tis",
        "--seed", str(seed), "--save", str(run_dir / "ckpt"), "--save-interval", str(args.steps),
        "--keep-checkpoints", "1", "--no-progress", "--eval-interval", "0",
        "--mode", args.mode, "--no-partial-rollout", "--device", args.device,
        *mode_flags(mode, args.int4_group_size), *shlex.split(args.miles_args),
    ]


def run(cmd: list[str], run_dir: Path) -> float:
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    run_dir.mkdir(parents=True)
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    t0 = time.monotonic()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())
    if proc.returncode:
        tail = (run_dir / "log.txt").read_text()[-3000:]
        raise SystemExit(f"{run_dir.name} failed ({proc.returncode}); {run_dir}/log.txt ends:\n{tail}")
    return time.monotonic() - t0


# ---- evaluation and figures --------------------------------------------------------------


def evaluate_weights(args: argparse.Namespace, inputs: dict[str, Path], ckpt: Path | None, spec: Any,
                     cache: dict[str, float], key: str) -> float:
    """Held-out mean reward of the SFT start (``ckpt`` None) or a run's final checkpoint,
    optionally quantized as ``spec`` (cached under ``key``)."""
    if key in cache:
        return cache[key]
    import torch

    from evaluate import evaluate, load_policy, read_rows
    from miles.models import load_pretrained, load_tokenizer
    from miles.models.quant import apply_quantization

    torch.set_num_threads(args.threads)
    model = load_pretrained(inputs["sft"]) if ckpt is None else load_policy(ckpt, inputs["sft"])[0]
    apply_quantization(model, spec)
    t0 = time.monotonic()
    cache[key] = evaluate(model.eval(), load_tokenizer(inputs["sft"]), read_rows(inputs["eval"]), n=args.eval_samples,
                          temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)["reward_mean"]
    print(f"  eval {key}: {cache[key]:.4f} ({time.monotonic() - t0:.1f}s)", flush=True)
    (Path(args.out) / "eval.json").write_text(json.dumps(cache, indent=1))
    return cache[key]


def final_checkpoint(run_dir: Path) -> Path:
    found = sorted(p for p in (run_dir / "ckpt").glob("step_*") if p.is_dir())
    if not found:
        raise SystemExit(f"{run_dir}: no checkpoint saved")
    return found[-1]


def train_metrics(run_dir: Path) -> dict[str, float]:
    """Means over steps of the mismatch and TIS figures, the training reward of the first and
    last five steps, and the median step time."""
    rows = [json.loads(x) for x in open(run_dir / "run" / "metrics.jsonl") if x.strip()]
    rows = [r for r in rows if "train/mismatch_kl_k1" in r]
    out = {k: statistics.fmean(r[k] for r in rows if k in r) for k in METRICS if any(k in r for r in rows)}
    out["train/tis_ratio_max_max"] = max(r.get("train/tis_ratio_max", math.nan) for r in rows)
    rew = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    out["rollout_reward_first5"], out["rollout_reward_last5"] = statistics.fmean(rew[:5]), statistics.fmean(rew[-5:])
    out["steps"] = len(rows)
    out["step_s_median"] = statistics.median(r["perf/step_s"] for r in rows)
    return out


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.4f}"


def summarize(args: argparse.Namespace, results: list[dict[str, Any]], start: dict[str, float]) -> list[str]:
    n = args.eval_prompts * args.eval_samples
    p0 = start["bf16"]
    se = math.sqrt(p0 * (1 - p0) / n)  # one evaluation's standard error (binary reward, samples taken as independent)
    by = {(r["mode"], r["seed"]): r for r in results}
    base_end = [by[("bf16", s)]["end"] for s in args.seeds if ("bf16", s) in by]
    spread = max(base_end) - min(base_end) if len(base_end) > 1 else math.nan
    noise = max(spread if not math.isnan(spread) else 0.0, 2 * math.sqrt(2) * se)
    lines = [
        f"held-out set: {args.eval_prompts} prompts × {args.eval_samples} samples, T = 1, {args.max_new_tokens} new "
        f"tokens, one evaluator (CPU, float32, seed 0); one evaluation's standard error ≈ {se:.4f}",
        f"runs: {args.steps} steps × {args.prompts} prompts × {args.samples} samples, --mode {args.mode}, --use-tis, "
        f"lr {args.lr}, seeds {args.seeds}, --device {args.device}; int4 group {args.int4_group_size}, all-linear",
        "",
        "| mode | seed | start | end | end − start | end (served) | mismatch KL k1 | k3 | TIS ratio mean | "
        "ratio max | clip frac | ESS | train reward first5 → last5 | step s | process s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r["metrics"]
        lines.append(
            f"| {r['mode']} | {r['seed']} | {start['bf16']:.4f} | {r['end']:.4f} | {r['end'] - start['bf16']:+.4f} | "
            f"{_f(r['end_served'])} | {m['train/mismatch_kl_k1']:.2e} | {m['train/mismatch_kl_k3']:.2e} | "
            f"{m['train/tis_ratio_mean']:.5f} | {m['train/tis_ratio_max_max']:.3f} | {m['train/tis_clip_frac']:.2e} | "
            f"{m['train/tis_ess']:.4f} | {m['rollout_reward_first5']:.3f} → {m['rollout_reward_last5']:.3f} | "
            f"{m['step_s_median']:.2f} | {r['process_s']:.0f} |")
    lines += [
        "",
        f"bf16's end reward spread over seeds: {spread:.4f}; noise taken as max(that spread, 2·√2·SE = "
        f"{2 * math.sqrt(2) * se:.4f}) = {noise:.4f}",
        "",
        "| mode | start | start (served) | end, mean over seeds | Δ vs bf16 (paired by seed) | per-seed Δ | "
        "within noise | end (served), mean | mismatch KL k1, mean | TIS ratio mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in args.modes:
        rs = [by[(mode, s)] for s in args.seeds if (mode, s) in by]
        if not rs:
            continue
        deltas = [r["end"] - by[("bf16", r["seed"])]["end"] for r in rs if ("bf16", r["seed"]) in by]
        d = statistics.fmean(deltas) if deltas else math.nan
        verdict = "—" if mode == "bf16" else ("yes" if abs(d) <= noise else "NO")
        served = [r["end_served"] for r in rs if r["end_served"] is not None]
        lines.append(
            f"| {mode} | {start['bf16']:.4f} | {_f(start.get(mode) if mode != 'bf16' else None)} | "
            f"{statistics.fmean(r['end'] for r in rs):.4f} | {d:+.4f} | "
            f"{', '.join(f'{x:+.4f}' for x in deltas)} | {verdict} | "
            f"{_f(statistics.fmean(served) if served else None)} | "
            f"{statistics.fmean(r['metrics']['train/mismatch_kl_k1'] for r in rs):.2e} | "
            f"{statistics.fmean(r['metrics']['train/tis_ratio_mean'] for r in rs):.5f} |")
    lines += ["", "mismatch KL (k3, mean over steps and seeds) against bf16's: " + mismatch_order(results)]
    return lines


def mismatch_order(results: list[dict[str, Any]]) -> str:
    """Each mode's mean mismatch KL (k3: never negative) as a multiple of bf16's. Unified modes
    should sit near 1 (their engine and trainer share the forward), rollout-only FP8 far above."""
    k3: dict[str, list[float]] = {}
    for r in results:
        k3.setdefault(r["mode"], []).append(r["metrics"]["train/mismatch_kl_k3"])
    base = statistics.fmean(k3["bf16"])
    return ", ".join(f"{m} {statistics.fmean(v):.2e} ({statistics.fmean(v) / base:.3g}×)" if base > 0 else
                     f"{m} {statistics.fmean(v):.2e}" for m, v in k3.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--mode", default="sync", help="miles' --mode (sync isolates quantization from staleness)")
    ap.add_argument("--device", default="cpu", help="the runs' --device (the evaluator stays on the CPU)")
    ap.add_argument("--int4-group-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eval-prompts", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--served", nargs="*", choices=MODES, default=["int4-qat"],
                    help="modes also scored as they serve (their engine's quantization)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the evaluator")
    ap.add_argument("--miles-args", default="", help="extra `miles train` flags (one string)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "low_precision_rl"))
    ap.add_argument("--data-dir", default=str(ROOT / "runs" / "countdown" / "data"))
    ap.add_argument("--sft", default=str(ROOT / "runs" / "countdown" / "sft"))
    ap.add_argument("--eval-only", action="store_true", help="score and report the runs already under --out")
    ap.add_argument("--log", default=str(ROOT / "benchmarks" / "log" / "low_precision.md"))
    ap.add_argument("--no-log", action="store_true")
    args = ap.parse_args()
    if "bf16" not in args.modes:
        ap.error("--modes needs bf16 (the baseline the others are set against)")
    load0 = os.getloadavg()
    inputs = prepare(args)
    out = Path(args.out)
    runs = [(m, s, out / f"{m}_seed{s}") for s in args.seeds for m in args.modes]
    process_s: dict[str, float] = {}
    if not args.eval_only:
        (out / "eval.json").unlink(missing_ok=True)
        for mode, seed, run_dir in runs:
            print(f"[lowp-rl] {mode}, seed {seed} -> {run_dir}", flush=True)
            process_s[run_dir.name] = run(train_command(args, inputs, mode, seed, run_dir), run_dir)
            print(f"[lowp-rl]   done in {process_s[run_dir.name]:.0f}s", flush=True)
        (out / "process_s.json").write_text(json.dumps(process_s))
    process_s = json.loads((out / "process_s.json").read_text())
    cache_path = out / "eval.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    g = args.int4_group_size
    start = {"bf16": evaluate_weights(args, inputs, None, None, cache, "sft/float")}
    start.update({m: evaluate_weights(args, inputs, None, served_spec(m, g), cache, f"sft/{m}")
                  for m in args.modes if m in args.served and m != "bf16"})
    results = []
    for mode, seed, run_dir in runs:
        ckpt = final_checkpoint(run_dir)
        results.append({
            "mode": mode, "seed": seed, "process_s": process_s.get(run_dir.name, math.nan),
            "end": evaluate_weights(args, inputs, ckpt, None, cache, f"{run_dir.name}/float"),
            "end_served": (evaluate_weights(args, inputs, ckpt, served_spec(mode, g), cache, f"{run_dir.name}/served")
                           if mode in args.served and mode != "bf16" else None),
            "metrics": train_metrics(run_dir),
        })
    lines = summarize(args, results, start)
    (out / "results.json").write_text(json.dumps({"start": start, "results": results}, indent=1))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    load1 = os.getloadavg()
    setup = (f"Commit `{commit}`; {os.cpu_count()} CPUs; load average {load0[0]:.2f} at the start, {load1[0]:.2f} at "
             f"the end; runs one at a time")
    from benchmarks.trainer import record_section

    import torch

    machine = torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else "CPU"
    record_section("low_precision_rl", machine, setup, ["### rl", "", *lines], args.log, save=not args.no_log)


if __name__ == "__main__":
    main()
