"""Decode variants (#14 items 2 and 3): sliding window, logits soft cap, attention sinks.

Every path against the float64 oracle (whose window is a slice of the full run and whose
sinks and cap are written out in ``reference.attention_f64``, independently of the
package's window table and merge): the reference backend and the real kernel sources of
both dialects on the CPU emulator; v2 with one chunk (the partial's store takes the
sinks) and split (the merge takes them), v1, the gather arm; cascade and sparse; windows
smaller than a page, crossing pages and longer than the context, with first-page offsets
and empty requests; NaN-poisoned outputs; the non-finite rules; one test per bad
argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import LSE_ATOL, VARIANTS, assert_matches_oracle, sinks_for, table_of, variant_kwargs

import paged_decode as pd
from paged_decode import get_backend
from paged_decode.errors import InvalidArgumentError, PlanMismatchError, UnsupportedProblemError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import attention_f64, lse_error, oracle_decode, request_kv_f64
from paged_decode.sparse import make_selection, selection_mask
from paged_decode.variants import PLAIN, Variant, check_path, window_table

LOG2E = 1.0 / math.log(2.0)
BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]
HQ, HKV, D, P = 8, 2, 64, 16


def _sinks(hq: int = HQ, seed: int = 3) -> np.ndarray:
    return sinks_for(hq, seed)


#: (path, pages_per_chunk): v2 one chunk per request (the partial stores the output), v2
#: split to single pages (the merge), v1, the gather arm
PATHS = [("v2", 10 ** 6), ("v2", 1), ("v1", None), ("gather", None)]


def _kw(name: str, hq: int = HQ) -> dict:
    return variant_kwargs(VARIANTS[name], hq)


def _problem(dtype: str = "float16", hq: int = HQ, seed: int = 0):
    # jitter: partial last pages and mid-page starts (first_page_offset > 0)
    return make_problem(ProblemSpec(3, 70, hq, HKV, D, P, dtype, dtype, seed=seed))


def _run(be, pr, path, ppc, kw, out_dtype, hq=HQ):
    plan = pd.plan_decode(pr.table, hq, HKV, D, device=be.device_info(),
                          pages_per_chunk=None if ppc is None else min(ppc, 64),
                          window_left=kw.get("window_left", -1))
    sinks = kw.get("sinks")
    kw = {**kw, "sinks": None if sinks is None else be.asarray(sinks)}
    out = be.asarray(np.full((pr.table.batch_size, hq, D), np.nan, out_dtype))
    got, lse = pd.decode(be.asarray(pr.q), be.asarray(pr.k_pages), be.asarray(pr.v_pages),
                         pr.table, plan, path=path, return_lse=True, out=out,
                         out_dtype=out_dtype, backend=be, **kw)
    return be.to_numpy(got), be.to_numpy(lse), plan


@pytest.mark.parametrize("path,ppc", PATHS, ids=["v2-one", "v2-split", "v1", "gather"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_variants_match_oracle(backend_name, variant, path, ppc):
    if path == "gather" and backend_name != "reference":
        pytest.skip("the emulated backends' gather arm is the reference backend's")
    be = get_backend(backend_name)
    pr = _problem()
    kw = _kw(variant)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    out, lse, plan = _run(be, pr, path, ppc, kw, "float32")
    o = pd.last_outcome()
    assert o.path.startswith(path), o
    if path == "v2":   # one chunk: the partial's store; split: the merge (W = 0: 1 page)
        assert o.path == ("v2+merge" if plan.needs_merge else "v2"), o
        assert plan.needs_merge == (ppc == 1 and variant != "w0"), o
    for name in kw:
        assert name in o.detail, o
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", f"{backend_name} {o}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_combined_variants_every_dtype(backend_name, dtype):
    """All three variants at once, in every dtype, with a GQA group of 3 (the per-head
    softmax phase; 4 takes the transposed one), one chunk and split."""
    be = get_backend(backend_name)
    hq = 6
    pr = _problem(dtype, hq=hq, seed=2)
    kw = _kw("all", hq)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    for ppc in (10 ** 6, 1):
        out, lse, _ = _run(be, pr, "v2", ppc, kw, dtype, hq=hq)
        assert_matches_oracle(out, lse, ref, ref_lse, dtype, f"{backend_name} ppc {ppc}")


def test_oracle_variants_follow_their_definitions():
    """The oracle against the plain oracle: a huge cap changes nothing, a -inf sink
    changes nothing, a sink rescales the output by 1 / (1 + e^(sink - lse)) and adds
    itself to the LSE, a window equals the plain decode of a table holding only the
    window's tokens."""
    pr = _problem("float32")
    q, k, v, t = pr.q, pr.k_pages, pr.v_pages, pr.table
    plain, plain_lse = oracle_decode(q, k, v, t)
    big, big_lse = oracle_decode(q, k, v, t, logits_soft_cap=1e9)
    assert np.allclose(big, plain, atol=1e-12) and np.allclose(big_lse, plain_lse)
    none, none_lse = oracle_decode(q, k, v, t, sinks=np.full(HQ, -np.inf, np.float32))
    assert np.array_equal(none, plain) and np.array_equal(none_lse, plain_lse)
    sk = _sinks()
    got, got_lse = oracle_decode(q, k, v, t, sinks=sk)
    nat = plain_lse / LOG2E
    want_lse = np.logaddexp(nat, sk[None, :]) * LOG2E
    assert np.allclose(got_lse, want_lse, atol=1e-12)
    assert np.allclose(got, plain * np.exp(nat - want_lse / LOG2E)[..., None], atol=1e-12)
    capped, _ = oracle_decode(q, k, v, t, logits_soft_cap=0.5)
    assert np.abs(capped - plain).max() > 1e-3           # the cap does something here
    wt = window_table(t, 9)
    w_ref, w_lse = oracle_decode(q, k, v, t, window_left=9)
    assert np.array_equal(wt.visible_lens, np.minimum(t.visible_lens, 10))
    plain_w, plain_w_lse = oracle_decode(q, k, v, wt)
    assert np.allclose(w_ref, plain_w) and np.allclose(w_lse, plain_w_lse)


