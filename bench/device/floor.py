"""What the bench's timer charges a call beyond its bytes, and the best float16 / fp8
ratio any kernel could show at a cell (CUDA, diagnostics; issue #14's 8 x 8K cell).

Every time here is taken as the decode suite takes its times
(``paged_decode.bench.timing``): the call captured in a CUDA graph, L2 flushed by the read
before every replay, median of REPS replays. Measured, in one process:

- ``empty``: a graph of one no-op kernel (1 CTA, and the v2tc grid's 512 CTAs of 128
  threads): the timer's own floor (graph launch, events);
- ``read``: a plain streaming read of exactly the K and V bytes of the cell's float16 pools
  and of its fp8 pools (no paging, no math: every 16-byte piece loaded once, an XOR kept
  so no load is dropped), in two orders (grid-stride, and one contiguous range per CTA as
  a split-KV partial reads) at 2-16 CTAs per SM and 4 or 8 loads in flight per thread;
  the best of them is what a perfect kernel of that byte count could take here;
- ``v2tc``: this package's tensor-core partial at the cell over float16 and e4m3fn pools
  (the bench's problem, plan and variants; checked against the float64 oracle first);
- ``paged read``: the same pools and plan read through the page table as the partial
  finds its rows (plan, table entries, page ids, rows: ``PAGED_SOURCE``, checked on the
  CPU by tests/test_floor_script.py) with no math and no merge, on v2tc's grid: what
  paging costs beside the plain read, and what v2tc's compute, combine and merge cost
  beside it;
- ``in_order``: v2tc and the paged read again with the same requests' pages renumbered in
  list order (``problems.in_order``: each request one contiguous run of the pool, where
  the bench's pages are shuffled): how much of paging's cost is the scattered page ids.

The ratio of the best reads' times is the ceiling of any decode's float16 / fp8 ratio at
that cell under this timer; the v2tc rows say how far the kernel's fixed part keeps it
from that ceiling.

Usage on the GPU machine: python3 bench/device/floor.py OUT.json [BATCHxCONTEXT ...]
(default 8x8192; Llama-3-8B heads 32/8 x 128, page 16, float16 queries).
"""

import json
import os
import sys

import cupy as cp
import numpy as np

from paged_decode import decode, plan_decode
from paged_decode.backends import get_backend
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.runner import TOLERANCE, _problem, _variants, _verify
from paged_decode.bench.timing import capture, measure_read_bandwidth, replay_times
from paged_decode.kernels.common import CUDA_COMMON
from paged_decode.problems import in_order

REPS = int(os.environ.get("FLOOR_REPS", "60"))

SOURCE = r"""
extern "C" __global__ void pd_floor_empty(unsigned* out) {
  if (threadIdx.x == 0x7fffffff) out[0] = 1u;     // never true: a launch and nothing else
}

// Every 16-byte piece of p[0, n) read once; BLOCKED: CTA b reads its own contiguous range
// (a split-KV partial's order), else grid-stride. U loads in flight per thread.
template <int U, bool BLOCKED>
__device__ void pd_floor_read(const uint4* __restrict__ p, long long n, unsigned* out) {
  long long first, end, stride;
  if (BLOCKED) {
    const long long per = (n + gridDim.x - 1) / gridDim.x;
    first = blockIdx.x * per + threadIdx.x;
    end = min(n, (blockIdx.x + 1) * per);
    stride = blockDim.x;
  } else {
    first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    end = n;
    stride = (long long)gridDim.x * blockDim.x;
  }
  unsigned acc = 0u;
  long long i = first;
  for (; i + (U - 1) * stride < end; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < end; i += stride) {
    const uint4 a = __ldg(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;           // the loads stay; the store almost never runs
}
#define PD_FLOOR_READ(NAME, U, BLOCKED)                                     \
  extern "C" __global__ void NAME(const uint4* p, long long n, unsigned* o) { \
    pd_floor_read<U, BLOCKED>(p, n, o);                                       \
  }
PD_FLOOR_READ(pd_floor_read_s4, 4, false)
PD_FLOOR_READ(pd_floor_read_s8, 8, false)
PD_FLOOR_READ(pd_floor_read_b4, 4, true)
PD_FLOOR_READ(pd_floor_read_b8, 8, true)
"""

