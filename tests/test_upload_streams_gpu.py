"""A memoised device copy of a host table array, used from a stream other than the one
that made it (``cuda_launch.DeviceCaches.upload``), on a real GPU; skipped cleanly without
one. The copy is queued on a created stream behind a 50 ms spin kernel, so a stream that
does not wait for it reads the buffer before the copy lands."""

from __future__ import annotations

import numpy as np
import pytest

import paged_decode as pd
from paged_decode.backends import availability

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}
"""


def _spin(stream, ms=50):
    import cupy as cp
    k = cp.RawKernel(SPIN, "spin")
    with stream:                                             # ~2 GHz SM clock
        k((1,), (1,), (np.int64(2_000_000 * ms),))


@pytest.mark.parametrize("second", ["created", "null"])
def test_another_streams_first_use_waits_for_the_copy(second):
    import cupy as cp
    be = pd.get_backend("cuda")
    # 16 MB, read-only like a table; values no earlier test left in the memory pool
    host = np.random.default_rng(len(second)).integers(0, 1 << 30, 1 << 22, dtype=np.int32)
    host.flags.writeable = False
    a = cp.cuda.Stream(non_blocking=True)
    b = cp.cuda.Stream(non_blocking=True) if second == "created" else cp.cuda.Stream.null
    dst = cp.full(host.shape, -1, cp.int32)
    cp.cuda.Device().synchronize()
    _spin(a)
    with a:
        dev = be.upload(host)                                # queued behind the spin
    with b:
        again = be.upload(host)
        assert again is dev
        dst[...] = again                                     # on b, before a has copied
    b.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dst), host)
    a.synchronize()


def test_the_same_stream_needs_no_wait():
    import cupy as cp
    be = pd.get_backend("cuda")
    host = np.arange(1 << 20, dtype=np.int32)
    host.flags.writeable = False
    a = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    _spin(a, 20)
    with a:
        dev = be.upload(host)
        out = dev + 1                                        # ordered after the copy on a
    a.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), host + 1)


def test_the_hazard_is_real_without_the_wait():
    """The negative control: the same copy made by hand (no cache, no wait) is read on the
    second stream before it lands, so the test above can fail."""
    import cupy as cp
    host = np.random.default_rng(99).integers(0, 1 << 30, 1 << 22, dtype=np.int32)
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    dst = cp.full(host.shape, -1, cp.int32)
    cp.cuda.Device().synchronize()
    _spin(a)
    with a:
        dev = cp.asarray(host)
    with b:
        dst[...] = dev
    b.synchronize()
    assert not np.array_equal(cp.asnumpy(dst), host)
    a.synchronize()