# ---------------------------------------------------------------------------- window table
@pytest.mark.parametrize("w", [-1, 0, 3, 15, 16, 17, 40, 500])
def test_window_table_holds_exactly_the_last_tokens(w):
    """Windows below, at and across page boundaries and beyond the context, over requests
    with first-page offsets, a one-page request and an empty one."""
    t = table_of(lengths=[45, 7, 0, 33, 16], fpo=[3, 9, 0, 0, 15], page_size=P)
    k = np.random.default_rng(0).standard_normal((t.num_pages or 40, P, 1, 4))
    wt = window_table(t, w)
    assert np.array_equal(wt.visible_lens,
                          t.visible_lens if w < 0 else np.minimum(t.visible_lens, w + 1))
    for r in range(t.batch_size):
        full = request_kv_f64(k, t, r)
        want = full if w < 0 else full[max(0, full.shape[0] - 1 - w):]
        assert np.array_equal(request_kv_f64(k, wt, r), want), r
        # no page wholly before the window is kept: the first page holds the first token
        assert wt.first_page_offset[r] < P
    assert window_table(t, w) is window_table(t, w)          # memoised per (table, W)


def test_plan_covers_only_the_window_pages():
    """W = 4095 over a 32K context plans the chunks of a 4K decode (the cost follows W):
    the chunk count and the pages planned equal those of a table holding 4096 tokens."""
    ctx, w = 32768, 4095
    long = table_of(lengths=[ctx] * 4, page_size=P)
    short = table_of(lengths=[w + 1] * 4, page_size=P)
    dev = get_backend("reference").device_info()
    for ppc in (None, 8):
        pw = pd.plan_decode(long, 32, 8, 128, device=dev, window_left=w, pages_per_chunk=ppc)
        ps = pd.plan_decode(short, 32, 8, 128, device=dev, pages_per_chunk=ppc)
        assert pw.num_chunks == ps.num_chunks, (ppc, pw.num_chunks, ps.num_chunks)
        assert pw.window_left == w and pw.matches(long)
    assert window_table(long, w).total_pages == short.total_pages
    # a window starting mid-page spans one page more, never the context
    mid = table_of(lengths=[ctx - 5] * 4, page_size=P)
    pw = pd.plan_decode(mid, 32, 8, 128, device=dev, window_left=w, pages_per_chunk=1)
    assert pw.num_chunks == 4 * (w + 1) // P + 4