#: A paged read, compiled after ``kernels.common.CUDA_COMMON`` (its ``pd::chunk_tokens``).
PAGED_SOURCE = r"""
// Every K and V row of a split-KV plan's chunks loaded once through the page table, found
// as the partials find them (the chunk's request and tile from the plan, the request's
// table entries, its page ids, then the rows); no math, no merge. grid (C, Hkv), 128
// threads; a row of head kvh is PIECES 16-byte pieces (pools [pages, P, Hkv, PIECES] of
// uint4); U tokens' rows in flight per thread. check: each CTA's XOR of every word it read
// lands in out[c * Hkv + kvh] (the CPU test's check); else the loads only feed a store that
// almost never runs.
template <int PAGE_SIZE, int PIECES, int U>
__device__ void pd_floor_paged(
    const uint4* __restrict__ k, const uint4* __restrict__ v, const int* __restrict__ indices,
    const int* __restrict__ indptr, const int* __restrict__ last_page_len,
    const int* __restrict__ first_page_offset, const int* __restrict__ request_indices,
    const int* __restrict__ kv_tile_indices, int pages_per_chunk, int num_kv_heads, int check,
    unsigned* __restrict__ out) {
  constexpr int THREADS = 128, TOK = THREADS / PIECES;   // tokens per pass of the CTA
  static_assert(THREADS % PIECES == 0, "a pass covers whole rows");
  const int c = blockIdx.x, kvh = blockIdx.y;
  const int r = request_indices[c];
  const long long tile = kv_tile_indices[c] < 0 ? 0 : kv_tile_indices[c];
  const long long pb = indptr[r], npages = indptr[r + 1] - pb, fpo = first_page_offset[r];
  const pd::TokenRange range = pd::chunk_tokens<PAGE_SIZE>(npages, last_page_len[r], fpo, tile,
                                                           pages_per_chunk);
  const int* __restrict__ ids = indices + pb;
  const long long a0 = fpo + range.t_begin, n = range.t_end - range.t_begin;
  const int piece = threadIdx.x % PIECES;
  unsigned acc = 0u;
  for (long long t = threadIdx.x / PIECES; t < n; t += (long long)TOK * U) {
    uint4 kx[U], vx[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = t + (long long)u * TOK;
      kx[u] = make_uint4(0u, 0u, 0u, 0u);
      vx[u] = kx[u];
      if (i < n) {
        const long long a = a0 + i;
        const long long row = (long long)ids[a / PAGE_SIZE] * PAGE_SIZE + a % PAGE_SIZE;
        const long long off = (row * num_kv_heads + kvh) * PIECES + piece;
        kx[u] = __ldg(k + off);
        vx[u] = __ldg(v + off);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      acc ^= kx[u].x ^ kx[u].y ^ kx[u].z ^ kx[u].w ^ vx[u].x ^ vx[u].y ^ vx[u].z ^ vx[u].w;
  }
  if (check) {
    __shared__ unsigned part[THREADS / 32];
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned x = 0u;
      for (int w = 0; w < THREADS / 32; ++w) x ^= part[w];
      out[(long long)c * gridDim.y + kvh] = x;
    }
  } else if (acc == 0x9e3779b9u) {
    out[0] = acc;
  }
}
#define PD_FLOOR_PAGED(NAME, PIECES)                                                      \
  extern "C" __global__ void __launch_bounds__(128) NAME(                                 \
      const uint4* k, const uint4* v, const int* indices, const int* indptr,              \
      const int* last_page_len, const int* first_page_offset, const int* request_indices, \
      const int* kv_tile_indices, int pages_per_chunk, int num_kv_heads, int check,       \
      unsigned* out) {                                                                    \
    pd_floor_paged<16, PIECES, 8>(k, v, indices, indptr, last_page_len, first_page_offset, \
                                  request_indices, kv_tile_indices, pages_per_chunk,      \
                                  num_kv_heads, check, out);                              \
  }
PD_FLOOR_PAGED(pd_floor_paged_16bit, 16)   // head_dim 128, 2-byte elements
PD_FLOOR_PAGED(pd_floor_paged_8bit, 8)     // head_dim 128, fp8
"""


def timed(launch) -> float:
    """Median us of ``launch`` captured alone in a graph, L2 flushed by the read."""
    replay, _ = capture(launch)
    return float(np.median(replay_times(replay, warmup=5, reps=REPS, cold_l2=True)) * 1e6)


