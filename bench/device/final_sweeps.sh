#!/usr/bin/env bash
# The adr sweep (gather / v1 / v2, pages 16/32/64, batch 1..128) that the H200 crossover
# table is written from, the variants preset (bf16, head_dim, GQA, page size vs contiguous
# SDPA) and the models preset with FlashInfer. At most 8 files in $OUT.
source bench/device/setup.sh
set -o pipefail
L=$(mktemp -d)
FI_SMOKE=0 timeout 120 bash -c 'source bench/device/flashinfer_setup.sh' > "$L/fi_setup.log" 2>&1
export FLASHINFER_WORKSPACE_BASE=/tmp/paged-decode-flashinfer/jit FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0
timeout 300 paged-decode bench --backend cuda --preset adr --arms gather,v1,v2 --reps 10 \
  --warmup 2 --json "$OUT/bench_adr.json" --write-crossover "$OUT/nvidia-h200.json" \
  2>"$L/adr.err" > "$L/adr.txt"
echo "adr rc=$?"; tail -4 "$L/adr.txt"
timeout 100 paged-decode bench --backend cuda --preset variants --arms v2,sdpa --reps 20 \
  --warmup 3 --json "$OUT/bench_variants.json" 2>"$L/variants.err" | tee "$L/variants.txt"
echo "variants rc=$?"
timeout 150 paged-decode bench --backend cuda --preset models \
  --arms v2,sdpa,flashinfer,flashinfer-tc --reps 10 --warmup 2 \
  --json "$OUT/bench_models.json" 2>"$L/models.err" > "$L/models.txt"
echo "models rc=$?"; tail -3 "$L/models.txt"
tar czf "$OUT/logs.tgz" -C "$L" .