def test_plan_window_must_match_the_call():
    pr = _problem("float32")
    be = get_backend("reference")
    plan = pd.plan_decode(pr.table, HQ, HKV, D, device=be.device_info())
    with pytest.raises(PlanMismatchError, match="window_left = -1, got 8"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, window_left=8, backend=be)
    plan8 = pd.plan_decode(pr.table, HQ, HKV, D, device=be.device_info(), window_left=8)
    with pytest.raises(PlanMismatchError, match="window_left = 8, got -1"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan8, backend=be)


# ---------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_empty_request_with_sinks_gives_zeros_and_the_sinks_lse(backend_name):
    be = get_backend(backend_name)
    t = table_of(lengths=[0, 30, 0], page_size=P, spare_pages=2)
    rng = np.random.default_rng(4)
    k = rng.standard_normal((t.num_pages, P, HKV, D)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((3, HQ, D)).astype(np.float32)
    sk = _sinks()
    ref, ref_lse = oracle_decode(q, k, v, t, sinks=sk)
    assert np.array_equal(ref[0], np.zeros((HQ, D)))
    assert np.allclose(ref_lse[0], sk * LOG2E)
    pr = type("Pr", (), {"q": q, "k_pages": k, "v_pages": v, "table": t})
    for path, ppc in PATHS:
        if path == "gather" and backend_name != "reference":
            continue
        out, lse, _ = _run(be, pr, path, ppc, {"sinks": sk, "window_left": 4}, "float32")
        ref_w, ref_wl = oracle_decode(q, k, v, t, sinks=sk, window_left=4)
        assert_matches_oracle(out, lse, ref_w, ref_wl, "float32", f"{path} {ppc}")
        assert np.array_equal(out[[0, 2]], np.zeros((2, HQ, D)))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_non_finite_rules_hold_with_variants(backend_name):
    """An infinite K element poisons its heads even under a soft cap (tanh would make the
    score finite); a NaN or +inf sink poisons its head; a -inf sink is no sink."""
    be = get_backend(backend_name)
    pr = _problem("float32")
    k = pr.k_pages.copy()
    r0_page = int(pr.table.request_pages(1)[-1])
    k[r0_page, 0, 1, 0] = np.inf                     # request 1, KV head 1 (if visible)
    sk = _sinks()
    sk[0], sk[1], sk[2] = np.nan, np.inf, -np.inf
    kw = {"logits_soft_cap": 1.0, "sinks": sk}
    ref, ref_lse = oracle_decode(pr.q, k, pr.v_pages, pr.table, **kw)
    bad = np.isnan(ref_lse)
    assert bad[:, :2].all() and not bad[:, 2].any() and bad[1, HQ // 2:].any()
    pr2 = type("Pr", (), {"q": pr.q, "k_pages": k, "v_pages": pr.v_pages, "table": pr.table})
    for path, ppc in PATHS:
        if path == "gather" and backend_name != "reference":
            continue
        out, lse, _ = _run(be, pr2, path, ppc, kw, "float32")
        assert np.array_equal(np.isnan(lse), bad), (path, ppc)
        assert np.array_equal(np.isnan(out).any(-1), bad), (path, ppc)
        assert np.allclose(out[~bad], ref[~bad], atol=1e-5)
        assert np.abs(lse[~bad] - ref_lse[~bad]).max() <= LSE_ATOL


# ---------------------------------------------------------------------------- merge, cascade
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_merge_takes_each_sink_once_per_group(backend_name):
    be = get_backend(backend_name)
    rng = np.random.default_rng(6)
    sizes = [3, 0, 1, 5]
    ip = np.concatenate([[0], np.cumsum(sizes)])
    n, h, d = int(ip[-1]), 4, 64
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = rng.uniform(-3, 3, (n, h)).astype(np.float32)
    sk = _sinks(h)
    out, lse_out = (be.to_numpy(x) for x in pd.merge_states(be.asarray(v), be.asarray(lse),
                                                              ip, backend=be,
                                                              sinks=be.asarray(sk)))
    for g in range(len(sizes)):
        w = np.exp2(lse[ip[g]:ip[g + 1]].astype(np.float64))        # [n_g, H]
        den = w.sum(0) + np.exp(sk.astype(np.float64))
        want = (w[..., None] * v[ip[g]:ip[g + 1]]).sum(0) / den[:, None]
        assert np.allclose(out[g], want, atol=1e-6), g
        assert np.allclose(lse_out[g], np.log2(den), atol=1e-5), g


def _forked(dtype="float16", seed=0):
    """Four requests forked from one 6-page prompt, each with 2 private pages (8 x 16
    tokens): a window of 6 pages starts on a page boundary after 2 of the shared pages."""
    pool = pd.PagePool(num_pages=64, page_size=P, num_kv_heads=HKV, head_dim=D, dtype=dtype)
    rng = np.random.default_rng(seed)
    root = pool.new_sequence()
    x = rng.standard_normal((6 * P, HKV, D)).astype(dtype)
    pool.append(root, x, x[::-1].copy())
    seqs = [pool.fork(root) for _ in range(4)]
    for s in seqs:
        y = rng.standard_normal((2 * P, HKV, D)).astype(dtype)
        pool.append(s, y, -y)
    table = pool.page_table(seqs)
    q = rng.standard_normal((4, HQ, D)).astype(dtype)
    return pool, table, q


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("variant", ["cap", "sinks", "all-aligned"])
def test_cascade_with_variants(backend_name, variant):
    be = get_backend(backend_name)
    pool, table, q = _forked()
    kw = {"cap": {"logits_soft_cap": 1.5}, "sinks": {"sinks": _sinks()},
          "all-aligned": {"window_left": 6 * P - 1, "logits_soft_cap": 2.0,
                          "sinks": _sinks()}}[variant]
    ref, ref_lse = oracle_decode(q, pool.k, pool.v, table, **kw)
    kwb = {**kw, "sinks": be.asarray(kw["sinks"]) if "sinks" in kw else None}
    # the group is detected on the window table (2 pages shared once the window drops 2)
    prefix = pd.detect_shared_prefix(window_table(table, kw.get("window_left", -1)),
                                     min_shared_pages=2)
    assert prefix is not None and prefix.num_members == 4
    out, lse = pd.cascade_decode(be.asarray(q), be.asarray(pool.k), be.asarray(pool.v), table,
                                 return_lse=True, out_dtype="float32", backend=be,
                                 cascade_plan=prefix, **kwb)
    o = pd.last_outcome()
    assert o.path == "cascade", o
    if "logits_soft_cap" in kw and be.device_info().prefix_tile_rows:
        assert "no logits soft cap" in o.detail, o
    # float16 pools: the tensor-core level 0 rounds its weights to them (PREFIX_RTOL)
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float16", str(o))


# ---------------------------------------------------------------------------- sparse
def _sparse_oracle(q, k, v, positions, live, w, cap, sinks):
    """float64 attention over the selected positions inside each request's window."""
    b, hkv, _, d = k.shape
    g = q.shape[1] // hkv
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:2], -np.inf)
    for bi in range(b):
        start = 0 if w < 0 else max(0, live[bi] - 1 - w)
        for h in range(hkv):
            pos = np.asarray([p for p in positions[bi, h] if p >= start], np.int64)
            kk = k[bi, h, pos].astype(np.float64)[:, None, :]
            vv = v[bi, h, pos].astype(np.float64)[:, None, :]
            hs = slice(h * g, (h + 1) * g)
            out[bi, hs], lse[bi, hs] = attention_f64(
                q[bi, hs].astype(np.float64), kk, vv, 1 / math.sqrt(d), soft_cap=cap,
                sinks=None if sinks is None else sinks[hs])
    return out, lse


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("min_sparsity", [0.0, 1e9], ids=["fused", "masked"])
def test_sparse_with_variants(backend_name, min_sparsity):
    be = get_backend(backend_name)
    rng = np.random.default_rng(8)
    b, cap_tokens = 2, 96
    k = rng.standard_normal((b, HKV, cap_tokens, D)).astype(np.float32)
    v = rng.standard_normal(k.shape).astype(np.float32)
    q = rng.standard_normal((b, HQ, D)).astype(np.float32)
    live = np.array([90, 41])
    pos = np.stack([np.stack([rng.choice(live[bi], 20, replace=False) for _ in range(HKV)])
                    for bi in range(b)])
    sk = _sinks()
    for w, cap_, sinks in [(30, None, None), (-1, 1.5, None), (-1, None, sk), (12, 2.0, sk)]:
        ref, ref_lse = _sparse_oracle(q, k, v, pos, live, w, cap_, sinks)
        out, lse, o = pd.sparse_decode(
            be.asarray(q), be.asarray(k), be.asarray(v), make_selection(pos), live_lens=live,
            min_sparsity=min_sparsity, return_lse=True, return_outcome=True, backend=be,
            window_left=w, logits_soft_cap=cap_,
            sinks=None if sinks is None else be.asarray(sinks))
        assert o.path == ("sparse" if min_sparsity == 0 else "sparse-masked"), o
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                              f"{o} w={w}")
    # the window drops selected rows before the gate counts them
    assert o.visible_tokens < int((selection_mask(make_selection(pos), cap_tokens)).sum())


