"""v2 vs v1 at small sizes for several chunk floors (GPU time, cold L2).

Usage on the GPU machine: python3 bench/device/tune_small.py OUT.json
"""

import json
import os
import sys

from paged_decode.backends import get_backend
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.runner import bench_case

CELLS = [(1, 1024, 16), (1, 1024, 64), (4, 1024, 16), (8, 1024, 16), (1, 4096, 16),
         (4, 4096, 16), (1, 16384, 16), (1, 32768, 16), (8, 8192, 16), (32, 2048, 16)]
FLOORS = [1, 64, 128, 256, 512]
be = get_backend("cuda")
rows = []
for b, ctx, p in CELLS:
    os.environ.pop("PAGED_DECODE_MIN_CHUNK_TOKENS", None)
    v1 = bench_case(be, BenchCase(b, ctx, p), arms=("v1",), reps=20, warmup=3).arms["v1"]
    line = f"B{b:<3} ctx{ctx:<6} ps{p:<3} v1 {v1.gpu['median_us']:7.1f} |"
    for fl in FLOORS:
        os.environ["PAGED_DECODE_MIN_CHUNK_TOKENS"] = str(fl)
        r = bench_case(be, BenchCase(b, ctx, p), arms=("v2",), reps=20, warmup=3)
        a = r.arms["v2"]
        rows.append({"batch": b, "context": ctx, "page": p, "floor": fl,
                     "v2_us": a.gpu["median_us"], "v1_us": v1.gpu["median_us"],
                     "chunks": r.num_chunks, "verified": a.verified and v1.verified})
        line += f" f{fl}: {a.gpu['median_us']:6.1f} ({r.num_chunks})"
    print(line, flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
