"""Time to the first trained step, as a new user meets it: ``miles train`` in a process of its
own on a Qwen3-0.6B-shaped checkpoint (random weights), colocated on one GPU. Three runs one
after the other, each with its own torch compile caches (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR`` under runs/first_step/caches): the compile warm-up inline with cold
caches (the trainer compiles before its first step), in the background with cold caches (a
child process fills the caches while the first steps run eagerly; ``trainers.compile_cache``),
and in the background again with the second run's caches (a user's second run).

    python benchmarks/first_step.py --device cuda [--steps 20] [--runs inline background warm]

``--dev compile_warmup=...`` sets the trainer's and the engines' mode together: in the
background runs the engines also serve their first rollouts with eager step functions while a
child compiles theirs (``miles.engines.warmup``), and switch when idle.

Figures per run: seconds from the process's launch to the first line of ``metrics.jsonl`` (the
first trained step); the median step time (gaps between consecutive ``wall_time`` values, what
a user waits) of the eager steps (after the first, before the trainer's switch) and of the
compiled ones (after both switches, from the third); and ``summary.json``'s ``startup``: actors
built, trainer and worker init, the first batch and train call, the trainer's warm-up seconds
in-process and in the child, the step that first ran compiled, and the engines' switch (its
pause, the seconds served eagerly before it, the policy version it came at). Goal (issue #37):
≤ 30 s to the first step, the compiled steps no slower than the inline run's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


RUNS = {  # name → (compile_warmup, cache directory, whether the run starts with it empty)
    "inline": ("inline", "inline", True),
    "background": ("background", "background", True),
    "warm": ("background", "background", False),
}
LABELS = {"inline": "inline, cold caches", "background": "background, cold caches",
          "warm": "background, the previous run's caches"}


def run_once(args: argparse.Namespace, inputs: dict[str, str], name: str) -> dict[str, Any]:
    import shutil

    mode, cache_name, fresh = RUNS[name]
    out = ROOT / "runs" / "first_step" / name
    if out.exists():
        shutil.rmtree(out)
    cache = ROOT / "runs" / "first_step" / "caches" / cache_name
    if fresh and cache.exists():
        shutil.rmtree(cache)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    task = (["--input-key", "input", "--custom-rm-path", "benchmarks/async_vs_sync.py:length_reward"]
            if args.device == "cuda" else ["--custom-rm-path", "examples/countdown/reward.py:reward"])
    cmd = [sys.executable, "-m", "miles", "train", "--hf-checkpoint", inputs["ckpt"], "--prompt-data", inputs["data"],
           *task, "--device", args.device, "--num-rollout", str(args.steps), "--rollout-max-response-len", str(args.max_len),
           "--output-dir", str(out), "--dev", f"compile_warmup={mode}", *args.extra]
    if args.device == "cuda":
        cmd += ["--colocate", "--actor-num-gpus-per-node", "1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first = None
    metrics = out / "metrics.jsonl"
    log: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size > 0:
            first = time.monotonic() - t0
        time.sleep(0.05)
    reader.join(5)
    total = time.monotonic() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.log").write_text("".join(log))  # the run's own log lines (the engines' switch among them)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: miles train failed (rc {proc.returncode}):\n" + "".join(log[-40:]))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    startup = summary.get("startup", {})
    switched = [startup.get("compiled_from_step"), engine_switch_step(startup)]
    return {"name": name, "first_step_s": first, "total_s": total, "steps": len(rows), "startup": startup,
            **step_times(rows, *switched), "load": os.getloadavg()[0]}


def engine_switch_step(startup: dict[str, float]) -> float | None:
    """The first step trained on rollouts of the compiled engines: the one after the version
    they switched at (a sync run trains version v's rollouts at step v + 1)."""
    version = startup.get("engine_compiled_from_version")
    return None if version is None else version + 1


def step_times(rows: list[dict[str, Any]], compiled_from: float | None,
               engine_from: float | None = None) -> dict[str, float]:
    """Median step times (gaps between consecutive wall times): eager steps (the second up to
    the one before the trainer's switch) and compiled ones (after the trainer's and the
    engines' switch steps, from the third)."""
    nan = float("nan")
    gaps = {int(b["step"]): b["wall_time"] - a["wall_time"] for a, b in zip(rows, rows[1:])}
    switch = int(compiled_from) if compiled_from else None
    last = max(switch or 0, int(engine_from or 0))
    eager = [g for s, g in gaps.items() if switch is None or s < switch]
    compiled = [g for s, g in gaps.items() if switch is not None and s > last and s >= 3]
    return {"eager_step_s": statistics.median(eager) if eager else nan,
            "compiled_step_s": statistics.median(compiled) if compiled else nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20, help="enough for the cold background run to switch")
    ap.add_argument("--max-len", type=int, default=256, help="--rollout-max-response-len")
    ap.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more miles train flags (last)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "log" / "first_step.md"))
    args = ap.parse_args()
    from benchmarks.async_vs_sync import make_cpu_inputs, make_gpu_inputs

    work = ROOT / "runs" / "first_step"
    work.mkdir(parents=True, exist_ok=True)
    inputs = make_gpu_inputs(work, 2048) if args.device == "cuda" else make_cpu_inputs(True)
    runs = [run_once(args, inputs, name) for name in args.runs]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cols = ["first trained step s", "eager step s", "compiled step s", "compiled from step", "warm-up s in-process",
            "child s", "engine switch s", "engine eager s", "engine from v", "actors built s", "trainer init s",
            "worker init s", "first batch s", "first train s", "load"]
    lines = ["| run | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]

    def f(x: Any, digits: int = 1) -> str:
        return "–" if x is None or x != x else f"{x:.{digits}f}"

    for r in runs:
        s = r["startup"]
        lines.append(" | ".join([
            f"| {LABELS[r['name']]}", f(r["first_step_s"]), f(r["eager_step_s"], 2), f(r["compiled_step_s"], 2),
            f(s.get("compiled_from_step"), 0), f(s.get("compile_warmup_s")), f(s.get("compile_background_s")),
            f(s.get("engine_compile_switch_s")), f(s.get("engine_eager_serve_s")),
            f(s.get("engine_compiled_from_version"), 0), f(s.get("startup_s")), f(s.get("trainer_init_s")), f(s.get("worker_init_s_max")),
            f(s.get("first_batch_s")), f(s.get("first_train_s")), f(r["load"], 2)]) + " |")
    extra = f" {' '.join(args.extra)}" if args.extra else ""
    text = "\n".join([
        f"\n## first_step — {datetime.date.today().isoformat()} ({args.device})\n",
        f"Command: `python benchmarks/first_step.py --device {args.device} --steps {args.steps} --max-len {args.max_len} "
        f"--runs {' '.join(args.runs)}{' --extra' + extra if extra else ''}` (commit {commit})  ",
        f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}  ",
        "Workload: `miles train` in its own process, "
        f"{'Qwen3-0.6B shape (random weights), colocated on one GPU' if args.device == 'cuda' else 'the countdown smoke model'}"
        ", sync, defaults otherwise; time from the process's launch to the first line of metrics.jsonl. "
        "Each run's compile caches are its own (the last reuses the background run's).\n",
        *lines, "",
        "Goal: first trained step ≤ 30 s; compiled steps no slower than the inline run's. "
        + "; ".join(f"{r['name']}: {f(r['first_step_s'])} s" for r in runs) + ".\n",
        "startup (summary.json), per run:\n",
        *[f"- {r['name']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["startup"].items()) for r in runs], "",
    ])
    print(text)
    print(json.dumps(runs))
    with open(args.results, "a", encoding="utf-8") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
