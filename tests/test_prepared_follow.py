"""Prepared calls and ``decode``'s fast path when what they were prepared for changes.

A prepared call over a pool's ``StepTable`` must follow the pool (or refuse a plan that no
longer fits), on every backend and for every kind of call (flat, cascade, windowed);
``decode``'s fast path must not replay a cascade of an older table, must notice a torch
tensor whose data moved, and must not accept an argument its checks refuse because an
equal value of another type is cached. Each case here returned a wrong answer (or took a
refused argument) before session 21's fixes.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, require_mlx

import paged_decode as pd
from paged_decode.errors import InvalidArgumentError, PlanMismatchError
from paged_decode.prepared import decode_cache
from paged_decode.reference import oracle_decode

P, HKV, D, HQ = 4, 1, 64, 2
BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]


def pool_of(backend, lens, rng, page_size=P, num_pages=64):
    pool = pd.PagePool(num_pages, page_size, num_kv_heads=HKV, head_dim=D, dtype="float16",
                       backend=backend)
    seqs = [pool.new_sequence() for _ in lens]
    for s, n in zip(seqs, lens):
        x = rng.standard_normal((n, HKV, D)).astype(np.float16)
        pool.append(s, x, x)
    return pool, seqs


def grow(pool, seqs, n, rng):
    for s in seqs:
        x = rng.standard_normal((n, HKV, D)).astype(np.float16)
        pool.append(s, x, x)


def assert_oracle(pool, st, q, out, what, **kw):
    want, _ = oracle_decode(q, pool.k, pool.v, st.page_table(), **kw)
    assert_matches_oracle(out, None, want, None, "float16", what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_call_over_a_step_table_follows_the_pool(backend, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(0)
    pool, seqs = pool_of(backend, [8, 3], rng)
    st = pool.step_table(seqs)
    plan = pd.plan_decode(st, HQ, HKV, D, backend=backend, pages_per_chunk=1, headroom=4)
    q = rng.standard_normal((2, HQ, D)).astype(np.float16)
    out = np.full_like(q, np.nan)
    prep = pd.prepare_decode(q, pool.k, pool.v, st, plan, path="v2", out=out,
                             backend=backend)
    prep()
    assert_oracle(pool, st, q, out, "fresh")
    grow(pool, seqs, 1, rng)          # within the plan's headroom; no flush by the caller
    prep()
    assert_oracle(pool, st, q, out, "after one token")
    grow(pool, seqs, 8, rng)          # past it: the caller's plan no longer fits
    with pytest.raises(PlanMismatchError, match="prepare_decode: plan does not match"):
        prep()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_call_follows_a_table_whose_update_grows_its_buffer(backend):
    """The pool grows a sequence past the step table's page capacity: the update that
    the call's catch-up makes itself moves the table to a new device buffer, so the call
    must be prepared again. It once checked the buffer before that update and kept its
    launches over the old buffer: max-rel error 0.77-0.92 on emulated-cuda, every call
    after (found by a session-24 audit)."""
    rng = np.random.default_rng(0)
    pool, seqs = pool_of(backend, [4], rng)
    st = pool.step_table(seqs, page_capacity=2)         # 1 page now, room for 2
    plan = pd.plan_decode(st, HQ, HKV, D, backend=backend, headroom=64)
    q = rng.standard_normal((1, HQ, D)).astype(np.float16)
    out = np.full_like(q, np.nan)
    prep = pd.prepare_decode(q, pool.k, pool.v, st, plan, out=out, backend=backend)
    layouts = [st.layout]
    for step in range(3):
        grow(pool, seqs, P, rng)                       # one more page each time
        prep()
        layouts.append(st.layout)
        assert_oracle(pool, st, q, out, f"after {step + 1} more pages")
    if backend != "reference":                         # the buffer did move
        assert layouts[0] != layouts[-1], layouts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["planned-here", "multi-token", "cascade"])
def test_every_kind_of_prepared_call_is_prepared_again_for_a_changed_table(backend, kind,
                                                                          monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(1)
    pool, seqs = pool_of(backend, [13], rng, num_pages=96)
    seqs += [pool.fork(seqs[0]) for _ in range(2)]     # a shared prefix for the cascade
    grow(pool, seqs, 2, rng)
    st = pool.step_table(seqs)
    t = 2 if kind == "multi-token" else None          # query tokens per request
    q = rng.standard_normal((3, t, HQ, D) if t else (3, HQ, D)).astype(np.float16)
    out = np.full_like(q, np.nan)
    cascade = pd.plan_cascade(st.page_table(), HQ, HKV, D, backend=backend,
                              min_shared_pages=1) if kind == "cascade" else None
    prep = pd.prepare_decode(q, pool.k, pool.v, st, out=out, backend=backend,
                             cascade=cascade)

    def check(what):
        if not t:
            return assert_oracle(pool, st, q, out, what)
        want, _ = oracle_decode(q.reshape(3 * t, HQ, D), pool.k, pool.v, st.page_table(),
                                qo_indptr=np.arange(0, 3 * t + 1, t))
        assert_matches_oracle(out.reshape(3 * t, HQ, D), None, want, None, "float16", what)

    prep()
    check(f"{kind} fresh")
    for step in range(3):
        grow(pool, seqs, 3, rng)
        if kind == "cascade":         # its level tables were made for the old table
            with pytest.raises(InvalidArgumentError, match="cascade plan was made for "
                               "another page table"):
                prep()
            return
        prep()
        check(f"{kind} step {step}")


def test_on_mlx_a_prepared_call_refuses_a_changed_batch():
    """MLX's appends replace the pool's arrays, which the prepared call holds."""
    mx = require_mlx()
    rng = np.random.default_rng(6)
    pool, seqs = pool_of("mlx", [9, 3], rng)
    st = pool.step_table(seqs)
    q = mx.array(rng.standard_normal((2, HQ, D)).astype(np.float16))
    prep = pd.prepare_decode(q, pool.k, pool.v, st)
    out = prep()
    assert_oracle(pool, st, np.array(q), np.array(out), "mlx fresh")
    grow(pool, seqs, 1, rng)
    with pytest.raises(InvalidArgumentError, match="prepare_decode: the pool changed the "
                       "batch since this call was prepared, and on the mlx backend"):
        prep()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_does_not_replay_a_cascade_of_an_older_table(backend):
    rng = np.random.default_rng(2)
    pool, seqs = pool_of(backend, [40], rng, page_size=16)
    seqs += [pool.fork(seqs[0]) for _ in range(3)]
    grow(pool, seqs, 3, rng)
    st = pool.step_table(seqs)
    cdp = pd.plan_cascade(st.page_table(), 4, HKV, D, backend=backend, min_shared_pages=1)
    q = rng.standard_normal((4, 4, D)).astype(np.float16)
    out = np.zeros_like(q)
    pd.decode(q, pool.k, pool.v, st, cascade=cdp, out=out, backend=backend)
    assert_oracle(pool, st, q, out, "cascade, first call")
    grow(pool, seqs, 10, rng)
    with pytest.raises(InvalidArgumentError, match="cascade plan was made for another"):
        pd.decode(q, pool.k, pool.v, st, cascade=cdp, out=out, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fast_path_follows_a_torch_tensor_whose_data_moved(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    pool, seqs = pool_of(backend, [20, 5], rng, num_pages=16)
    t = pool.page_table(seqs)
    k, v = torch.from_numpy(pool.k), torch.from_numpy(pool.v)
    q = torch.randn(2, HQ, D, dtype=torch.float16)
    out = torch.empty_like(q)
    plan = pd.plan_decode(t, HQ, HKV, D, backend=backend)
    pd.decode(q, k, v, t, plan, out=out, backend=backend)
    for x in (q, out):                # same objects and shapes, new storage
        x.set_(torch.empty(2, HQ, D, dtype=torch.float16))
    q.copy_(torch.randn(2, HQ, D, dtype=torch.float16))
    out.fill_(0)
    pd.decode(q, k, v, t, plan, out=out, backend=backend)
    want, _ = oracle_decode(q.numpy(), pool.k, pool.v, t)
    assert_matches_oracle(out.numpy(), None, want, None, "float16", "after set_")


def test_a_step_s_decode_follows_a_torch_tensor_whose_data_moved():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    pool, seqs = pool_of("emulated-cuda", [9, 4], rng)   # keyed on the layout, not version
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ)
    q = torch.randn(2, HQ, D, dtype=torch.float16)
    out = torch.empty_like(q)
    kv = torch.zeros(2, HKV, D, dtype=torch.float16)
    for it in range(2):
        step.begin()
        step.append(0, kv, kv)
        if it:
            out.set_(torch.full((2, HQ, D), float("nan"), dtype=torch.float16))
            q.set_(torch.randn(2, HQ, D, dtype=torch.float16))
        step.decode(0, q, out=out)
        assert_oracle(pool, step.table, q.numpy(), out.numpy(), f"step {it}")


@pytest.mark.parametrize("arg,cached,refused,msg", [
    ("window_left", 1, True, "window_left must be an integer >= -1"),
    ("window_left", 1, 1.0, "window_left must be an integer >= -1"),
    ("return_lse", False, 0, "return_lse must be a bool"),
])
def test_the_fast_path_refuses_what_the_checks_refuse(arg, cached, refused, msg):
    decode_cache.clear()
    rng = np.random.default_rng(5)
    pool, seqs = pool_of("reference", [9, 4], rng)
    t = pool.page_table(seqs)
    q = rng.standard_normal((2, HQ, D)).astype(np.float16)
    out = np.empty_like(q)
    wl = {"window_left": 1} if arg == "window_left" else {}
    plan = pd.plan_decode(t, HQ, HKV, D, backend="reference", **wl)
    pd.decode(q, pool.k, pool.v, t, plan, out=out, backend="reference", **{arg: cached})
    with pytest.raises(InvalidArgumentError, match=msg):
        pd.decode(q, pool.k, pool.v, t, plan, out=out, backend="reference",
                  **{arg: refused})


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_a_prepared_call_keeps_the_array_scales_it_read_through_a_remake(backend):
    """An array k_scale / v_scale is read once, at preparation (documented); a prepared
    call over a step table re-prepares itself when the pool changes the batch, and that
    used to read the arrays again: on reference the scale switched to the array's value
    of that moment, on emulated-cuda it did not (S25's fuzzing). Both keep 0.5 now."""
    from paged_decode.reference import oracle_decode, row_rel_error
    rng = np.random.default_rng(0)
    hq, hkv, d = 4, 2, 64
    pool = pd.PagePool(32, 8, num_kv_heads=hkv, head_dim=d, dtype="float8_e4m3fn",
                       backend=backend, k_scale=1.0, v_scale=1.0)
    s = pool.new_sequence()
    x = rng.standard_normal((20, hkv, d)).astype(np.float32)
    pool.append(s, x, x)
    st = pool.step_table([s])
    plan = pd.plan_decode(st, hq, hkv, d, backend=backend, headroom=32,
                          kv_dtype="float8_e4m3fn")
    q = rng.standard_normal((1, hq, d)).astype(np.float16)
    out = np.zeros_like(q)
    vs = np.array([0.5], np.float32)
    prep = pd.prepare_decode(q, pool.k, pool.v, st, plan, path="v2", out=out,
                             backend=backend, kv_dtype="float8_e4m3fn",
                             k_scale=np.array([1.0], np.float32), v_scale=vs)

    def err(v):
        want, _ = oracle_decode(q, pool.k, pool.v, st.page_table(), k_scale=1.0, v_scale=v)
        return row_rel_error(out, want)
    prep()
    vs[0] = 2.0
    for _ in range(2):               # before and after the pool changes the batch
        prep()
        assert err(0.5) < 5e-3 < err(2.0)
        y = rng.standard_normal((1, hkv, d)).astype(np.float32)
        pool.append(s, y, y)


def test_a_prepared_multi_token_call_refuses_an_edited_qo_indptr():
    """The queries' split is made once from qo_indptr; an in-place edit used to be
    ignored by the prepared call (max-rel 1.7) while decode follows it: refused now."""
    from paged_decode.reference import oracle_decode, row_rel_error
    rng = np.random.default_rng(0)
    hq, hkv, d = 4, 2, 64
    pool = pd.PagePool(32, 8, num_kv_heads=hkv, head_dim=d, dtype="float16",
                       backend="reference")
    seqs = [pool.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (30, 40)):
        x = rng.standard_normal((n, hkv, d)).astype(np.float32)
        pool.append(s, x, x)
    t = pool.page_table(seqs)
    plan = pd.plan_decode(t, hq, hkv, d, backend="reference", query_tokens=3)
    qi = np.array([0, 3, 4], np.int32)
    q = rng.standard_normal((4, hq, d)).astype(np.float16)
    out = np.zeros_like(q)
    prep = pd.prepare_decode(q, pool.k, pool.v, t, plan, path="v2", out=out, qo_indptr=qi,
                             backend="reference")
    prep()
    want, _ = oracle_decode(q, pool.k, pool.v, t, qo_indptr=qi)
    assert row_rel_error(out, want) < 5e-3
    qi[1] = 1
    with pytest.raises(InvalidArgumentError, match=r"PreparedMultiToken\(\): qo_indptr "
                                                   r"changed since prepare_decode"):
        prep()
    qi[1] = 3                                      # back as prepared: runs again
    prep()


def test_a_list_argument_is_computed_not_cached():
    """sinks (or q) as a list is accepted by the checks; with plan and out given, the fast
    path's cache used to read its .shape after the launches wrote out (AttributeError).
    Such a call is computed every time, never cached."""
    rng = np.random.default_rng(0)
    hq, hkv, d = 4, 2, 64
    pool = pd.PagePool(16, 8, num_kv_heads=hkv, head_dim=d, dtype="float32",
                       backend="reference")
    s = pool.new_sequence()
    x = rng.standard_normal((13, hkv, d)).astype(np.float32)
    pool.append(s, x, x)
    t = pool.page_table([s])
    plan = pd.plan_decode(t, hq, hkv, d, backend="reference")
    q = rng.standard_normal((1, hq, d)).astype(np.float32)
    out = np.full((1, hq, d), np.nan, np.float32)
    want = pd.decode(q, pool.k, pool.v, t, plan, sinks=np.full(hq, 0.5, np.float32),
                     backend="reference")
    for _ in range(2):
        pd.decode(q, pool.k, pool.v, t, plan, sinks=[np.float32(0.5)] * hq, out=out,
                  backend="reference")
        np.testing.assert_allclose(out, want, rtol=1e-6)
