"""The one metrics recorder. Metrics have path names (``rollout/tokens_per_s``,
``buffer/staleness_max``, ``train/tis_clip_frac``, ``spec/accept_len``).

Every component returns plain ``dict[str, float]``; only the driver owns a recorder and
writes one JSONL line per train step (plus TensorBoard when it is installed and asked for).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, IO


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/Inf; None marks "not finite" unambiguously
    if hasattr(value, "item"):
        return _clean(value.item())
    return value


class MetricsRecorder:
    """Appends one JSON object per ``log`` call to ``metrics.jsonl`` in the output dir.

    ``wall_time`` counts from the recorder's creation (start-up included: Ray, actors, model
    loads); ``train_time`` from ``start_train_clock()``, which the driver calls as the first
    step begins (or, where nobody calls it, the first row), so runs compare without their
    start-up."""

    def __init__(self, output_dir: str | Path | None, *, tensorboard: bool = False,
                 clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._train_start: float | None = None
        self.output_dir = Path(output_dir) if output_dir else None
        self._file: IO[str] | None = None
        self._tb: Any = None
        self._start = clock()
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:  # tensorboard is optional
                    self._tb = None
                else:
                    self._tb = SummaryWriter(str(self.output_dir / "tb"))
        # Only the newest row is kept in memory: a long run's history lives in the file.
        self.last: dict[str, Any] = {}

    def log(self, step: int, metrics: Mapping[str, Any], at: float | None = None) -> dict[str, Any]:
        """Append a row; its clocks read ``at`` (a time of this recorder's clock, when the row
        describes a moment before it is written) or now."""
        now = self._clock() if at is None else at
        if self._train_start is None:
            self._train_start = now
        row = {"step": step, "wall_time": round(now - self._start, 4),
               "train_time": round(now - self._train_start, 4)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self.last = row
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, step)
        return row

    def start_train_clock(self) -> None:
        """Start ``train_time`` now (once; later calls keep the first start)."""
        if self._train_start is None:
            self._train_start = self._clock()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class MetricsFileError(ValueError):
    """A metrics or eval JSONL line that is not JSON."""


def read_metrics(path: str | Path, *, partial_tail: bool = False) -> list[dict[str, Any]]:
    """Read a metrics.jsonl back (for plots, tests and resume checks). A line that is not JSON
    raises MetricsFileError naming it; with ``partial_tail`` an unfinished last line (a run still
    writing it, or killed while it did) is left out instead."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        lines = [(n, line) for n, line in enumerate(fh, 1) if line.strip()]
    for i, (n, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if partial_tail and i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise MetricsFileError(f"{path}:{n}: not JSON ({exc.msg})") from None
    return rows
