#!/usr/bin/env bash
# The GPU runs behind benchmarks/RESULTS.md's H200 rows (raw sections: benchmarks/log/), one part per argument:
#   bash benchmarks/gpu.sh tests engine trainer     (each part is one timed command; parts:
#   tests (both halves at once) tests-engine tests-trainer tests-one (TESTS, or the whole suite in one process) failing ontrue engine-matmul engine-attn engine-rollout profile engine engine-ab mlp attention long-tail trainer trainer-long-tail spec spec-overhead lowp first-step megatron weights memory memory-lora async async-x2 sweep bg-start bg-wait)
# A run longer than one call: `BG_PARTS=async-x2 ... gpu.sh bg-start` in one call, then at once
# `gpu.sh bg-wait [more parts]` in the next (the machine is given back ~30 s after a call).
# On a machine without ray/msgspec/megatron-core, a .whl folder of their Python 3.12 wheels
# (downloaded with pip where it works) is installed first. Env: TESTS (test paths), ATTN (engine-attn's --decode-attention values), TESTS_TIMEOUT (default 480: the trainer compiles on CUDA now), WEIGHTS_ARGS, WEIGHTS_TIMEOUT,
# TLT_ARGS (trainer-long-tail, e.g. --compile; --profile), SWEEP_ARGS / SWEEP_TIMEOUT (sweep: e.g. SWEEP_ARGS="--steps 12 --only sync async_eta2 ..."), TRAINER_ARGS (trainer, e.g. --profile), ASYNC_ARGS / ASYNC_TIMEOUT (e.g. ASYNC_ARGS="--steps 8 --only sync async_eta2"; "--lanes 2" with async-x2 on nvidia-h200-x4: all ten configs in one call), SPEC_STEPS, SPEC_ARGS
# (e.g. "--batches 1 4 16 64 --repeats 1": the full sweep and 8 steps overran 300 s on the H200),
# MEMORY_8B_ARGS / MEMORY_32B_ARGS / MEMORY_TIMEOUT (memory; e.g. MEMORY_32B_ARGS="--engine-weights keep"). Extra outputs go to $OUT (default: runs/gpu).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import ray, msgspec" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
failed=()
for part in "$@"; do
    echo "=== $part $(date +%T)"
    case "$part" in
        tests-engine|tests-trainer|tests-one)
                  case "$part" in  # the whole suite outgrew one 10-minute call: two halves
                      tests-engine)  files="tests/gpu/test_engine_gpu.py tests/gpu/test_model_gpu.py tests/gpu/test_spec_gpu.py tests/unit/engines/test_triton_decode.py tests/unit/engines/test_gate_up.py" ;;
                      tests-trainer) files="tests/gpu/test_trainer_gpu.py tests/gpu/test_runs_gpu.py tests/gpu/test_multi_gpu.py tests/gpu/test_megatron_gpu.py tests/gpu/test_weights_gpu.py tests/gpu/test_serve_gpu.py" ;;
                      *)             files="${TESTS:-tests/gpu tests/unit/engines/test_triton_decode.py}" ;;
                  esac
                  timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -v -rfE --tb=short --durations=12 $files -p no:cacheprovider > "$OUT/$part.txt" 2>&1
                  rc=$?; tail -40 "$OUT/$part.txt"; (exit $rc) ;;
        tests)    # both halves at once (406 s on 2×H200, 2026-11-30): the engine half on GPU 0 alone
                  # (its tests need one GPU), the trainer half (two-GPU tests too) on all
                  (CUDA_VISIBLE_DEVICES=0 OUT="$OUT" bash benchmarks/gpu.sh tests-engine > "$OUT/tests-engine.log" 2>&1) & engine=$!
                  OUT="$OUT" bash benchmarks/gpu.sh tests-trainer > "$OUT/tests-trainer.log" 2>&1; rc=$?
                  wait $engine || rc=1
                  grep -h -E '^(FAILED|ERROR)|passed|failed|skipped' "$OUT/tests-engine.txt" "$OUT/tests-trainer.txt"; (exit $rc) ;;
        failing)  timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider $FAILING > "$OUT/failing.txt" 2>&1
                  rc=$?; tail -5 "$OUT/failing.txt"; (exit $rc) ;;
        engine-matmul) timeout 200 python3 benchmarks/engine.py --device cuda --preset 0.5b --decode-attention matmul --no-hf ;;
        engine-attn) for a in ${ATTN:-sdpa triton}; do timeout 200 python3 benchmarks/engine.py --device cuda --preset 0.5b --decode-attention $a --no-hf; done ;;
        engine-rollout) timeout 300 python3 benchmarks/engine.py --device cuda --preset 0.5b --workload rollout --no-hf ;;
        profile)  timeout 200 python3 benchmarks/profile_decode.py --device cuda 2>&1 | tail -45 ;;
        engine)   timeout 300 python3 benchmarks/engine.py --device cuda --preset 0.5b ;;
        mlp)      timeout 280 python3 benchmarks/decode_mlp.py --batch 8 16 32 64 128 256 ;;
        attention) # the decode attention, each call on its own cache: the engine's cache (one chunk a
                  # row) and one over 1024 positions, where rows merge (the merge kernel)
                  timeout 150 python3 benchmarks/decode_attention.py --quick --rope --batch 64 256 --lengths uniform spread \
                      --caches bf16 fp8_e4m3 &&
                  timeout 150 python3 benchmarks/decode_attention.py --quick --rope --batch 64 256 --lengths uniform spread \
                      --caches bf16 --chunks 256 512 1024 --cache-len 2049 --context 1024 ;;
        engine-ab) # the engine's decode options side by side (ENGINE_SIDES: --side arguments, names without spaces)
                  timeout 400 python3 benchmarks/engine.py --device cuda --preset 0.5b --no-fp8-kv --no-torch-ops \
                      --no-rope-outside ${ENGINE_SIDES:---side "512-position chunks:decode_attention_chunk=512"} ;;
        long-tail) timeout 300 python3 benchmarks/long_tail_decode.py --device cuda --preset 0.5b ;;
        trainer)  timeout 300 python3 benchmarks/trainer.py --device cuda --preset 0.5b --compile ${TRAINER_ARGS:-} ;;
        trainer-long-tail) timeout 300 python3 benchmarks/trainer_long_tail.py --device cuda ${TLT_ARGS:-} ;;
        spec)     timeout 480 python3 benchmarks/speculative.py --device cuda --steps ${SPEC_STEPS:-16} --plot "$OUT/speculative_cuda.png" ${SPEC_ARGS:-} ;;
        ontrue)   # --true-on-policy on CUDA: the exact zero (dense + MoE) and the mode's decode tok/s vs the default's
                  timeout 230 python3 benchmarks/true_on_policy.py --device cuda; rc=$?
                  timeout 60 python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/gpu/test_true_on_policy_gpu.py \
                      > "$OUT/ontrue-tests.txt" 2>&1 || rc=1
                  tail -15 "$OUT/ontrue-tests.txt"; (exit $rc) ;;
        lowp)     # #40's decode GEMMs: per-shape tuning of the INT4 decode kernel and the FP8 paths (each launch checked
                  # against torch's dequantized product), the 8B decode step with the winners, then the kernels' GPU tests
                  # (caps for a 120 s slot with the .whl install and the log tar: a tune part cut short keeps the launches it chose, lowp.TUNED's defaults the rest)
                  timeout ${LOWP_TIMEOUT:-85} python3 benchmarks/low_precision.py --parts bytes tune decode kl \
                      --part-timeout ${LOWP_PART_TIMEOUT:-50} --iters ${LOWP_ITERS:-20} --json "$OUT/low_precision.json" ${LOWP_ARGS:-}; rc=$?
                  timeout ${LOWP_TESTS_TIMEOUT:-20} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider tests/unit/models/test_lowp_kernels.py \
                      tests/gpu/test_quant_gpu.py > "$OUT/lowp-tests.txt" 2>&1 || rc=1
                  tail -15 "$OUT/lowp-tests.txt"; (exit $rc) ;;
        spec-overhead) timeout 300 python3 benchmarks/spec_overhead.py --device cuda ;;
        first-step) timeout 400 python3 benchmarks/first_step.py --device cuda ${FIRST_STEP_ARGS:-} ;;
        megatron) timeout 300 python3 benchmarks/megatron_trainer.py --device cuda ;;
        memory)   # one process per shape (benchmarks/memory.py), then the table; raw section in benchmarks/log/memory.md
                  timeout ${MEMORY_TIMEOUT:-240} python3 benchmarks/memory.py --shape 8b --mode full --json "$OUT/memory-8b.json" ${MEMORY_8B_ARGS:-}; r8=$?
                  timeout ${MEMORY_TIMEOUT:-240} python3 benchmarks/memory.py --shape 32b --mode lora --json "$OUT/memory-32b.json" ${MEMORY_32B_ARGS:-}; r32=$?
                  python3 benchmarks/memory.py --summarize "$OUT/memory-8b.json" "$OUT/memory-32b.json"
                  [ $r8 = 0 ] && [ $r32 = 0 ] ;;
        memory-lora) # 32B LoRA colocated: the engine over the trainer's base (one copy), then the engine's own copy
                  # (the older path, LORA_BASELINE=0 skips it) on the same card; table + raw section in $OUT/memory-lora.md
                  timeout ${MEMORY_TIMEOUT:-200} python3 benchmarks/memory.py --shape 32b --mode lora --json "$OUT/memory-32b-shared.json" ${MEMORY_32B_ARGS:-}; rs=$?
                  ro=0; [ "${LORA_BASELINE:-1}" = 1 ] && { timeout ${MEMORY_TIMEOUT:-200} python3 benchmarks/memory.py --shape 32b --mode lora --engine-base own --json "$OUT/memory-32b-own.json" ${MEMORY_32B_ARGS:-}; ro=$?; }
                  python3 benchmarks/memory.py --summarize "$OUT/memory-32b-shared.json" "$OUT/memory-32b-own.json" --log "$OUT/memory-lora.md"
                  [ $rs = 0 ] && [ $ro = 0 ] ;;
        weights)  timeout ${WEIGHTS_TIMEOUT:-300} python3 benchmarks/weight_sync.py --device cuda ${WEIGHTS_ARGS:-} ;;
        async)    timeout ${ASYNC_TIMEOUT:-540} python3 benchmarks/async_vs_sync.py --device cuda ${ASYNC_ARGS:-} ;;
        async-x2) timeout ${ASYNC_TIMEOUT:-540} python3 benchmarks/async_vs_sync.py --device cuda --disaggregated ${ASYNC_ARGS:-} ;;
        sweep)    # #37's staleness sweep, colocated on one GPU: the countdown SFT warm start (trained here, cached),
                  # η = 0..16, ∞ ± partial rollouts, kept vs recomputed KV; the raw section in $OUT/sweep.md
                  timeout ${SWEEP_TIMEOUT:-540} python3 benchmarks/async_vs_sync.py --device cuda --workload countdown --sweep \
                      --results "$OUT/sweep.md" ${SWEEP_ARGS:-} ;;
        bg-start) # BG_PARTS in a process session of their own, from a copy of the tree: they outlive
                  # this call while the machine stays held (call again within its idle release, ~30 s);
                  # the 10-config sweep needs ~11.5 min on 2×H200 (11:22 run of 2026-11-30)
                  rm -rf /tmp/bg /tmp/bg-out && cp -r . /tmp/bg && mkdir -p /tmp/bg-out
                  (cd /tmp/bg && OUT=/tmp/bg-out ASYNC_TIMEOUT=${ASYNC_TIMEOUT:-1500} setsid nohup bash benchmarks/gpu.sh ${BG_PARTS:-async-x2} \
                      > /tmp/bg-out/bg.log 2>&1 < /dev/null &)
                  sleep ${BG_SLEEP:-570}; tail -c 3000 /tmp/bg-out/bg.log ;;
        bg-wait)  # wait (at most BG_WAIT s) for bg-start's parts, then bring their outputs into $OUT/bg
                  t0=$(date +%s)
                  while pgrep -f "gpu.sh ${BG_PARTS:-async-x2}" > /dev/null && [ $(( $(date +%s) - t0 )) -lt ${BG_WAIT:-400} ]; do sleep 3; done
                  mkdir -p "$OUT/bg"; cp /tmp/bg-out/* "$OUT/bg/" 2>/dev/null; tail -c 6000 /tmp/bg-out/bg.log
                  ! pgrep -f "gpu.sh ${BG_PARTS:-async-x2}" > /dev/null ;;
        *) echo "unknown part $part"; false ;;
    esac
    rc=$?  # the part's own status (a pipe's first failure: pipefail), before anything else runs
    echo "=== $part done $(date +%T) rc=$rc"
    [ "$rc" = 0 ] || failed+=("$part")
    if [ "$part" = bg-wait ] && [ "$rc" != 0 ]; then  # still running: later parts would share its GPUs
        echo "=== the bg parts are still running; the parts after bg-wait are skipped"; break
    fi
    tar czf "$OUT/log.tgz" benchmarks/log  # after every part: a later timeout keeps what ran
    case "$part" in async*|sweep) tar czf "$OUT/$part-metrics.tgz" runs/async_vs_sync/*/metrics.jsonl 2>/dev/null ;; esac
done
# one line to read at the end of a log (a pipe into tee hides this script's status)
if [ ${#failed[@]} -gt 0 ]; then echo "=== FAILED parts: ${failed[*]}"; exit 1; fi
echo "=== all parts passed"
