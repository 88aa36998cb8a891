"""Multi-token decode (#14 item 4): 1-8 query tokens per request, causal within them.

Every path against the float64 oracle (``reference.oracle_decode`` walks each token's own
range, ``< L - T + t + 1``, independently of the package's common-range / pieces split):
the reference backend and the real CUDA and Metal kernel sources on the CPU emulator; v2
one chunk and split, v2tc (float16 / bfloat16, folded groups of one and two 16-row
tiles), v1 and the gather arm; uniform ``q [B, T, Hq, D]`` and ragged ``qo_indptr``
counts, T in 1..8, GQA groups 1-8, page sizes 1 and 16, first-page offsets, requests
holding only their new tokens (``L == T``), windows (shorter than ``T - 1``, so there is no
common range, and longer), soft cap and sinks; NaN-poisoned outputs (conftest) and
NaN-filled pools outside every request's tokens (``make_problem``); plans, prepared calls,
outcomes and one test per bad argument. Negative controls show the checks can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, require_mlx, sinks_for, tc_out_tol, variant_kwargs

import paged_decode as pd
from paged_decode import get_backend
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.errors import InvalidArgumentError, PlanMismatchError, UnsupportedProblemError
from paged_decode.multitoken import MAX_QUERY_TOKENS, QueryTokens, range_table, split_tokens
from paged_decode.page_table import frozen_int32
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import max_rel_error, oracle_decode, request_kv_f64

BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]
HKV, D = 2, 64


def _problem(lengths, counts, *, hq=8, page_size=16, dtype="float16", seed=0,
             offsets=None):
    """Pools and table for ``lengths`` (which include the new tokens), and a flat
    ``q [N, Hq, D]`` with its ``qo_indptr`` for ``counts`` tokens per request."""
    pr = make_problem(ProblemSpec(len(lengths), max(lengths), hq, HKV, D, page_size, dtype,
                                  dtype, seed=seed), lengths=list(lengths), offsets=offsets)
    rng = np.random.default_rng(seed + 100)
    n = int(sum(counts))
    q = (rng.standard_normal((n, hq, D), dtype=np.float32) * 1.5).astype(pr.q.dtype)
    return pr, q, np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def _sinks(hq=8):
    return sinks_for(hq)


def _decode(be, pr, q, qo_indptr, *, path="v2", ppc=None, out_dtype="float32", plan=None,
            uniform=False, **kw):
    hq = q.shape[1]
    counts = np.diff(qo_indptr)
    if plan is None and ppc is not None:
        plan = pd.plan_decode(pr.table, hq, HKV, D, device=be.device_info(),
                              pages_per_chunk=ppc, window_left=kw.get("window_left", -1),
                              query_tokens=int(counts.max()))
    if kw.get("sinks") is not None:
        kw["sinks"] = be.asarray(kw["sinks"])
    if uniform:
        shape = (len(counts), int(counts[0]), hq)
        out = be.asarray(np.full((*shape, D), np.nan, out_dtype))
        got, lse = pd.decode(be.asarray(q.reshape(*shape, D)), be.asarray(pr.k_pages),
                             be.asarray(pr.v_pages), pr.table, plan, path=path, out=out,
                             out_dtype=out_dtype, return_lse=True, backend=be, **kw)
        assert tuple(got.shape) == (*shape, D) and tuple(lse.shape) == shape
        return be.to_numpy(got).reshape(q.shape), be.to_numpy(lse).reshape(q.shape[:2])
    out = be.asarray(np.full((q.shape[0], hq, D), np.nan, out_dtype))
    got, lse = pd.decode(be.asarray(q), be.asarray(pr.k_pages), be.asarray(pr.v_pages),
                         pr.table, plan, path=path, out=out, out_dtype=out_dtype,
                         return_lse=True, backend=be, qo_indptr=qo_indptr, **kw)
    return be.to_numpy(got), be.to_numpy(lse)


def _check(be_name, pr, q, qo_indptr, *, tol=None, out_dtype="float32", **kw):
    be = get_backend(be_name)
    ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qo_indptr,
                                 **{k: v for k, v in kw.items()
                                    if k in ("window_left", "logits_soft_cap", "sinks")})
    got, lse = _decode(be, pr, q, qo_indptr, out_dtype=out_dtype, **kw)
    o = pd.last_outcome()
    assert "query tokens" in o.detail, o
    assert_matches_oracle(got, lse, ref, ref_lse, out_dtype, f"{be_name} {o}", tol=tol)
    return o


# ---------------------------------------------------------------------------- the oracle
def test_oracle_is_the_one_token_oracle_of_each_tokens_prefix():
    """Token t of T sees the first L - T + t + 1 tokens: the one-token oracle over a table
    holding exactly those (built by hand here, not by the package's split), window
    included; T = 1 is the plain oracle."""
    pr, q, qi = _problem([37, 5, 20], [4, 5, 1], dtype="float32", page_size=4,
                         offsets=[0, 3, 1])
    for w in (-1, 0, 2, 9):
        got, got_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi,
                                     window_left=w)
        n = 0
        for r in range(3):
            big_t = int(qi[r + 1] - qi[r])
            k_all = request_kv_f64(pr.k_pages, pr.table, r)
            for t in range(big_t):
                end = k_all.shape[0] - big_t + t + 1
                begin = 0 if w < 0 else max(0, end - 1 - w)
                one = range_table(pr.table, np.array([r]), np.array([begin]), np.array([end]))
                assert int(one.visible_lens[0]) == end - begin
                want, want_lse = oracle_decode(q[n:n + 1], pr.k_pages, pr.v_pages, one)
                assert np.allclose(got[n], want[0]) and np.allclose(got_lse[n], want_lse[0])
                n += 1
    plain, plain_lse = oracle_decode(q[:3], pr.k_pages, pr.v_pages, pr.table)
    ones, ones_lse = oracle_decode(q[:3], pr.k_pages, pr.v_pages, pr.table,
                                   qo_indptr=np.arange(4))
    assert np.array_equal(plain, ones) and np.array_equal(plain_lse, ones_lse)


def test_a_non_causal_answer_fails_the_check():
    """Negative control: every token seeing the whole request (no causal mask) is far
    outside the tolerance, so the oracle tests can tell."""
    pr, q, qi = _problem([40, 12], [4, 4], dtype="float32")
    ref, _ = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi)
    seen_all = np.repeat(pr.table.subset([0, 1]).visible_lens, 4)
    wide = pd.PageTable.build(
        np.concatenate([pr.table.request_pages(r) for r in (0, 0, 0, 0, 1, 1, 1, 1)]),
        np.concatenate([[0], np.cumsum(np.repeat(pr.table.pages_per_request, 4))]),
        np.repeat(pr.table.last_page_len, 4), page_size=16,
        first_page_offset=np.repeat(pr.table.first_page_offset, 4))
    assert np.array_equal(wide.visible_lens, seen_all)
    bad, _ = oracle_decode(q, pr.k_pages, pr.v_pages, wide)
    assert max_rel_error(bad, ref) > 100 * 1e-5


# ---------------------------------------------------------------------------- the split
@pytest.mark.parametrize("window_left", [-1, 0, 1, 2, 6, 1000])
def test_split_covers_each_tokens_range_exactly_once(window_left):
    """The common range plus a token's pieces are its range, each position once."""
    pr, q, qi = _problem([9, 3, 30, 8], [3, 3, 8, 1], page_size=4, offsets=[1, 0, 3, 2])
    qt = QueryTokens(frozen_int32(np.diff(qi)), frozen_int32(qi), False)
    sp = split_tokens(pr.table, qt, window_left, 8)
    lens = pr.table.visible_lens
    common = sp.common.visible_lens
    for n in range(qt.num_tokens):
        r = int(np.searchsorted(qi, n, side="right") - 1)
        big_t, t = int(qi[r + 1] - qi[r]), n - int(qi[r])
        end = int(lens[r]) - big_t + t + 1
        begin = 0 if window_left < 0 else max(0, end - 1 - window_left)
        pieces = [j for j in range(sp.piece_token.size) if sp.piece_token[j] == n]
        assert sp.merge_indptr[n + 1] - sp.merge_indptr[n] == 1 + len(pieces)
        assert len(pieces) <= 2
        total = int(common[r]) + sum(int(sp.pieces.visible_lens[j]) for j in pieces)
        assert total == end - begin, (n, window_left)
        for j in pieces:
            assert int(sp.pieces.visible_lens[j]) <= big_t - 1


def test_split_is_memoised_per_table_counts_window_and_fold():
    pr, _, qi = _problem([9, 30], [3, 2])
    qt = QueryTokens(frozen_int32(np.diff(qi)), frozen_int32(qi), False)
    assert split_tokens(pr.table, qt, 4, 3) is split_tokens(pr.table, qt, 4, 3)
    assert split_tokens(pr.table, qt, 4, 3) is not split_tokens(pr.table, qt, 5, 3)


# ---------------------------------------------------------------------------- the oracle tests
@pytest.mark.parametrize("tokens", list(range(1, MAX_QUERY_TOKENS + 1)))
@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_uniform_tokens_match_oracle(backend_name, tokens):
    """q [B, T, Hq, D], T = 1..8, one request holding only its new tokens (L == T), a
    mid-page start and a split plan (the common pass merges its chunks too)."""
    lengths = [tokens, 45, 70]
    pr, q, qi = _problem(lengths, [tokens] * 3, offsets=[0, 5, 9], seed=tokens)
    _check(backend_name, pr, q, qi, uniform=True)
    _check(backend_name, pr, q, qi, uniform=True, ppc=1)


@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_uniform_tokens_match_oracle_on_metal(tokens):
    pr, q, qi = _problem([tokens, 33, 70], [tokens] * 3, offsets=[0, 5, 9], seed=tokens)
    _check("emulated-metal", pr, q, qi, uniform=True, ppc=2)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("path,ppc", [("v2", None), ("v2", 1), ("v1", None),
                                      ("gather", None)],
                         ids=["v2-one", "v2-split", "v1", "gather"])
def test_ragged_counts_match_oracle(backend_name, path, ppc):
    """qo_indptr with counts 1, 8, 3, 5 (one of them L == T) on every path."""
    if path == "gather" and backend_name != "reference":
        pytest.skip("the emulated backends' gather arm is the reference backend's")
    pr, q, qi = _problem([1, 50, 3, 77], [1, 8, 3, 5], offsets=[0, 7, 2, 15], seed=4)
    o = _check(backend_name, pr, q, qi, path=path, ppc=ppc)
    assert o.path == f"{path}+merge", o


@pytest.mark.parametrize("hq", [2, 6, 8, 16])
@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_gqa_groups(backend_name, hq):
    """GQA groups 1, 3, 4 and 8 (folded with 3 tokens: 3, 9, 12, 24 rows per KV head)."""
    pr, q, qi = _problem([20, 41], [3, 3], hq=hq, seed=hq)
    _check(backend_name, pr, q, qi)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_page_size_one(backend_name):
    pr, q, qi = _problem([6, 2, 19], [4, 2, 7], page_size=1, seed=7)
    _check(backend_name, pr, q, qi)
    _check(backend_name, pr, q, qi, ppc=3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_dtypes_and_output_dtype(backend_name, dtype):
    pr, q, qi = _problem([30, 17], [2, 6], dtype=dtype, seed=9)
    _check(backend_name, pr, q, qi, out_dtype=dtype)


VARIANTS = {
    "w0": {"window_left": 0},                        # each token sees itself alone
    "w2": {"window_left": 2},                        # shorter than T - 1: no common range
    "w9": {"window_left": 9},                        # crossing pages, a common range
    "cap": {"logits_soft_cap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window_left": 21, "logits_soft_cap": 2.0, "sinks": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_variants_match_oracle(backend_name, variant):
    """Windows end at each token's own position; the sinks enter each token's merge
    once; the cap applies in both passes."""
    kw = variant_kwargs(VARIANTS[variant], 8)
    pr, q, qi = _problem([6, 50, 40], [6, 5, 1], page_size=4, offsets=[1, 3, 0], seed=11)
    o = _check(backend_name, pr, q, qi, ppc=2, **kw)
    for name in kw:
        assert name in o.detail, o


def test_empty_pieces_and_empty_common_range():
    """W = 0 over T = 8: no common range (every request's common state is empty: zeros
    and -inf), each token's range, its own position, is one piece."""
    pr, q, qi = _problem([8, 8], [8, 8], page_size=4, seed=12)
    o = _check("emulated-cuda", pr, q, qi, window_left=0, sinks=_sinks())
    assert "16 causal pieces" in o.detail, o


# ---------------------------------------------------------------------------- v2tc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("hq,tokens", [(8, 4), (8, 8), (16, 4)],
                         ids=["g4-t4-one-tile", "g4-t8-two-tiles", "g8-t4-two-tiles"])
def test_v2tc_matches_oracle(dtype, hq, tokens):
    """The tensor-core partial with the tokens packed into its M rows: 16 rows (one tile)
    and 32 rows (two tiles) per KV head."""
    pr, q, qi = _problem([tokens, 60, 33], [tokens] * 3, hq=hq, dtype=dtype,
                         offsets=[0, 4, 1], seed=tokens + hq)
    for ppc in (None, 1):
        o = _check("emulated-cuda", pr, q, qi, path="v2tc", ppc=ppc,
                   tol=tc_out_tol(dtype, "float32"))
        assert o.path == "v2tc+merge", o


def test_v2tc_refuses_more_rows_than_two_tiles():
    pr, q, qi = _problem([20, 20], [8, 8], hq=16)   # 8 tokens x group 8 = 64 rows
    with pytest.raises(UnsupportedProblemError, match=r"8 query tokens x GQA group 8"):
        _decode(get_backend("emulated-cuda"), pr, q, qi, path="v2tc")


# ---------------------------------------------------------------------------- plans
def test_plan_serves_fewer_tokens_and_refuses_more():
    be = get_backend("emulated-cuda")
    pr, q, qi = _problem([20, 41], [3, 2], seed=13)
    ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi)
    plan8 = pd.plan_decode(pr.table, 8, HKV, D, device=be.device_info(), query_tokens=8)
    assert plan8.query_tokens == 8 and plan8.heads_per_cta * plan8.q_groups == 32
    got, lse = _decode(be, pr, q, qi, plan=plan8)        # padded to 8 folded tokens
    assert_matches_oracle(got, lse, ref, ref_lse, "float32", "plan for 8")
    plan2 = pd.plan_decode(pr.table, 8, HKV, D, device=be.device_info(), query_tokens=2)
    with pytest.raises(PlanMismatchError, match=r"query_tokens = 2 .* up to 3"):
        _decode(be, pr, q, qi, plan=plan2)
    plain = pd.plan_decode(pr.table, 8, HKV, D, device=be.device_info())
    with pytest.raises(PlanMismatchError, match=r"query_tokens = 1"):
        _decode(be, pr, q, qi, plan=plain)
    with pytest.raises(PlanMismatchError, match=r"one-token call"):
        pd.decode(q[:2], pr.k_pages, pr.v_pages, pr.table, plan8, backend=be)
    with pytest.raises(InvalidArgumentError, match=r"query_tokens must be an integer in 1"):
        pd.plan_decode(pr.table, 8, HKV, D, device=be.device_info(), query_tokens=9)


def test_plan_with_headroom_serves_grown_requests():
    """An engine appends T tokens per step: a plan with headroom keeps serving."""
    be = get_backend("reference")
    pr, q, qi = _problem([20, 41], [4, 4], seed=14)
    plan = pd.plan_decode(pr.table, 8, HKV, D, device=be.device_info(), pages_per_chunk=1,
                          query_tokens=4, headroom=16)
    grown, q2, qi2 = _problem([36, 57], [4, 4], seed=14)
    ref, ref_lse = oracle_decode(q2, grown.k_pages, grown.v_pages, grown.table,
                                 qo_indptr=qi2)
    got, lse = _decode(be, grown, q2, qi2, plan=plan)
    assert_matches_oracle(got, lse, ref, ref_lse, "float32", "headroom")


# ---------------------------------------------------------------------------- prepared
@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_prepared_call_follows_new_queries(backend_name):
    be = get_backend(backend_name)
    pr, q, qi = _problem([20, 41, 4], [2, 5, 4], seed=15)
    qb = be.asarray(q.copy())
    prep = pd.prepare_decode(qb, be.asarray(pr.k_pages), be.asarray(pr.v_pages), pr.table,
                             qo_indptr=qi, return_lse=True, out_dtype="float32",
                             logits_soft_cap=3.0, sinks=be.asarray(_sinks()), backend=be)
    assert isinstance(prep, pd.prepared.PreparedMultiToken)
    for seed in (0, 1):
        q_new = np.random.default_rng(seed).standard_normal(q.shape).astype(q.dtype)
        qb[...] = q_new
        out, lse = prep()
        ref, ref_lse = oracle_decode(q_new, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi,
                                     logits_soft_cap=3.0, sinks=_sinks())
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                              f"prepared {seed}")
        assert "prepared call" in pd.last_outcome().reason


def test_empty_batch_uniform():
    be = get_backend("reference")
    pr, _, _ = _problem([5], [1])
    empty = pd.PageTable.build([], [0], [], page_size=16)
    out, lse = pd.decode(np.zeros((0, 3, 8, D), np.float16), pr.k_pages, pr.v_pages, empty,
                         return_lse=True, backend=be)
    assert out.shape == (0, 3, 8, D) and lse.shape == (0, 3, 8)


# ---------------------------------------------------------------------------- bad input
def _bad(q=None, qo_indptr=None, **kw):
    pr, q0, qi = _problem([6, 9], [3, 2])
    return pd.decode(q0 if q is None else q, pr.k_pages, pr.v_pages, pr.table,
                     qo_indptr=qi if qo_indptr is None else qo_indptr, backend="reference",
                     **kw)


@pytest.mark.parametrize("qo_indptr,match", [
    ([0, 3], r"qo_indptr must have shape \[B\+1\] = \[3\], got \[2\]"),
    ([1, 3, 5], r"qo_indptr\[0\] must be 0, got 1"),
    ([0, 0, 5], r"request 0 0 query tokens; each request takes 1 to 8"),
    ([0, 9, 10], r"request 0 9 query tokens"),
    ([0, 3, 4], r"qo_indptr\[-1\] = 4 query tokens, but q \[N, Hq, D\] has N = 5"),
    (np.array([0.0, 3.0, 5.0]), r"qo_indptr must hold integers, got dtype float64"),
    ([[0, 3, 5]], r"qo_indptr must have shape \[B\+1\]"),
    ("abc", r"qo_indptr must hold integers"),
], ids=["length", "start", "zero", "nine", "sum", "float", "2d", "str"])
def test_bad_qo_indptr(qo_indptr, match):
    with pytest.raises(InvalidArgumentError, match=match):
        _bad(qo_indptr=qo_indptr)


def test_bad_query_shapes_and_lengths():
    pr, q, qi = _problem([6, 2], [3, 3])
    with pytest.raises(InvalidArgumentError, match=r"request 1 has 2 visible tokens but 3 "
                                                   r"query tokens.*L >= T"):
        pd.decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi, backend="reference")
    q4 = np.zeros((2, 9, 8, D), np.float16)
    with pytest.raises(InvalidArgumentError, match=r"1 <= T <= 8 .* got T = 9"):
        pd.decode(q4, pr.k_pages, pr.v_pages, pr.table, backend="reference")
    with pytest.raises(InvalidArgumentError, match=r"1 <= T <= 8 .* got T = 0"):
        pd.decode(q4[:, :0], pr.k_pages, pr.v_pages, pr.table, backend="reference")
    with pytest.raises(InvalidArgumentError, match=r"B = 2 .* got \[3, 2, 8, 64\]"):
        pd.decode(np.zeros((3, 2, 8, D), np.float16), pr.k_pages, pr.v_pages, pr.table,
                  backend="reference")
    with pytest.raises(InvalidArgumentError, match=r"got both"):
        pd.decode(q4[:, :2], pr.k_pages, pr.v_pages, pr.table, qo_indptr=[0, 2, 4],
                  backend="reference")
    with pytest.raises(InvalidArgumentError, match=r"q must be 3-D .* or 4-D"):
        pd.decode(np.zeros((2, 1, 2, 8, D), np.float16), pr.k_pages, pr.v_pages, pr.table,
                  backend="reference")
    pr, q, qi = _problem([6, 9], [3, 3])
    with pytest.raises(InvalidArgumentError, match=r"q must have shape \[N, Hq, D\]"):
        pd.decode(np.zeros((6, 8, 32), np.float16), pr.k_pages, pr.v_pages, pr.table,
                  qo_indptr=qi, backend="reference")


