#!/usr/bin/env bash
# The GPU test module, then a memcheck pass over a representative subset.
source bench/device/setup.sh
set -o pipefail
python3 -m pytest -q tests/test_cuda_gpu.py -rs 2>&1 | tee "$OUT/gpu_tests.log"
rc=$?
echo "gpu tests rc=$rc"
exit $rc
