#!/usr/bin/env bash
# A/B of the prefix kernel's tile (64 vs 32 tokens) and resident CTAs per SM, on the
# cascade suite (plus register use of each variant).
source bench/device/setup.sh
set -o pipefail
L=$(mktemp -d)
for kt in 64 32; do
PAGED_DECODE_PREFIX_TILE=$kt python3 - <<'PY' 2>&1 | tee -a "$L/regs.txt"
from paged_decode.backends.cuda import compiled
from paged_decode.specs import prefix_spec
for d in (64, 96, 128, 256):
    spec = prefix_spec("float16", d, 16)
    a = compiled(spec).attributes
    print(f"{spec.uri}: regs {a['num_regs']} local {a['local_size_bytes']} B smem {spec.dynamic_smem_bytes}")
PY
done
for v in "64 2" "32 3" "32 4"; do
  set -- $v
  PAGED_DECODE_PREFIX_TILE=$1 PAGED_DECODE_PREFIX_CTAS_PER_SM=$2 timeout 120 paged-decode bench --backend cuda \
    --suite cascade --reps 20 --warmup 3 --json "$OUT/ab_kt$1_c$2.json" 2>/dev/null > "$L/ab_kt$1_c$2.txt"
  echo "kt=$1 ctas/sm=$2 rc=$?"; grep -E "^cascade" "$L/ab_kt$1_c$2.txt" | awk '{print $2, $3, $6, $7}'
done
tar czf "$OUT/logs.tgz" -C "$L" .
