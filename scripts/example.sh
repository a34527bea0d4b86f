#!/usr/bin/env bash
# The README's first command: the countdown example end to end on the CPU, on a fresh machine.
# Sets up .venv (CPU torch + miles) if needed, then examples/countdown/run.sh: prompt data,
# SFT warm-up (cached), held-out eval, asynchronous RL, held-out eval, plot, report.
# Extra arguments go to run.sh (e.g. --smoke, or miles train flags).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
PYTHON=.venv/bin/python exec bash examples/countdown/run.sh "$@"