def test_bad_outputs():
    pr, q, qi = _problem([6, 9], [3, 3])
    q4 = q.reshape(2, 3, 8, D)
    with pytest.raises(InvalidArgumentError, match=r"out must have shape \[B, T, Hq, D\]"):
        pd.decode(q4, pr.k_pages, pr.v_pages, pr.table, out=np.zeros((6, 8, D), np.float16),
                  backend="reference")
    with pytest.raises(InvalidArgumentError, match=r"lse must have shape \[N, Hq\]"):
        pd.decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi,
                  lse=np.zeros((2, 8), np.float32), backend="reference")


def test_refusals_by_name():
    pr, q, qi = _problem([6, 9], [3, 3])
    with pytest.raises(UnsupportedProblemError, match=r"cascade decode does not run "
                                                      r"multi-token"):
        pd.decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi, cascade=True,
                  backend="reference")
    with pytest.raises(UnsupportedProblemError, match=r"cascade decode does not run"):
        pd.cascade_decode(q.reshape(2, 3, 8, D), pr.k_pages, pr.v_pages, pr.table,
                          backend="reference")
    with pytest.raises(UnsupportedProblemError, match=r"cascade decode does not run"):
        pd.prepare_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi, cascade=True,
                          backend="reference")
    with pytest.raises(UnsupportedProblemError, match=r"sparse_decode: multi-token"):
        pd.sparse_decode(q.reshape(2, 3, 8, D), np.zeros((2, HKV, 16, D), np.float16),
                         np.zeros((2, HKV, 16, D), np.float16),
                         np.zeros((2, HKV, 1), np.int32), live_lens=[5, 5],
                         backend="reference")


