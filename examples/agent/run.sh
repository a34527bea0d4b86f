#!/usr/bin/env bash
# The bring-your-own-agent example end to end on the CPU: a tiny random checkpoint and
# prompts -> RL of the OpenAI-client agent in agent.py (miles train) -> reward report.
#
#   bash examples/agent/run.sh            # the full example (a few minutes on 2 CPU cores)
#   bash examples/agent/run.sh --smoke    # 2 RL steps (CI)
#   bash examples/agent/run.sh --lr 1e-3  # anything else is passed to `miles train`
#
# Env: PYTHON (default: python), OUT (default: runs/agent, or runs/agent-smoke), STEPS.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"  # cd to the root, PY, PYTHONPATH, SMOKE
if [ "$SMOKE" = 1 ]; then
    OUT=${OUT:-runs/agent-smoke}
    STEPS=2
    SIZE=(--rollout-batch-size 2 --n-samples-per-prompt 2)
else
    OUT=${OUT:-runs/agent}
    STEPS=${STEPS:-50}
    SIZE=()
fi

"$PY" examples/agent/agent.py prepare "$OUT"
rm -rf "$OUT/rl"
"$PY" -m miles train --config examples/agent/config.yaml \
    --hf-checkpoint "$OUT/ckpt" --prompt-data "$OUT/train.jsonl" --output-dir "$OUT/rl" \
    --num-rollout "$STEPS" ${SIZE[@]+"${SIZE[@]}"} "$@"
"$PY" examples/agent/agent.py report "$OUT/rl"
