#!/usr/bin/env bash
# The README's test command: sets up .venv if needed, then runs the unit and integration tiers.
# GPU tests are skipped without CUDA; benchmarks never run here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
