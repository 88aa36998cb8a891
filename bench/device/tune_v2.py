"""Sweep the v2 partial's row loads and the plan's CTA target on key cells, GPU time under
CUDA-graph replay (cold L2) and per-call time of the prepared call.

Usage on the GPU machine: python3 bench/device/tune_v2.py OUT.json [cells]
"""

import itertools
import json
import os
import sys
import time

import numpy as np

from paged_decode import plan_decode
from paged_decode.backends import get_backend
from paged_decode.bench.arms import make_arm
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.runner import TOLERANCE, _problem, time_arm, verifier

CELLS = [(1, 1024), (1, 16384), (1, 32768), (4, 4096), (4, 16384), (8, 8192), (32, 2048),
         (64, 4096), (64, 32768), (128, 1024)]
LOADS = [int(x) for x in os.environ.get("TUNE_LOADS", "1").split(",")]
TARGETS = [int(x) for x in os.environ.get("TUNE_TARGETS", "264,528,1056").split(",")]

be = get_backend("cuda")
t0 = time.time()
rows = []
for b, ctx in CELLS:
    case = BenchCase(b, ctx, 16)
    q, k, v, table = _problem(be, case, 0)
    scale = 1 / np.sqrt(128)
    for ld, tgt in itertools.product(LOADS, TARGETS):
        os.environ["PAGED_DECODE_V2_ROW_LOADS"] = str(ld)
        plan = plan_decode(table, 32, 8, 128, device=be.device_info(), target_ctas=tgt)
        arm = make_arm("v2", be, q, k, v, table, plan, scale)
        r = time_arm(be, "v2", arm.call, verifier(be, arm, q, k, v, table),
                     case.io_bytes(), TOLERANCE["float16"], arm.expected, warmup=3, reps=20,
                     cold_l2=True, ran=arm.ran)
        rows.append({"batch": b, "context": ctx, "row_loads": ld, "target": tgt,
                     "gpu_us": r.gpu.get("median_us"), "call_us": r.call.get("median_us"),
                     "gpu_mode": r.gpu_mode, "gbps": r.gbps, "chunks": plan.num_chunks,
                     "verified": r.verified, "err": r.max_rel_error})
        print(f"B{b:<4} ctx{ctx:<6} ld{ld} tgt{tgt:<5} {rows[-1]['gpu_us']:9.1f} us "
              f"call {rows[-1]['call_us']:8.1f} {r.gbps:7.0f} GB/s chunks {plan.num_chunks:<5}"
              f" {'ok' if r.verified else 'FAIL'} {r.gpu_mode} t={time.time() - t0:.0f}s",
              flush=True)
    os.environ.pop("PAGED_DECODE_V2_ROW_LOADS", None)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
