"""Non-finite inputs on every backend and path: poison, never a plausible answer.

The rules (``docs/concepts.md``, "Non-finite inputs"; every path, the tensor-core
partial ``v2tc`` included where a backend runs it): a visible score that is not
finite (a NaN or +-inf element of q or of a visible K row) makes that head's output and
LSE NaN; a NaN in a visible V row makes the output NaN and leaves the LSE (a function of
the scores) finite; a NaN anywhere nobody may read (entries outside the visible window,
unselected rows) changes nothing; an empty request stays zeros and ``-inf``, even with a
NaN query. Merges: a NaN or ``+inf`` partial LSE poisons its group, ``-inf`` partials
carry no weight.

Expected NaN patterns are written out by hand here (the oracle follows the same rules and
gives the finite values), so a backend that drops a NaN partial, or turns a poisoned head
into an empty one, fails whichever oracle it matches.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LSE_ATOL, OUT_RTOL, PREFIX_RTOL

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import V2TC_DTYPES

BACKENDS = [
    pytest.param("reference"),
    pytest.param("emulated-cuda", marks=pytest.mark.skipif(
        not availability("emulated-cuda").ok, reason="no C++ compiler for the emulator")),
    pytest.param("emulated-metal", marks=pytest.mark.skipif(
        not availability("emulated-metal").ok, reason="no C++ compiler for the emulator")),
    pytest.param("mlx", marks=pytest.mark.skipif(
        not availability("mlx").ok, reason=f"mlx: {availability('mlx').reason}")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not availability("cuda").ok, reason=f"cuda: {availability('cuda').reason}")]),
]
#: (decode path, forced pages_per_chunk): single-chunk v2, v2 + merge, v1, gather
PATHS = [("v2", 10**6), ("v2", 1), ("v1", None), ("gather", None)]
#: the tensor-core partial, single chunk and merged (16-bit pools, backends that run it)
TC_PATHS = [("v2tc", 10**6), ("v2tc", 1)]

HQ, HKV, D, P = 8, 2, 64, 16
G = HQ // HKV
LENGTHS = [90, 0, 70, 41, 33]


def _backend(name: str):
    be = pd.get_backend(name)
    if name == "mlx":
        import mlx.core as mx
        mx.set_default_device(mx.cpu)
    return be


def _paths(be, dtype: str = "float32") -> list[tuple[str, int | None]]:
    paths = [p for p in PATHS if be.name != "mlx" or p[0] == "gather"]   # mlx: gather only
    tc = be.tensor_core_decode and dtype in V2TC_DTYPES
    return paths + (TC_PATHS if tc else [])


def _visible_entry(table, r: int, t: int) -> tuple[int, int]:
    """(page id, entry) of visible token ``t`` of request ``r``."""
    a = int(table.first_page_offset[r]) + t
    return int(table.indices[int(table.indptr[r]) + a // table.page_size]), a % table.page_size


def poisoned_problem(dtype: str):
    """A batch with one kind of non-finite input per request, and the expected pattern:
    ``(problem, nan_out [B, Hq, D], nan_lse [B, Hq])``.

    r0: NaN in q (head 1: the whole row) and NaN in element 3 of a visible V row (KV head
    1: element 3 of heads 4-7, LSE finite); r1: empty, with an all-NaN query; r2: +inf in
    q (head 4); NaN in a visible K row (KV head 0: heads 0-3); r3: -inf in q (head 6);
    r4: one score of -inf (+inf in a K row of KV head 1 against negative q elements of
    heads 4-7: a -inf that is not a masked token). Every pool entry outside the visible
    windows already holds NaN (``make_problem``)."""
    pr = make_problem(ProblemSpec(len(LENGTHS), 64, HQ, HKV, D, P, dtype, dtype, seed=3),
                      lengths=LENGTHS, offsets=[5, 0, 0, 9, 15])
    q, k, v, t = pr.q, pr.k_pages, pr.v_pages, pr.table
    nan_lse = np.zeros((len(LENGTHS), HQ), bool)
    q[0, 1, 7] = np.nan
    nan_lse[0, 1] = True
    q[1] = np.nan
    q[2, 4, 0] = np.inf
    nan_lse[2, 4] = True
    page, e = _visible_entry(t, 2, 69)       # the last visible token
    k[page, e, 0, 11] = np.nan
    nan_lse[2, 0:4] = True
    q[3, 6, 63] = -np.inf
    nan_lse[3, 6] = True
    # a single -inf score (+inf in K against negative q elements) is not a masked token
    q[4, G:2 * G, 20] = -1.0
    page, e = _visible_entry(t, 4, 7)
    k[page, e, 1, 20] = np.inf
    nan_lse[4, G:2 * G] = True
    nan_out = np.repeat(nan_lse[..., None], D, axis=-1)
    page, e = _visible_entry(t, 0, 50)
    v[page, e, 1, 3] = np.nan
    nan_out[0, 4:8, 3] = True                # V does not enter the LSE
    return pr, nan_out, nan_lse


def check_pattern(out, lse, ref, ref_lse, nan_out, nan_lse, rtol: float, what: str) -> None:
    out = np.asarray(out, np.float64)
    got = np.isnan(out)
    assert np.array_equal(got, nan_out), (
        f"{what}: NaN output elements {np.argwhere(got).tolist()[:12]}..., expected "
        f"{np.argwhere(nan_out).tolist()[:12]}...")
    clean = ~nan_out
    scale = np.abs(ref[clean]).max()
    err = np.abs(out[clean] - ref[clean]).max() / scale
    assert err <= rtol, f"{what}: clean elements off the oracle by {err:.2e}"
    empty = np.asarray([n == 0 for n in LENGTHS])
    assert (out[empty] == 0).all(), f"{what}: empty request not zeros"
    if lse is None:
        return
    lse = np.asarray(lse, np.float64)
    assert np.array_equal(np.isnan(lse), nan_lse), (
        f"{what}: NaN LSEs {np.argwhere(np.isnan(lse)).tolist()}, "
        f"expected {np.argwhere(nan_lse).tolist()}")
    assert np.isneginf(lse[empty]).all(), f"{what}: empty request LSE not -inf"
    fin = ~nan_lse & ~empty[:, None]
    assert np.isfinite(lse[fin]).all()
    assert np.abs(lse[fin] - ref_lse[fin]).max() <= LSE_ATOL, what


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_non_finite_inputs_poison_their_heads_on_every_path(backend_name, dtype):
    be = _backend(backend_name)
    pr, nan_out, nan_lse = poisoned_problem(dtype)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    # the oracle itself follows the rules (its NaN heads are the hand-written ones)
    assert np.array_equal(np.isnan(ref), nan_out)
    assert np.array_equal(np.isnan(ref_lse), nan_lse)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    ran = set()
    for path, ppc in _paths(be, dtype):
        plan = pd.plan_decode(pr.table, HQ, HKV, D, device=be.device_info(),
                              pages_per_chunk=ppc)
        for want_lse in (True, False):
            res = pd.decode(q, k, v, pr.table, plan, path=path, return_lse=want_lse,
                            out_dtype="float32", backend=be)
            out, lse = res if want_lse else (res, None)
            # clean elements: the inputs' dtype bounds the error (the torch/MLX SDPA of the
            # gather arm computes in it); the pattern is the point here
            what = f"{backend_name} {pd.last_outcome().path} lse={want_lse}"
            ran.add(pd.last_outcome().path)
            check_pattern(be.to_numpy(out), None if lse is None else be.to_numpy(lse),
                          ref, ref_lse, nan_out, nan_lse, OUT_RTOL[dtype], what)
    if be.tensor_core_decode and dtype in V2TC_DTYPES:
        assert {"v2tc", "v2tc+merge"} <= ran, ran


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_merge_poisons_on_nan_and_plus_inf_lse(backend_name):
    be = _backend(backend_name)
    rng = np.random.default_rng(5)
    sizes = [3, 0, 40, 70, 1, 2]
    indptr = np.concatenate([[0], np.cumsum(sizes)])
    n, h, d = int(indptr[-1]), 2, 64
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = rng.uniform(-120, 120, (n, h)).astype(np.float32)    # spread over 240 log2 units
    lse[1, 0] = -np.inf
    v[1, 0] = np.nan                         # an empty partial's V is never read
    lse[indptr[2] + 35, 1] = np.nan          # group 2, head 1
    lse[indptr[3] + 69, 0] = np.inf          # group 3, head 0 (its last row)
    lse[indptr[4], 1] = np.nan               # a group of one, head 1
    out, lse_out = pd.merge_states(be.asarray(v), be.asarray(lse), indptr, backend=be)
    out, lse_out = be.to_numpy(out).astype(np.float64), be.to_numpy(lse_out).astype(np.float64)
    poisoned = np.zeros((len(sizes), h), bool)
    poisoned[2, 1] = poisoned[3, 0] = poisoned[4, 1] = True
    assert np.array_equal(np.isnan(lse_out), poisoned)
    assert np.array_equal(np.isnan(out).all(-1), poisoned) and \
        np.array_equal(np.isnan(out).any(-1), poisoned)
    assert (out[1] == 0).all() and np.isneginf(lse_out[1]).all()    # the empty group
    for o in range(len(sizes)):                                     # the rest: closed form
        for hh in range(h):
            if poisoned[o, hh] or sizes[o] == 0:
                continue
            ls = lse[indptr[o]:indptr[o + 1], hh].astype(np.float64)
            live = np.isfinite(ls)
            w = np.exp2(ls[live] - ls[live].max())
            ref = (w[:, None] * v[indptr[o]:indptr[o + 1], hh][live]).sum(0) / w.sum()
            assert np.abs(out[o, hh] - ref).max() <= 1e-5
            assert abs(lse_out[o, hh] - (ls[live].max() + np.log2(w.sum()))) <= 1e-4


def _cascade_batch(dtype: str):
    """Two groups forked from shared prompts plus a solo request; returns ``(q, pool,
    table, cascade plan)`` with the shared prefix detected."""
    from test_cascade import shared_batch
    q, pool, table = shared_batch([("group", 40, [5, 9, 3]), ("solo", 21),
                                   ("group", 33, [7, 4])], page_size=4, hkv=HKV, group=G,
                                  head_dim=D, dtype=dtype, seed=2, shuffle=False)
    cp = pd.detect_shared_prefix(table, min_shared_pages=2)
    assert cp is not None
    return q, pool, table, cp


@pytest.mark.parametrize("backend_name", [b for b in BACKENDS if b.values[0] != "mlx"])
@pytest.mark.parametrize("level0", ["auto", "v2"])
def test_cascade_poisons_members_of_a_poisoned_prefix(backend_name, level0):
    """A NaN in a shared prefix row poisons that KV head in every member; a NaN query
    poisons its own head only; the solo request and the other group stay exact."""
    be = _backend(backend_name)
    q, pool, table, cp = _cascade_batch("float16")
    k = np.array(pool.backend.to_numpy(pool.k))   # the pool lives on the default backend
    vv = np.array(pool.backend.to_numpy(pool.v))
    first_group = list(range(3))               # requests 0-2 share the first prompt
    page, e = _visible_entry(table, 0, 10)     # inside the first shared prefix
    k[page, e, 1, 0] = np.nan
    q[4, 2, 5] = np.nan                        # request 4: a member of the second group
    nan_out = np.zeros((table.batch_size, HQ), bool)
    nan_out[first_group, G:2 * G] = True
    nan_out[4, 2] = True
    ref, ref_lse = oracle_decode(q, k, vv, table)
    assert np.array_equal(np.isnan(ref).any(-1), nan_out)
    cplan = pd.plan_cascade(table, HQ, HKV, D, prefix=cp, device=be.device_info(),
                            level0=level0)
    out, lse = pd.cascade_decode(be.asarray(q), be.asarray(k), be.asarray(vv), table,
                                 return_lse=True, out_dtype="float32", backend=be,
                                 cascade_plan=cplan)
    out, lse = be.to_numpy(out).astype(np.float64), be.to_numpy(lse).astype(np.float64)
    assert np.array_equal(np.isnan(out).any(-1), nan_out), np.argwhere(np.isnan(out).any(-1))
    assert np.array_equal(np.isnan(lse), nan_out)
    clean = ~nan_out
    rtol = PREFIX_RTOL["float16"] if pd.last_outcome().path.find("tc") >= 0 else 4e-3
    assert np.abs(out[clean] - ref[clean]).max() / np.abs(ref[clean]).max() <= rtol
    assert np.abs(lse[clean] - ref_lse[clean]).max() <= LSE_ATOL


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("min_sparsity", [0.0, 1e9])      # the fused path, the masked path
def test_sparse_poisons_selected_rows_only(backend_name, min_sparsity):
    be = _backend(backend_name)
    if be.name == "mlx" and min_sparsity == 0.0:
        pytest.skip("the mlx backend has no v2 kernel: the fused path declines there")
    rng = np.random.default_rng(9)
    b, cap = 3, 64
    live = np.array([64, 40, 50])
    k = rng.standard_normal((b, HKV, cap, D), dtype=np.float32)
    v = rng.standard_normal((b, HKV, cap, D), dtype=np.float32)
    q = rng.standard_normal((b, HQ, D), dtype=np.float32)
    pos = np.stack([np.stack([rng.choice(int(live[i]), 8, replace=False) for _ in range(HKV)])
                    for i in range(b)]).astype(np.int32)
    sel = pd.make_selection(pos)
    unselected = sorted(set(range(int(live[0]))) - set(pos[0, 0].tolist()))[0]
    k[0, 0, unselected] = np.nan               # never selected: must change nothing
    k[1, 1, pos[1, 1, 3]] = np.inf             # selected: poisons KV head 1 of request 1
    q[2, 0, 0] = np.nan
    res = pd.sparse_decode(be.asarray(q), be.asarray(k), be.asarray(v), sel, live_lens=live,
                           min_sparsity=min_sparsity, return_lse=True, backend=be)
    out, lse = (be.to_numpy(x).astype(np.float64) for x in res)
    nan_heads = np.zeros((b, HQ), bool)
    nan_heads[1, G:] = True
    nan_heads[2, 0] = True
    assert np.array_equal(np.isnan(out).any(-1), nan_heads), np.argwhere(np.isnan(out).any(-1))
    assert np.array_equal(np.isnan(lse), nan_heads)
    assert np.isfinite(out[~nan_heads]).all() and np.isfinite(lse[~nan_heads]).all()
