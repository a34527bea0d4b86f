"""benchmarks/kernel_registers.py: the decode attention's variants compiled offline for sm_90
(triton's bundled ptxas, no GPU). The in-kernel merge must not cost ``_partial`` occupancy: its
first, inlined form took 144 registers a thread against 106, one program fewer an SM, and was
4-8% slower on the H200 even where no row merged. Runs where triton is installed (CI's kernel
pass); skipped otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_merging_in_the_kernel_keeps_the_partial_programs_occupancy() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_registers.py"), "--no-record"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = r"^\| (_partial, .*?), merge (kernel|in the kernel) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| [\d.]+ \|$"
    rows = re.findall(row, out.stdout, re.M)
    forms: dict[str, dict[str, tuple[int, ...]]] = {}
    for form, merge, *counts in rows:
        forms.setdefault(form, {})[merge] = tuple(map(int, counts))
    assert len(forms) == 5 and all(len(v) == 2 for v in forms.values()), out.stdout
    for form, v in forms.items():
        regs, spill, _, programs = v["kernel"]
        regs_in, spill_in, _, programs_in = v["in the kernel"]
        assert regs > 0 and spill == 0, form
        assert programs_in == programs and spill_in == 0, (form, v)
    # where each form's loop spends its instructions: a row per form, opcode classes that add up
    # to no more than the loop itself
    mixes = re.findall(r"^\| (_partial, [^|]*?) \| (\d+) \| (\d+) \| ((?:[\w.]+ \d+(?:, )?)+) \|$", out.stdout,
                       re.M)
    assert len(mixes) == 5, out.stdout
    for form, loop, _, top in mixes:
        counts = [int(n) for n in re.findall(r" (\d+)", top)]
        assert 0 < sum(counts) <= int(loop) and counts == sorted(counts, reverse=True), (form, top)
