"""Seconds to compile each kernel specialization a Llama-3-8B-shaped decode can take on
CUDA (heads 32 / 8 x 128, float16 pools, page 16): the v2tc partial writing float32
partials or the output, its fused merge without and with each cluster size, the merge at
each split that fits. Each spec is compiled twice in one process: first (NVRTC runs when
CuPy's disk cache, ``CUPY_CACHE_DIR``, does not hold it: point that at an empty folder),
then after clearing this package's in-process cache (CuPy's own caches serve it).
Usage: CUPY_CACHE_DIR=$(mktemp -d) python3 bench/device/compile_times.py OUT.json"""

from __future__ import annotations

import json
import sys
import time

from paged_decode.backends import cuda_launch
from paged_decode.kernels.merge import SPLITS, split_fits
from paged_decode.specs import CLUSTER_SIZES, merge_spec, v2tc_spec


def main(path: str) -> None:
    specs = [v2tc_spec("float16", "float32", 128, 16), v2tc_spec("float16", "float16", 128, 16)]
    specs += [v2tc_spec("float16", "float32", 128, 16, merged_dtype="float16", cluster=k)
              for k in (0, *CLUSTER_SIZES)]
    specs += [merge_spec("float16", 128, split=s) for s in SPLITS
              if split_fits(128, s)]
    rows = []
    for spec in specs:
        t0 = time.perf_counter()
        cuda_launch.compiled(spec)
        first = time.perf_counter() - t0
        rows.append({"uri": spec.uri, "first_s": first})
    cuda_launch._compiled.cache_clear()
    for row, spec in zip(rows, specs):
        t0 = time.perf_counter()
        cuda_launch.compiled(spec)
        row["again_s"] = time.perf_counter() - t0
    for row in rows:
        print(f"{row['uri']:70s} {row['first_s']:7.3f} s  again {row['again_s']:.3f} s")
    print(f"total {sum(r['first_s'] for r in rows):.1f} s over {len(rows)} specializations")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
