#!/usr/bin/env bash
# After a kernel change: GPU tests (incl. prepared calls / CUDA graphs), the full check
# matrix in three dtypes (14 parallel shards each), memcheck over a representative subset,
# then the targets preset with v1, v2, contiguous SDPA and FlashInfer. At most 8 files in
# $OUT: per-dtype check JSONs are merged and every log goes into one tarball.
source bench/device/setup.sh
set -o pipefail
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
L=$(mktemp -d)
FI_SMOKE=0 timeout 120 bash -c 'source bench/device/flashinfer_setup.sh' > "$L/fi_setup.log" 2>&1
echo "fi setup rc=$?"
export FLASHINFER_WORKSPACE_BASE=/tmp/paged-decode-flashinfer/jit FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$L/gpu_tests.log"
N=14
for dt in float16 bfloat16 float32; do
  t0=$(date +%s)
  for k in $(seq 0 $((N - 1))); do
    timeout 200 paged-decode check --backend cuda --full --dtype $dt --shard $k/$N \
      --json "$L/check_${dt}_$k.json" > "$L/check_${dt}_$k.log" 2>&1 &
  done
  wait
  echo "check $dt: summaries: $(grep -h -E '^(PASS|FAIL):' $L/check_${dt}_*.log | sort | uniq -c | tr '\n' ' ')" \
       "wall $(( $(date +%s) - t0 )) s"
  python3 bench/device/merge_check_shards.py "$OUT/check_$dt.json" "$L"/check_${dt}_*.json
done
PAGED_DECODE_PLAIN_MALLOC=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py tests/test_cuda_graphs.py \
  -k "llama or g7 or ps1 or d256 or ps256 or empty or merge_states or capturable" > "$L/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -3
timeout ${BENCH_TIMEOUT:-240} paged-decode bench --backend cuda --preset targets \
  --arms v1,v2,sdpa,flashinfer,flashinfer-tc --reps 20 --warmup 3 \
  --json "$OUT/bench_targets.json" --markdown "$OUT/bench_targets.md" 2>"$L/bench_targets.err" \
  | tee "$L/bench_targets.txt"
echo "bench rc=$?"
tar czf "$OUT/logs.tgz" -C "$L" .
