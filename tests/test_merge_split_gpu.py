"""The split merge (``kernels/merge.py`` ``SPLIT``: several warps per (row, head)) on a
real GPU (skipped cleanly without one).

The emulator runs each block's warps as fibers under a few schedules; on the GPU the
warps of a block really race to the shared-memory combine, and thousands of partials per
group run through the 8-wide loads. Every split is compared with the float64 closed form
(the reference backend's ``merge_states``) over NaN-poisoned outputs, and the decodes the
split serves (batch 1 over hundreds of chunks per head, on both partials) with the
float64 oracle and with the unsplit merge. ``bench/device/run.sh merge-split`` runs this
module under compute-sanitizer memcheck and racecheck too.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, tc_out_tol

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.launching import MERGE_SPLIT_ENV
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

SIZES = [0, 1, 7, 8, 33, 64, 65, 130, 257, 300, 1000, 4097]


def _states(rng, n, h, d):
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = rng.uniform(-8, 12, (n, h)).astype(np.float32)
    empty = rng.random((n, h)) < 0.1
    lse[empty] = -np.inf
    v[empty] = np.nan                  # an empty partial's V must never be read
    return v, lse


@pytest.mark.parametrize("split", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("gather", [False, True])
def test_split_merge_matches_closed_form(monkeypatch, split, d, gather):
    import cupy as cp
    monkeypatch.setenv(MERGE_SPLIT_ENV, str(split))
    be = pd.get_backend("cuda")
    rng = np.random.default_rng(split * 7 + d)
    indptr = np.concatenate([[0], np.cumsum(SIZES)]).astype(np.int32)
    n, h, m = int(indptr[-1]), 3, len(SIZES)
    v, lse = _states(rng, n, h, d)
    lse[indptr[10] + 3000, 2] = np.nan       # poisons (group 10, head 2) only
    ref_v, ref_l = pd.merge_states(np.where(np.isneginf(lse)[..., None], 0, v), lse, indptr,
                                   backend="reference")
    kw = {}
    if gather:
        perm = rng.permutation(n).astype(np.int32)
        sv, sl = np.empty_like(v), np.empty_like(lse)
        sv[perm], sl[perm] = v, lse
        v, lse, kw = sv, sl, {"rows": cp.asarray(perm)}
    vo = cp.full((m, h, d), np.nan, cp.float32)
    lo = cp.full((m, h), np.nan, cp.float32)
    for _ in range(3):                       # races show up run to run
        be.merge(cp.asarray(v), cp.asarray(lse), indptr, vo, lo, **kw)
        got_v, got_l = vo.get(), lo.get()
        assert np.array_equal(np.isnan(got_l), np.isnan(ref_l))
        assert np.isnan(got_v[np.isnan(ref_l)]).all()          # the poisoned group's rows
        fin = np.isfinite(ref_l)
        np.testing.assert_allclose(got_l[fin], ref_l[fin], rtol=0, atol=2e-5)
        np.testing.assert_allclose(got_v[fin], ref_v[fin], rtol=0, atol=2e-5)
        empty = np.isneginf(ref_l)                              # every empty group
        assert empty[0].all() and np.isneginf(got_l[empty]).all()
        assert (got_v[empty] == 0).all()
        vo.fill(np.nan)
        lo.fill(np.nan)


@pytest.mark.parametrize("path, hq, hkv, ctx", [
    ("v2tc", 8, 1, 32768), ("v2", 8, 1, 32768), ("v2tc", 32, 2, 16384),
    ("v2", 32, 8, 16384), ("v2tc", 28, 4, 8192)])
def test_batch1_decode_with_the_split_merge(monkeypatch, path, hq, hkv, ctx):
    """A batch-1 decode whose plan gives hundreds of chunks per head: the rule picks a
    split (asserted), the result matches the float64 oracle, and the unsplit merge
    (``PAGED_DECODE_MERGE_SPLIT=1``) gives the same result to float32 rounding."""
    import cupy as cp

    from paged_decode.backends import launches
    be = pd.get_backend("cuda")
    spec = ProblemSpec(1, ctx, hq, hkv, 128, 16, seed=ctx + hq)
    pr = make_problem(spec)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    cp.cuda.Device().synchronize()
    cpc = v2tc_ctas_per_chunk(hq, hkv) if path == "v2tc" else None
    plan = pd.plan_decode(pr.table, hq, hkv, 128, device=be.device_info(), ctas_per_chunk=cpc)
    assert plan.needs_merge
    split = launches.merge_split(1, hq, plan.num_chunks, be.device_info().compute_units,
                                  plan.head_dim)
    assert split > 1, plan.num_chunks
    monkeypatch.setenv("PAGED_DECODE_FUSED_MERGE", "0")
    outs = {}
    for forced in ("", "1"):
        monkeypatch.setenv(MERGE_SPLIT_ENV, forced)
        out = cp.full(q.shape, np.nan, cp.float32)
        lse = cp.full(q.shape[:2], np.nan, cp.float32)
        pd.decode(q, k, v, pr.table, plan, path=path, out=out, lse=lse, out_dtype="float32")
        outs[forced] = (out.get(), lse.get())
    ref_o, ref_l = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    tol = tc_out_tol("float16", "float32") if path == "v2tc" else None
    assert_matches_oracle(*outs[""], ref_o, ref_l, "float32", f"{path} split {split}", tol=tol)
    np.testing.assert_allclose(outs[""][0], outs["1"][0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(outs[""][1], outs["1"][1], rtol=0, atol=1e-5)