def test_a_one_token_engine_step_refuses_multi_token_queries():
    """begin() gave one slot per sequence; begin(tokens=T) runs them
    (tests/test_engine_step_tokens.py)."""
    pool = pd.PagePool(16, 16, num_kv_heads=HKV, head_dim=D, dtype="float16")
    seqs = [pool.new_sequence() for _ in range(2)]
    for s in seqs:
        pool.append(s, np.ones((5, HKV, D), np.float16), np.ones((5, HKV, D), np.float16))
    step = pd.DecodeStep(pool, seqs, num_qo_heads=8)
    step.begin()
    step.append(0, np.ones((2, HKV, D), np.float16), np.ones((2, HKV, D), np.float16))
    with pytest.raises(UnsupportedProblemError,
                       match=r"DecodeStep.decode: .*multi-token query.*begin\(tokens=T\)"):
        step.decode(0, np.zeros((2, 2, 8, D), np.float16))


class _RebindingReference(ReferenceBackend):
    """The reference backend taking the code path of backends whose results rebind
    (``functional_outputs``, MLX): states stacked by concatenation, the flat results
    handed back to the call's arrays."""

    functional_outputs = True


def test_the_rebinding_backends_path():
    be = _RebindingReference()
    pr, q, qi = _problem([9, 40, 5], [4, 4, 4], seed=16)
    kw = {"window_left": 6, "sinks": _sinks()}
    ref, ref_lse = oracle_decode(q.reshape(3, 4, 8, D), pr.k_pages, pr.v_pages, pr.table,
                                 **kw)
    out = np.full((3, 4, 8, D), np.nan, np.float32)
    lse = np.full((3, 4, 8), np.nan, np.float32)
    got, got_lse = pd.decode(q.reshape(3, 4, 8, D), pr.k_pages, pr.v_pages, pr.table,
                             out=out, lse=lse, return_lse=True, out_dtype="float32",
                             backend=be, **kw)
    assert got is out and got_lse is lse
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", "rebinding backend")


