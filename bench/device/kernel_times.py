"""One decode call of one arm at one cell, inside a profiler range, for
``ncu --profile-from-start off``: ncu then times each kernel of that call alone (with its
caches flushed), so a call's GPU time splits into its kernels (our partial and merge,
FlashInfer's), and what the graph replay adds on top is the launch gaps.

Usage: python3 bench/device/kernel_times.py ARM BATCH CONTEXT HQ HKV [HEAD_DIM]
(ARM: v2, v2tc, flashinfer, flashinfer-tc, or flashinfer-xqa after ``run.sh fi06``; float16
queries, page 16, the bench's plan and arms; ``KT_KV_DTYPE`` an fp8 pool dtype, planned
for it as ``decode`` plans; ``KT_SHARED=N``: the forks suite's pages instead, the first N
tokens of every request one prefix of pages all share and CONTEXT - N private, as
``bench --suite forks`` lays them out, so ncu sees how an arm reads shared pages)
"""

import os
import sys

import numpy as np

arm_name, b, ctx, hq, hkv = sys.argv[1], *map(int, sys.argv[2:6])
d = int(sys.argv[6]) if len(sys.argv) > 6 else 128

import cupy as cp  # noqa: E402

from paged_decode import plan_decode  # noqa: E402
from paged_decode.backends import get_backend  # noqa: E402
from paged_decode.bench.arms import make_arm  # noqa: E402
from paged_decode.bench.cases import BenchCase  # noqa: E402
from paged_decode.bench.runner import _problem, _variants  # noqa: E402

be = get_backend("cuda")
kv_dtype = os.environ.get("KT_KV_DTYPE", "")
case = BenchCase(b, ctx, 16, hq, hkv, d, kv_dtype=kv_dtype)
shared = int(os.environ.get("KT_SHARED", "0"))
if shared:
    from paged_decode.bench.suites import CascadeCase, cascade_problem
    if kv_dtype or not 0 < shared < ctx or shared % 16:
        sys.exit(f"kernel_times.py: KT_SHARED={shared} needs 16-bit pools and whole pages "
                 f"below CONTEXT={ctx}")
    q, k, v, table = cascade_problem(be, CascadeCase(b, shared, ctx - shared, 16, hq, hkv, d))
else:
    q, k, v, table = _problem(be, case, 0)
plan = plan_decode(table, hq, hkv, d, device=be.device_info(), path="v2",
                   kv_dtype=kv_dtype or None)
arm = make_arm(arm_name, be, q, k, v, table, plan, 1 / np.sqrt(d), _variants(be, case, 0, q))
for _ in range(3):
    arm.call()
cp.cuda.Device().synchronize()
cp.cuda.runtime.profilerStart()
arm.call()
cp.cuda.Device().synchronize()
cp.cuda.runtime.profilerStop()
print("ran", arm.ran)
