#!/usr/bin/env bash
# GPU tests, the CTA-target sweep of the v2 partial, FlashInfer set up offline, then the
# targets preset (page 16, ctx {1K..32K} x batch {1..128}) with v1, v2, contiguous SDPA
# and FlashInfer (CUDA cores and tensor cores).
source bench/device/setup.sh
set -o pipefail
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs 2>&1 | tail -40 \
  > "$OUT/gpu_tests.log"
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout 150 python3 bench/device/tune_v2.py "$OUT/tune_v2.json" > "$OUT/tune_v2.txt" 2>&1
echo "tune rc=$?"; grep -E "ld1" "$OUT/tune_v2.txt" | awk '{print $1,$2,$4,$5,$8,$12}' | column -t | head -40
FI_SMOKE=0 timeout 150 bash -c 'source bench/device/flashinfer_setup.sh' > "$OUT/fi_setup.log" 2>&1
echo "fi setup rc=$?"; tail -5 "$OUT/fi_setup.log"
export FLASHINFER_WORKSPACE_BASE=/tmp/paged-decode-flashinfer/jit FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0
timeout ${BENCH_TIMEOUT:-300} paged-decode bench --backend cuda --preset targets \
  --arms v1,v2,sdpa,flashinfer,flashinfer-tc --reps 20 --warmup 3 \
  --json "$OUT/bench_targets.json" 2>"$OUT/bench_targets.err" | tee "$OUT/bench_targets.txt"
echo "bench rc=$?"; tail -5 "$OUT/bench_targets.err"
