"""metrics.jsonl: ``train_time`` starts at the first step, ``wall_time`` at the recorder."""

from __future__ import annotations

import json

from miles.metrics import MetricsRecorder


def test_train_time_starts_at_the_first_step(tmp_path) -> None:
    now = [100.0]
    rec = MetricsRecorder(tmp_path, clock=lambda: now[0])
    now[0] = 112.0  # start-up: Ray, actors, model loads
    rec.start_train_clock()
    now[0] = 115.0
    rec.log(1, {"x": 1.0})
    rec.start_train_clock()  # a later call keeps the first start
    now[0] = 118.5
    rec.log(2, {"x": 2.0})
    rec.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["wall_time"], r["train_time"]) for r in rows] == [(15.0, 3.0), (18.5, 6.5)]
    lone = MetricsRecorder(None, clock=lambda: now[0])  # nobody starts it: the first row is 0
    assert lone.log(1, {})["train_time"] == 0.0
