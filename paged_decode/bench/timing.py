"""Timers: CUDA-graph replay and CUDA events per iteration (optionally with a cold L2),
per-call wall time, or host perf counters.

A cold L2 (``cold_l2`` True or ``"clean"``, the default) is made by reading a 256 MB
buffer before each iteration, outside the events: L2 then holds clean lines of that
buffer, as it holds a projection's weights before attention in a model's step.
``"dirty"`` overwrites the buffer instead (this bench's only flush before session 25): L2
is left full of modified lines, which the timed call must write back to DRAM as its reads
evict them, up to an L2's worth (50 MB on an H100) of extra DRAM traffic charged to every
call. ``False``: no flush. Every timer here, the device scripts' included, has flushed by
the read since session 25: compare with earlier runs only under ``"dirty"``.

Each returns per-iteration seconds; the runner reports median, p20 and p80.

GPU time is measured under CUDA-graph replay by default: the call is captured once and
each iteration replays the graph between two events, so launch gaps of the host (Python,
argument packing) are not counted, only the GPU work and its in-graph dependencies.
Capture binds one stream as the current stream of both CuPy and torch, so arms written
against either framework are captured alike.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

L2_FLUSH_BYTES = 256 << 20   # larger than any current GPU's L2 (tens of MB)

#: the cold-L2 flushes (``cold_l2`` True means "clean")
L2_FLUSHES = ("clean", "dirty")


def l2_flush_kind(cold_l2: bool | str) -> str | None:
    """``cold_l2`` as a flush kind: None (warm L2), "clean" or "dirty"."""
    if cold_l2 is False:
        return None
    kind = "clean" if cold_l2 is True else cold_l2
    if kind not in L2_FLUSHES:
        raise ValueError(f"cold_l2 must be True, False or one of {', '.join(L2_FLUSHES)}, "
                         f"got {cold_l2!r}")
    return kind


def l2_flusher(buffer: Any, kind: str | None) -> Callable[[int], Any] | None:
    """The per-iteration flush of ``buffer`` (a CuPy array or torch tensor): a read (its
    sum, reduced on the device) for "clean", an overwrite for "dirty"."""
    if kind is None:
        return None
    if kind == "dirty":
        return lambda i: buffer.fill_(i) if hasattr(buffer, "fill_") else buffer.fill(i)
    return lambda i: buffer.sum()


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


def _event_loop(fn: Callable[[], Any], *, warmup: int, reps: int,
                flush: Callable[[int], Any] | None, new_event: Callable[[], Any],
                elapsed_ms: Callable[[Any, Any], float],
                wait: Callable[[], Any]) -> np.ndarray:
    """The timed loop shared by the event timers: per iteration, ``flush(i)`` L2 (if
    given), record an event, run ``fn``, record an event; returns the
    seconds between each pair."""
    for _ in range(warmup):
        fn()
    starts = [new_event() for _ in range(reps)]
    ends = [new_event() for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush(i)
        starts[i].record()
        fn()
        ends[i].record()
    wait()
    return np.array([elapsed_ms(s, e) * 1e-3 for s, e in zip(starts, ends)])


def cuda_event_times(fn: Callable[[], Any], *, warmup: int, reps: int,
                     cold_l2: bool | str = True) -> np.ndarray:
    """GPU time of each call between CUDA events on CuPy's current stream.

    With ``cold_l2`` a 256 MB buffer is read ("clean") or overwritten ("dirty") before
    every iteration (outside the events), so no iteration reads K/V left in L2 by the
    previous one (the module docstring says what each leaves in L2).
    """
    import cupy as cp
    kind = l2_flush_kind(cold_l2)
    buffer = cp.ones(L2_FLUSH_BYTES // 4, cp.int32) if kind else None
    return _event_loop(fn, warmup=warmup, reps=reps, flush=l2_flusher(buffer, kind),
                       new_event=cp.cuda.Event,
                       elapsed_ms=cp.cuda.get_elapsed_time,
                       wait=lambda: cp.cuda.get_current_stream().synchronize())


def _torch() -> Any:
    try:
        import torch
    except Exception:
        return None
    return torch if torch.cuda.is_available() else None


@contextlib.contextmanager
def shared_stream(ptr: int) -> Iterator[None]:
    """Make the raw CUDA stream ``ptr`` current for CuPy and (when importable) torch."""
    import cupy as cp
    torch = _torch()
    with contextlib.ExitStack() as stack:
        stack.enter_context(cp.cuda.ExternalStream(ptr))
        if torch is not None:
            stack.enter_context(torch.cuda.stream(torch.cuda.ExternalStream(ptr)))
        yield


class GraphCaptureError(RuntimeError):
    """A call could not be captured in a CUDA graph (it synchronizes, allocates outside a
    graph pool, or copies from the host)."""


def capture(fn: Callable[[], Any], *, warmup: int = 2) -> tuple[Callable[[], None], Any]:
    """Capture ``fn`` into a CUDA graph; returns ``(replay, result)``: a function launching
    the graph, and what ``fn`` returned during capture (the arrays a replay writes). With
    torch importable, torch's graph machinery captures (allocations then come from the
    graph's private pool) and ``replay`` launches on torch's current stream; otherwise
    CuPy's stream capture, and ``replay`` launches on CuPy's current stream. Time a replay
    with ``replay_times``, which records events on that same stream."""
    import cupy as cp
    torch = _torch()
    try:
        if torch is not None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with shared_stream(side.cuda_stream):
                for _ in range(warmup):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):   # the warm-up stream: per-stream
                # workspaces and prepared calls made by the warm-up are the ones captured
                with shared_stream(torch.cuda.current_stream().cuda_stream):
                    result = fn()
            torch.cuda.synchronize()
            return graph.replay, result
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(warmup):
                fn()
            stream.synchronize()
            stream.begin_capture()
            try:
                result = fn()
            finally:
                g = stream.end_capture()
        return (lambda: g.launch(cp.cuda.get_current_stream())), result
    except Exception as exc:
        raise GraphCaptureError(f"{type(exc).__name__}: {exc}") from exc


def replay_times(replay: Callable[[], None], *, warmup: int, reps: int,
                 cold_l2: bool | str = True) -> np.ndarray:
    """GPU time of each ``replay`` between events on the stream it launches on (torch's
    current stream when torch is importable, else CuPy's); with ``cold_l2`` a 256 MB
    buffer is read or overwritten on that stream before each iteration, outside the
    events (as ``cuda_event_times``)."""
    torch = _torch()
    if torch is None:
        return cuda_event_times(replay, warmup=warmup, reps=reps, cold_l2=cold_l2)
    kind = l2_flush_kind(cold_l2)
    buffer = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") \
        if kind else None
    return _event_loop(replay, warmup=warmup, reps=reps, flush=l2_flusher(buffer, kind),
                       new_event=lambda: torch.cuda.Event(enable_timing=True),
                       elapsed_ms=lambda s, e: s.elapsed_time(e), wait=torch.cuda.synchronize)


def synchronize() -> None:
    """Wait for all work on the current device (every stream)."""
    import cupy as cp
    cp.cuda.Device().synchronize()


def cuda_per_call_times(fn: Callable[[], Any], *, warmup: int, reps: int) -> np.ndarray:
    """Per-call time as a Python caller sees it: back-to-back calls, wall clock around a
    batch of ``reps`` calls with one synchronize (launch and host overhead included, no
    per-call synchronization), reported per call for 5 batches."""
    import cupy as cp
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    cp.cuda.Device().synchronize()
    n = max(1, reps // 5)
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        cp.cuda.Device().synchronize()
        out.append((time.perf_counter() - t0) / n)
    return np.array(out)


def host_enqueue_times(fn: Callable[[], Any], *, warmup: int, reps: int) -> np.ndarray:
    """Host time of each call alone (argument checks, packing, launch enqueue; no wait for
    the GPU): the host overhead a caller pays per call. The device is synchronized every
    4 calls, outside the timed region, so the launch queue never fills and blocks."""
    for _ in range(warmup):
        fn()
    synchronize()
    out = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t0
        if i % 4 == 3:
            synchronize()
    synchronize()
    return out


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
