#!/usr/bin/env bash
# Issue 3's H200 validation in one go: the full check matrix in three dtypes, a memcheck
# pass over a representative subset of the GPU tests, and the adr benchmark sweep.
source bench/device/setup.sh
set -o pipefail
paged-decode info | tee "$OUT/info.txt"
for dt in float16 bfloat16 float32; do
  paged-decode check --backend cuda --full --dtype $dt --json "$OUT/check_$dt.json" \
    > "$OUT/check_$dt.log" 2>&1
  echo "check $dt rc=$?"; tail -3 "$OUT/check_$dt.log"
done
PAGED_DECODE_PLAIN_MALLOC=1 PAGED_DECODE_POISON=1 compute-sanitizer --tool memcheck \
  --error-exitcode 3 python3 -m pytest -q -x tests/test_cuda_gpu.py \
  -k "paths_match_oracle or empty or many_chunks" > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -3