# ---------------------------------------------------------------------------- prepared calls
@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_prepared_and_fast_path_calls_keep_their_variants(backend_name):
    be = get_backend(backend_name)
    pr = _problem("float32")
    sk = be.asarray(_sinks())
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    plan = pd.plan_decode(pr.table, HQ, HKV, D, device=be.device_info(), pages_per_chunk=1,
                          window_left=20)
    prep = pd.prepare_decode(q, k, v, pr.table, plan, path="v2", return_lse=True,
                             out_dtype="float32", backend=be, window_left=20,
                             logits_soft_cap=3.0, sinks=sk)
    for _ in range(2):
        out, lse = prep()
        ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, window_left=20,
                                     logits_soft_cap=3.0, sinks=be.to_numpy(sk))
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32")
        sk[...] = sk * 0.5 - 1.0            # bound: the next call reads the new values
    # decode's fast path keys on the variants: a different cap is a different call
    out = be.asarray(np.zeros((3, HQ, D), np.float32))
    lse = be.asarray(np.zeros((3, HQ), np.float32))
    results = []
    for cap in (1.0, 4.0, 1.0):
        pd.decode(q, k, v, pr.table, plan, path="v2", out=out, lse=lse, return_lse=True,
                  backend=be, window_left=20, logits_soft_cap=cap)
        ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, window_left=20,
                                     logits_soft_cap=cap)
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32")
        results.append(be.to_numpy(out).copy())
    assert np.array_equal(results[0], results[2])
    assert not np.array_equal(results[0], results[1])


