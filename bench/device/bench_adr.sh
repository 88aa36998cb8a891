#!/usr/bin/env bash
# The adr sweep (context {1K,4K,16K,32K} x batch {1,4,8,32,64} x page {16,32,64},
# Llama-3-8B heads, float16) with every output format.
source bench/device/setup.sh
set -o pipefail
paged-decode bench --backend cuda --preset adr "$@" --json "$OUT/bench_adr.json" \
  --csv "$OUT/bench_adr.csv" --markdown "$OUT/bench_adr.md" 2>"$OUT/bench_adr.err" \
  | tee "$OUT/bench_adr.txt"
