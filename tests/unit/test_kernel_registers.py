"""benchmarks/kernel_registers.py: the decode attention's variants compiled offline for sm_90
(triton's bundled ptxas, no GPU). The in-kernel merge must not cost ``_partial`` occupancy: its
first, inlined form took 144 registers a thread against 106, one program fewer an SM, and was
4-8% slower on the H200 even where no row merged. The 8-bit cache as the engine stores it (V
transposed) must keep the bf16 form's occupancy too. Runs where triton is installed (CI's
kernel pass); skipped otherwise."""

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
    # eight forms; the two former 8-bit layouts (V position-major) compile with the merge kernel only
    former = {form for form in forms if "V position-major" in form}
    assert len(forms) == 8 and len(former) == 2, out.stdout
    assert all(len(v) == (1 if form in former else 2) for form, v in forms.items()), out.stdout
    for form, v in forms.items():
        regs, spill, _, programs = v["kernel"]
        assert regs > 0 and spill == 0, form
        if form not in former:
            regs_in, spill_in, _, programs_in = v["in the kernel"]
            assert programs_in == programs and spill_in == 0, (form, v)
    # the 8-bit cache as the engine stores it: no fewer programs an SM than the bf16 cache's form
    engine_fp8 = next(v for form, v in forms.items() if "V transposed, float16 dots" in form)
    bf16 = next(v for form, v in forms.items() if "group 2, bfloat16 cache, 64 rows" in form)
    assert engine_fp8["kernel"][3] >= bf16["kernel"][3], (engine_fp8, bf16)
    # where each form's loop spends its instructions: a row per form, opcode classes that add up
    # to no more than the loop itself
    mixes = re.findall(r"^\| (_partial, [^|]*?) \| (\d+) \| (\d+) \| ((?:[\w.]+ \d+(?:, )?)+) \|$", out.stdout,
                       re.M)
    assert len(mixes) == 8, out.stdout
    for form, loop, _, top in mixes:
        counts = [int(n) for n in re.findall(r" (\d+)", top)]
        assert 0 < sum(counts) <= int(loop) and counts == sorted(counts, reverse=True), (form, top)
