"""Run the prepared cascade of one suite case a few times (for ncu / nsys): the level-1
v2 partial, the tensor-core prefix kernel and the gathering merge.

Usage: python3 bench/device/profile_cascade.py BATCH SHARED [REPS]
"""
import sys

import cupy as cp

import paged_decode as pd
from paged_decode.bench.suites import CascadeCase, cascade_problem

be = pd.get_backend("cuda")
b, shared = int(sys.argv[1]), int(sys.argv[2])
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
case = CascadeCase(b, shared)
q, k, v, table = cascade_problem(be, case)
cplan = pd.plan_cascade(table, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                        min_shared_pages=1)
print(f"B{b} shared{shared}: C0={cplan.plan0.num_chunks} (ppc {cplan.plan0.pages_per_chunk}),"
      f" C1={cplan.plan1.num_chunks}, row tiles {cplan.prefix_row_tiles}")
call = pd.prepare_decode(q, k, v, table, cascade=cplan)
for lc in call._launch.launches:
    print(" ", lc.spec.uri, "grid", lc.grid, "block", lc.block, "smem", lc.smem)
for _ in range(reps):
    call()
cp.cuda.Device().synchronize()
