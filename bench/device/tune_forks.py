"""Flat decode over shared pages at larger CTA targets (issue #17's L2 reuse): v2 and
v2tc on the forks suite's cells and on private-page controls of the same sizes, at plan
CTA targets 264 (the H200 default: 2 per SM) to 2112, v2tc also at 8 warps. GPU time under
CUDA-graph replay, cold L2, every output checked against the float64 oracle first.

Usage on the GPU machine: python3 bench/device/tune_forks.py OUT.json
"""

import json
import os
import sys
import time

import numpy as np

from paged_decode import plan_decode
from paged_decode.backends import get_backend
from paged_decode.bench.arms import make_arm
from paged_decode.bench.runner import TOLERANCE, time_arm, verifier
from paged_decode.bench.suites import CascadeCase, cascade_problem
from paged_decode.dtypes import numpy_dtype
from paged_decode.problems import make_table
from paged_decode.specs import v2tc_ctas_per_chunk

be = get_backend("cuda")
HQ, HKV, D = 32, 8, 128
TARGETS = (264, 528, 1056, 2112)
t0 = time.time()
rows = []


def private(b, ctx):
    import cupy as cp
    table, num_pages = make_table([ctx] * b, 16, slack=1.0, rng=np.random.default_rng(0))
    g = cp.random.default_rng(0)
    dt = numpy_dtype("float16")
    q = g.standard_normal((b, HQ, D), dtype=cp.float32).astype(dt)
    k, v = (g.standard_normal((num_pages, 16, HKV, D), dtype=cp.float32).astype(dt)
            for _ in range(2))
    return q, k, v, table


def measure(tag, arm_name, q, k, v, table, target, env=None):
    os.environ.update(env or {})
    try:
        ctas = v2tc_ctas_per_chunk(HQ, HKV) if arm_name == "v2tc" else None
        plan = plan_decode(table, HQ, HKV, D, device=be.device_info(), target_ctas=target,
                           ctas_per_chunk=ctas)
        arm = make_arm(arm_name, be, q, k, v, table, plan, 1 / np.sqrt(D), keep_plan=True)
        assert arm.call.plan is plan
        nbytes = int(2 * table.total_visible * HKV * D * 2)
        r = time_arm(be, arm_name, arm.call, verifier(be, arm, q, k, v, table), nbytes,
                     TOLERANCE["float16"], arm.expected, warmup=3, reps=15, cold_l2=True,
                     ran=arm.ran)
    finally:
        for name in env or {}:
            os.environ.pop(name)
    row = dict(tag, arm=arm_name, target=target, env=env or {},
               gpu_us=r.gpu.get("median_us") or float("nan"), gbps=r.gbps,
               chunks=plan.num_chunks, pages_per_chunk=plan.pages_per_chunk,
               verified=r.verified, err=r.max_rel_error)
    rows.append(row)
    print(f"{tag['cell']:24s} {arm_name:5s} {json.dumps(env or {}):30s} target {target:5d} "
          f"{row['gpu_us']:8.1f} us {r.gbps:7.0f} GB/s-equiv chunks {plan.num_chunks:<5} "
          f"{'ok' if r.verified else 'FAIL'} t={time.time() - t0:.0f}s", flush=True)


cells = [("shared", b, s) for b, s in ((32, 8192), (8, 8192), (64, 1024), (128, 1024))]
cells += [("private", 32, 8448), ("private", 128, 1280)]
for kind, b, s in cells:
    if kind == "shared":
        q, k, v, table = cascade_problem(be, CascadeCase(b, s))
        tag = {"cell": f"B{b} shared{s}+256"}
    else:
        q, k, v, table = private(b, s)
        tag = {"cell": f"B{b} private{s}"}
    for arm_name in ("v2", "v2tc"):
        for target in TARGETS:
            measure(tag, arm_name, q, k, v, table, target)
    for target in (528, 1056):
        measure(tag, "v2tc", q, k, v, table, target, {"PAGED_DECODE_TC_WARPS": "8"})
    del q, k, v
json.dump(rows, open(sys.argv[1], "w"), indent=1)