def test_fast_path_replays_and_follows_qo_indptr_content():
    """decode with a plan and out is kept as a prepared call (the second call replays
    it); rewriting qo_indptr in place is a new key (its content), never a stale split."""
    be = get_backend("emulated-cuda")
    pr, q, qi = _problem([20, 41, 12], [3, 5, 4], seed=17)
    plan = pd.plan_decode(pr.table, 8, HKV, D, device=be.device_info(), query_tokens=8)
    qb, out = q.copy(), np.full((12, 8, D), np.nan, np.float32)
    lse = np.full((12, 8), np.nan, np.float32)
    qo = qi.copy()
    for i, (counts, rewrite, replays) in enumerate((
            ((3, 5, 4), False, False), ((3, 5, 4), False, True), ((6, 2, 4), True, False),
            ((6, 2, 4), False, True))):
        if rewrite:
            qo[:] = np.concatenate([[0], np.cumsum(counts)])
        qb[...] = np.random.default_rng(i).standard_normal(q.shape).astype(q.dtype)
        got, got_lse = pd.decode(qb, pr.k_pages, pr.v_pages, pr.table, plan, out=out,
                                 lse=lse, return_lse=True, qo_indptr=qo, out_dtype="float32",
                                 backend=be)
        assert got is out and got_lse is lse
        ref, ref_lse = oracle_decode(qb, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qo)
        assert_matches_oracle(out, lse, ref, ref_lse, "float32", f"{counts} {rewrite}")
        assert ("prepared call" in pd.last_outcome().reason) == replays, pd.last_outcome()