# ---------------------------------------------------------------------------- refusals, errors
def test_paths_without_a_variant_refuse_it_in_one_place():
    for path in ("v2", "v2tc"):        # v2tc: tests/test_v2tc_variants.py
        check_path("decode", "reference", path, Variant(3, 1.0, np.zeros(2, np.float32)))
    check_path("decode", "reference", "future", PLAIN)        # plain: any path
    for v in (Variant(window_left=3), Variant(soft_cap=1.0),
              Variant(sinks=np.zeros(2, np.float32))):
        with pytest.raises(UnsupportedProblemError, match=r"path 'future' .* does not "
                                                          f"implement {v.names[0]}"):
            check_path("decode", "cuda", "future", v)


CAP_MSG = r"logits_soft_cap must be None or a finite number in \[1e-30, 1e\+30\], got "
BAD = [
    ("window_left", -2, "window_left must be an integer >= -1, got -2"),
    ("window_left", 2.0, "window_left must be an integer >= -1, got 2.0"),
    ("window_left", True, "window_left must be an integer >= -1, got True"),
    ("window_left", "8", "window_left must be an integer >= -1, got '8'"),
    ("logits_soft_cap", 0.0, CAP_MSG + "0.0"),
    ("logits_soft_cap", -1.0, CAP_MSG + "-1.0"),
    ("logits_soft_cap", math.inf, CAP_MSG + "inf"),
    ("logits_soft_cap", math.nan, CAP_MSG + "nan"),
    ("logits_soft_cap", "30", CAP_MSG + "'30'"),
    ("logits_soft_cap", True, CAP_MSG + "True"),
    # the kernels multiply by 1 / cap: a cap whose reciprocal would leave float32's normal
    # numbers is refused (a larger cap is no cap: None)
    ("logits_soft_cap", 1e-31, CAP_MSG + "1e-31"),
    ("logits_soft_cap", 1e31, CAP_MSG + r"1e\+31"),
    ("sinks", np.zeros(HQ + 1, np.float32), r"sinks must have shape \[Hq\] = \[8\], got \[9\]"),
    ("sinks", np.zeros((1, HQ), np.float32), r"sinks must have shape \[Hq\] = \[8\], got \[1, 8\]"),
    ("sinks", np.zeros(HQ, np.float16), "sinks must be float32, got float16"),
    ("sinks", list(range(HQ)), "sinks must be float32, got int64"),
    ("sinks", np.zeros(2 * HQ, np.float32)[::2], "sinks must be C-contiguous"),
    ("sinks", object(), "sinks must be an array the reference backend can use, got object"),
]


