"""``PagePool.append_batch`` on the ``cuda`` backend (skipped cleanly where CuPy or a GPU
is missing): the model checks of ``test_append_batch.py`` on CuPy pools, and one launch
for one token of 128 sequences in 32 layers. Not run yet (no GPU where this was written).
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


def test_one_token_for_128_sequences_and_32_layers_is_one_launch(monkeypatch):
    """Timing-free: the backend's launch path (``CudaBackend._run``) sees one launch, and
    the rows land where the page table says."""
    import cupy as cp
    be = pd.get_backend("cuda")
    launched = []
    real = be._run

    def counting(lc):
        launched.append(lc)
        real(lc)
    monkeypatch.setattr(be, "_run", counting)
    pool = pd.PagePool(256, 16, 8, 128, "float16", num_layers=32, backend="cuda")
    seqs = np.array([pool.new_sequence() for _ in range(128)])
    rng = np.random.default_rng(0)
    first = cp.asarray(rng.standard_normal((32, 128 * 5, 8, 128)).astype(np.float16))
    pool.append_batch(seqs, first, -first, counts=np.full(128, 5))
    launched.clear()
    one = cp.asarray(rng.standard_normal((32, 128, 8, 128)).astype(np.float16))
    pool.append_batch(seqs, one, -one)
    cp.cuda.get_current_stream().synchronize()
    assert len(launched) == 1
    assert launched[0].spec.uri == "pd_append_o-f16_vb-16"
    assert launched[0].grid == (128, 32)
    t = pool.page_table(seqs)
    pages = cp.asarray(t.indices[t.indptr[1:] - 1])      # each sequence's last page
    slot = int(t.last_page_len[0]) - 1
    np.testing.assert_array_equal(cp.asnumpy(pool.k[:, pages, slot]), cp.asnumpy(one))
    np.testing.assert_array_equal(cp.asnumpy(pool.v[:, pages, slot]), -cp.asnumpy(one))
