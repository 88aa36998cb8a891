"""Sweep chunks per request x staging-ring depth of the v2 partial on key cells (GPU time
under CUDA-graph replay, cold L2), to set the plan rule and the ring depth.

Usage on the GPU machine: python3 bench/device/tune_plan.py OUT.json
"""

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

CELLS = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (4, 1024), (4, 4096), (8, 8192),
         (32, 1024), (32, 2048), (64, 1024), (64, 4096), (128, 4096)]
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
STAGES = [int(x) for x in os.environ.get("TUNE_STAGES", "2,3,4").split(",")]

be = get_backend("cuda")
t0 = time.time()
rows = []
for b, ctx in CELLS:
    case = BenchCase(b, ctx, 16)
    q, k, v, table = _problem(be, case, 0)
    pages = int(table.pages_per_request.max())
    for st in STAGES:
        os.environ["PAGED_DECODE_STAGES"] = str(st)
        seen = set()
        for n in SPLITS:
            ppc = -(-pages // n)
            ctas = b * 8 * (-(-pages // ppc))
            if ppc in seen or ppc * 16 < 32 or ctas > 4 * 528:
                continue
            seen.add(ppc)
            plan = plan_decode(table, 32, 8, 128, device=be.device_info(), pages_per_chunk=ppc)
            arm = make_arm("v2", be, q, k, v, table, plan, 1 / np.sqrt(128))
            r = time_arm(be, "v2", arm.call, verifier(be, arm, q, k, v, table),
                         case.io_bytes(), TOLERANCE["float16"], arm.expected, warmup=3,
                         reps=15, cold_l2=True, ran=arm.ran)
            rows.append({"batch": b, "context": ctx, "stages": st, "ppc": ppc,
                         "chunks": plan.num_chunks, "ctas": plan.num_ctas,
                         "gpu_us": r.gpu.get("median_us"), "gpu_mode": r.gpu_mode,
                         "verified": r.verified})
            print(f"B{b} ctx{ctx} st{st} ppc{ppc} ctas{plan.num_ctas} "
                  f"{rows[-1]['gpu_us']:.1f}us {r.gpu_mode} t={time.time() - t0:.0f}",
                  flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
best = {}
for r in rows:
    key = (r["batch"], r["context"])
    if key not in best or r["gpu_us"] < best[key]["gpu_us"]:
        best[key] = r
for key, r in best.items():
    print("best", key, "stages", r["stages"], "ctas", r["ctas"], f"{r['gpu_us']:.1f}")
