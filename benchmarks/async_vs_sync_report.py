"""The report of ``benchmarks/async_vs_sync.py``: its benchmark-log section (the headline
table of trained tokens/s against sync, the sweep's AReaL-style table, every config's row, the
machine and the notes on what each column means) and where it is appended."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

NO_KEEP = "no-keep-kv"  # the suffix of a sweep config run with --no-keep-kv-cache-on-update


def eta_name(eta: int | float) -> str:
    return "∞" if eta == float("inf") else str(eta)


def report(results: dict[str, dict[str, float]], args: argparse.Namespace, steps: int, base: dict[str, Any],
           what: str, interrupted: str = "", lanes: list[str] | None = None) -> str:
    """The benchmark-log section for the configs in ``results`` (all of them, or those that ran
    before ``interrupted`` says the run was stopped)."""
    gpu = args.device == "cuda"
    sync = results.get("sync") or results.get("sync s1")
    headline = headline_table(results)
    if args.sweep:
        headline = [*sweep_table(results, args.etas, args.no_keep_etas, getattr(args, "sft_start", None)), "", *headline]
    gpu_cols = sorted({k for r in results.values() for k in r if k.startswith("gpu")})
    lines = ["| config | trained samples/s | × sync | tokens/s | × sync | raw trained/s | stock drawn | final reward | "
             "wait for data | buffer busy | buffer CPU | buffer calls/traj | admission | max staleness | rollout tok/s | graph capture | engine compile | KV read useful | engine idle | engine prefill | prefill ms/fwd | rows/step | worker starved | loop lag |"
             + "".join(f" {c.removesuffix('_util').upper()} util |" for c in gpu_cols),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(gpu_cols)]
    for name, r in results.items():
        ratio = r["samples_per_s"] / sync["samples_per_s"] if sync else float("nan")
        tratio = r["tokens_per_s"] / sync["tokens_per_s"] if sync else float("nan")
        lines.append(f"| {name} | {r['samples_per_s']:.2f} | {ratio:.2f}× | {r['tokens_per_s']:.0f} | {tratio:.2f}× | "
                     f"{r['trained_samples_per_s']:.2f} | {100 * r['stock_drawn']:.0f}% | {r['reward']:.3f} | {100 * r['wait_share']:.0f}% | {100 * r['buffer_share']:.2f}% | "
                     f"{100 * r.get('buffer_cpu_share', float('nan')):.2f}% | {r.get('buffer_calls_per_traj', float('nan')):.2f} | {100 * r['admission_share']:.2f}% | {r['staleness_max']:.0f} | {r['rollout_tokens_per_s'] or float('nan'):.0f} | {100 * r['capture_share']:.0f}% | "
                     f"{100 * r.get('compile_share', float('nan')):.0f}% | {100 * r['kv_useful']:.0f}% | "
                     f"{100 * r.get('engine_idle', float('nan')):.0f}% | {100 * r.get('engine_prefill', float('nan')):.0f}% | "
                     f"{r.get('prefill_ms_per_forward', float('nan')):.1f} | {r.get('rows_per_step', float('nan')):.1f} | "
                     f"{100 * r.get('worker_starved', float('nan')):.0f}% | {1e3 * r.get('loop_lag', float('nan')):.1f} ms/s |"
                     + "".join(f" {r[c]:.0f}% |" if c in r else " – |" for c in gpu_cols))
    machine = (f"{platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    if gpu:
        import torch

        machine += f", {torch.cuda.device_count()}× {torch.cuda.get_device_name()}, torch {torch.__version__}"
    section = "\n".join([
        f"## async_vs_sync — {datetime.date.today().isoformat()} ({args.device})"
        + (f" (partial: {interrupted})" if interrupted else ""),
        "",
        f"Command: `python benchmarks/async_vs_sync.py {shlex.join(sys.argv[1:])}` ({steps} steps)  ",
        f"Machine: {machine}  ",
        f"Workload: {what}; {steps} steps × {base['rollout_batch_size']} groups × {base['n_samples_per_prompt']} samples per config, "
        + (f"in {len(lanes)} concurrent lanes of one run, one after another within a lane ({'; '.join(lanes)})."
           if lanes else "run one after another in one process."),
        "",
        *headline,
        "",
        *lines,
        "",
        "Headline: trained tokens/s against sync (median over seeds, and the range: each seed's "
        "run against the same seed's sync), samples/s beside it; 'prefill by cause' splits the "
        "engines' prefilled tokens into fresh prompts / resumed partial rollouts / rows recomputing "
        "their cache after an update that did not keep it; 'mixed KV' is the mean per step of "
        "train/mixed_version_kv_frac (loss tokens sampled on a cache holding an older version's "
        "entries), 'mismatch KL' the mean train/mismatch_kl_k1. Per-run rows below.",
        "",
        "Ratios are trained samples/s against sync over the same number of trained samples, counting only "
        "the samples the rollout side completed within the measured span: 'raw trained/s' is what the trainer "
        "consumed, and 'stock drawn' the share of that which came from trajectories finished before the span "
        "(an async run's head start during step 1), left out of the steady rate (tokens/s scaled alike); "
        "'buffer busy' is the replay buffer's own measured work as a share of wall time (the wall time of its calls), "
        "'buffer CPU' the CPU time of the same calls (without the time its process was descheduled or waited for the "
        "GIL), 'buffer calls/traj' "
        "the workers' calls into the buffer (put-only, and put-and-lease) per trajectory the buffer took back, "
        "'admission' the driver's admission loop (Ray round trips included); 'rollout tok/s' counts every "
        "token the engines generated (recycled and not yet trained ones too; the workers report every "
        "--health-check-interval-s, nan when the run was shorter); 'graph capture' the share of the span the "
        "engines spent capturing CUDA graphs for new batch × context shapes; 'KV read useful' the share of "
        "the KV cache positions decode steps read that a row attends to (a step reads every row up to the "
        "batch's longest context); 'engine idle' the share of the span the engines' stepping threads had "
        "nothing to decode (the worker left them unfed), 'engine prefill' the share of their busy time spent "
        "prefilling (fresh prompts and the re-prefills of resumed partials), 'prefill ms/fwd' the mean prefill forward's time, and 'rows/step' the mean rows a decode step carried "
        "(both from the workers' last reports); 'worker starved' the share of the span the workers had room for "
        "work and the buffer leased them none (summed over workers), 'loop lag' how late their event loops woke "
        "up, in ms per second. GPU util: nvidia-smi's "
        "utilization.gpu (share of time a kernel ran), averaged from the end of step 1 to the end of the "
        "last step; disaggregated, GPU0 is the trainer's and GPU1 the engine's"
        + (" (each lane's own GPUs)." if lanes else "."),
        "",
    ])
    return section


def by_config(results: dict[str, dict[str, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per-run results ('async η=2 s1', or 'async η=2' with one seed) as config → seed → figures."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, r in results.items():
        config, _, seed = name.rpartition(" s")
        if not (config and seed.isdigit()):
            config, seed = name, "1"
        out.setdefault(config, {})[seed] = r
    return out


def sweep_table(results: dict[str, dict[str, float]], etas: list[int | float], no_keep_etas: list[int | float],
                start: dict[str, float] | None = None) -> list[str]:
    """AReaL's staleness table from the sweep's results: per η, trained tokens/s relative to
    η = 0 (sync, the same seed's) without and with partial rollouts, samples/s beside it, the
    held-out reward of the final policy, mismatch KL and the mixed-version KV share (medians
    over seeds); then kept vs recomputed KV at ``no_keep_etas``. Configs not run show '–'."""
    runs = by_config(results)
    sync = runs.get("sync", {})
    med = statistics.median

    def fig(config: str, key: str, fmt: str, ratio: bool = False) -> str:
        seeds = runs.get(config, {})
        if ratio:
            vals = [r[key] / sync[s][key] for s, r in seeds.items() if s in sync and sync[s][key] > 0]
        else:
            vals = [r[key] for r in seeds.values() if key in r]
        return format(med(vals), fmt) + ("×" if ratio else "") if vals else "–"

    def name(eta: int | float, variant: str = "") -> str:
        return "sync" if eta == 0 else f"async η={eta_name(eta)}{variant}"

    lines = ["| η | tokens/s × η=0 | +partial | samples/s × η=0 | +partial | held-out reward | +partial | "
             "mismatch KL | +partial | mixed KV +partial |", "|---|---|---|---|---|---|---|---|---|---|"]
    for eta in etas:
        plain, part = name(eta), (name(eta, " +partial") if eta != 0 else "")
        cells = [(fig(c, "tokens_per_s", ".2f", True), fig(c, "samples_per_s", ".2f", True), fig(c, "eval_reward", ".3f"),
                  fig(c, "mismatch_kl", ".2e")) for c in (plain, part)]
        mixed = fig(part, "mixed_version_kv_frac", ".1%")
        lines.append(f"| {eta_name(eta)} | " + " | ".join(f"{a} | {b}" for a, b in zip(*cells)) + f" | {mixed} |")
    if start:
        lines += ["", f"SFT start on the same held-out set: {start['eval_reward']:.3f} "
                      f"(one evaluation's standard error ≈ {start['eval_reward_se']:.3f})."]
    kept = [eta for eta in no_keep_etas if name(eta, f" +partial {NO_KEEP}") in runs]
    if kept:
        lines += ["", "| config | KV across an update | tokens/s × η=0 | held-out reward | mismatch KL | mixed KV |",
                  "|---|---|---|---|---|---|"]
        for eta in kept:
            for label, config in (("kept", name(eta, " +partial")), ("recomputed", name(eta, f" +partial {NO_KEEP}"))):
                lines.append(f"| η={eta_name(eta)} +partial | {label} | {fig(config, 'tokens_per_s', '.2f', True)} | "
                             f"{fig(config, 'eval_reward', '.3f')} | {fig(config, 'mismatch_kl', '.2e')} | "
                             f"{fig(config, 'mixed_version_kv_frac', '.1%')} |")
    return lines


def headline_table(results: dict[str, dict[str, float]]) -> list[str]:
    """One row per config: the tokens/s ratio to sync first (median over seeds with the
    spread), samples/s beside it, the prefill causes and the mixed-version KV share."""
    runs = by_config(results)
    sync = runs.get("sync", {})
    lines = ["| config | seeds | tokens/s × sync (median, range) | samples/s × sync | tokens/s | final reward | held-out reward | "
             "engine prefill | prefill by cause (fresh/resumed/recompute) | wait for data | loop lag | mixed KV | mismatch KL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    med = statistics.median
    for config, seeds in runs.items():
        rs = list(seeds.values())
        tr = [r["tokens_per_s"] / sync[s]["tokens_per_s"] for s, r in seeds.items() if s in sync]
        sr = [r["samples_per_s"] / sync[s]["samples_per_s"] for s, r in seeds.items() if s in sync]
        rng = f" ({min(tr):.2f}–{max(tr):.2f})" if len(tr) > 1 else ""
        cause = "/".join(f"{100 * med(r.get(f'prefill_{c}', float('nan')) for r in rs):.0f}%"
                         for c in ("fresh", "resumed", "recompute"))
        lines.append(
            f"| {config} | {len(rs)} | {med(tr) if tr else float('nan'):.2f}×{rng} | {med(sr) if sr else float('nan'):.2f}× | "
            f"{med(r['tokens_per_s'] for r in rs):.0f} | {med(r['reward'] for r in rs):.3f} | "
            f"{med(r.get('eval_reward', float('nan')) for r in rs):.3f} | "
            f"{100 * med(r.get('engine_prefill', float('nan')) for r in rs):.0f}% | {cause} | "
            f"{100 * med(r['wait_share'] for r in rs):.0f}% | {1e3 * med(r.get('loop_lag', float('nan')) for r in rs):.1f} ms/s | "
            f"{100 * med(r.get('mixed_version_kv_frac', float('nan')) for r in rs):.1f}% | "
            f"{med(r.get('mismatch_kl', float('nan')) for r in rs):.2e} |")
    return lines


def write(section: str, path: str) -> None:
    from benchmarks.trainer import append_section

    print(section, flush=True)
    append_section(Path(path), "\n" + section)
