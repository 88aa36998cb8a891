"""``PagePool.append_batch`` on the ``cuda`` backend (skipped cleanly where CuPy or a GPU
is missing): the model checks of ``test_append_batch.py`` on CuPy pools, and one launch
for one token of 128 sequences in 32 layers; the eager append's packed launches and
pinned descriptor buffers (``backends/cuda_append.py``).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from test_append_batch import GEOMETRIES, _forked, check, make, random_ops, rows, snapshot

import paged_decode as pd
from paged_decode.backends import availability

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]


@pytest.mark.parametrize("geom", [g[1] for g in GEOMETRIES], ids=[g[0] for g in GEOMETRIES])
def test_random_operations_match_the_model_on_cuda(geom):
    rng = np.random.default_rng(zlib.crc32(repr(sorted(geom.items())).encode()))
    pool, model = make("cuda", **geom)
    random_ops(pool, model, rng, 200)


@pytest.mark.parametrize("layers", [None, 3])
def test_copy_on_write_in_one_batch_on_cuda(layers):
    pool, model, rng, a, b = _forked("cuda", layers)
    k, v = rows(rng, pool, 5, layers is not None), rows(rng, pool, 5, layers is not None)
    got = pool.append_batch([a, b], k, v, counts=[1, 4])
    model.append_batch([a, b], k, v, [1, 4])
    check(pool, model)
    assert got.copies.tolist() == [[1, 2]]


def test_cuda_pools_agree_with_the_reference_bit_for_bit():
    """The same history on cuda and reference leaves identical pools, every slot."""
    got = []
    for backend in ("cuda", "reference"):
        rng = np.random.default_rng(5)
        pool, model = make(backend, 64, layers=4, heads=8, head_dim=128)
        random_ops(pool, model, rng, 60, check_every=20)
        got.append(snapshot(pool))
    assert got[0][:4] == got[1][:4]
    np.testing.assert_array_equal(got[0][4], got[1][4])
    np.testing.assert_array_equal(got[0][5], got[1][5])


def _count_eager(monkeypatch, be):
    """Count the appends ``cuda_append.EagerAppend`` launched (``run`` returned True)."""
    hits = []
    real = be._eager_append.run

    def counting(*a):
        ok = real(*a)
        hits.append(ok)
        return ok
    monkeypatch.setattr(be._eager_append, "run", counting)
    return hits


@pytest.mark.parametrize("geom", [g[1] for g in GEOMETRIES], ids=[g[0] for g in GEOMETRIES])
def test_random_operations_with_device_rows_in_the_pools_dtype(geom, monkeypatch):
    """Rows already on the device in the pool's dtype take the eager append
    (``cuda_append``: packed launches, the descriptor through pinned buffers): the model
    checks of every operation, and that path really ran."""
    be = pd.get_backend("cuda")
    hits = _count_eager(monkeypatch, be)
    rng = np.random.default_rng(zlib.crc32(repr(sorted(geom.items())).encode()) + 1)
    pool, model = make("cuda", **geom)
    random_ops(pool, model, rng, 200,
               to_pool=lambda a: be.append_row_arrays(pool.k, a, a)[0])
    assert sum(hits) >= 30, (sum(hits), len(hits))


def test_appends_queued_far_ahead_of_the_gpu_land_in_order(monkeypatch):
    """Many one-token appends queued behind a long GPU job, without a host sync: each
    step's descriptor differs, so a descriptor rewritten before its kernel ran would
    scramble the pool. The first append stages its descriptor through a pinned buffer;
    the rest read the worked-out descriptors (``AppendWrite.shared``, more of them than
    one lookahead holds) uploaded once. Compared slot for slot with the reference backend
    after the same history."""
    import cupy as cp

    from paged_decode.backends.cuda_append import DEPTH
    steps, b = 4 * DEPTH + 3, 24
    pools = {n: pd.PagePool(400, 4, 2, 16, "float16", num_layers=2, backend=n)
             for n in ("cuda", "reference")}
    rng = np.random.default_rng(11)
    lens = rng.integers(1, 9, b)
    prefill = rows(rng, pools["reference"], int(lens.sum()), True)
    step_rows = [rows(rng, pools["reference"], b, True) for _ in range(steps)]
    dev_rows = [cp.asarray(r.astype(np.float16)) for r in step_rows]
    ids = {}
    for name, pool in pools.items():
        ids[name] = np.array([pool.new_sequence() for _ in range(b)])
        pool.append_batch(ids[name], prefill, -prefill, counts=lens)
    cp.cuda.Device().synchronize()
    be = pools["cuda"].backend
    hits = _count_eager(monkeypatch, be)
    staged = []
    real_copy = be._eager_append._staging.copy
    monkeypatch.setattr(be._eager_append._staging, "copy",
                        lambda *a: (staged.append(1), real_copy(*a)))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.ones((4096, 4096), np.float32) / 4096
        for _ in range(8):                 # tens of milliseconds of GPU work first
            x = x @ x
        for r in dev_rows:
            pools["cuda"].append_batch(ids["cuda"], r, -r)
    stream.synchronize()
    assert hits == [True] * steps and len(staged) == 1, (hits, staged)
    for r in step_rows:
        pools["reference"].append_batch(ids["reference"], r, -r)
    got, want = snapshot(pools["cuda"]), snapshot(pools["reference"])
    assert got[:4] == want[:4]
    np.testing.assert_array_equal(got[4], want[4])
    np.testing.assert_array_equal(got[5], want[5])


def test_the_eager_append_stands_aside_while_a_stream_captures():
    """Under stream capture the eager append launches nothing and leaves the call to the
    general path (a graph must not hold a copy from a reused pinned buffer)."""
    import cupy as cp

    from paged_decode.kernels.append import AppendWrite
    be = pd.get_backend("cuda")
    pool = pd.PagePool(8, 4, 2, 16, "float16", backend="cuda")
    kr = cp.zeros((1, 2, 16), np.float16)
    write = AppendWrite(np.zeros((5, 1), np.int32), 1, 0, 1, False)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            ran = be._eager_append.run(pool.k, pool.v, kr, kr, write)
        finally:
            stream.end_capture()
    assert ran is False
    with stream:                           # and outside a capture it runs
        assert be._eager_append.run(pool.k, pool.v, kr, kr, write) is True
    stream.synchronize()


def test_one_token_for_128_sequences_and_32_layers_is_one_launch(monkeypatch):
    """Timing-free: one kernel launch in all (``CudaBackend._run`` and the eager append's
    ``cuLaunchKernel`` counted), of the append kernel with the grid (128, 32), and the
    rows land where the page table says."""
    import cupy as cp

    from paged_decode.specs import append_spec
    be = pd.get_backend("cuda")
    launched, driver = [], []
    real_run, real_driver = be._run, cp.cuda.driver.launchKernel

    def counting(lc):
        launched.append(lc)
        real_run(lc)

    def counting_driver(fn, gx, gy, *rest):
        driver.append((fn, gx, gy))
        real_driver(fn, gx, gy, *rest)
    monkeypatch.setattr(be, "_run", counting)
    monkeypatch.setattr(cp.cuda.driver, "launchKernel", counting_driver)
    pool = pd.PagePool(256, 16, 8, 128, "float16", num_layers=32, backend="cuda")
    seqs = np.array([pool.new_sequence() for _ in range(128)])
    rng = np.random.default_rng(0)
    first = cp.asarray(rng.standard_normal((32, 128 * 5, 8, 128)).astype(np.float16))
    pool.append_batch(seqs, first, -first, counts=np.full(128, 5))
    launched.clear()
    driver.clear()
    one = cp.asarray(rng.standard_normal((32, 128, 8, 128)).astype(np.float16))
    minus = -one
    pool.append_batch(seqs, one, minus)
    cp.cuda.get_current_stream().synchronize()
    assert launched == [] and len(driver) == 1
    kernel = be.kernel(append_spec("float16", 16))
    assert driver[0] == (int(kernel.kernel.ptr), 128, 32)
    t = pool.page_table(seqs)
    pages = cp.asarray(t.indices[t.indptr[1:] - 1])      # each sequence's last page
    slot = int(t.last_page_len[0]) - 1
    np.testing.assert_array_equal(cp.asnumpy(pool.k[:, pages, slot]), cp.asnumpy(one))
    np.testing.assert_array_equal(cp.asnumpy(pool.v[:, pages, slot]), -cp.asnumpy(one))
