# Sourced by the examples' run.sh scripts: what every example sets up before its steps.
# The repository root becomes the working directory and goes on PYTHONPATH (the examples'
# modules import from it), PY is the Python to run (PYTHON, default python), Ray's token
# auth is off (a local cluster), and SMOKE is 1 when the script's first argument is --smoke
# (taken off the arguments; the rest go to `miles train`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