@pytest.mark.parametrize("entry", ["decode", "prepare_decode", "cascade_decode"])
@pytest.mark.parametrize("name,value,msg", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in
                                                       enumerate(BAD)])
def test_bad_variant_arguments_are_refused(entry, name, value, msg):
    pr = _problem("float32")
    fn = getattr(pd, entry)
    with pytest.raises(InvalidArgumentError, match=f"^{entry}: {msg}"):
        fn(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="reference", **{name: value})


@pytest.mark.parametrize("name,value,msg", BAD[::3], ids=[n for n, _, _ in BAD[::3]])
def test_bad_variant_arguments_are_refused_by_sparse_decode(name, value, msg):
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, HKV, 32, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    with pytest.raises(InvalidArgumentError, match=f"^sparse_decode: {msg}"):
        pd.sparse_decode(q, k, k, np.zeros((1, HKV, 4), np.int64) + np.arange(4),
                         live_lens=[32], backend="reference", **{name: value})


def test_bad_sinks_are_refused_by_merge_states():
    v = np.zeros((2, 4, 64), np.float32)
    lse = np.zeros((2, 4), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"^merge_states: sinks must have shape "
                                                   r"\[Hq\] = \[4\], got \[3\]"):
        pd.merge_states(v, lse, [0, 2], sinks=np.zeros(3, np.float32))


