"""Sweep v2 pipeline depth and plan target on a few cells (GPU time, cold L2).

Usage on the GPU machine: python3 bench/device/tune_v2.py OUT.json
"""

import itertools
import json
import os
import sys
import time

from paged_decode.backends import get_backend
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.runner import bench_case

CELLS = [(1, 1024), (1, 16384), (4, 1024), (4, 4096), (8, 8192), (32, 2048), (64, 4096),
         (128, 1024)]
STAGES = [2, 3, 4, 6]
TARGETS = [264, 528, 1056]

be = get_backend("cuda")
t0 = time.time()
rows = []
for (b, ctx), st, tgt in itertools.product(CELLS, STAGES, TARGETS):
    os.environ["PAGED_DECODE_STAGES"] = str(st)
    os.environ["PAGED_DECODE_TARGET_CTAS"] = str(tgt)
    r = bench_case(be, BenchCase(b, ctx, 16), arms=("v2",), reps=20, warmup=3)
    a = r.arms["v2"]
    rows.append({"batch": b, "context": ctx, "stages": st, "target": tgt,
                 "gpu_us": a.gpu["median_us"], "gbps": a.gbps, "chunks": r.num_chunks,
                 "verified": a.verified})
    print(f"B{b:<4} ctx{ctx:<6} st{st} tgt{tgt:<5} {a.gpu['median_us']:9.1f} us "
          f"{a.gbps:7.0f} GB/s chunks {r.num_chunks:<5} {'ok' if a.verified else 'FAIL'}",
          f"t={time.time() - t0:.0f}s", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
best = {}
for r in rows:
    k = (r["batch"], r["context"])
    if k not in best or r["gpu_us"] < best[k]["gpu_us"]:
        best[k] = r
for k, r in best.items():
    print("best", k, r["stages"], r["target"], f"{r['gpu_us']:.1f}")
