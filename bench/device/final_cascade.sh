#!/usr/bin/env bash
# Final #6 run: every GPU test, memcheck on the prefix/cascade/merge tests, then the
# cascade, cascade-rule and sparse suites (JSON + markdown each).
source bench/device/setup.sh
set -o pipefail
L=$(mktemp -d)
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$L/gpu_tests.log"
PAGED_DECODE_PLAIN_MALLOC=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py tests/test_cuda_graphs.py \
  -k "prefix or cascade or merge_states" > "$L/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -2
for s in cascade cascade-rule sparse; do
  timeout 200 paged-decode bench --backend cuda --suite $s --reps 20 --warmup 3 \
    --json "$OUT/bench_$s.json" --markdown "$OUT/bench_$s.md" 2>"$L/bench_$s.err" | tee "$L/bench_$s.txt"
  echo "bench $s rc=$?"
done
tar czf "$OUT/logs.tgz" -C "$L" .
