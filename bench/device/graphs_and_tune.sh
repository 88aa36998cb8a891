#!/usr/bin/env bash
# GPU tests (incl. prepared calls and CUDA-graph capture), the v2 row-loads x CTA-target
# sweep under graph timing, and an ncu profile of the v2 partial at 64 x 4K.
source bench/device/setup.sh
set -o pipefail
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs 2>&1 | tail -40 \
  > "$OUT/gpu_tests.log"
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout 300 python3 bench/device/tune_v2.py "$OUT/tune_v2.json" 2>&1 | tee "$OUT/tune_v2.txt" | tail -80
if command -v ncu >/dev/null; then
  for ld in 1 2; do
    timeout 100 ncu -k regex:pd_decode_v2 -c 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats \
      python3 bench/device/profile_v2.py 64 4096 $ld >> "$OUT/ncu_v2.txt" 2>&1
  done
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issued|Eligible|Stall|No Eligible|One or More|Warp Cycles" "$OUT/ncu_v2.txt" | head -80
else
  echo "no ncu on this machine"
fi
