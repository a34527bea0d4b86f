"""benchmarks/kernel_registers.py: the decode attention's variants compiled offline for sm_90
(triton's bundled ptxas, no GPU). No form spills, and the 8-bit cache as the engine stores it
(V transposed) keeps the bf16 form's occupancy (a form that needs more registers runs fewer
programs an SM, slower even where its extra code never runs). Runs where triton is installed
(CI's kernel pass); skipped otherwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_the_decode_attention_forms_compile_without_spills_at_the_bf16_occupancy() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_registers.py"), "--no-record"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    row = r"^\| (_partial, .*?) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| [\d.]+ \|$"
    forms = {form: tuple(map(int, counts)) for form, *counts in re.findall(row, out.stdout, re.M)}
    assert len(forms) == 8, out.stdout  # eight forms, two of them the former 8-bit layouts (V position-major)
    assert sum("V position-major" in form for form in forms) == 2, out.stdout
    for form, (regs, spill, _, programs) in forms.items():
        assert regs > 0 and spill == 0 and programs > 0, form
    # the 8-bit cache as the engine stores it: no fewer programs an SM than the bf16 cache's form
    engine_fp8 = next(v for form, v in forms.items() if "V transposed, float16 dots" in form)
    bf16 = next(v for form, v in forms.items() if "group 2, bfloat16 cache, 64 rows" in form)
    assert engine_fp8[3] >= bf16[3], (engine_fp8, bf16)
    # where each form's loop spends its instructions: a row per form, opcode classes that add up
    # to no more than the loop itself
    mixes = re.findall(r"^\| (_partial, [^|]*?) \| (\d+) \| (\d+) \| ((?:[\w.]+ \d+(?:, )?)+) \|$", out.stdout,
                       re.M)
    assert len(mixes) == 8, out.stdout
    for form, loop, _, top in mixes:
        counts = [int(n) for n in re.findall(r" (\d+)", top)]
        assert 0 < sum(counts) <= int(loop) and counts == sorted(counts, reverse=True), (form, top)
