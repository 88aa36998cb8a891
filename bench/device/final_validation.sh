#!/usr/bin/env bash
# The final kernel and host code on the H200: GPU tests, the full check matrix in three
# dtypes (5 shards each, all at once), memcheck over a representative subset, then the
# targets preset with every arm (GPU time, per-call, host-enqueue and plain-API times).
source bench/device/setup.sh
set -o pipefail
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
L=$(mktemp -d)
FI_SMOKE=0 timeout 120 bash -c 'source bench/device/flashinfer_setup.sh' > "$L/fi_setup.log" 2>&1
export FLASHINFER_WORKSPACE_BASE=/tmp/paged-decode-flashinfer/jit FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$L/gpu_tests.log"
t0=$(date +%s)
for dt in float16 bfloat16 float32; do
  for k in 0 1 2 3 4; do
    timeout 200 paged-decode check --backend cuda --full --dtype $dt --shard $k/5 \
      --json "$L/check_${dt}_$k.json" > "$L/check_${dt}_$k.log" 2>&1 &
  done
done
wait
echo "check wall $(( $(date +%s) - t0 )) s"
for dt in float16 bfloat16 float32; do
  python3 bench/device/merge_check_shards.py "$L/check_$dt.json" "$L"/check_${dt}_*.json
done
PAGED_DECODE_PLAIN_MALLOC=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py tests/test_cuda_graphs.py \
  -k "llama or g7 or g8 or g16 or ps1 or d256 or ps256 or empty or merge_states or capturable" \
  > "$L/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -3
timeout ${BENCH_TIMEOUT:-260} paged-decode bench --backend cuda --preset targets \
  --arms v1,v2,sdpa,flashinfer,flashinfer-tc --reps 15 --warmup 3 \
  --json "$OUT/bench_targets.json" --csv "$OUT/bench_targets.csv" 2>"$L/bench_targets.err" \
  | tee "$OUT/bench_targets.txt"
echo "bench rc=$?"
tar czf "$OUT/logs.tgz" -C "$L" .
