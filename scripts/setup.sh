#!/usr/bin/env bash
# Creates .venv (once) with the CPU build of torch first, then miles and its test extras.
# Sourced by scripts/example.sh and scripts/test.sh so each is self-sufficient on a fresh machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.miles-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q "torch==${MILES_TORCH_VERSION:-2.13.0}" \
        || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    .venv/bin/python -m pip install -q -e ".[test]"
    touch "$stamp"
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export RAY_USAGE_STATS_ENABLED=0
