#!/usr/bin/env bash
# Cascade with the tensor-core level 0: its GPU tests (oracle, geometries, cascade vs flat),
# memcheck and racecheck on the prefix kernel, then the cascade and cascade-rule suites
# (flat v2, cascade, cascade with the v2 level 0, side by side). Logs in one tarball.
source bench/device/setup.sh
set -o pipefail
L=$(mktemp -d)
python3 - <<'PY' 2>&1 | tee "$L/prefix_regs.txt"
from paged_decode.backends.cuda import compiled
from paged_decode.specs import prefix_spec
for dt in ("float16", "bfloat16"):
    for d in (64, 128, 256):
        k = compiled(prefix_spec(dt, d, 16))
        try:
            a = k.attributes
            print(f"prefix {dt} hd{d}: regs {a['num_regs']} local {a['local_size_bytes']} B")
        except Exception as exc:
            print(f"prefix {dt} hd{d}: attributes unavailable ({exc})")
PY
python3 -m pytest -q tests/test_cuda_gpu.py -k "prefix or cascade" -rs -s > "$L/gpu_prefix.log" 2>&1
echo "prefix/cascade gpu tests rc=$?"; grep -E "^prefix|passed|failed" "$L/gpu_prefix.log" | tail -12
PAGED_DECODE_PLAIN_MALLOC=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py -k "prefix_kernel_on_cuda_geometries" > "$L/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -3
timeout 120 compute-sanitizer --tool racecheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py -k "prefix_kernel_on_cuda_matches_oracle and 128-float16" > "$L/racecheck.log" 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$L/racecheck.log" | tail -3
for s in ${SUITES:-cascade cascade-rule}; do
  timeout ${BENCH_TIMEOUT:-200} paged-decode bench --backend cuda --suite $s --reps 20 --warmup 3 \
    --json "$OUT/bench_$s.json" --markdown "$OUT/bench_$s.md" 2>"$L/bench_$s.err" | tee "$L/bench_$s.txt"
  echo "bench $s rc=$?"
done
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs > "$L/gpu_tests.log" 2>&1
echo "all gpu tests rc=$?"; tail -1 "$L/gpu_tests.log"
tar czf "$OUT/logs.tgz" -C "$L" .
