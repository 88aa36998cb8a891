#!/usr/bin/env bash
# The prefix kernel with page ids fetched one tile ahead: GPU tests, memcheck on the
# prefix tests, then the cascade suite.
source bench/device/setup.sh
set -o pipefail
L=$(mktemp -d)
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$L/gpu_tests.log"
PAGED_DECODE_PLAIN_MALLOC=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py -k "prefix or cascade" > "$L/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -2
timeout 200 paged-decode bench --backend cuda --suite cascade --reps 20 --warmup 3 \
  --json "$OUT/bench_cascade.json" --markdown "$OUT/bench_cascade.md" 2>"$L/bench.err" | tee "$L/bench_cascade.txt"
echo "bench rc=$?"
tar czf "$OUT/logs.tgz" -C "$L" .