@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_step_table_follows_the_pool(backend_name):
    """A pool's step table (the split reads its host view): after each append of the
    next tokens the same step table decodes them. Its padding rows (``capacity``) hold no
    tokens, so a multi-token call over them is refused (``L >= T``)."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(18)
    pool = pd.PagePool(32, 4, num_kv_heads=HKV, head_dim=D, dtype="float32", backend=be)
    seqs = [pool.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (7, 13)):
        kv = rng.standard_normal((n, HKV, D)).astype(np.float32)
        pool.append(s, kv, kv * 0.5)
    st = pool.step_table(seqs)
    for step in range(2):
        for s in seqs:
            kv = rng.standard_normal((3, HKV, D)).astype(np.float32)
            pool.append(s, kv, -kv)
        q = rng.standard_normal((2, 3, 8, D)).astype(np.float32)
        out, lse = pd.decode(be.asarray(q), pool.k, pool.v, st, return_lse=True, backend=be)
        ref, ref_lse = oracle_decode(q, be.to_numpy(pool.k), be.to_numpy(pool.v),
                                     st.page_table())
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                              f"step {step}")
    padded = pool.step_table(seqs, capacity=3)
    with pytest.raises(InvalidArgumentError, match=r"request 2 has 0 visible tokens"):
        pd.decode(np.zeros((3, 2, 8, D), np.float32), pool.k, pool.v, padded, backend=be)


@pytest.mark.parametrize("qo", [[0, 1, 2], [0, 2, 3]])
def test_flat_queries_on_mlx_match_the_oracle(qo):
    """A flat q [N, Hq, D] with qo_indptr on MLX (functional outputs): the merge rebinds
    the flat results, which were handed back only where their shape differed from the
    call's, so this case returned zeros for the output and the LSE (found by a
    session-24 audit). Decode, prepared call and caller-given outputs."""
    require_mlx()
    import mlx.core as mx
    rng = np.random.default_rng(0)
    p, hkv, hq, d = 4, 1, 2, 64
    table = pd.PageTable.build(np.arange(5, dtype=np.int32), np.array([0, 3, 5]),
                               np.array([1, 2], np.int32), page_size=p)
    k = rng.standard_normal((5, p, hkv, d)).astype(np.float32)
    v = rng.standard_normal((5, p, hkv, d)).astype(np.float32)
    qi = np.array(qo)
    q = rng.standard_normal((int(qi[-1]), hq, d)).astype(np.float32)
    ref = oracle_decode(q, k, v, table, qo_indptr=qi)
    args = (mx.array(q), mx.array(k), mx.array(v), table)
    out, lse = pd.decode(*args, qo_indptr=qi, return_lse=True, backend="mlx")
    assert_matches_oracle(np.array(out), np.array(lse), *ref, "float32", "decode")
    out, lse = pd.prepare_decode(*args, qo_indptr=qi, return_lse=True, backend="mlx")()
    assert_matches_oracle(np.array(out), np.array(lse), *ref, "float32", "prepared")
    out, lse = mx.full((len(q), hq, d), 7.0), mx.full((len(q), hq), 7.0)
    pd.decode(*args, qo_indptr=qi, out=out, lse=lse, return_lse=True, backend="mlx")
    assert_matches_oracle(np.array(out), np.array(lse), *ref, "float32", "given out")
