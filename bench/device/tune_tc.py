"""Sweeps for the tensor-core partial and the ragged-batch plan rule (CUDA), GPU time
under CUDA-graph replay, cold L2, every output checked against the float64 oracle.

Usage on the GPU machine: python3 bench/device/tune_tc.py OUT.json [residency] [warps] [ragged]

- residency: v2tc at CTA targets 264 / 528 / 1056 x ring depths 2 / 3 / 4 over cells of
  GQA 4, 7, 8 and 16 (v2 at its defaults beside each cell);
- warps: v2tc at 2 / 4 / 8 warps per CTA x ring depths 2 / 3 (``PAGED_DECODE_TC_WARPS``);
- ragged: v2 and v2tc on ragged batches (16 x U(1K, 8K), 128 x U(512, 4K), 64 and 128 x
  U(512, 1536), the engine suite's) at ``ragged_split`` 0 (off) / 1 / 0.75 / 0.5.
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
from paged_decode.bench.runner import TOLERANCE, time_arm, verifier
from paged_decode.dtypes import numpy_dtype
from paged_decode.problems import make_table
from paged_decode.specs import v2tc_ctas_per_chunk

be = get_backend("cuda")
t0 = time.time()
rows = []
D = 128


def problem(lens, hq, hkv, seed=0):
    import cupy as cp
    rng = np.random.default_rng(seed)
    table, num_pages = make_table([int(x) for x in lens], 16, slack=1.25, rng=rng)
    g = cp.random.default_rng(seed)
    dt = numpy_dtype("float16")
    q = g.standard_normal((len(lens), hq, D), dtype=cp.float32).astype(dt)
    k = g.standard_normal((num_pages, 16, hkv, D), dtype=cp.float32).astype(dt)
    v = g.standard_normal((num_pages, 16, hkv, D), dtype=cp.float32).astype(dt)
    return q, k, v, table


def measure(tag, arm_name, q, k, v, table, hq, hkv, **plan_kw):
    ctas = v2tc_ctas_per_chunk(hq, hkv) if arm_name == "v2tc" else None
    plan = plan_decode(table, hq, hkv, D, device=be.device_info(), ctas_per_chunk=ctas,
                       path="v2", **plan_kw)
    arm = make_arm(arm_name, be, q, k, v, table, plan, 1 / np.sqrt(D), keep_plan=True)
    nbytes = int(2 * table.total_visible * hkv * D * 2)
    r = time_arm(be, arm_name, arm.call, verifier(be, arm, q, k, v, table), nbytes,
                 TOLERANCE["float16"], arm.expected, warmup=3, reps=15, cold_l2=True,
                 ran=arm.ran)
    row = dict(tag, arm=arm_name, stages=os.environ.get("PAGED_DECODE_STAGES"),
               gpu_us=r.gpu.get("median_us") or r.call.get("median_us") or float("nan"),
               gbps=r.gbps, chunks=plan.num_chunks,
               pages_per_chunk=plan.pages_per_chunk, verified=r.verified,
               err=r.max_rel_error, **{k2: v2 for k2, v2 in plan_kw.items()})
    rows.append(row)
    print(f"{json.dumps(tag):58s} {arm_name:5s} st{row['stages']} {plan_kw} "
          f"{row['gpu_us']:9.1f} us {r.gbps:7.0f} GB/s chunks {plan.num_chunks:<5} "
          f"{'ok' if r.verified else 'FAIL'} t={time.time() - t0:.0f}s", flush=True)


parts = sys.argv[2:] or ["residency", "warps", "ragged"]

def sweep(cells, settings, baseline=False):
    """v2tc over ``cells`` (batch, context, Hq, Hkv) under each of ``settings`` (env
    values and plan keywords), v2 at its defaults first when ``baseline``."""
    for b, ctx, hq, hkv in cells:
        q, k, v, table = problem([ctx] * b, hq, hkv)
        tag = {"batch": b, "context": ctx, "heads": f"{hq}/{hkv}"}
        if baseline:
            measure(tag, "v2", q, k, v, table, hq, hkv)
        for env, plan_kw in settings:
            os.environ.update(env)
            measure(dict(tag, **env), "v2tc", q, k, v, table, hq, hkv, **plan_kw)
            for name in env:
                os.environ.pop(name)
        del q, k, v


if "residency" in parts:
    sweep([(8, 8192, 32, 8), (32, 8192, 32, 8), (32, 8192, 28, 4), (32, 8192, 8, 1),
           (8, 8192, 32, 2), (32, 2048, 32, 2), (1, 32768, 32, 8), (128, 1024, 32, 8)],
          [({"PAGED_DECODE_STAGES": str(st)}, {"target_ctas": tgt})
           for st, tgt in itertools.product((2, 3, 4), (264, 528, 1056))], baseline=True)
if "warps" in parts:
    sweep([(8, 8192, 32, 8), (32, 8192, 32, 8), (32, 8192, 28, 4), (8, 8192, 8, 1),
           (8, 8192, 32, 2), (1, 32768, 32, 8), (128, 1024, 32, 8), (1, 4096, 32, 2)],
          [({"PAGED_DECODE_TC_WARPS": str(w), "PAGED_DECODE_STAGES": str(st)}, {})
           for w, st in itertools.product((2, 4, 8), (2, 3))])
if "ragged" in parts:
    rng = np.random.default_rng(5)
    batches = {"16xU(1K,8K)": rng.integers(1024, 8193, 16),
               "128xU(512,4K)": rng.integers(512, 4097, 128),
               "64xU(512,1536)": rng.integers(512, 1537, 64),
               "128xU(512,1536)": rng.integers(512, 1537, 128)}
    for name, lens in batches.items():
        q, k, v, table = problem(lens, 32, 8)
        for arm_name, rs in itertools.product(("v2", "v2tc"), (0.0, 1.0, 0.75, 0.5)):
            measure({"batch": name, "heads": "32/8"}, arm_name, q, k, v, table, 32, 8,
                    ragged_split=rs)
        del q, k, v
json.dump(rows, open(sys.argv[1], "w"), indent=1)
