"""What a simulated configuration reports, and how ``benchmarks/simulate.py`` lays a sweep out:
the ``Result`` of one run, the markdown table and verdicts it prints, and the section it
appends to ``benchmarks/log/simulate.md``. Kept apart from the simulation so that the event
loop reads on its own; nothing here runs a simulation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.simulate_model import SimConfig

BINDS = 0.01  # a row whose mask policy zeroed more than this share of tokens: the bound sets its staleness


@dataclass
class Result:
    cfg: SimConfig
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    trainer_util: float = 0.0
    worker_util: float = 0.0
    staleness_mean: float = 0.0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    staleness_max: int = 0
    masked_frac: float = 0.0
    bound_held: bool = True
    ledger_ok: bool = False
    duplicates: int = 0
    admitted_groups: int = 0
    trained_groups: int = 0
    buffer_s: dict[str, float] = field(default_factory=dict)  # wall seconds by call, measured window
    calls: int = 0  # buffer calls (round trips) in the measured window
    lapsed_waits: int = 0  # waiting leases that found nothing until their deadline
    buffer_cpu_s: dict[str, float] = field(default_factory=dict)  # the same, CPU seconds
    per_traj_us: float = 0.0
    overhead_frac: float = 0.0  # buffer + scheduler wall seconds / simulated seconds
    per_traj_cpu_us: float = 0.0
    overhead_cpu_frac: float = 0.0
    wall_s: float = 0.0
    model: dict[str, float] = field(default_factory=dict)
    little: float = 0.0  # mean staleness from Little's identity: E[untaken tokens at a bump] / K

    def quantile(self, q: float) -> int:
        total = sum(self.staleness_hist.values())
        run = 0
        for k in sorted(self.staleness_hist):
            run += self.staleness_hist[k]
            if run >= q * total:
                return k
        return 0


def table(results: list[Result]) -> list[str]:
    lines = ["| W | η | B×n | samples/s | tokens/s | vs W=1 per worker | trainer util | worker util | "
             "staleness mean (model, err) | p50/p90/max | masked | bound | ledger | "
             "buffer+sched µs/traj, wall (CPU) | buffer+sched % of step time, wall (CPU) | calls/step | little | sim wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in results:
        if r.cfg.workers == 1:
            base[r.cfg.eta] = r.samples_per_s
    for r in results:
        cfg, m = r.cfg, r.model
        b = base.get(cfg.eta)
        scale = f"{r.samples_per_s / (b * cfg.workers):.2f}" if b else "-"
        regime = {0.0: "sync", 1.0: "roll", 2.0: "train"}[m["regime"]]
        if cfg.eta == 0:
            stale = f"{r.staleness_mean:.3f} (0, sync)"
        else:
            err = (r.staleness_mean - m["S"]) / m["S"] * 100 if m["S"] else math.nan
            binds = " bound binds" if r.masked_frac > BINDS else ""
            stale = f"{r.staleness_mean:.3f} ({m['S']:.3f} {regime}, {err:+.1f}%{binds})"
        lines.append(
            f"| {cfg.workers} | {cfg.eta} | {cfg.batch}×{cfg.n} | {r.samples_per_s:.2f} | {r.tokens_per_s:,.0f} | "
            f"{scale} | {r.trainer_util:.0%} | {r.worker_util:.0%} | {stale} | "
            f"{r.quantile(0.5)}/{r.quantile(0.9)}/{r.staleness_max} | {r.masked_frac:.2%} | "
            f"{'held' if r.bound_held else 'BROKEN'} | {'exact' if r.ledger_ok and not r.duplicates else 'WRONG'} | "
            f"{r.per_traj_us:.1f} ({r.per_traj_cpu_us:.1f}) | {r.overhead_frac:.3%} ({r.overhead_cpu_frac:.3%}) | "
            f"{r.calls / cfg.measured_steps:,.0f} | {r.little:.3f} | {r.wall_s:.1f} |")
    return lines


def verdicts(results: list[Result]) -> list[str]:
    out = []
    big = [r for r in results if r.cfg.workers == max(x.cfg.workers for x in results)]
    if big:
        worst = max(r.overhead_frac for r in big)
        worst_cpu = max(r.overhead_cpu_frac for r in big)
        out.append(f"- buffer + scheduler wall cost at {big[0].cfg.workers} workers: at most {worst:.3%} of the "
                   f"simulated step time (goal < 1%: {'met' if worst < 0.01 else 'NOT met'}; CPU time "
                   f"{worst_cpu:.3%}); {max(r.per_traj_us for r in big):.1f} µs wall "
                   f"({max(r.per_traj_cpu_us for r in big):.1f} µs CPU) a trajectory at most")
    checked = [r for r in results if r.cfg.eta > 0 and r.masked_frac <= BINDS]
    if checked:
        errs = {(r.cfg.workers, r.cfg.eta): abs(r.staleness_mean - r.model["S"]) / r.model["S"] for r in checked}
        worst = max(errs, key=errs.get)
        out.append(f"- mean staleness vs the closed-form model, {len(checked)} async rows where the bound does not "
                   f"bind (≤ {BINDS:.0%} of tokens masked): worst error {errs[worst]:.1%} at W={worst[0]}, "
                   f"η={worst[1]} (goal ≤ 10%: {'met' if errs[worst] <= 0.10 else 'NOT met'})")
        inf = {(r.cfg.workers, r.cfg.eta): abs(r.staleness_mean - r.model["S_inf"]) / r.model["S_inf"]
               for r in checked}
        worst_inf = max(inf, key=inf.get)
        out.append(f"  - without the finite-batch term (the many-worker limit): worst {inf[worst_inf]:.1%} at "
                   f"W={worst_inf[0]}, η={worst_inf[1]}")
    for eta in sorted({r.cfg.eta for r in results}):
        rows = sorted((r for r in results if r.cfg.eta == eta), key=lambda r: r.cfg.workers)
        if len(rows) > 1 and rows[0].cfg.workers == 1:
            eff = [f"{r.cfg.workers}: {r.samples_per_s / (rows[0].samples_per_s * r.cfg.workers):.2f}" for r in rows]
            out.append(f"- η={eta}: throughput per worker relative to 1 worker — {', '.join(eff)}")
    bad = [r for r in results if not (r.ledger_ok and r.bound_held and not r.duplicates)]
    out.append(f"- ledger exact and bound held in every row: {'yes' if not bad else 'NO: ' + str(len(bad))}")
    return out


def append_section(path: Path, text: str) -> None:
    """Append a section to a benchmark log (as ``benchmarks.trainer.append_section``, which
    imports torch)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# {path.stem} — raw sections, newest last\n")
    with path.open("a", encoding="utf-8") as fh:
        fh.write(text)
