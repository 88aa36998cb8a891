"""Multi-token engine steps (speculative decoding): ``begin(tokens=T)``, ``append`` and
``decode`` of ``[capacity, T, ...]`` rows, ``trim_back`` of the rejected drafts, and
``PagePool.trim_back`` / ``trim_back_batch`` under them.

Every step's outputs are checked against the float64 oracle over the pool's own page
table of the live sequences (token ``t`` sees the context and the new tokens ``<= t``),
with NaN-poisoned outputs and padding rows that must come back zero; steps of 1-8 tokens
alternate with one-token steps (whose device tables must follow every trim), through
forks sharing a partial page, a batch change and replans. ``tests/mutants.py`` plants
``py-trim-back-*`` and ``py-step-tokens-*``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle

import paged_decode as pd
from paged_decode.errors import InvalidArgumentError, UnsupportedProblemError
from paged_decode.reference import oracle_decode

BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]
L, HKV, D, HQ, P = 2, 2, 64, 8, 4
TOKENS = [3, 1, 4, 2, 1, 8, 1, 5, 2, 1]


def _pool(backend, rng, dtype="float32"):
    pool = pd.PagePool(160, P, HKV, D, dtype, num_layers=L, backend=backend)
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [9, 2, 14]):
        x = rng.standard_normal((L, n, HKV, D)).astype(np.float32)
        pool.append(s, x, x)
    seqs.append(pool.fork(seqs[2]))        # shares a partial last page: copy-on-write
    return pool, seqs


def _check(be, pool, step, layer, q, got, lse, dtype, what):
    rows, ids, _ = step.table.live_rows()
    k, v = pool.layer(layer)
    want, want_lse = oracle_decode(be.to_numpy(q)[rows], be.to_numpy(k), be.to_numpy(v),
                                   pool.page_table(ids))
    got, lse = be.to_numpy(got), be.to_numpy(lse)
    assert_matches_oracle(got[rows].astype(np.float32), lse[rows], want, want_lse, dtype,
                          what)
    pad = np.setdiff1d(np.arange(step.capacity), rows)
    assert not np.any(got[pad]), f"{what}: padding rows not zero"
    assert np.all(np.isneginf(lse[pad])), f"{what}: padding rows' LSE not -inf"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["auto", "v2", "v1"])
def test_token_steps_match_the_oracle(backend, path):
    rng = np.random.default_rng(2)
    be = pd.get_backend(backend)
    pool, seqs = _pool(be, rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=6, headroom=4, path=path)
    free0 = pool.num_free
    for i, t in enumerate(TOKENS):
        if i == 3:      # a freed row: padding between live rows
            pool.free(seqs[1])
        if i == 7:      # another batch, with a new sequence
            s = pool.new_sequence()
            x = rng.standard_normal((L, 3, HKV, D)).astype(np.float32)
            pool.append(s, x, x)
            step.set_sequences([seqs[3], s, seqs[0], seqs[2]])
        step.begin(tokens=t)
        shape = (step.capacity, t) if t > 1 else (step.capacity,)
        for layer in range(L):
            kv = be.asarray(rng.standard_normal((*shape, HKV, D)).astype(np.float32))
            step.append(layer, kv, kv)
            q = be.asarray(rng.standard_normal((*shape, HQ, D)).astype(np.float32))
            out = be.asarray(np.full((*shape, HQ, D), np.nan, np.float32))
            lse = be.asarray(np.full((*shape, HQ), np.nan, np.float32))
            got, got_lse = step.decode(layer, q, out=out, lse=lse, return_lse=True)
            _check(be, pool, step, layer, q, got, got_lse, "float32", f"step {i} T={t}")
        if t > 1:
            assert pd.last_outcome().path.endswith("+merge") and f"({t} per request)" in \
                pd.last_outcome().detail, str(pd.last_outcome())
            rows, ids, _ = step.table.live_rows()
            reject = np.zeros(step.capacity, np.int64)
            reject[rows] = rng.integers(0, t, rows.size)
            before = [pool.seq_len(int(s)) for s in ids]
            step.trim_back(reject)
            assert [pool.seq_len(int(s)) for s in ids] == \
                [b - int(r) for b, r in zip(before, reject[rows])]
    for s in pool.sequences():
        pool.free(s)
    assert pool.num_free == pool.num_pages > free0, "pages leaked through trims"


def test_a_step_with_every_row_live_writes_the_callers_buffers():
    """No padding: q and out go to the multi-token call as they are (no gather)."""
    rng = np.random.default_rng(4)
    be = pd.get_backend("emulated-cuda")
    pool, seqs = _pool(be, rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ)
    assert step.capacity == len(seqs)
    step.begin(tokens=4)
    for layer in range(L):
        kv = rng.standard_normal((4, 4, HKV, D)).astype(np.float32)
        step.append(layer, kv, kv)
        q = rng.standard_normal((4, 4, HQ, D)).astype(np.float32)
        out = np.full((4, 4, HQ, D), np.nan, np.float32)
        lse = np.full((4, 4, HQ), np.nan, np.float32)
        got, got_lse = step.decode(layer, q, out=out, lse=lse, return_lse=True)
        assert got is out and got_lse is lse
        _check(be, pool, step, layer, q, got, got_lse, "float32", f"layer {layer}")


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
def test_token_steps_over_16_bit_and_fp8_pools_on_v2tc(dtype):
    rng = np.random.default_rng(5)
    be = pd.get_backend("emulated-cuda")
    kw = {"k_scale": 0.5, "v_scale": 0.25} if dtype.startswith("float8") else {}
    pool = pd.PagePool(160, 16, HKV, D, dtype, num_layers=L, backend=be, **kw)
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [40, 3, 70]):
        x = rng.standard_normal((L, n, HKV, D)).astype(np.float16)
        pool.append(s, x, x)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4, path="v2tc")
    for t in (4, 8, 2):
        step.begin(tokens=t)
        for layer in range(L):
            kv = rng.standard_normal((4, t, HKV, D)).astype(np.float16)
            step.append(layer, kv, kv)
            q = rng.standard_normal((4, t, HQ, D)).astype(np.float16)
            got, lse = step.decode(layer, q, return_lse=True)
            rows, ids, _ = step.table.live_rows()
            k, v = pool.layer(layer)
            want, want_lse = oracle_decode(q[rows], k, v, pool.page_table(ids),
                                           **pool.decode_args(layer))
            assert_matches_oracle(np.asarray(got)[rows].astype(np.float32),
                                  np.asarray(lse)[rows], want, want_lse, "float16",
                                  f"{dtype} T={t}", tol=5e-2 if kw else None)
            assert pd.last_outcome().path == "v2tc+merge"
        step.trim_back(np.array([t - 1, 0, 1, 0]))


def test_step_refuses_bad_token_calls():
    rng = np.random.default_rng(6)
    be = pd.get_backend("emulated-cuda")
    pool, seqs = _pool(be, rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=5)
    for bad in (0, 9, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="DecodeStep.begin: tokens must be"):
            step.begin(tokens=bad)
    step.begin(tokens=3)
    rows1 = np.zeros((5, HKV, D), np.float32)
    with pytest.raises(InvalidArgumentError,
                       match=r"DecodeStep.append: k must have shape \[capacity, T = 3, Hkv, "
                             r"D\] = \[5, 3, 2, 64\], got \[5, 2, 64\]"):
        step.append(0, rows1, rows1)
    with pytest.raises(InvalidArgumentError,
                       match=r"DecodeStep.trim_back: .*layers \[0, 1\] have not"):
        step.trim_back(np.zeros(5, np.int64))
    rows = np.zeros((5, 3, HKV, D), np.float32)
    step.append(0, rows, rows)
    with pytest.raises(InvalidArgumentError, match="DecodeStep.append: layer 0 was appended"):
        step.append(0, rows, rows)
    step.append(1, rows, rows)
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.decode: q must be \[capacity, "
                                                   r"T, Hq, D\] = \[5, 3, 8, 64\]"):
        step.decode(0, np.zeros((5, 2, HQ, D), np.float32))
    q3 = np.zeros((5, 3, HQ, D), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.decode: out must have shape "
                                                   r"\[capacity, T, Hq, D\]"):
        step.decode(0, q3, out=np.zeros((5, 3, HQ, D // 2), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.decode: lse must have shape "
                                                   r"\[capacity, T, Hq\]"):
        step.decode(0, q3, lse=np.zeros((5, 3, HQ, 1), np.float32), return_lse=True)
    with pytest.raises(InvalidArgumentError, match="DecodeStep.capture: .*runs eagerly"):
        step.capture(lambda st: st.decode(0, np.zeros((5, 3, HQ, D), np.float32)))
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.trim_back: counts\[4\] must "
                                                   "be 0 \\(row 4 is a padding row\\)"):
        step.trim_back(np.array([0, 0, 0, 0, 1]))
    with pytest.raises(InvalidArgumentError, match="DecodeStep.trim_back: counts must have "
                                                   r"shape \[B\] = \[5\]"):
        step.trim_back(np.zeros(4, np.int64))
    with pytest.raises(InvalidArgumentError, match="must be in \\[0, 5\\]"):
        step.trim_back(np.array([0, 6, 0, 0, 0]))    # seqs[1] holds 2 + 3 tokens
    step.trim_back(np.array([2, 0, 1, 0, 0]))
    step.begin()
    for layer in range(L):
        step.append(layer, rows1, rows1)
    with pytest.raises(UnsupportedProblemError, match="DecodeStep.decode: .*begin\\(tokens=T\\)"):
        step.decode(0, np.zeros((5, 2, HQ, D), np.float32))


# ---------------------------------------------------------------------------- the pool
def _view(pool, seq):
    t = pool.page_table([seq])
    return (int(t.indptr[1]), int(t.last_page_len[0]), int(t.first_page_offset[0]),
            int(t.rope_positions[0]))


def test_trim_back_releases_pages_and_keeps_positions():
    pool = pd.PagePool(32, 4, 1, 8, "float32")
    s = pool.new_sequence()
    x = np.arange(11 * 8, dtype=np.float32).reshape(11, 1, 8)
    pool.append(s, x, x)                       # 11 tokens: pages of 4, 4, 3
    free = pool.num_free
    pool.trim_back(s, 4)                       # 7 left: 2 pages, the second full 3
    assert pool.seq_len(s) == 7 and pool.num_free == free + 1
    assert _view(pool, s) == (2, 3, 0, 7)
    pool.trim_back(s, 0)
    pool.append(s, x[:2], x[:2])               # the retired positions are taken back
    assert _view(pool, s) == (3, 1, 0, 9)
    k = np.asarray(pool.k)
    pages = pool.seq_pages(s)
    assert np.array_equal(k[pages[1], 3], x[0]) and np.array_equal(k[pages[2], 0], x[1])
    pool.trim_front(s, 6)                      # window moved: first page gone, start 2
    assert _view(pool, s) == (2, 1, 2, 9)
    pool.trim_back(s, 3)                       # nothing visible left: no page kept
    assert _view(pool, s) == (0, 0, 0, 6) and pool.seq_len(s) == 0
    assert pool.num_free == pool.num_pages
    pool.append(s, x[:1], x[:1])
    assert _view(pool, s) == (1, 1, 0, 7)      # positions go on from the retired ones


def test_trim_back_of_forks_sharing_pages():
    """Two forks retiring into the prompt they share in one batch: the shared pages lose
    one reference each (freed only by the last holder), and the next append into a
    still-shared partial page copies it."""
    pool = pd.PagePool(32, 4, 1, 8, "float32")
    base = pool.new_sequence()
    x = np.random.default_rng(0).standard_normal((10, 1, 8)).astype(np.float32)
    pool.append(base, x, x)                    # pages A(4) B(4) C(2)
    a, b = pool.fork(base), pool.fork(base)
    pool.append(a, x[:3], x[:3])               # a: copy of C, then one more page
    shared = pool.seq_pages(base)
    assert pool.refcount(shared[1]) == 3
    pool.trim_back_batch([a, b], [8, 5])       # a keeps 5 tokens, b keeps 5: A, B
    assert pool.seq_pages(a) == shared[:2] and pool.seq_pages(b) == shared[:2]
    assert pool.refcount(shared[1]) == 3 and pool.refcount(shared[2]) == 1
    pool.append(b, x[:1], x[:1])               # into shared B: copied on write
    assert pool.seq_pages(b)[1] != shared[1]
    assert np.array_equal(np.asarray(pool.k)[pool.seq_pages(b)[1], 1], x[0])
    assert np.array_equal(np.asarray(pool.k)[shared[1], 1], x[5])   # base's token kept
    for s in (a, b, base):
        pool.free(s)
    assert pool.num_free == pool.num_pages
    # both forks drop the same two shared pages in one batch: two references each
    base = pool.new_sequence()
    pool.append(base, x, x)
    a, b = pool.fork(base), pool.fork(base)
    pool.trim_back_batch([a, b], [6, 6])
    shared = pool.seq_pages(base)
    assert [pool.refcount(pg) for pg in shared] == [3, 1, 1]
    pool.free(base)
    assert pool.num_free == pool.num_pages - 1
    pool.free(a)
    pool.free(b)
    assert pool.num_free == pool.num_pages


def test_trim_back_refuses_bad_input_and_changes_nothing():
    pool = pd.PagePool(16, 4, 1, 8, "float32")
    s, t = pool.new_sequence(), pool.new_sequence()
    x = np.zeros((5, 1, 8), np.float32)
    pool.append(s, x, x)
    pool.append(t, x[:2], x[:2])
    before = (pool.num_free, pool.seq_len(s), pool.seq_len(t))
    with pytest.raises(InvalidArgumentError, match=r"PagePool.trim_back_batch: the count for "
                                                   r"sequence 1 must be in \[0, 2\]"):
        pool.trim_back_batch([s, t], [1, 3])
    with pytest.raises(InvalidArgumentError, match="trim_back_batch: counts must be >= 0"):
        pool.trim_back_batch([s, t], [1, -1])
    with pytest.raises(InvalidArgumentError, match="trim_back_batch: seqs must not repeat"):
        pool.trim_back_batch([s, s], [1, 1])
    with pytest.raises(InvalidArgumentError, match="PagePool.trim_back: unknown sequence 7"):
        pool.trim_back(7, 1)
    with pytest.raises(InvalidArgumentError, match="PagePool.trim_back: n must be an integer"):
        pool.trim_back(s, 1.0)
    assert (pool.num_free, pool.seq_len(s), pool.seq_len(t)) == before


def test_step_tables_follow_trim_back():
    """A device step table after trims (one-token decodes read it): the oracle."""
    rng = np.random.default_rng(8)
    be = pd.get_backend("emulated-cuda")
    pool, seqs = _pool(be, rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4)
    for i, counts in enumerate(([0, 1, 5, 0], [2, 0, 0, 3], [9, 0, 0, 0], [0, 0, 0, 0])):
        pool.trim_back_batch(seqs, counts)
        for layer in range(L):      # decode reads the step table's device copy as it is
            k, v = pool.layer(layer)
            q = rng.standard_normal((4, HQ, D)).astype(np.float32)
            got, lse = pd.decode(q, k, v, step.table, return_lse=True, backend=be)
            want, want_lse = oracle_decode(q, k, v, pool.page_table(seqs))
            assert_matches_oracle(got, lse, want, want_lse, "float32", f"trim {i}, table")
        step.begin()
        for layer in range(L):
            kv = rng.standard_normal((4, HKV, D)).astype(np.float32)
            step.append(layer, kv, kv)
            q = rng.standard_normal((4, HQ, D)).astype(np.float32)
            got, lse = step.decode(layer, q, return_lse=True)
            k, v = pool.layer(layer)
            want, want_lse = oracle_decode(q, k, v, pool.page_table(seqs))
            assert_matches_oracle(got, lse, want, want_lse, "float32", f"trim {i}")


def test_a_token_step_over_padding_rows_only():
    """Every sequence of the batch freed: nothing runs; zeros and -inf come back."""
    rng = np.random.default_rng(9)
    be = pd.get_backend("emulated-cuda")
    pool, seqs = _pool(be, rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4)
    for s in seqs:
        pool.free(s)
    step.begin(tokens=2)
    rows = np.ones((4, 2, HKV, D), np.float32)
    for layer in range(L):
        step.append(layer, rows, rows)
        out = np.full((4, 2, HQ, D), np.nan, np.float32)
        got, lse = step.decode(layer, np.ones((4, 2, HQ, D), np.float32), out=out,
                               return_lse=True)
        assert got is out and not np.any(out) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("backend", ["emulated-cuda", "reference"])
def test_a_captured_one_token_step_is_not_replayed_over_a_token_begin(backend):
    """A graph writes one slot per sequence: after begin(tokens=T) its replay is refused
    (the T slots would stay unwritten); eager token steps and replays then alternate."""
    rng = np.random.default_rng(10)
    be = pd.get_backend(backend)
    pool, seqs = _pool(be, rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ)
    rows1 = np.zeros((4, HKV, D), np.float32)
    q1 = rng.standard_normal((4, HQ, D)).astype(np.float32)
    outs = [np.zeros((4, HQ, D), np.float32) for _ in range(L)]

    def body(st):
        for layer in range(L):
            st.append(layer, rows1, rows1)
            st.decode(layer, q1, out=outs[layer])

    step.begin()
    graph = step.capture(body)
    step.begin(tokens=2)
    with pytest.raises(InvalidArgumentError, match=r"CapturedStep.replay: the last begin\(\) "
                                                   "gave each sequence 2 slots"):
        graph.replay()
    with pytest.raises(InvalidArgumentError, match="DecodeStep.replayed: the last begin"):
        step.replayed()
    rows2 = np.zeros((4, 2, HKV, D), np.float32)
    for layer in range(L):
        step.append(layer, rows2, rows2)
    step.trim_back(np.array([1, 0, 1, 0]))
    step.begin()
    graph.replay()
    for layer in range(L):
        k, v = pool.layer(layer)
        want, _ = oracle_decode(q1, be.to_numpy(k), be.to_numpy(v), pool.page_table(seqs))
        assert_matches_oracle(be.to_numpy(outs[layer]), None, want, None, "float32",
                              f"replay after a token step, layer {layer}")
