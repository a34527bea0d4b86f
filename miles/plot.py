"""``miles plot OUTPUT_DIR``: reward, throughput and staleness curves from metrics.jsonl."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

PANELS = [
    ("reward", ["rollout/reward_mean", "eval/reward_mean"]),
    ("throughput", ["perf/trained_samples_per_s", "rollout/tokens_per_s"]),
    ("staleness", ["buffer/staleness_mean", "buffer/staleness_max"]),
    ("response length", ["rollout/response_len_mean"]),
]


def plot_run(output_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from miles.metrics import read_metrics

    output_dir = Path(output_dir)
    metrics_file = output_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{output_dir}: no metrics.jsonl (is this a miles output dir?)")
    rows = read_metrics(metrics_file, partial_tail=True)  # the run may still be writing
    evals = read_metrics(output_dir / "eval.jsonl", partial_tail=True) if (output_dir / "eval.jsonl").is_file() else []
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for key in keys:
            source = evals if key.startswith("eval/") else rows
            pts = [(r["step"], r[key]) for r in source if isinstance(r.get(key), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="." if len(pts) < 50 else None, label=key)
        ax.set_title(title)
        ax.set_xlabel("train step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    target = Path(out) if out else output_dir / "curves.png"
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="miles plot")
    parser.add_argument("output_dir")
    parser.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/curves.png)")
    args = parser.parse_args(list(argv))
    from miles.metrics import MetricsFileError

    try:
        path = plot_run(args.output_dir, args.out)
    except (FileNotFoundError, MetricsFileError) as exc:
        from miles.cli import UserError

        raise UserError(str(exc)) from None
    print(path)
    return 0
