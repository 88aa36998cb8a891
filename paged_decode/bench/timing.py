"""Timers: CUDA events per iteration (optionally with a cold L2), or host perf counters.

Each returns per-iteration seconds; the runner reports median, p20 and p80.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

L2_FLUSH_BYTES = 256 << 20   # larger than any current GPU's L2 (H200: 60 MB)


def host_times(fn: Callable[[], Any], *, warmup: int, reps: int,
               sync: Callable[[], Any] = lambda: None) -> np.ndarray:
    """Wall time of each call, synchronizing after each (host overhead included)."""
    for _ in range(warmup):
        fn()
    sync()
    out = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out[i] = time.perf_counter() - t0
    return out


def cuda_event_times(fn: Callable[[], Any], *, warmup: int, reps: int,
                     cold_l2: bool = True) -> np.ndarray:
    """GPU time of each call between CUDA events on the current stream.

    With ``cold_l2`` a 256 MB buffer is overwritten before every iteration (outside the
    events), so no iteration reads K/V left in L2 by the previous one.
    """
    import cupy as cp
    flush = cp.empty(L2_FLUSH_BYTES // 4, cp.int32) if cold_l2 else None
    for _ in range(warmup):
        fn()
    starts = [cp.cuda.Event() for _ in range(reps)]
    ends = [cp.cuda.Event() for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.fill(i)
        starts[i].record()
        fn()
        ends[i].record()
    ends[-1].synchronize()
    return np.array([cp.cuda.get_elapsed_time(s, e) * 1e-3 for s, e in zip(starts, ends)])


def cuda_per_call_times(fn: Callable[[], Any], *, warmup: int, reps: int) -> np.ndarray:
    """Per-call time as a Python caller sees it: back-to-back calls, wall clock around a
    batch of ``reps`` calls with one synchronize (launch and host overhead included, no
    per-call synchronization), reported per call for 5 batches."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    n = max(1, reps // 5)
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        cp.cuda.get_current_stream().synchronize()
        out.append((time.perf_counter() - t0) / n)
    return np.array(out)


def stats(times: np.ndarray) -> dict[str, float]:
    return {"median_us": float(np.median(times) * 1e6),
            "p20_us": float(np.percentile(times, 20) * 1e6),
            "p80_us": float(np.percentile(times, 80) * 1e6)}


def measure_read_bandwidth() -> float:
    """Device read bandwidth in bytes/s: a 4 GiB float32 reduction (reads dominate)."""
    import cupy as cp
    x = cp.random.standard_normal(1 << 30, dtype=cp.float32)
    t = cuda_event_times(lambda: x.sum(), warmup=3, reps=10, cold_l2=False)
    return float(x.nbytes / np.median(t))