def reads(module, nbytes: int, sms: int, sink) -> list[dict]:
    buf = cp.ones(nbytes // 4, cp.uint32)
    n16 = np.int64(nbytes // 16)
    rows = []
    for name in ("s4", "s8", "b4", "b8"):
        kern = module.get_function(f"pd_floor_read_{name}")
        for per_sm in (2, 4, 8, 16):
            grid = sms * per_sm

            def launch(k=kern, g=grid, b=buf):
                k((g,), (256,), (b, n16, sink))
            us = timed(launch)
            rows.append({"kernel": name, "ctas_per_sm": per_sm, "us": us,
                         "GBps": nbytes / us * 1e-3})
    return rows


def paged_read(module, k, v, table, plan, sink) -> float:
    """Median us of the paged read (``PAGED_SOURCE``) of ``plan``'s chunks over the pools
    ``k`` / ``v`` ([pages, 16, Hkv, 128], 2- or 1-byte elements) on v2tc's grid (C, Hkv)."""
    name = "pd_floor_paged_8bit" if k.dtype.itemsize == 1 else "pd_floor_paged_16bit"
    kern = module.get_function(name)
    hkv = k.shape[2]
    dev = [cp.asarray(np.ascontiguousarray(a, np.int32)) for a in (
        table.indices, table.indptr, table.last_page_len, table.first_page_offset,
        plan.request_indices, plan.kv_tile_indices)]

    def launch():
        kern((plan.num_chunks, hkv), (128,), (k, v, *dev, np.int32(plan.pages_per_chunk),
                                              np.int32(hkv), np.int32(0), sink))
    return timed(launch)


def v2tc(be, module, sink, batch: int, ctx: int, kv_dtype: str) -> dict:
    case = BenchCase(batch, ctx, 16, 32, 8, 128, kv_dtype=kv_dtype)
    q, k, v, table = _problem(be, case, 0)
    vk = _variants(be, case, 0, q)
    plan = plan_decode(table, 32, 8, 128, device=be.device_info(), path="v2tc",
                       kv_dtype=kv_dtype or None)
    out = cp.full(q.shape, cp.nan, q.dtype)
    scale = 1 / np.sqrt(128)

    def call(t):
        return decode(q, k, v, t, plan, path="v2tc", out=out, backend=be,
                      sm_scale=scale, **vk)
    def checked_time(t) -> tuple[float, float]:
        call(t)
        cp.cuda.Device().synchronize()
        err = _verify(be, out, q, k, v, t, vk)     # requests 0 and B-1 against float64
        if not err <= TOLERANCE["float16"]:        # the bench's bound for float16 queries
            sys.exit(f"v2tc over {kv_dtype or 'float16'} failed its check: {err}")
        out.fill(cp.nan)
        us = timed(lambda: call(t))
        if not bool(cp.isfinite(out).all()):
            sys.exit("a timed replay left NaN in the output")
        return us, err

    us, err = checked_time(table)
    # the same requests over pages in list order (each request one run of the pool; the
    # pools' contents are random either way): what the shuffled page ids cost
    ordered = in_order(table)
    us_ordered, err_ordered = checked_time(ordered)
    return {"kv_dtype": kv_dtype or "float16", "us": us, "ctas": plan.num_ctas,
            "max_rel_err": err, "paged_read_us": paged_read(module, k, v, table, plan, sink),
            "in_order": {"us": us_ordered, "max_rel_err": err_ordered,
                         "paged_read_us": paged_read(module, k, v, ordered, plan, sink)}}


def main() -> None:
    be = get_backend("cuda")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    module = cp.RawModule(code=SOURCE + CUDA_COMMON + PAGED_SOURCE, options=("-std=c++17",))
    sink = cp.zeros(1, cp.uint32)
    bw = measure_read_bandwidth()
    empty = module.get_function("pd_floor_empty")
    result = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "sms": sms, "read_bandwidth_GBps": bw / 1e9, "reps": REPS,
              "empty_1cta_us": timed(lambda: empty((1,), (32,), (sink,))),
              "empty_512ctas_us": timed(lambda: empty((512,), (128,), (sink,))),
              "cells": []}
    print(f"{result['device']}: read bandwidth {bw / 1e9:.0f} GB/s; empty graph "
          f"{result['empty_1cta_us']:.1f} us (1 CTA), {result['empty_512ctas_us']:.1f} us "
          f"(512 CTAs)", flush=True)
    for cell in sys.argv[2:] or ["8x8192"]:
        b, ctx = (int(x) for x in cell.split("x"))
        f16_bytes = 2 * b * ctx * 8 * 128 * 2             # K and V, 8 KV heads, head_dim 128
        row = {"cell": cell}
        for label, nbytes in (("float16", f16_bytes), ("fp8", f16_bytes // 2)):
            rs = reads(module, nbytes, sms, sink)
            best = min(rs, key=lambda x: x["us"])
            row[f"read_{label}"] = {"bytes": nbytes, "best": best, "all": rs,
                                    "at_bandwidth_us": nbytes / bw * 1e6}
            print(f"{cell} read {label:7s} {nbytes / 1e6:7.1f} MB: best {best['us']:6.1f} us "
                  f"({best['kernel']}, {best['ctas_per_sm']}/SM, {best['GBps']:.0f} GB/s); "
                  f"bytes at the measured bandwidth {nbytes / bw * 1e6:6.1f} us", flush=True)
        row["read_ratio"] = row["read_float16"]["best"]["us"] / row["read_fp8"]["best"]["us"]
        for kv in ("", "float8_e4m3fn"):
            r = v2tc(be, module, sink, b, ctx, kv)
            row[f"v2tc_{r['kv_dtype']}"] = r
            o = r["in_order"]
            print(f"{cell} v2tc {r['kv_dtype']:14s} {r['us']:6.1f} us ({r['ctas']} CTAs, "
                  f"max rel err {r['max_rel_err']:.2e}); the paged read of its chunks "
                  f"{r['paged_read_us']:6.1f} us; pages in list order: v2tc {o['us']:6.1f} "
                  f"us, paged read {o['paged_read_us']:6.1f} us", flush=True)
        row["v2tc_ratio"] = row["v2tc_float16"]["us"] / row["v2tc_float8_e4m3fn"]["us"]
        print(f"{cell} float16 / fp8: best plain reads {row['read_ratio']:.3f}, v2tc "
              f"{row['v2tc_ratio']:.3f}", flush=True)
        result["cells"].append(row)
        json.dump(result, open(sys.argv[1], "w"), indent=1)
    json.dump(result, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
