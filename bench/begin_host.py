"""Host time of ``DecodeStep.begin`` on the CPU: the steady begin against the general one.

Usage: python bench/begin_host.py [BATCH ...]   (default 8 64 128)

The engine suite's batch shape (ragged contexts 512-1536, a fork of request 0 in every
other row of the second half, page 16), on the reference backend with small heads (the
host work does not depend on them) and with the backend's table update stubbed out, so
the numbers are the bookkeeping alone. Each batch runs 200 begins with the steady path
and 200 with it disabled (every begin general), on twin pools, and prints the medians.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from paged_decode.backends import get_backend
from paged_decode.engine_step import DecodeStep
from paged_decode.pool import PagePool
from paged_decode.steady_step import SteadyBegin

P, STEPS = 16, 200


def _step(batch: int) -> DecodeStep:
    be = get_backend("reference")
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
    # the bookkeeping alone: no device table update
    be.update_table = lambda buf, delta, cap, pcap, scratch=None: buf  # type: ignore
    return DecodeStep(pool, seqs, num_qo_heads=4, headroom=64)


def median_begin_us(batch: int, steady: bool) -> float:
    step = _step(batch)
    arm = SteadyBegin.__dict__["arm"]
    if not steady:      # the step never arms the steady state
        SteadyBegin.arm = classmethod(lambda cls, pool, table: None)  # type: ignore
    try:
        ts = []
        for _ in range(STEPS):
            t0 = time.perf_counter()
            step.begin()
            ts.append(time.perf_counter() - t0)
    finally:
        SteadyBegin.arm = arm  # type: ignore
    return float(np.median(ts) * 1e6)


if __name__ == "__main__":
    for b in [int(a) for a in sys.argv[1:]] or [8, 64, 128]:
        print(f"batch {b}: begin steady {median_begin_us(b, True):.1f} us, "
              f"general {median_begin_us(b, False):.1f} us (median of {STEPS})")
