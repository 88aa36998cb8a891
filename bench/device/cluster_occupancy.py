"""How many CTAs of the tensor-core partial the GPU holds at once, with its fused merge
in thread-block clusters of K = 2-8 CTAs and without (CUDA, sm_90+).

S45-R3's timeline showed clustered launches running on 124 of an H100's 132 SMs: a
cluster's CTAs must share one GPC, and a GPC whose SMs do not divide into whole clusters
leaves some idle. This asks the driver, for each pool dtype and K, how many clusters fit
at once (``cuOccupancyMaxActiveClusters``) and how many CTAs an SM holds without clusters
(``cuOccupancyMaxActiveBlocksPerMultiprocessor``), so the CTA slots with and without
clusters can be compared with a plan's grid.

Usage on the GPU machine: python3 bench/device/cluster_occupancy.py OUT.json
"""

import ctypes
import json
import sys

import cupy as cp

from paged_decode.backends.cuda_launch import compiled, with_smem
from paged_decode.backends.cuda_pdl import _Config
from paged_decode.kernels.registry import kernel_def
from paged_decode.specs import CLUSTER_SIZES, v2tc_spec

lib = ctypes.CDLL("libcuda.so.1")
clusters_fn = lib.cuOccupancyMaxActiveClusters
clusters_fn.restype = ctypes.c_int
clusters_fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                        ctypes.POINTER(_Config)]
blocks_fn = lib.cuOccupancyMaxActiveBlocksPerMultiprocessor
blocks_fn.restype = ctypes.c_int
blocks_fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int,
                      ctypes.c_size_t]

props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
sms = int(props["multiProcessorCount"])
rows = []
for kv in ("float16", "bfloat16", "float8_e4m3fn"):
    for k in (0, *CLUSTER_SIZES):
        spec = v2tc_spec(kv, "float32", 128, 16, q_dtype="bfloat16" if kv == "bfloat16"
                         else "float16", merged_dtype="float32", cluster=k)
        kdef = kernel_def(spec.kernel)
        threads, smem = kdef.threads(spec), kdef.dynamic_smem(spec)
        fn = with_smem(compiled(spec), smem)
        handle = ctypes.c_void_p(fn.kernel.ptr)   # the CUfunction of the RawKernel
        per_sm = ctypes.c_int(0)
        err_b = blocks_fn(ctypes.byref(per_sm), handle, threads, smem)
        n = ctypes.c_int(0)
        err_c = 0
        if k:
            # the grid must be a whole number of clusters; its size does not bound the answer
            cfg = _Config(gridDimX=k * 64, gridDimY=8, gridDimZ=1, blockDimX=threads,
                          blockDimY=1, blockDimZ=1, sharedMemBytes=smem, hStream=None,
                          attrs=None, numAttrs=0)
            err_c = clusters_fn(ctypes.byref(n), handle, ctypes.byref(cfg))
        row = {"kv_dtype": kv, "cluster": k, "threads": threads, "smem": smem, "sms": sms,
               "ctas_per_sm": per_sm.value, "slots_without_clusters": per_sm.value * sms,
               "max_active_clusters": n.value if k else None,
               "cta_slots": n.value * k if k else per_sm.value * sms,
               "err": [err_b, err_c], "uri": spec.uri}
        rows.append(row)
        print(f"{kv:14s} K={k} {threads} threads {smem:6d} B smem  {per_sm.value} CTAs/SM "
              f"({per_sm.value * sms} slots)  clusters {row['max_active_clusters']} -> "
              f"{row['cta_slots']} CTA slots ({row['cta_slots'] / max(1, per_sm.value):.1f} "
              f"SMs' worth) err {err_b}/{err_c}", flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
