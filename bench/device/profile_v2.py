"""Run the prepared v2 (or v2tc) decode of one cell a few times (for ncu /
compute-sanitizer).

Usage: python3 bench/device/profile_v2.py BATCH CONTEXT [ROW_LOADS [ARM [HQ HKV [KV_DTYPE]]]]
(ARM: v2, the default, or v2tc; heads 32/8 by default; ROW_LOADS 0 leaves the default;
KV_DTYPE: float8_e4m3fn / float8_e5m2 for fp8 pools, float16 queries)
"""

import os
import sys

import numpy as np

b, ctx = int(sys.argv[1]), int(sys.argv[2])
if len(sys.argv) > 3 and sys.argv[3] != "0":
    os.environ["PAGED_DECODE_V2_ROW_LOADS"] = sys.argv[3]
arm_name = sys.argv[4] if len(sys.argv) > 4 else "v2"
hq, hkv = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (32, 8)
kv_dtype = sys.argv[7] if len(sys.argv) > 7 else ""

from paged_decode import plan_decode  # noqa: E402
from paged_decode.backends import get_backend  # noqa: E402
from paged_decode.bench.arms import make_arm  # noqa: E402
from paged_decode.bench.cases import BenchCase  # noqa: E402
from paged_decode.bench.runner import _problem, _variants  # noqa: E402

be = get_backend("cuda")
case = BenchCase(b, ctx, 16, hq, hkv, kv_dtype=kv_dtype)
q, k, v, table = _problem(be, case, 0)
# over fp8 pools the plan aims at the fp8 CTA target, as decode's own plans do
plan = plan_decode(table, hq, hkv, 128, device=be.device_info(), kv_dtype=kv_dtype or None,
                   path="v2")
arm = make_arm(arm_name, be, q, k, v, table, plan, 1 / np.sqrt(128), _variants(be, case, 0, q))
for _ in range(3):
    arm.call()
import cupy as cp  # noqa: E402

cp.cuda.Device().synchronize()
print("ran", arm.ran)
