#!/usr/bin/env bash
# The GPU test module, then the cascade and sparse suites (issue 6), all logs to $OUT.
source bench/device/setup.sh
set -o pipefail
python3 -m pytest -q tests/test_cuda_gpu.py -rs > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$OUT/gpu_tests.log"
for s in cascade sparse; do
  paged-decode bench --backend cuda --suite $s --reps 20 --warmup 3 --json "$OUT/bench_$s.json" \
    2>"$OUT/bench_$s.err" | tee "$OUT/bench_$s.txt" | tail -20
done
