"""benchmarks/engine.py's report: a figure the hardware cannot reach is called invalid, not a goal met."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import engine as bench  # noqa: E402


def _report(roofline: float, capsys) -> str:
    args = argparse.Namespace(device="cuda", side=[], no_record=True, preset="0.5b", prompt_len=128, new_tokens=512,
                              quick=False)
    rows = [dict(system="embedded", batch=256, total_s=2.5, total_tps=5e4, decode_tps=8e4, step_s=2.9e-3,
                 roofline=roofline, vs_hf=29.0)]
    bench.report(args, rows, dict(params=596e6, dtype="bfloat16", copy_bw=4.1e12))
    return capsys.readouterr().out


def test_a_step_faster_than_copying_its_bytes_is_not_a_goal_met(capsys) -> None:
    out = _report(1.024, capsys)
    assert "NOT a valid measurement: 102% of the copy bandwidth" in out
    assert "met" not in out.replace("NOT a valid", "")


def test_a_plausible_step_gets_its_verdicts(capsys) -> None:
    out = _report(0.64, capsys)
    assert "valid measurement" not in out
    assert "64.0% of copy-bandwidth roofline (goal ≥ 50%: met)" in out and "29.00× HF decode" in out