def test_lse_error_sees_a_missing_sink():
    """Negative control: the plain decode is far from the oracle with sinks (the tests
    above can fail)."""
    pr = _problem("float32")
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, sinks=_sinks())
    _, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, return_lse=True,
                       backend="reference")
    assert lse_error(lse, ref_lse) > 100 * LSE_ATOL


def test_mlx_gather_and_merge_with_variants():
    """The ``mlx`` backend (MLX ops: the gather arm, the merge) with every variant; the
    soft cap takes its float32 logits pass, sinks join through ``with_sink``."""
    from helpers import require_mlx
    mx = require_mlx()
    be = get_backend("mlx")
    pr = _problem("float32")
    kw = _kw("all")
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    for lse_wanted in (True, False):
        res = pd.decode(mx.array(pr.q), mx.array(pr.k_pages), mx.array(pr.v_pages), pr.table,
                        return_lse=lse_wanted, backend=be, window_left=kw["window_left"],
                        logits_soft_cap=kw["logits_soft_cap"], sinks=mx.array(kw["sinks"]))
        out, lse = res if lse_wanted else (res, None)
        assert_matches_oracle(np.array(out), None if lse is None else np.array(lse), ref,
                              ref_lse, "float32", f"mlx lse={lse_wanted}")
    # sinks without a cap: SDPA's output, then the sink joined
    kw = _kw("sinks")
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    out = pd.decode(mx.array(pr.q), mx.array(pr.k_pages), mx.array(pr.v_pages), pr.table,
                    backend=be, sinks=mx.array(kw["sinks"]))
    assert_matches_oracle(np.array(out), None, ref, ref_lse, "float32", "mlx sinks")
    v = np.random.default_rng(1).standard_normal((5, HQ, D)).astype(np.float32)
    lse = np.random.default_rng(2).uniform(-2, 2, (5, HQ)).astype(np.float32)
    got = pd.merge_states(mx.array(v), mx.array(lse), [0, 2, 2, 5], backend=be,
                          sinks=mx.array(kw["sinks"]))
    want = pd.merge_states(v, lse, [0, 2, 2, 5], backend="reference", sinks=kw["sinks"])
    assert np.allclose(np.array(got[0]), want[0], atol=1e-6)
    assert np.allclose(np.array(got[1]), want[1], atol=1e-5)


@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_step_tables_take_cap_and_sinks_and_refuse_a_window(backend_name):
    """A pool's device-resident step table: the kernel variants (cap, sinks) run on it;
    a window needs the host table (refused by name, never a wrong answer)."""
    be = get_backend(backend_name)
    pool = pd.PagePool(num_pages=64, page_size=P, num_kv_heads=HKV, head_dim=D,
                       dtype="float32", backend=be)
    rng = np.random.default_rng(0)
    seqs = [pool.new_sequence() for _ in range(3)]
    for n, s in zip((40, 7, 33), seqs):
        x = rng.standard_normal((n, HKV, D)).astype(np.float32)
        pool.append(s, x, -x)
    st = pool.step_table(seqs)
    host = st.page_table()
    qq = np.random.default_rng(1).standard_normal((len(seqs), HQ, D)).astype(np.float32)
    sk = _sinks()
    ref, ref_lse = oracle_decode(qq, be.to_numpy(pool.k), be.to_numpy(pool.v), host,
                                 logits_soft_cap=2.0, sinks=sk)
    out, lse = pd.decode(be.asarray(qq), pool.k, pool.v, st, path="v2", return_lse=True,
                         backend=be, logits_soft_cap=2.0, sinks=be.asarray(sk))
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32")
    with pytest.raises(UnsupportedProblemError, match="^decode: window_left needs a "
                                                      "PageTable"):
        pd.decode(be.asarray(qq), pool.k, pool.v, st, backend=be, window_left=8)
