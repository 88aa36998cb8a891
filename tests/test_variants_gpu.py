"""Decode variants (window, soft cap, sinks) on the CUDA backend of a real GPU (skipped
cleanly without CuPy or a GPU): every path against the float64 oracle, NaN-poisoned
outputs (conftest), the prepared (recorded launch) path, cascade and sparse; a window
planned over a long context launches only the window's chunks."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LSE_ATOL, OUT_RTOL, PREFIX_RTOL, sinks_for, variant_kwargs

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import lse_error, max_rel_error, oracle_decode
from paged_decode.sparse import make_selection

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

HQ, HKV, D = 32, 8, 128
PATHS = [("v2", 10 ** 6), ("v2", 4), ("v1", None), ("gather", None)]


def _sinks(hq=HQ):
    return sinks_for(hq)


VARIANTS = {
    "window": {"window_left": 1000},
    "window-mid-page": {"window_left": 997},
    "cap": {"logits_soft_cap": 30.0},
    "cap-tight": {"logits_soft_cap": 1.0},
    "sinks": {"sinks": True},
    "all": {"window_left": 777, "logits_soft_cap": 5.0, "sinks": True},
}


@pytest.fixture(scope="module")
def cuda():
    return pd.get_backend("cuda")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants_match_oracle_on_cuda(cuda, variant, dtype):
    import cupy as cp
    pr = make_problem(ProblemSpec(4, 3000, HQ, HKV, D, 16, dtype, dtype, seed=5))
    kw = variant_kwargs(VARIANTS[variant], HQ)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    kwc = {**kw, "sinks": None if "sinks" not in kw else cp.asarray(kw["sinks"])}
    for path, ppc in PATHS:
        plan = pd.plan_decode(pr.table, HQ, HKV, D, device=cuda.device_info(),
                              pages_per_chunk=None if ppc is None else min(ppc, 1000),
                              window_left=kw.get("window_left", -1))
        out, lse = pd.decode(q, k, v, pr.table, plan, path=path, return_lse=True,
                             out_dtype=dtype, **kwc)
        what = (variant, dtype, pd.last_outcome().path, ppc)
        assert max_rel_error(cp.asnumpy(out), ref) <= OUT_RTOL[dtype], what
        assert lse_error(cp.asnumpy(lse), ref_lse) <= LSE_ATOL, what


def test_window_launches_only_the_window_chunks_and_prepares(cuda):
    import cupy as cp
    pr = make_problem(ProblemSpec(8, 32768, HQ, HKV, D, 16, jitter=False, seed=1))
    w = 4095
    plan = pd.plan_decode(pr.table, HQ, HKV, D, device=cuda.device_info(), window_left=w)
    short = make_problem(ProblemSpec(8, 4096, HQ, HKV, D, 16, jitter=False, seed=1))
    plan4k = pd.plan_decode(short.table, HQ, HKV, D, device=cuda.device_info())
    assert plan.num_chunks == plan4k.num_chunks
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    sk = cp.asarray(_sinks())
    prep = pd.prepare_decode(q, k, v, pr.table, plan, path="v2", return_lse=True,
                             window_left=w, logits_soft_cap=30.0, sinks=sk)
    out, lse = prep()
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, window_left=w,
                                 logits_soft_cap=30.0, sinks=cp.asnumpy(sk))
    assert max_rel_error(cp.asnumpy(out), ref) <= OUT_RTOL["float16"]
    assert lse_error(cp.asnumpy(lse), ref_lse) <= LSE_ATOL


def test_cascade_and_sparse_with_variants_on_cuda(cuda):
    import cupy as cp
    pool = pd.PagePool(num_pages=1024, page_size=16, num_kv_heads=HKV, head_dim=D,
                       dtype="float16", backend="cuda")
    rng = np.random.default_rng(2)
    root = pool.new_sequence()
    x = rng.standard_normal((2048, HKV, D)).astype(np.float16)
    pool.append(root, x, x)
    seqs = [pool.fork(root) for _ in range(8)]
    for s in seqs:
        y = rng.standard_normal((100, HKV, D)).astype(np.float16)
        pool.append(s, y, y)
    table = pool.page_table(seqs)
    q = cp.asarray(rng.standard_normal((8, HQ, D)).astype(np.float16))
    sk = _sinks()
    for kw, tol in (({"sinks": sk}, PREFIX_RTOL["float16"]),
                    ({"logits_soft_cap": 20.0, "sinks": sk}, OUT_RTOL["float16"])):
        ref, ref_lse = oracle_decode(cp.asnumpy(q), cp.asnumpy(pool.k), cp.asnumpy(pool.v),
                                     table, **kw)
        out, lse = pd.cascade_decode(q, pool.k, pool.v, table, return_lse=True,
                                     **{**kw, "sinks": cp.asarray(sk)})
        o = pd.last_outcome()
        assert o.path == "cascade", o
        assert max_rel_error(cp.asnumpy(out), ref) <= tol, o
        assert lse_error(cp.asnumpy(lse), ref_lse) <= LSE_ATOL, o
    kc = cp.asarray(rng.standard_normal((2, HKV, 4096, D)).astype(np.float16))
    pos = np.stack([np.stack([rng.choice(4000, 256, replace=False) for _ in range(HKV)])
                    for _ in range(2)])
    qs = cp.asarray(rng.standard_normal((2, HQ, D)).astype(np.float16))
    out = pd.sparse_decode(qs, kc, kc, make_selection(pos), live_lens=[4000, 4000],
                           window_left=2047, logits_soft_cap=10.0, sinks=cp.asarray(sk))
    assert pd.last_outcome().path == "sparse" and bool(cp.isfinite(out).all())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("hq,hkv", [(32, 8), (28, 4), (32, 2), (32, 1)],
                         ids=["g4", "g7", "g16", "g32"])
def test_v2tc_variants_match_oracle_on_cuda(cuda, variant, dtype, hq, hkv):
    """The tensor-core partial (mma.sync) with each variant: one chunk per request (the
    partial's final store takes the sinks) and split (the merge takes them), at GQA 4, 7,
    16 and 32 (two 16-row tiles)."""
    import cupy as cp

    from paged_decode.specs import v2tc_ctas_per_chunk
    pr = make_problem(ProblemSpec(4, 3000, hq, hkv, D, 16, dtype, dtype, seed=6))
    kw = variant_kwargs(VARIANTS[variant], hq)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    kwc = {**kw, "sinks": None if "sinks" not in kw else cp.asarray(kw["sinks"])}
    for ppc in (None, 10 ** 6, 4):
        plan = pd.plan_decode(pr.table, hq, hkv, D, device=cuda.device_info(),
                              pages_per_chunk=ppc, ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv),
                              window_left=kw.get("window_left", -1))
        for od in ("float32", dtype):
            out, lse = pd.decode(q, k, v, pr.table, plan, path="v2tc", return_lse=True,
                                 out_dtype=od, **kwc)
            o = pd.last_outcome()
            what = (variant, dtype, o.path, ppc, od)
            assert o.path == ("v2tc+merge" if plan.needs_merge else "v2tc"), what
            tol = max(PREFIX_RTOL[dtype], OUT_RTOL[od])
            assert max_rel_error(cp.asnumpy(out), ref) <= tol, what
            assert lse_error(cp.asnumpy(lse), ref_lse) <= LSE_ATOL, what


@pytest.mark.parametrize("cap", [1e-30, 0.7, 43.28, 1e9, 1e30], ids=str)
def test_soft_capped_logit_on_the_gpu(cap):
    """The CUDA logit under a cap on this GPU's exp2 and reciprocal approximations
    (``tests/test_soft_cap_logit.py`` runs the same kernel on the emulator): within its
    tolerance of ``c * tanh(x / c)`` in float64 over the same score sweep."""
    import cupy as cp
    from test_soft_cap_logit import LOGIT_TEST, check_logits, scores

    from paged_decode.backends.cuda_launch import COMPILE_OPTIONS
    x = scores(cap)
    mod = cp.RawModule(code=LOGIT_TEST, options=COMPILE_OPTIONS,
                       name_expressions=["pd_logit_test"])
    out = cp.full(x.size, np.nan, cp.float32)
    mod.get_function("pd_logit_test")((1,), (128,), (cp.asarray(x), out, np.float32(cap),
                                                      np.int32(x.size)))
    check_logits(cap, x, cp.asnumpy(out))
