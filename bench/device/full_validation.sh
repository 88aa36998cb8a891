#!/usr/bin/env bash
# Issue 3's H200 validation in one go: the GPU test module, the full check matrix in three
# dtypes (split over parallel processes), and a memcheck pass over a representative subset.
source bench/device/setup.sh
set -o pipefail
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
paged-decode info > "$OUT/info.txt" 2>&1
python3 -m pytest -q tests/test_cuda_gpu.py -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -2 "$OUT/gpu_tests.log"
N=14
for dt in float16 bfloat16 float32; do
  t0=$(date +%s)
  for k in $(seq 0 $((N - 1))); do
    paged-decode check --backend cuda --full --dtype $dt --shard $k/$N \
      --json "$OUT/check_${dt}_$k.json" > "$OUT/check_${dt}_$k.log" 2>&1 &
  done
  wait
  echo "check $dt: $(cat $OUT/check_${dt}_*.log | grep -c ' PASS') pass lines," \
       "$(cat $OUT/check_${dt}_*.log | grep -c ' FAIL') fail lines;" \
       "summaries: $(grep -h -E '^(PASS|FAIL):' $OUT/check_${dt}_*.log | sort | uniq -c | tr '\n' ' ')" \
       "wall $(( $(date +%s) - t0 )) s"
  python3 bench/device/merge_check_shards.py "$OUT/check_$dt.json" "$OUT"/check_${dt}_*.json \
    && rm -f "$OUT"/check_${dt}_*.json && cat "$OUT"/check_${dt}_*.log > "$OUT/check_$dt.log" \
    && rm -f "$OUT"/check_${dt}_*.log
done
PAGED_DECODE_PLAIN_MALLOC=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py \
  -k "llama or g7 or ps1 or d256 or ps256 or empty or merge_states" > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
