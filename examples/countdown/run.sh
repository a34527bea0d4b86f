#!/usr/bin/env bash
# The countdown example end to end: prompt data -> SFT warm-up (cached) -> held-out eval ->
# asynchronous RL (miles train) -> held-out eval -> plot -> report.
#
#   bash examples/countdown/run.sh            # the full example (~4 min on 2 idle CPU cores)
#   bash examples/countdown/run.sh --smoke    # seconds of work: a tiny model, 2 RL steps (CI)
#   bash examples/countdown/run.sh --lr 1e-4  # anything else is passed to `miles train`
#
# Env: PYTHON (default: python), OUT (default: runs/countdown, or runs/countdown-smoke),
#      STEPS (RL steps, default 80; a checkpoint is saved at the last one for the final eval).
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"  # cd to the root, PY, PYTHONPATH, SMOKE
if [ "$SMOKE" = 1 ]; then
    OUT=${OUT:-runs/countdown-smoke}
    DATA_ARGS=(--num-train 64 --num-eval 4)
    SFT_ARGS=(--steps 20 --hidden-size 32 --num-layers 1 --log-every 10)
    EVAL_ARGS=(--n-samples 2 --max-new-tokens 24)
    STEPS=2
    RL_ARGS=(--rollout-batch-size 2 --n-samples-per-prompt 2 --rollout-max-response-len 24
             --eval-interval 1 --n-samples-per-eval-prompt 2)
else
    OUT=${OUT:-runs/countdown}
    DATA_ARGS=()
    SFT_ARGS=()
    EVAL_ARGS=(--n-samples 8)
    STEPS=${STEPS:-80}
    RL_ARGS=()
fi

timings=""
phase() { timings+="$1=$(( SECONDS - t0 )),"; }

t0=$SECONDS
"$PY" examples/countdown/task.py --out-dir "$OUT/data" "${DATA_ARGS[@]}"
phase data

t0=$SECONDS
"$PY" examples/countdown/sft.py --data "$OUT/data/train.jsonl" --out "$OUT/sft" "${SFT_ARGS[@]}"
phase sft

t0=$SECONDS
"$PY" examples/countdown/evaluate.py "$OUT/sft" --data "$OUT/data/eval.jsonl" "${EVAL_ARGS[@]}" \
    --json "$OUT/eval_before.json"
phase eval_before

t0=$SECONDS
rm -rf "$OUT/rl"
"$PY" -m miles train --config examples/countdown/config.yaml \
    --hf-checkpoint "$OUT/sft" --prompt-data "$OUT/data/train.jsonl" \
    --eval-prompt-data "$OUT/data/eval.jsonl" --output-dir "$OUT/rl" \
    --num-rollout "$STEPS" --save "$OUT/rl/checkpoints" --save-interval "$STEPS" --keep-checkpoints 1 \
    "${RL_ARGS[@]}" "$@"
phase rl

t0=$SECONDS
"$PY" examples/countdown/evaluate.py "$OUT/rl/checkpoints" --base "$OUT/sft" --data "$OUT/data/eval.jsonl" \
    "${EVAL_ARGS[@]}" --json "$OUT/eval_after.json"
phase eval_after

t0=$SECONDS
"$PY" -m miles plot "$OUT/rl"
phase plot

"$PY" examples/countdown/report.py "$OUT" --timings "$timings"
