#!/usr/bin/env bash
# After changing the merge and prefix kernels: every GPU test, the full check matrix in
# three dtypes (14 shards each), memcheck over merge/prefix/cascade tests, register use,
# the cascade suites and the targets preset (v2 against contiguous SDPA, same run).
source bench/device/setup.sh
set -o pipefail
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
L=$(mktemp -d)
python3 - <<'PY' 2>&1 | tee "$L/regs.txt"
from paged_decode.backends.cuda import compiled
from paged_decode.specs import merge_spec, prefix_spec
for spec in [prefix_spec(dt, d, 16) for dt in ("float16", "bfloat16") for d in (64, 96, 128, 256)] \
        + [merge_spec("float16", d, g) for d in (128, 256) for g in (False, True)]:
    a = compiled(spec).attributes
    print(f"{spec.uri}: regs {a['num_regs']} local {a['local_size_bytes']} B")
PY
python3 -m pytest -q tests/test_cuda_graphs.py tests/test_cuda_gpu.py -rs > "$L/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -1 "$L/gpu_tests.log"
N=14
for dt in float16 bfloat16 float32; do
  t0=$(date +%s)
  for k in $(seq 0 $((N - 1))); do
    timeout 200 paged-decode check --backend cuda --full --dtype $dt --shard $k/$N \
      --json "$L/check_${dt}_$k.json" > "$L/check_${dt}_$k.log" 2>&1 &
  done
  wait
  echo "check $dt: $(grep -h -E '^(PASS|FAIL):' $L/check_${dt}_*.log | sort | uniq -c | tr '\n' ' ')" \
       "wall $(( $(date +%s) - t0 )) s"
  python3 bench/device/merge_check_shards.py "$L/check_$dt.json" "$L"/check_${dt}_*.json
done
PAGED_DECODE_PLAIN_MALLOC=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 \
  python3 -m pytest -q tests/test_cuda_gpu.py tests/test_cuda_graphs.py \
  -k "prefix or cascade or merge_states or ps1 or d256 or empty or llama" > "$L/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -3
for s in cascade cascade-rule; do
  timeout 200 paged-decode bench --backend cuda --suite $s --reps 20 --warmup 3 \
    --json "$OUT/bench_$s.json" --markdown "$OUT/bench_$s.md" 2>"$L/bench_$s.err" | tee "$L/bench_$s.txt"
  echo "bench $s rc=$?"
done
timeout 200 paged-decode bench --backend cuda --preset targets --arms v2,sdpa --reps 20 --warmup 3 \
  --json "$OUT/bench_targets.json" 2>"$L/bench_targets.err" | tee "$L/bench_targets.txt"
echo "bench targets rc=$?"
tar czf "$OUT/logs.tgz" -C "$L" .
