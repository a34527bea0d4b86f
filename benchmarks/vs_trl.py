"""TRL's GRPOTrainer vs miles (sync, async η=2 + partial) on the countdown task, on the CPU.

    python benchmarks/vs_trl.py                       # 3 configs × 2 seeds, then the evaluation
    python benchmarks/vs_trl.py --steps 60 --seeds 0  # shorter
    python benchmarks/vs_trl.py --only trl sync       # a subset
    python benchmarks/vs_trl.py --eval-only           # re-score the runs already under --out

Every run starts from the countdown example's SFT warm-up (a 0.3 M-parameter Qwen3-style
checkpoint, made and cached by examples/countdown/sft.py) and trains on the same prompt file
with the same reward (examples/countdown/reward.py), sampling (T = 1, top-p 1, no top-k,
--max-new-tokens new tokens) and optimiser (AdamW β = (0.9, 0.999), eps 1e-8, no weight
decay, constant lr, grad-norm clip 1.0, no KL, token-mean loss over the batch — TRL's
``loss_type="dapo"``, miles' ``token-mean`` — group-std advantages with eps 1e-4 and
Bessel's correction, one optimiser step per batch of 16 prompts × 8 samples). The configs
run one after another, each in a process of its own (TRL: this script as a child; miles:
``python -m miles train``), never two at once.

Evaluation is offline, so it never touches a training clock: each run saves its weights
every --eval-every steps (TRL through a callback, miles with --save), the time spent saving
is taken off its clock, and afterwards ONE evaluator (examples/countdown/evaluate.py's
``evaluate``, the embedded engine, per-sample seeds: every checkpoint of every run is scored
on the same random numbers) scores every checkpoint on a fixed held-out set: --eval-prompts
prompts drawn with the task's Zipf weights from the held-out starts (task.held_out), with
--eval-samples samples each at T = 1 and --max-new-tokens tokens.

The training clock starts when the first step asks for data: miles' ``train_time`` in
metrics.jsonl, TRL's from ``on_train_begin``. Start-up (Ray, actor processes, model loads)
is reported apart. Reported per run: completions/s and generated tokens/s over the training
clock, seconds to the --threshold reward (linear between the evaluation points), the final
reward, and the host's other load while it ran (benchmarks/hostload.py: async keeps every
core busy and slows down by whatever else the host runs, sync absorbs it in its idle time,
so a ratio means little unless both had the host to themselves); per config the median over
seeds, and the ratios the issue asks for. A reward-vs-training-time plot goes to
benchmarks/vs_trl.png, the raw section to benchmarks/log/vs_trl.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = ROOT / "examples" / "countdown"
sys.path[:0] = [str(ROOT), str(COUNTDOWN)]
from benchmarks.hostload import HostLoad  # noqa: E402
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

CONFIGS = ("trl", "sync", "async")
MILES_MODE = {
    "sync": ["--mode", "sync", "--no-partial-rollout"],
    # The stale-mode default correction (MIS) is left on: it is what a user gets.
    "async": ["--mode", "async", "--max-staleness", "2", "--partial-rollout"],
}


def labels(miles_args: str) -> dict[str, str]:
    """Each config's name in the report and plot: the async one with the η and partial
    setting its runs used (the last of its own flags and --miles-args wins, as in argparse)."""
    flags = [*MILES_MODE["async"], *shlex.split(miles_args)]
    eta, partial = "", True
    for i, flag in enumerate(flags):
        if flag == "--max-staleness" and i + 1 < len(flags):
            eta = flags[i + 1]
        elif flag.startswith("--max-staleness="):
            eta = flag.split("=", 1)[1]
        elif flag in ("--partial-rollout", "--no-partial-rollout"):
            partial = flag == "--partial-rollout"
    return {"trl": "TRL GRPOTrainer", "sync": "miles sync",
            "async": f"miles async η={eta}" + (" + partial" if partial else "")}


# ---- inputs ------------------------------------------------------------------------------


def prepare(args: argparse.Namespace, sft_args: Sequence[str] = ()) -> dict[str, Path]:
    """The example's prompt data and SFT warm-up (cached; ``sft_args``: more sft.py flags, a
    larger model for a GPU), and the fixed evaluation set."""
    import task

    data = Path(args.data_dir)
    if not (data / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(COUNTDOWN / "task.py"), "--out-dir", str(data)], check=True)
    subprocess.run([sys.executable, str(COUNTDOWN / "sft.py"), "--data", str(data / "train.jsonl"),
                    "--out", args.sft, *sft_args], check=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng, weights = random.Random(task.EVAL_SEED), task.distance_weights()
    pool = [n for n in range(100, 1000) if task.held_out(n)]
    starts = rng.choices(pool, weights=[weights[n % 100] for n in pool], k=args.eval_prompts)
    eval_path = out / "eval.jsonl"
    eval_path.write_text("".join(json.dumps(task.row(n)) + "\n" for n in starts))
    return {"train": data / "train.jsonl", "eval": eval_path, "sft": Path(args.sft)}


# ---- TRL (a child process) ---------------------------------------------------------------


def trl_child(args: argparse.Namespace) -> None:
    """One TRL GRPOTrainer run; writes run_dir/clock.jsonl and run_dir/ckpt/step_N/."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward import reward as countdown_reward

    born = time.monotonic()
    run_dir = Path(args.run_dir)
    rows = [json.loads(line) for line in open(args.train_data) if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.sft, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.sft)
    tokenizer.padding_side = "left"
    counts = {"completions": 0, "tokens": 0, "reward_sum": 0.0}

    def reward(prompts: list[str], completions: list[str], label: list[str], completion_ids=None, **_: Any) -> list[float]:
        out = [countdown_reward(_Sample(c, lab)) for c, lab in zip(completions, label)]
        counts["completions"] += len(out)
        counts["tokens"] += sum(len(ids) for ids in completion_ids) if completion_ids is not None else 0
        counts["reward_sum"] += sum(out)
        return out

    class Clock(TrainerCallback):
        """The training clock (from the first step; checkpoint writes taken off) and the
        evaluation checkpoints."""

        def __init__(self) -> None:
            self.start = 0.0
            self.paused = 0.0
            self.fh = open(run_dir / "clock.jsonl", "w")

        def now(self) -> float:
            return time.monotonic() - self.start - self.paused

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.monotonic()
            self.fh.write(json.dumps({"startup_s": self.start - born}) + "\n")
            self.save(0, k["model"])

        def on_step_end(self, a: Any, state: Any, control: Any, **k: Any) -> None:
            step = state.global_step
            row = {"step": step, "train_time": self.now(), **counts}
            self.fh.write(json.dumps(row) + "\n")
            self.fh.flush()
            if step % args.eval_every == 0 or step == args.steps:
                self.save(step, k["model"])

        def save(self, step: int, m: Any) -> None:
            t0 = time.monotonic()
            d = run_dir / "ckpt" / f"step_{step:06d}"
            d.mkdir(parents=True, exist_ok=True)
            save_file({k: v.detach().contiguous() for k, v in m.state_dict().items()}, str(d / "model.safetensors"))
            self.paused += time.monotonic() - t0

    config = GRPOConfig(
        output_dir=str(run_dir / "trl"), use_cpu=True, bf16=False, seed=args.seed, data_seed=args.seed,
        per_device_train_batch_size=args.prompts * args.samples, gradient_accumulation_steps=1,
        num_generations=args.samples, max_completion_length=args.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
        loss_type="dapo", scale_rewards="group",
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.steps, logging_steps=10 ** 9, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
        gradient_checkpointing=False,  # TRL's default recomputes activations: no use at this size
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()


class _Sample:
    """What the countdown reward reads of a sample."""

    def __init__(self, response: str, label: str) -> None:
        self.response, self.label = response, label


def run_trl(args: argparse.Namespace, inputs: dict[str, Path], seed: int, run_dir: Path) -> None:
    cmd = [sys.executable, __file__, "--child-trl", "--run-dir", str(run_dir), "--seed", str(seed),
           "--train-data", str(inputs["train"]), "--sft", str(inputs["sft"]), "--steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--lr", str(args.lr), "--prompts", str(args.prompts),
           "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens),
           "--threads", str(args.threads)]
    _run(cmd, run_dir)


# ---- miles -------------------------------------------------------------------------------


def miles_command(args: argparse.Namespace, inputs: dict[str, Path], config: str, seed: int, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "miles", "train",
        "--hf-checkpoint", str(inputs["sft"]), "--prompt-data", str(inputs["train"]),
        "--custom-rm-path", f"{COUNTDOWN / 'reward.py'}:reward", "--output-dir", str(run_dir / "run"),
        "--num-rollout", str(args.steps), "--rollout-batch-size", str(args.prompts),
        "--n-samples-per-prompt", str(args.samples), "--rollout-max-response-len", str(args.max_new_tokens),
        "--rollout-temperature", "1.0", "--rollout-top-p", "1.0", "--rollout-top-k", "-1",
        "--advantage-estimator", "grpo", "--grpo-std-eps", "1e-4", "--grpo-std-level", "group",
        "--grpo-std-unbiased", "--loss-agg", "token-mean", "--kl-coef", "0",
        "--lr", str(args.lr), "--weight-decay", "0", "--clip-grad", "1.0",
        "--seed", str(seed), "--save", str(run_dir / "ckpt"), "--save-interval", str(args.eval_every),
        "--keep-checkpoints", "100000", "--no-progress", "--eval-interval", "0",
        *MILES_MODE[config], *shlex.split(args.miles_args),
    ]


def run_miles(args: argparse.Namespace, inputs: dict[str, Path], config: str, seed: int, run_dir: Path) -> None:
    _run(miles_command(args, inputs, config, seed, run_dir), run_dir)


def _run(cmd: list[str], run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    t0 = time.monotonic()
    load = HostLoad()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())
        load.start(proc.pid)
        proc.wait()
        load.stop()
    (run_dir / "process_s.txt").write_text(f"{time.monotonic() - t0:.2f}\n")
    (run_dir / "host.json").write_text(json.dumps(load.result()))
    if proc.returncode:
        tail = (run_dir / "log.txt").read_text()[-3000:]
        raise SystemExit(f"{cmd[:4]}... failed ({proc.returncode}); {run_dir}/log.txt ends:\n{tail}")


# ---- clocks ------------------------------------------------------------------------------


def clock(config: str, run_dir: Path, eval_every: int) -> dict[str, Any]:
    """Per-step training clock, completions and generated tokens; startup; excluded save time."""
    if config == "trl":
        lines = [json.loads(x) for x in open(run_dir / "clock.jsonl")]
        startup = lines[0]["startup_s"]
        steps = {r["step"]: r for r in lines[1:]}
        return {"startup_s": startup, "excluded_s": 0.0,  # the callback takes its saves off already
                "time": {s: r["train_time"] for s, r in steps.items()},
                "completions": {s: r["completions"] for s, r in steps.items()},
                "tokens": {s: r["tokens"] for s, r in steps.items()},
                "step_s_median": statistics.median(
                    steps[s]["train_time"] - steps[s - 1]["train_time"] for s in steps if s - 1 in steps)}
    rows = [json.loads(x) for x in open(run_dir / "run" / "metrics.jsonl")]
    summary = json.loads((run_dir / "run" / "summary.json").read_text())
    # A save at step s sits between row s and row s + 1: the gap between the two rows' clocks
    # beyond that step's own time and the usual bookkeeping between rows is the save.
    gaps = {r["step"]: r["train_time"] - p["train_time"] - r["perf/step_s"] for p, r in zip(rows, rows[1:])}
    usual = statistics.median([g for s, g in gaps.items() if (s - 1) % eval_every] or [0.0])
    excluded, cum, t, comp, tok = 0.0, 0.0, {}, {}, {}
    n = m = 0
    for r in rows:
        s = r["step"]
        if s in gaps and (s - 1) % eval_every == 0:
            extra = max(0.0, gaps[s] - usual)
            cum += extra
            excluded += extra
        n += int(r["perf/trained_samples"])
        m += int(r["perf/trained_tokens"])
        t[s], comp[s], tok[s] = r["train_time"] - cum, n, m
    startup = rows[0]["wall_time"] - rows[0]["train_time"]
    return {"startup_s": startup, "excluded_s": excluded, "time": t, "completions": comp, "tokens": tok,
            "step_s_median": statistics.median(r["perf/step_s"] for r in rows[1:] or rows),
            "startup": summary.get("startup", {}), "step_parts": step_parts(rows)}


def step_parts(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Where a miles step's time goes (medians over steps 2..): waiting for a batch, the
    trainer call (its own step inside), and the rest (version bump, publish, stats, log)."""
    rows = rows[1:] or rows
    med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
    return {"step_s": med(lambda r: r["perf/step_s"]), "wait_for_data_s": med(lambda r: r["perf/wait_for_data_s"]),
            "trainer_call_s": med(lambda r: r["perf/train_s"]), "trainer_step_s": med(lambda r: r["train/step_time_s"]),
            "publish_and_rest_s": med(lambda r: r["perf/step_s"] - r["perf/wait_for_data_s"] - r["perf/train_s"]),
            "weights_delivery_s": med(lambda r: r.get("weights/delivery_s_mean", 0.0))}


# ---- evaluation --------------------------------------------------------------------------


def checkpoints(config: str, run_dir: Path) -> dict[int, Path]:
    found = {int(p.name.removeprefix("step_")): p for p in sorted((run_dir / "ckpt").glob("step_*")) if p.is_dir()}
    return found


def score(args: argparse.Namespace, inputs: dict[str, Path], config: str, run_dir: Path) -> dict[int, float]:
    """Every checkpoint of one run through the one evaluator (cached in run_dir/eval.json)."""
    import torch
    from safetensors.torch import load_file

    from evaluate import evaluate, load_policy, read_rows
    from miles.models import load_pretrained, load_tokenizer

    torch.set_num_threads(args.threads)
    cache_path = run_dir / "eval.json"
    cache = {int(k): v for k, v in json.loads(cache_path.read_text()).items()} if cache_path.is_file() else {}
    rows = read_rows(inputs["eval"])
    tokenizer = load_tokenizer(inputs["sft"])
    for step, path in checkpoints(config, run_dir).items():
        if step in cache:
            continue
        if config == "trl":
            model = load_pretrained(inputs["sft"])
            model.load_state_dict(load_file(str(path / "model.safetensors")))
        else:
            model, _ = load_policy(path, inputs["sft"])
        t0 = time.monotonic()
        cache[step] = evaluate(model.eval(), tokenizer, rows, n=args.eval_samples, temperature=1.0,
                               max_new_tokens=args.max_new_tokens, seed=0)["reward_mean"]
        print(f"  eval {config} {run_dir.name} step {step}: {cache[step]:.4f} ({time.monotonic() - t0:.1f}s)", flush=True)
        cache_path.write_text(json.dumps(cache))
    return cache


def base_reward(args: argparse.Namespace, inputs: dict[str, Path]) -> float:
    from evaluate import evaluate, read_rows
    from miles.models import load_pretrained, load_tokenizer

    path = Path(args.out) / "eval_sft.json"
    if path.is_file():
        return json.loads(path.read_text())["reward_mean"]
    m = evaluate(load_pretrained(inputs["sft"]).eval(), load_tokenizer(inputs["sft"]), _rows(inputs),
                 n=args.eval_samples, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    path.write_text(json.dumps(m))
    return m["reward_mean"]


def _rows(inputs: dict[str, Path]) -> list[dict]:
    from evaluate import read_rows

    return read_rows(inputs["eval"])


def time_to(curve: list[tuple[float, float]], threshold: float) -> float | None:
    """The first training time at which the reward curve reaches ``threshold`` (linear
    between evaluation points); None if it never does."""
    for (t0, r0), (t1, r1) in zip(curve, curve[1:]):
        if r1 >= threshold:
            return t0 if r0 >= threshold else t0 + (t1 - t0) * (threshold - r0) / (r1 - r0)
    return None


# ---- report ------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, inputs: dict[str, Path], runs: list[tuple[str, int, Path]],
              base: float) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    threshold = args.threshold if args.threshold is not None else base + args.threshold_gain
    results = []
    for config, seed, run_dir in runs:
        c = clock(config, run_dir, args.eval_every)
        rewards = score(args, inputs, config, run_dir)
        rewards[0] = rewards.get(0, base)
        curve = sorted((0.0 if s == 0 else c["time"][s], r) for s, r in rewards.items() if s == 0 or s in c["time"])
        last = max(c["time"])
        t_end = c["time"][last]
        results.append({
            "config": config, "seed": seed, "steps": last, "train_s": t_end, "startup_s": c["startup_s"],
            "excluded_save_s": c["excluded_s"], "step_s_median": c["step_s_median"],
            "completions_per_s": c["completions"][last] / t_end, "tokens_per_s": c["tokens"][last] / t_end,
            "time_to_threshold_s": time_to(curve, threshold), "final_reward": rewards[max(rewards)],
            "curve": curve, "startup": c.get("startup", {}), "step_parts": c.get("step_parts", {}),
            "process_s": float((run_dir / "process_s.txt").read_text()),
            "host": json.loads((run_dir / "host.json").read_text()) if (run_dir / "host.json").is_file() else {},
        })
    per_config: dict[str, dict[str, Any]] = {}
    for config in CONFIGS:
        rs = [r for r in results if r["config"] == config]
        if not rs:
            continue
        tts = [r["time_to_threshold_s"] for r in rs]
        per_config[config] = {
            "completions_per_s": statistics.median(r["completions_per_s"] for r in rs),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "time_to_threshold_s": statistics.median(tts) if all(t is not None for t in tts) else None,
            "final_reward": statistics.median(r["final_reward"] for r in rs),
            "seeds": [r["seed"] for r in rs], "threshold": threshold,
        }
    return results, per_config


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "n/a"


def report(args: argparse.Namespace, results: list[dict[str, Any]], per: dict[str, dict[str, Any]], base: float) -> str:
    names = labels(args.miles_args)
    thr = next(iter(per.values()))["threshold"]
    lines = [f"fixed eval: {args.eval_prompts} held-out prompts × {args.eval_samples} samples, T=1, "
             f"{args.max_new_tokens} new tokens; SFT start {base:.4f}; threshold {thr:.4f}", "",
             "| run | seed | steps | train s | start-up s | step s (median) | completions/s | gen tok/s | "
             "s to threshold | final reward | save s excluded | other load (cores) | steal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tt = f"{r['time_to_threshold_s']:.1f}" if r["time_to_threshold_s"] is not None else "not reached"
        host = r.get("host", {})
        other = f"{host['other_cores']:.2f}" if host.get("other_cores") is not None else "n/a"
        steal = f"{100 * host['steal_frac']:.1f}%" if host.get("steal_frac") is not None else "n/a"
        lines.append(f"| {names[r['config']]} | {r['seed']} | {r['steps']} | {r['train_s']:.1f} | {r['startup_s']:.1f} | "
                     f"{r['step_s_median']:.3f} | {r['completions_per_s']:.1f} | {r['tokens_per_s']:.0f} | {tt} | "
                     f"{r['final_reward']:.4f} | {r['excluded_save_s']:.2f} | {other} | {steal} |")
    lines += ["", "| config | completions/s | gen tok/s | s to threshold | final reward | seeds |", "|---|---|---|---|---|---|"]
    for config, p in per.items():
        tt = f"{p['time_to_threshold_s']:.1f}" if p["time_to_threshold_s"] is not None else "not reached (all seeds)"
        lines.append(f"| {names[config]} | {p['completions_per_s']:.1f} | {p['tokens_per_s']:.0f} | {tt} | "
                     f"{p['final_reward']:.4f} | {p['seeds']} |")
    g = {c: per.get(c, {}) for c in CONFIGS}
    lines += ["", "ratios (medians over seeds):",
              f"- time to threshold, TRL / miles async: {ratio(g['trl'].get('time_to_threshold_s'), g['async'].get('time_to_threshold_s'))} (goal ≥ 2×)",
              f"- time to threshold, miles sync / miles async: {ratio(g['sync'].get('time_to_threshold_s'), g['async'].get('time_to_threshold_s'))} (goal ≥ 1.3×)",
              f"- completions/s, miles async / TRL: {ratio(g['async'].get('completions_per_s'), g['trl'].get('completions_per_s'))} (goal ≥ 3×)",
              f"- completions/s, miles sync / TRL: {ratio(g['sync'].get('completions_per_s'), g['trl'].get('completions_per_s'))}",
              f"- final reward, async − sync: {g['async'].get('final_reward', float('nan')) - g['sync'].get('final_reward', float('nan')):+.4f} (goal ≥ 0)"]
    # per seed: the spread the ratio of medians hides; at higher rewards too (start + 2, 3 × the
    # gain): a threshold crossed before the first checkpoint weighs async's pipeline fill (η
    # batches generated ahead while the first ones train) against a handful of steps, later
    # ones show the sustained rate
    lines += paired_ratios(results, [("threshold", thr)] + [
        (f"start + {k * args.threshold_gain:.2f}", base + k * args.threshold_gain) for k in (2, 3)])
    lines.append("")
    for r in results:
        lines.append(f"- {names[r['config']]} seed {r['seed']}: process {r['process_s']:.1f} s = start-up "
                     f"{r['startup_s']:.1f} + training {r['train_s']:.1f} + the rest (imports before the clock, shutdown)")
        if r["startup"]:
            lines.append("  - start-up: " + ", ".join(f"{k} {v:.2f}" for k, v in r["startup"].items()))
        if r["step_parts"]:
            lines.append("  - a step (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["step_parts"].items()))
    return "\n".join(lines)


def paired_ratios(results: list[dict[str, Any]], thresholds: list[tuple[str, float]]) -> list[str]:
    """For each (name, reward): the sync / async ratio of the time to that reward, per seed
    both configs ran, and its median."""
    curves = {(r["config"], r["seed"]): r["curve"] for r in results}
    seeds = sorted({s for c, s in curves if c == "async" and ("sync", s) in curves})
    out = []
    for name, reward in thresholds:
        t = {(c, s): time_to(curves[c, s], reward) for c in ("sync", "async") for s in seeds}
        paired = [t["sync", s] / t["async", s] for s in seeds if t["sync", s] and t["async", s]]
        if paired:
            out.append(f"- time to {name}, miles sync / miles async, per seed: "
                       f"{', '.join(f'{x:.2f}×' for x in paired)} (median {statistics.median(paired):.2f}×)")
    return out


def plot(results: list[dict[str, Any]], per: dict[str, dict[str, Any]], path: Path, names: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"trl": "tab:red", "sync": "tab:blue", "async": "tab:green"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    seen = set()
    for r in results:
        xs, ys = zip(*r["curve"])
        label = names[r["config"]] if r["config"] not in seen else None
        seen.add(r["config"])
        ax.plot(xs, ys, marker="o", ms=3, color=colors[r["config"]], alpha=0.8, label=label)
    ax.axhline(next(iter(per.values()))["threshold"], color="grey", ls="--", lw=1, label="threshold")
    ax.set_xlabel("training time, s (from the first step; start-up and evaluation excluded)")
    ax.set_ylabel("held-out reward (fixed eval set)")
    ax.set_title("countdown, 16 prompts × 8 samples, 2-core CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--eval-every", type=int, default=15, help="steps between saved checkpoints")
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--eval-samples", type=int, default=4)
    parser.add_argument("--threshold", type=float, default=None, help="reward threshold (default: SFT start + --threshold-gain)")
    parser.add_argument("--threshold-gain", type=float, default=0.04)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of TRL's process and of the evaluator")
    parser.add_argument("--miles-args", default="", help="extra `miles train` flags (one string)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "vs_trl"))
    parser.add_argument("--data-dir", default=str(ROOT / "runs" / "countdown" / "data"))
    parser.add_argument("--sft", default=str(ROOT / "runs" / "countdown" / "sft"))
    parser.add_argument("--eval-only", action="store_true", help="score and report the runs under --out")
    parser.add_argument("--no-log", action="store_true",
                        help="leave benchmarks/log/vs_trl.md and benchmarks/vs_trl.png alone (the plot goes under --out)")
    # the TRL child
    parser.add_argument("--child-trl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--train-data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_trl:
        trl_child(args)
        return
    inputs = prepare(args)
    out = Path(args.out)
    runs = [(c, s, out / f"{c}_seed{s}") for s in args.seeds for c in args.only]
    if not args.eval_only:
        for config, seed, run_dir in runs:
            print(f"[vs_trl] {labels(args.miles_args)[config]}, seed {seed} -> {run_dir}", flush=True)
            if run_dir.exists():
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            t0 = time.monotonic()
            (run_trl(args, inputs, seed, run_dir) if config == "trl" else run_miles(args, inputs, config, seed, run_dir))
            print(f"[vs_trl]   done in {time.monotonic() - t0:.0f}s", flush=True)
    print("[vs_trl] evaluating checkpoints", flush=True)
    base = base_reward(args, inputs)
    results, per = summarize(args, inputs, runs, base)
    text = report(args, results, per, base)
    print(text)
    png = out / "vs_trl.png" if args.no_log else ROOT / "benchmarks" / "vs_trl.png"  # a trial run keeps the repo's plot
    plot(results, per, png, labels(args.miles_args))
    (out / "results.json").write_text(json.dumps({"results": results, "per_config": per}, indent=1, default=str))
    if not args.no_log:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        cmd = "python benchmarks/vs_trl.py " + shlex.join(sys.argv[1:])
        header = (f"\n## {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · `{commit}` · "
                  f"{platform.machine()} {os.cpu_count()} CPUs (shared with other jobs; configs one at a time)\n\n"
                  f"`{cmd}`\n\n")
        log = ROOT / "benchmarks" / "log" / "vs_trl.md"
        if not log.exists():
            log.write_text("# benchmarks/vs_trl.py — raw sections\n")
        with open(log, "a") as fh:
            fh.write(header + text + "\n")
    print(f"[vs_trl] plot: {png}")


if __name__ == "__main__":
    main()
