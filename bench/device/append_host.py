"""Host time of one batched append (``PagePool.append_batch``) on the CUDA backend.

B sequences x 1 token x L layers (float16, Hkv 8, D 128, page 16), sequences prefilled
to ragged lengths so page boundaries fall at different steps. Per step: the host time of
the call (enqueue only: the clock stops when the call returns), then a synchronize; and
the CUDA-event time across the call (host work, the descriptor upload and the launch).
Prints medians over the steps, the split between the pool's bookkeeping and the
backend's call, and the host cost of the primitives the eager append uses; writes JSON.

    python3 bench/device/append_host.py OUT.json [--batch 128] [--layers 32] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import cupy as cp
import numpy as np

import paged_decode as pd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    b, layers, hkv, d, p = a.batch, a.layers, 8, 128, 16
    rng = np.random.default_rng(0)
    lens = rng.integers(100, 2000, b)
    pages = int(sum(-(-(n + 2 * a.steps + 40) // p) for n in lens)) + 64
    pool = pd.PagePool(pages, p, hkv, d, "float16", num_layers=layers, backend="cuda")
    seqs = [pool.new_sequence() for _ in range(b)]
    # one block generated once (float32 normals: per-sequence float64 ones took minutes)
    block = cp.asarray(rng.standard_normal((layers, int(lens.max()), hkv, d),
                                           dtype=np.float32).astype(np.float16))
    for s, n in zip(seqs, lens):
        kv = cp.ascontiguousarray(block[:, :int(n)])
        pool.append(s, kv, kv)
    ids = np.asarray(seqs, np.int64)
    rows = (layers, b, hkv, d)
    k = cp.asarray(rng.standard_normal(rows, dtype=np.float32).astype(np.float16))
    v = cp.asarray(rng.standard_normal(rows, dtype=np.float32).astype(np.float16))
    cp.cuda.Device().synchronize()
    host, gpu = [], []
    for step in range(a.steps + 4):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        t0 = time.perf_counter()
        pool.append_batch(ids, k, v)
        t1 = time.perf_counter()
        e1.record()
        e1.synchronize()
        if step >= 4:                          # warm-up: compile, first uploads
            host.append((t1 - t0) * 1e6)
            gpu.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res = {"batch": b, "layers": layers, "steps": a.steps, "device": name,
           "host_us_median": statistics.median(host),
           "host_us_p80": float(np.percentile(host, 80)),
           "host_us_mean": statistics.fmean(host),   # with the lookahead's plan every 32
           "event_us_median": statistics.median(gpu)}
    print(json.dumps(res))
    # where the host time goes: the backend's share (append_rows, timed around the call),
    # then the per-call cost of the primitives the eager append makes (2000 calls each)
    be = pool.backend
    real, inner = be.append_rows, []

    def timed(*args, **kw):
        t = time.perf_counter()
        got = real(*args, **kw)
        inner.append((time.perf_counter() - t) * 1e6)
        return got
    be.append_rows = timed
    outer = []
    for _ in range(64):
        t0 = time.perf_counter()
        pool.append_batch(ids, k, v)
        outer.append((time.perf_counter() - t0) * 1e6)
        cp.cuda.Device().synchronize()
    be.append_rows = real
    res["split_us"] = {"append_batch": statistics.median(outer),
                       "backend_append_rows": statistics.median(inner),
                       "pool_side": statistics.median(o - i for o, i in zip(outer, inner))}
    res["primitive_us"] = _primitives(k, v)
    print(json.dumps({"split_us": res["split_us"], "primitive_us": res["primitive_us"]},
                     indent=1))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


def _primitives(k, v) -> dict[str, float]:
    """Host us per call of what one eager append does, each over 2000 calls."""
    from paged_decode.backends.cuda_staging import PinnedStaging
    stream = cp.cuda.get_current_stream()
    ev = cp.cuda.Event(disable_timing=True)
    ev.record(stream)
    staging = PinnedStaging(depth=8)
    desc = np.zeros((5, 128), np.int32)
    dst = cp.zeros(desc.size, np.int32)
    host = np.zeros(desc.nbytes, np.uint8)
    cases = {
        "flags.c_contiguous": lambda: k.flags.c_contiguous,
        "data.ptr": lambda: k.data.ptr,
        "runtime.getDevice": cp.cuda.runtime.getDevice,
        "get_current_stream": cp.cuda.get_current_stream,
        "stream.is_capturing": stream.is_capturing,
        "event.record": lambda: ev.record(stream),
        "event.synchronize": ev.synchronize,
        "desc into pinned (numpy)": lambda: host.__setitem__(
            slice(0, desc.nbytes), desc.reshape(-1).view(np.uint8)),
        "PinnedStaging.copy 2.5 KB": lambda: staging.copy(dst, desc),
    }
    nop = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")
    fptr = nop.kernel.ptr
    cases["driver.launchKernel (no args)"] = lambda: cp.cuda.driver.launchKernel(
        fptr, 1, 1, 1, 32, 1, 1, 0, stream.ptr, 0, 0)
    out = {}
    for name, fn in cases.items():
        fn()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        out[name] = (time.perf_counter() - t) / 2000 * 1e6
        cp.cuda.Device().synchronize()
    return out


if __name__ == "__main__":
    main()
