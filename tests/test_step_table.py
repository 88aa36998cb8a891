"""Step tables: a pool's device-resident page table, updated in place by a delta.

The model is the pool itself: after any sequence of pool operations, a flushed step
table's device buffer must hold exactly ``pool.page_table(seqs)`` (padding rows empty),
on every backend (reference: the numpy contract; emulated-cuda / emulated-metal: the
table-update kernel's two dialects on the emulator). Plus: what a flush uploads is the
change only, decodes through a step table equal decodes through the host table, plans with
headroom keep serving a growing table and stop (clearly) when it outgrows them.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle

import paged_decode as pd
from paged_decode.errors import InvalidArgumentError, PlanMismatchError
from paged_decode.kernels.table_update import (
    apply_delta,
    delta_header_words,
    table_views,
    table_words,
)
from paged_decode.reference import oracle_decode
from paged_decode.step_upload import StepUpload

BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]
HKV, D = 2, 64


def rows(rng, n, layers=None):
    shape = (n, HKV, D) if layers is None else (layers, n, HKV, D)
    return rng.standard_normal(shape).astype(np.float32)


def assert_matches_pool(st):
    """The flushed device buffer against the pool's own (validated) table."""
    st.flush()
    want = st.page_table()
    got = table_views(st.pool.backend.to_numpy(st.buffer), st.capacity)
    n = int(want.indptr[-1])
    np.testing.assert_array_equal(got["indptr"], want.indptr)
    np.testing.assert_array_equal(got["indices"][:n], want.indices)
    np.testing.assert_array_equal(got["last_page_len"], want.last_page_len)
    np.testing.assert_array_equal(got["first_page_offset"], want.first_page_offset)
    live = st.sequences >= 0
    ids = st.sequences[live]
    for r, s in zip(np.flatnonzero(live), ids):   # and against the pool's page lists
        pages = got["indices"][got["indptr"][r]:got["indptr"][r + 1]]
        assert pages.tolist() == st.pool.seq_pages(int(s))
    assert (np.diff(got["indptr"])[~live] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_operations_keep_the_device_table_equal_to_the_pool(backend):
    rng = np.random.default_rng(7)
    pool = pd.PagePool(96, 4, HKV, D, "float32", backend=backend)
    seqs = [pool.new_sequence() for _ in range(4)]
    for s, n in zip(seqs, [5, 0, 9, 3]):
        if n:
            pool.append(s, rows(rng, n), rows(rng, n))
    st = pool.step_table(seqs, capacity=6, page_capacity=6)
    assert_matches_pool(st)
    live = list(seqs)
    for _ in range(40):
        op = rng.integers(0, 8)
        if op <= 3:                                   # the decode step: one token each
            pool.append_batch(live, rows(rng, len(live)), rows(rng, len(live)))
        elif op == 4:                                 # a ragged run (prefill chunks)
            c = rng.integers(0, 6, len(live))
            pool.append_batch(live, rows(rng, int(c.sum())), rows(rng, int(c.sum())),
                              counts=c)
        elif op == 5 and len(live) < 6:               # a fork joins (copy-on-write next)
            child = pool.fork(live[int(rng.integers(len(live)))])
            live.append(child)
            st.set_sequences(live)
        elif op == 6:                                 # a sliding window moves on
            s = live[int(rng.integers(len(live)))]
            pool.trim_front(s, int(rng.integers(0, pool.seq_len(s) + 1)))
        elif len(live) > 2:                           # a sequence finishes
            s = live.pop(int(rng.integers(len(live))))
            pool.free(s)
            if rng.integers(2):
                st.set_sequences(live)                # compacted, or left as an empty row
        assert_matches_pool(st)
    assert st.layout >= 1            # the page capacity of 6 was outgrown on the way


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_batches_between_flushes_keep_the_device_table_right(backend):
    """Two or more set_sequences calls (reorders, subsets, new members) with appends and
    trims between them and no flush: the delta maps each row to the device row it keeps
    pages of through every unsent batch (before, the second call took the first's unsent
    order for the device's, and moved rows got another row's pages: S25's fuzzing)."""
    rng = np.random.default_rng(17)
    pool = pd.PagePool(128, 4, HKV, D, "float32", backend=backend)
    seqs = [pool.new_sequence() for _ in range(6)]
    for s, n in zip(seqs, [5, 9, 14, 1, 7, 22]):
        pool.append(s, rows(rng, n), rows(rng, n))
    st = pool.step_table(seqs[:3], capacity=6, page_capacity=64)
    assert_matches_pool(st)
    for _ in range(30):
        for _ in range(int(rng.integers(2, 5))):       # batches set without a flush
            live = [int(x) for x in rng.permutation(seqs)[: int(rng.integers(1, 7))]]
            st.set_sequences(live)
            op = rng.integers(0, 3)
            if op == 0:
                pool.append_batch(live, rows(rng, len(live)), rows(rng, len(live)))
            elif op == 1:
                s = live[int(rng.integers(len(live)))]
                pool.trim_front(s, int(rng.integers(0, min(3, pool.seq_len(s)) + 1)))
        assert_matches_pool(st)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_step_uploads_only_what_changed(backend, monkeypatch):
    rng = np.random.default_rng(3)
    pool = pd.PagePool(256, 4, HKV, D, "float32", backend=backend)
    seqs = [pool.new_sequence() for _ in range(8)]
    for i, s in enumerate(seqs):
        pool.append(s, rows(rng, 4 * i + 2), rows(rng, 4 * i + 2))
    st = pool.step_table(seqs)
    be = pool.backend
    sent, updates = [], []
    real_send, real_update = StepUpload.send, type(be).update_table

    def spy_send(self, desc, delta):
        sent.append(delta.copy())
        return real_send(self, desc, delta)

    def spy_update(self, buf, delta, cap, page_cap, *, scratch):
        updates.append(cap)
        return real_update(self, buf, delta, cap, page_cap, scratch=scratch)

    monkeypatch.setattr(StepUpload, "send", spy_send)
    monkeypatch.setattr(type(be), "update_table", spy_update)
    assert not st.flush()                    # nothing changed: nothing sent
    for step in range(6):
        before = [pool.seq_len(s) for s in seqs]
        pool.append_batch(seqs, rows(rng, 8), rows(rng, 8))
        st.flush()
        crossed = sum(n % 4 == 0 for n in before)     # a full last page: a new page
        assert len(sent) == len(updates) == step + 1  # one upload, one update each
        assert sent[-1].size == delta_header_words(8) + crossed
        assert_matches_pool(st)


def test_apply_delta_contract_by_hand():
    # two rows: row 0 keeps its 2 pages and gains page 9; row 1 drops its first page
    # (skip 1) and keeps the next one
    cap, pcap = 2, 6
    old = np.full(table_words(cap, pcap), -1, np.int32)
    ov = table_views(old, cap)
    ov["indptr"][:] = [0, 2, 4]
    ov["indices"][:4] = [5, 6, 7, 8]
    delta = np.concatenate([[0, 3, 4], [1, 2], [0, 1], [0, 1], [0, 1], [2, 1], [0, 1, 1],
                            [9]]).astype(np.int32)
    new = table_views(apply_delta(old, delta, cap), cap)
    assert new["indptr"].tolist() == [0, 3, 4]
    assert new["indices"].tolist() == [5, 6, 9, 8, -1, -1]
    assert new["last_page_len"].tolist() == [1, 2]
    assert new["first_page_offset"].tolist() == [0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["v2", "v1"])
def test_decode_through_a_step_table_equals_the_host_table(backend, path, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(11)
    pool = pd.PagePool(64, 4, HKV, D, "float32", backend=backend)
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [5, 1, 13]):
        pool.append(s, rows(rng, n), rows(rng, n))
    st = pool.step_table(seqs, capacity=5)            # two padding rows
    plan = pd.plan_decode(st, 8, HKV, D, backend=backend, headroom=8, pages_per_chunk=1)
    q = rng.standard_normal((5, 8, D)).astype(np.float32)
    out = np.full((5, 8, D), np.nan, np.float32)
    lse = np.full((5, 8), np.nan, np.float32)
    for _ in range(5):
        pool.append_batch(seqs, rows(rng, 3), rows(rng, 3))
        o, l = pd.decode(q, pool.k, pool.v, st, plan, out=out, lse=lse, return_lse=True,
                         path=path, backend=backend)
        ro, rl = oracle_decode(q, pool.k, pool.v, st.page_table())
        assert_matches_oracle(o, l, ro, rl, "float32", path)
        assert (o[3:] == 0).all() and np.isneginf(l[3:]).all()   # padding rows


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_a_plan_with_headroom_serves_growth_then_refuses_clearly(backend):
    rng = np.random.default_rng(5)
    pool = pd.PagePool(64, 4, HKV, D, "float32", backend=backend)
    s = pool.new_sequence()
    pool.append(s, rows(rng, 6), rows(rng, 6))        # 2 pages, 2 free slots
    st = pool.step_table([s])
    plan = pd.plan_decode(st, 4, HKV, D, backend=backend, headroom=6, pages_per_chunk=1)
    assert plan.headroom == 6 and plan.num_chunks == 3    # ceil((6 + 6) / 4) pages
    q = rng.standard_normal((1, 4, D)).astype(np.float32)
    out = np.empty((1, 4, D), np.float32)
    for _ in range(6):                                # 12 tokens: still 3 pages
        pool.append_batch([s], rows(rng, 1), rows(rng, 1))
        pd.decode(q, pool.k, pool.v, st, plan, out=out, backend=backend)
        ro, _ = oracle_decode(q, pool.k, pool.v, st.page_table())
        assert_matches_oracle(out, None, ro, None, "float32", "headroom")
    pool.append_batch([s], rows(rng, 1), rows(rng, 1))    # a 4th page: outgrown
    with pytest.raises(PlanMismatchError, match=r"request 0 needs 4 chunks of 1 pages, "
                                                r"plan has 3"):
        pd.decode(q, pool.k, pool.v, st, plan, out=out, backend=backend)


def test_bad_arguments_are_refused_clearly():
    pool = pd.PagePool(16, 4, HKV, D, "float32")
    a, b = pool.new_sequence(), pool.new_sequence()
    with pytest.raises(InvalidArgumentError, match=r"PagePool.step_table: capacity must "
                                                   r"be at least the number of sequences"):
        pool.step_table([a, b], capacity=1)
    with pytest.raises(InvalidArgumentError, match=r"seqs must not repeat a sequence"):
        pool.step_table([a, a])
    with pytest.raises(InvalidArgumentError, match=r"unknown sequence 7"):
        pool.step_table([a, 7])
    pool.append(a, np.zeros((9, HKV, D), np.float32), np.zeros((9, HKV, D), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"page_capacity must hold the batch's "
                                                   r"3 pages, got 2"):
        pool.step_table([a], page_capacity=2)
    st = pool.step_table([a, b])
    with pytest.raises(InvalidArgumentError, match=r"StepTable.set_sequences: .*unknown"):
        st.set_sequences([a, 99])
    q = np.zeros((2, 4, D), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"decode: table is a step table of a "
                                                   r"'reference' pool, but the call runs "
                                                   r"on backend 'emulated-cuda'"):
        pd.decode(q, pool.k, pool.v, st, backend="emulated-cuda")


def test_reserve_batch_then_write_layer_equals_append_batch():
    rng = np.random.default_rng(2)
    made = []
    for how in ("append", "reserve"):
        pool = pd.PagePool(32, 4, HKV, D, "float32", num_layers=3)
        seqs = [pool.new_sequence() for _ in range(3)]
        for s, n in zip(seqs, [4, 2, 7]):
            x = rows(np.random.default_rng(n), n, 3)
            pool.append(s, x, x)
        child = pool.fork(seqs[1])                  # a shared partial page: a copy
        batch_seqs = [seqs[1], child, seqs[2]]
        k = rows(np.random.default_rng(9), 3, 3)
        if how == "append":
            pool.append_batch(batch_seqs, k, k)
        else:
            batch = pool.reserve_batch(batch_seqs)
            assert batch.copies.shape == (1, 2)
            for layer in range(3):
                pool.write_layer(batch, k[layer], k[layer], layer=layer)
        made.append((np.array(pool.k), [pool.seq_pages(s) for s in batch_seqs]))
    np.testing.assert_array_equal(made[0][0], made[1][0])
    assert made[0][1] == made[1][1]
    del rng


def test_reserve_batch_is_all_or_nothing():
    pool = pd.PagePool(3, 4, HKV, D, "float32")
    seqs = [pool.new_sequence() for _ in range(4)]
    with pytest.raises(pd.PoolExhaustedError, match=r"need 4 free pages for 4 of the 4 "
                                                    r"sequences .*nothing was changed"):
        pool.reserve_batch(seqs)
    assert pool.num_free == 3 and all(pool.seq_len(s) == 0 for s in seqs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_row_table_with_a_tiny_page_capacity(backend):
    """Capacity 1 and page capacity 2: the table buffer has 6 words, which MLX passes to
    the update kernel in the constant address space (the Metal dialect must not bind it
    to a device pointer; the emulator refuses that since session 21)."""
    rng = np.random.default_rng(12)
    pool = pd.PagePool(8, 16, HKV, D, "float32", backend=backend)
    s = pool.new_sequence()
    pool.append(s, rows(rng, 5), rows(rng, 5))
    st = pool.step_table([s], page_capacity=2)
    for n in (7, 9, 6):
        pool.append(s, rows(rng, n), rows(rng, n))
        assert_matches_pool(st)


def test_host_views_are_read_only_and_survive_a_caller_write_attempt():
    """Every array a step table hands out is read-only: a caller writing into
    ``last_page_len`` (a view of the host mirror) would otherwise change what every later
    read of it returns, while the device copy keeps the old values."""
    rng = np.random.default_rng(3)
    pool = pd.PagePool(8, 16, HKV, D, "float32", backend="reference")
    s = pool.new_sequence()
    pool.append(s, rows(rng, 21), rows(rng, 21))
    st = pool.step_table([s], page_capacity=4)
    names = ("sequences", "pages_per_request", "visible_lens", "last_page_len",
             "first_page_offset")
    before = {n: getattr(st, n).copy() for n in names}
    for n in names:
        a = getattr(st, n)
        assert not a.flags.writeable, n
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1
    for n in names:
        np.testing.assert_array_equal(getattr(st, n), before[n])
    assert before["last_page_len"].tolist() == [5] and before["visible_lens"].tolist() == [21]
