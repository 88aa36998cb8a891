"""Host time of ``DecodeStep.begin`` on the CPU: the steady begin against the general one,
and the device calls a begin and a captured replay make.

Usage: python bench/begin_host.py [BATCH ...]   (default 8 64 128)

The engine suite's batch shape (ragged contexts 512-1536, a fork of request 0 in every
other row of the second half, page 16), with small heads (the host work does not depend
on them).

- Time: on the reference backend with its table update stubbed out (a begin leaves the
  update pending; only a begin after a begin without a step between applies the one
  before), so the numbers are the bookkeeping alone. Each batch runs 200 begins with the
  steady path and 200 with it disabled (every begin general), on twin pools, and prints
  the medians.
- Device calls (``paged_decode.bench.device_calls``): on ``emulated-cuda``, whose captured
  steps are recorded graphs, a step of one layer's append is captured and 6 steps run as
  ``begin(); replay()``; printed per begin and per replay: host-to-device uploads,
  table updates made by the host, kernel launches outside and inside the graph. (The
  counts, not the emulator's time, are the point: the H200 host pays 10-40 us per CUDA
  API call, ``bench/device/profile_engine.py``.)
"""

from __future__ import annotations

import sys
import time

import numpy as np

from paged_decode.backends import get_backend
from paged_decode.bench.device_calls import DeviceCalls
from paged_decode.engine_step import DecodeStep
from paged_decode.pool import PagePool
from paged_decode.steady_step import SteadyBegin

P, STEPS = 16, 200


def _pool(batch: int, backend: str) -> tuple[PagePool, list[int]]:
    be = get_backend(backend)
    lens = np.random.default_rng(0).integers(512, 1536, batch)
    pages = int(sum(-(-(int(n) + STEPS + 8) // P) for n in lens)) + 2 * batch
    pool = PagePool(pages, P, 1, 8, "float16", num_layers=1, backend=be)
    seqs: list[int] = []
    for i, n in enumerate(lens):
        if i > batch // 2 and i % 2 == 0:
            seqs.append(pool.fork(seqs[0]))
        else:
            s = pool.new_sequence()
            x = np.zeros((1, int(n), 1, 8), np.float16)
            pool.append(s, x, x)
            seqs.append(s)
    return pool, seqs


def _step(batch: int) -> DecodeStep:
    pool, seqs = _pool(batch, "reference")
    # the bookkeeping alone: no device table update
    pool.backend.update_table = lambda buf, delta, cap, pcap, scratch=None: buf  # type: ignore
    return DecodeStep(pool, seqs, num_qo_heads=4, headroom=64)


def device_calls(batch: int, steps: int = 6) -> tuple[list[dict[str, int]],
                                                      list[dict[str, int]]]:
    """Per begin and per replay of a captured one-layer append step on ``emulated-cuda``:
    the ``DeviceCalls`` counts (the first begin, a general one, is left out)."""
    pool, seqs = _pool(batch, "emulated-cuda")
    step = DecodeStep(pool, seqs, num_qo_heads=4, headroom=64)
    k = np.zeros((step.capacity, 1, 8), np.float16)
    step.begin()
    graph = step.capture(lambda st: st.append(0, k, k))
    begins, replays = [], []
    with DeviceCalls(pool.backend) as calls:
        for _ in range(steps):
            step.begin()
            begins.append(calls.take())
            graph.replay()
            replays.append(calls.take())
    return begins, replays


def median_begin_us(batch: int, steady: bool) -> float:
    step = _step(batch)
    arm = SteadyBegin.__dict__["arm"]
    if not steady:      # the step never arms the steady state
        SteadyBegin.arm = classmethod(lambda cls, pool, table: None)  # type: ignore
    k = np.zeros((step.capacity, 1, 8), np.float16)
    try:
        ts = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            step.begin()
            ts.append(time.perf_counter() - t0)
            step.append(0, k, k)        # (untimed) a begin's slots are written before the next

    finally:
        SteadyBegin.arm = arm  # type: ignore
    return float(np.median(ts) * 1e6)


def _same(counts: list[dict[str, int]]) -> str:
    """The counts of every step, or each step's when they differ."""
    return str(counts[0]) if all(c == counts[0] for c in counts) else str(counts)


if __name__ == "__main__":
    for b in [int(a) for a in sys.argv[1:]] or [8, 64, 128]:
        print(f"batch {b}: begin steady {median_begin_us(b, True):.1f} us, "
              f"general {median_begin_us(b, False):.1f} us (median of {STEPS})")
        begins, replays = device_calls(b)
        print(f"  device calls per steady begin: {_same(begins)}; per replay: "
              f"{_same(replays)} ({len(begins)} steps, emulated-cuda)")
