#!/usr/bin/env bash
# One parametrized runner for a device run: bench/device/run.sh STEP [STEP ...]
#
# Steps (each logs under a scratch folder that is packed into $OUT/logs.tgz at the end;
# bench tables and JSON go to $OUT directly):
#   fi          FlashInfer 0.3.1 laid out offline from .carry (carry it), no smoke test
#   gpu-tests   every test marked gpu (run fi first for the FlashInfer arm's test), -rs
#   check-full  `paged-decode check --full` in float16, bfloat16, float32 (5 shards each,
#               all at once), merged per dtype
#   memcheck    compute-sanitizer memcheck over a representative GPU subset
#   racecheck   compute-sanitizer racecheck over the prefix-kernel GPU tests
#   targets     bench --preset targets with v1, v2, sdpa, flashinfer, flashinfer-tc
#   cascade     bench --suite cascade
# Knobs: GPU_TEST_K (a -k expression for gpu-tests), BENCH_REPS (15), BENCH_TIMEOUT (260).
source bench/device/setup.sh
set -o pipefail
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
L=$(mktemp -d)
GPU_FILES="tests/test_cuda_gpu.py tests/test_cuda_graphs.py tests/test_nan_semantics.py tests/test_append_gpu.py"
FI_ENV="FLASHINFER_WORKSPACE_BASE=/tmp/paged-decode-flashinfer/jit FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0"
export $FI_ENV
REPS=${BENCH_REPS:-15}

step_fi() {
  FI_SMOKE=0 timeout 150 bash -c 'source bench/device/flashinfer_setup.sh' > "$L/fi_setup.log" 2>&1
  echo "fi setup rc=$?"; tail -2 "$L/fi_setup.log"
}
step_gpu_tests() {
  python3 -m pytest -q tests -m gpu -rs ${GPU_TEST_K:+-k "$GPU_TEST_K"} \
    > "$L/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/gpu_tests.log" | tail -8
}
step_check_full() {
  local t0 dt k
  t0=$(date +%s)
  for dt in float16 bfloat16 float32; do
    for k in 0 1 2 3 4; do
      timeout 240 paged-decode check --backend cuda --full --dtype $dt --shard $k/5 \
        --json "$L/check_${dt}_$k.json" > "$L/check_${dt}_$k.log" 2>&1 &
    done
  done
  wait
  echo "check wall $(( $(date +%s) - t0 )) s"
  for dt in float16 bfloat16 float32; do
    python3 bench/device/merge_check_shards.py "$L/check_$dt.json" "$L"/check_${dt}_*.json
  done
}
step_memcheck() {
  PAGED_DECODE_PLAIN_MALLOC=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 -m pytest -q $GPU_FILES -m gpu \
    -k "llama or g7 or g8 or g16 or ps1 or d256 or ps256 or empty or merge or capturable or poison or append" \
    > "$L/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -3
}
step_racecheck() {
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 3 \
    python3 -m pytest -q tests/test_cuda_gpu.py -m gpu -k "prefix_kernel_on_cuda_matches_oracle and 128-float16" \
    > "$L/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$L/racecheck.log" | tail -3
}
step_targets() {
  timeout ${BENCH_TIMEOUT:-260} paged-decode bench --backend cuda --preset targets \
    --arms v1,v2,sdpa,flashinfer,flashinfer-tc --reps $REPS --warmup 3 \
    --json "$OUT/bench_targets.json" 2>"$L/bench_targets.err" | tee "$OUT/bench_targets.txt" | tail -40
  echo "targets rc=$?"; tail -3 "$L/bench_targets.err"
}
step_cascade() {
  timeout ${BENCH_TIMEOUT:-260} paged-decode bench --backend cuda --suite cascade \
    --reps $REPS --warmup 3 --json "$OUT/bench_cascade.json" 2>"$L/bench_cascade.err" \
    | tee "$OUT/bench_cascade.txt" | tail -20
  echo "cascade rc=$?"; tail -3 "$L/bench_cascade.err"
}

for s in "$@"; do
  echo "== $s ($(date +%T))"
  "step_${s//-/_}"
done
tar czf "$OUT/logs.tgz" -C "$L" .
