#!/usr/bin/env bash
# The README's test command: sets up .venv if needed, then runs the unit and integration tiers.
# GPU tests are skipped without CUDA; benchmarks never run here.
#
# MILES_KERNEL_TESTS=1 (CI sets it) then runs the Triton kernels' tests once more in triton's CPU
# interpreter: triton 3.5.1 with numpy < 2.4 (the interpreter's loops break on numpy >= 2.4, and
# triton 3.9's fails the decode kernels' masked stores), installed apart from the venv, in
# .venv/interp, so every other test keeps the venv's numpy. Without triton those tests skip.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
.venv/bin/python -m pytest -q tests "$@"
if [ "${MILES_KERNEL_TESTS:-0}" = 1 ]; then
    interp=.venv/interp
    if [ ! -f "$interp/.installed" ]; then
        .venv/bin/python -m pip install -q --target "$interp" "triton==3.5.1" "numpy<2.4" && touch "$interp/.installed"
    fi
    echo "kernel tests in triton's CPU interpreter ($interp):"
    export PYTHONPATH="$PWD/$interp" TRITON_INTERPRET=1
    # they must run, not skip: a triton or numpy the interpreter cannot use is an error here
    .venv/bin/python -c "from miles.kernels import decode_attention as k; assert k.available('cpu'), \
        'triton interpreter unusable (triton missing or numpy >= 2.4)'"
    .venv/bin/python -m pytest -q "$@" \
        tests/unit/engines/test_triton_decode.py tests/unit/engines/test_fused_sampling.py \
        tests/unit/engines/test_gate_up.py tests/benchmarks/test_kernel_registers.py tests/unit/models/test_invariant_kernels.py \
        tests/unit/models/test_lowp_kernels.py
fi
