"""Chunkings x ring depths of both partials on named `models` cells, beside contiguous SDPA
on the same bytes (CUDA; GPU time under CUDA-graph replay, cold L2, every output checked
against the float64 oracle): where the plan's chunking, not the kernel, keeps a cell
from SDPA's time.

Usage on the GPU machine:
    python3 bench/device/tune_cells.py OUT.json MODEL:BATCHxCONTEXT [...]
Environment: TUNE_STAGES (ring depths, default "2,3"), TUNE_SPLITS (chunks per request,
default "1,2,3,4,6,8,12,16,24,32"), TUNE_ARMS (default "v2tc,v2"), TUNE_MAX_CTAS
(largest grid swept, default 2112), TUNE_BACKEND (default cuda; emulated-cuda for a CPU
smoke run), TUNE_KV (K/V dtypes, default "-": the queries' float16; "-,float8_e4m3fn"
times each cell over both, SDPA beside the 16-bit pools only).

Each cell prints SDPA, each arm at its own plan (``default``), then every chunking; the
summary gives each arm's best setting against its default and SDPA.
"""

import json
import os
import sys
import time

import numpy as np

from paged_decode import plan_decode
from paged_decode.backends import get_backend
from paged_decode.bench.arms import make_arm
from paged_decode.bench.cases import MODELS, BenchCase
from paged_decode.bench.runner import TOLERANCE, _problem, _variants, time_arm, verifier
from paged_decode.specs import v2tc_ctas_per_chunk

STAGES = [int(x) for x in os.environ.get("TUNE_STAGES", "2,3").split(",")]
SPLITS = [int(x) for x in os.environ.get("TUNE_SPLITS", "1,2,3,4,6,8,12,16,24,32").split(",")]
ARMS = os.environ.get("TUNE_ARMS", "v2tc,v2").split(",")
MAX_CTAS = int(os.environ.get("TUNE_MAX_CTAS", "2112"))
KVS = ["" if x == "-" else x for x in os.environ.get("TUNE_KV", "-").split(",")]

be = get_backend(os.environ.get("TUNE_BACKEND", "cuda"))   # "emulated-cuda": a CPU smoke run
t0 = time.time()
rows: list[dict] = []


def cell(text: str, kv: str) -> BenchCase:
    model, shape = text.split(":")
    b, ctx = (int(x) for x in shape.lower().split("x"))
    hq, hkv, d = MODELS[model]
    return BenchCase(b, ctx, 16, hq, hkv, d, "float16", model, kv_dtype=kv)


def measure(case, q, k, v, table, vk, arm_name, setting, plan=None):
    """Time one arm on ``plan`` (None: the arm's own plan) with ``decode``'s variant
    arguments ``vk`` (an fp8 pool's format and scales) and record it."""
    if plan is None:
        plan = plan_decode(table, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                           device=be.device_info(), kv_dtype=case.kv_dtype or None)
    arm = make_arm(arm_name, be, q, k, v, table, plan, 1 / np.sqrt(case.head_dim), vk,
                   keep_plan=setting != "default")
    r = time_arm(be, arm_name, arm.call, verifier(be, arm, q, k, v, table, vk), case.io_bytes(),
                 TOLERANCE["float16"], arm.expected, warmup=3, reps=15, cold_l2=True,
                 ran=arm.ran)
    us = r.gpu.get("median_us") or float("nan")
    row = {"cell": case.label, "arm": arm_name, "setting": setting, "gpu_us": us,
           "p20_us": r.gpu.get("p20_us"), "p80_us": r.gpu.get("p80_us"),
           "gbps": r.gbps, "verified": r.verified, "err": r.max_rel_error,
           "stages": os.environ.get("PAGED_DECODE_STAGES", "default"),
           "chunks": getattr(plan, "num_chunks", None), "ctas": getattr(plan, "num_ctas", None)}
    rows.append(row)
    print(f"{case.label:44s} {arm_name:5s} {setting:18s} {us:9.1f} us {r.gbps:6.0f} GB/s "
          f"{'ok' if r.verified else 'FAIL'} t={time.time() - t0:.0f}s", flush=True)


for text, kv in ((t, kv) for t in sys.argv[2:] for kv in KVS):
    case = cell(text, kv)
    q, k, v, table = _problem(be, case, 0)
    vk = _variants(be, case, 0, q)
    if not kv and be.name == "cuda":       # SDPA: torch on the GPU, over 16-bit pools
        measure(case, q, k, v, table, vk, "sdpa", "default")
    for arm_name in ARMS:
        measure(case, q, k, v, table, vk, arm_name, "default")
    pages = int(table.pages_per_request.max())
    for arm_name in ARMS:
        per_chunk = (v2tc_ctas_per_chunk(case.num_qo_heads, case.num_kv_heads)
                     if arm_name == "v2tc" else None)
        for st in STAGES:
            os.environ["PAGED_DECODE_STAGES"] = str(st)
            seen = set()
            for n in SPLITS:
                ppc = -(-pages // n)
                if ppc in seen:
                    continue
                seen.add(ppc)
                plan = plan_decode(table, case.num_qo_heads, case.num_kv_heads,
                                   case.head_dim, device=be.device_info(),
                                   kv_dtype=kv or None, ctas_per_chunk=per_chunk,
                                   pages_per_chunk=ppc, path="v2")
                if plan.num_ctas > MAX_CTAS:
                    continue
                measure(case, q, k, v, table, vk, arm_name,
                        f"st{st} split{-(-pages // ppc)} ctas{plan.num_ctas}", plan)
            os.environ.pop("PAGED_DECODE_STAGES")
    del q, k, v

json.dump(rows, open(sys.argv[1], "w"), indent=1)
print("\nsummary (GPU us; ratio against SDPA)")
for label in dict.fromkeys(r["cell"] for r in rows):
    mine = [r for r in rows if r["cell"] == label and r["verified"]]
    sdpa = next((r["gpu_us"] for r in mine if r["arm"] == "sdpa"), float("nan"))
    for arm_name in ARMS:
        own = [r for r in mine if r["arm"] == arm_name]
        if not own:
            continue
        default = next((r for r in own if r["setting"] == "default"), None)
        best = min(own, key=lambda r: r["gpu_us"])
        d_us = default["gpu_us"] if default else float("nan")
        print(f"{label:44s} {arm_name:5s} default {d_us:9.1f} ({d_us / sdpa:.3f}) "
              f"best {best['gpu_us']:9.1f} ({best['gpu_us'] / sdpa:.3f}) at {best['setting']}"
              f" chunks {best['chunks']}; sdpa {sdpa:.1f}")
