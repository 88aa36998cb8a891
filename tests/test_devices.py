"""Arrays of one call on different devices are refused with a clear error (the rule a
multi-GPU engine relies on: a kernel launched on one device is never handed another's
memory). Checked on the CPU with a backend whose arrays carry a device ordinal; the
two-GPU run of issue #15 checks it on real devices."""

from __future__ import annotations

import numpy as np
import pytest

import paged_decode as pd
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.errors import InvalidArgumentError


class TwoDevices(ReferenceBackend):
    """The reference backend, with a device ordinal per array (by identity)."""

    name = "two-devices"

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[int, int] = {}
        self.now = 0

    def on(self, dev: int, x):
        self.where[id(x)] = dev
        return x

    def device_of(self, x):
        return self.where.get(id(x))

    def current_device(self):
        return self.now


def _problem(be):
    pool = pd.PagePool(16, 4, 2, 64, "float32", backend=be)
    s = pool.new_sequence()
    pool.append(s, np.ones((5, 2, 64), np.float32), np.ones((5, 2, 64), np.float32))
    q = np.ones((1, 4, 64), np.float32)
    return pool, s, q


def test_a_pool_on_another_device_than_q_is_refused():
    be = TwoDevices()
    pool, s, q = _problem(be)
    be.on(0, q), be.on(1, pool.k), be.on(1, pool.v)
    with pytest.raises(InvalidArgumentError, match=r"decode: k_pages is on device 1, but q "
                                                   r"is on device 0"):
        pd.decode(q, pool.k, pool.v, pool.page_table([s]), backend=be)
    be.on(0, pool.k), be.on(0, pool.v)
    out = be.on(1, np.empty((1, 4, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"decode: out is on device 1, but q is "
                                                   r"on device 0"):
        pd.decode(q, pool.k, pool.v, pool.page_table([s]), out=out, backend=be)
    be.on(0, out)
    pd.decode(q, pool.k, pool.v, pool.page_table([s]), out=out, backend=be)   # all on 0


def test_a_step_table_and_appended_rows_on_another_device_are_refused():
    be = TwoDevices()
    pool, s, q = _problem(be)
    be.on(1, pool.k), be.on(1, pool.v)
    st = pool.step_table([s])
    be.on(1, st.buffer)
    be.on(1, q)
    pd.decode(q, pool.k, pool.v, st, backend=be)                 # device 1 throughout
    q0 = be.on(0, np.ones((1, 4, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"decode: k_pages is on device 1, but q "
                                                   r"is on device 0"):
        pd.decode(q0, pool.k, pool.v, st, backend=be)
    rows = be.on(0, np.ones((1, 2, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"PagePool.append_batch: k is on device "
                                                   r"0, but the pool is on device 1"):
        pool.append_batch([s], rows, rows)
    assert pool.seq_len(s) == 5                                  # nothing changed


def test_a_step_table_on_another_device_than_q_is_refused():
    be = TwoDevices()
    pool, s, q = _problem(be)
    for x in (pool.k, pool.v, q):
        be.on(1, x)
    st = pool.step_table([s])
    be.on(0, st.buffer)
    with pytest.raises(InvalidArgumentError, match=r"decode: table \(its device buffer\) is "
                                                   r"on device 0, but q is on device 1"):
        pd.decode(q, pool.k, pool.v, st, backend=be)
