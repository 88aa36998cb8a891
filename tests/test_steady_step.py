"""The steady begin (``paged_decode/steady_step.py``) against the general one, on twin
pools: every begin of one twin takes the steady path where it applies, the other twin's
always the general path (``PagePool._append`` + ``StepTable.update_device``), and after
every step the two agree on everything: the pool's bookkeeping, the device table, the
append descriptor and the returned ``AppendedBatch``. Outside changes (appends, forks,
trims, frees, a new table, a new batch) and pool exhaustion happen to both twins.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle

import paged_decode as pd
from paged_decode import engine_step
from paged_decode.errors import PoolExhaustedError
from paged_decode.reference import oracle_decode

L, HKV, D, HQ, P = 2, 2, 16, 4, 4
BATCH_FIELDS = ("seqs", "counts", "seq_lens", "last_page_len", "num_pages",
                "first_changed", "changed_pages", "changed_indptr", "copies")


def _twin(backend, num_pages=160, lens=(5, 1, 10, 4, 7), fork_of=2, capacity=8, head_dim=D,
          page_capacity=None):
    """A pool with ragged sequences (one of them forked: a shared partial last page) and
    a step over them; built the same way twice, the twins are equal."""
    rng = np.random.default_rng(3)
    pool = pd.PagePool(num_pages, P, HKV, head_dim, "float32", num_layers=L, backend=backend)
    seqs = [pool.new_sequence() for _ in lens]
    for s, n in zip(seqs, lens):
        x = rng.standard_normal((L, n, HKV, head_dim)).astype(np.float32)
        pool.append(s, x, x)
    seqs.append(pool.fork(seqs[fork_of]))
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=capacity, headroom=4,
                         page_capacity=page_capacity)
    return pool, step, seqs


def _write(*steps):
    """Every layer's rows of each step's token (zeros): a begin's slots must be written
    before the next begin."""
    for step in steps:
        k = np.zeros((step.capacity, HKV, step.pool.head_dim), np.float32)
        for layer in range(L):
            step.append(layer, k, k)


def _general_begin(step):
    step._steady = None                  # never armed when begin() runs
    batch = step.begin()
    step._steady = None
    return batch


def _state(pool, step, be):
    S = pool._seqs
    t = step.table
    out = {f: getattr(S, f).copy() for f in ("npages", "head", "start", "filled", "trimmed")}
    out.update(pages=S.pages.copy(), free=pool._free[:pool._nfree].copy(),
               nfree=pool._nfree, ref=pool._ref.copy(), version=pool._version,
               desc=np.asarray(be.to_numpy(step._desc)).copy(),
               npages=t.pages_per_request.copy(), visible=t.visible_lens.copy(),
               lpl=t.last_page_len.copy(), fpo=t.first_page_offset.copy())
    t.flush()                  # the device update a begin leaves pending
    buf = np.asarray(be.to_numpy(t.buffer))
    cap = t.capacity
    out["header"] = buf[:3 * cap + 1].copy()
    out["indices"] = buf[3 * cap + 1:3 * cap + 1 + t.total_pages].copy()
    return out


def _same(a, b, what):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=f"{what}: {k}")


def _same_batch(x, y, what):
    for f in BATCH_FIELDS:
        np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f"{what}: {f}")
    np.testing.assert_array_equal(x.write.desc, y.write.desc, err_msg=f"{what}: write.desc")
    assert x.write.num_rows == y.write.num_rows and x.write.copy_cow == y.write.copy_cow


class _Count:
    """Counts the steady advances that applied (not None)."""

    def __init__(self, monkeypatch):
        self.applied = 0
        cls = engine_step.SteadyBegin       # the class the step uses (a mutant's too)
        real = cls.advance

        def spy(this):
            r = real(this)
            self.applied += r is not None
            return r
        monkeypatch.setattr(cls, "advance", spy)


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_steady_begins_equal_general_ones_through_outside_changes(backend, monkeypatch):
    be = pd.get_backend(backend)
    count = _Count(monkeypatch)
    pa, sa, seqs_a = _twin(backend)
    pb, sb, seqs_b = _twin(backend)
    assert seqs_a == seqs_b
    rng = np.random.default_rng(5)
    extra = {}
    for it in range(40):
        # outside changes, the same on both twins, between some steps
        for pool, step, seqs in ((pa, sa, seqs_a), (pb, sb, seqs_b)):
            if it == 9:      # a sequence outside the batch grows
                s = pool.new_sequence()
                x = np.ones((L, 6, HKV, D), np.float32)
                pool.append(s, x, x)
                extra[id(pool)] = s
            elif it == 12:   # a fork of a batch member stays out: its last page is shared
                extra[("f", id(pool))] = pool.fork(seqs[4])
            elif it == 15:   # a fork of a batch member joins: a shared partial page again
                step.set_sequences([*seqs, pool.fork(seqs[1])])
            elif it == 21:
                pool.trim_front(seqs[0], 5)
            elif it == 26:
                pool.free(extra[id(pool)])
            elif it == 30:   # another table follows the pool from now on
                extra[("t", id(pool))] = pool.step_table(seqs[:3])
        xa = sa.begin()
        xb = _general_begin(sb)
        _same_batch(xa, xb, f"step {it}")
        _same(_state(pa, sa, be), _state(pb, sb, be), f"step {it}")
        if it >= 30:
            ta, tb = extra[("t", id(pa))], extra[("t", id(pb))]
            ta.flush()
            tb.flush()
            for f in ("indices", "indptr", "last_page_len", "first_page_offset"):
                np.testing.assert_array_equal(getattr(ta.page_table(), f),
                                              getattr(tb.page_table(), f), err_msg=f)
        # the rows the step writes, the same on both
        for layer in range(L):
            k = rng.standard_normal((sa.capacity, HKV, D)).astype(np.float32)
            sa.append(layer, k, k)
            sb.append(layer, k, k)
    # not vacuous: most begins were steady ones (the general path ran at the first step
    # and after each outside change)
    assert count.applied >= 25, count.applied
    ka, _ = pa.layer(1)
    kb, _ = pb.layer(1)
    np.testing.assert_array_equal(be.to_numpy(ka), be.to_numpy(kb))


def test_decode_after_steady_begins_matches_the_oracle(monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    count = _Count(monkeypatch)
    d = 64                                  # a head_dim the kernels take
    pool, step, _ = _twin("emulated-cuda", head_dim=d)
    rng = np.random.default_rng(8)
    cap = step.capacity
    for it in range(9):
        step.begin()
        for layer in range(L):
            k = rng.standard_normal((cap, HKV, d)).astype(np.float32)
            step.append(layer, k, k)
        q = rng.standard_normal((cap, HQ, d)).astype(np.float32)
        out = np.full((cap, HQ, d), np.nan, np.float32)
        step.decode(1, q, out=out)
        kp, vp = pool.layer(1)
        want, _ = oracle_decode(q, np.asarray(kp), np.asarray(vp), step.table.page_table())
        assert_matches_oracle(out, None, want, None, "float32", f"step {it}")
    assert count.applied >= 6, count.applied   # (a row at the page array's width: general)


def test_exhaustion_falls_back_and_changes_nothing(monkeypatch):
    """A pool that runs out mid-loop: the steady path steps aside, the general path
    raises, and both twins are unchanged by the failing begin."""
    be = pd.get_backend("reference")
    count = _Count(monkeypatch)
    pa, sa, _ = _twin("reference", num_pages=18, lens=(3, 1, 2, 4, 3))
    pb, sb, _ = _twin("reference", num_pages=18, lens=(3, 1, 2, 4, 3))
    failed = None
    for it in range(30):
        before = _state(pa, sa, be)
        try:
            xa = sa.begin()
        except PoolExhaustedError as e:
            with pytest.raises(PoolExhaustedError) as eb:
                _general_begin(sb)
            assert str(e) == str(eb.value)
            _same(before, _state(pa, sa, be), "after the failed begin")
            failed = it
            break
        xb = _general_begin(sb)
        _same_batch(xa, xb, f"step {it}")
        _same(_state(pa, sa, be), _state(pb, sb, be), f"step {it}")
        _write(sa, sb)
    assert failed is not None and failed > 2
    assert count.applied >= 2


def test_arming_refuses_what_is_not_the_steady_case():
    SteadyBegin = engine_step.SteadyBegin
    pool, step, seqs = _twin("reference")
    # right after construction: the forked sequence shares its partial last page
    assert SteadyBegin.arm(pool, step.table) is None
    step.begin()                           # the general begin copies it
    assert SteadyBegin.arm(pool, step.table) is not None
    _write(step)
    s = pool.new_sequence()                # a sequence without pages joins
    step.set_sequences([*seqs, s])
    step.table.flush()
    assert SteadyBegin.arm(pool, step.table) is None


def test_a_long_steady_loop_takes_one_general_begin(monkeypatch):
    """Without outside changes the lookahead keeps covering the loop: the page-list room
    it spends is each row's fresh pages, so 90 begins at page size 4 take the general
    path once (the first), and the pools still agree with the general twin. (The device
    table is sized for the loop: a table at its page capacity grows on the general path.)"""
    be = pd.get_backend("reference")
    count = _Count(monkeypatch)
    pa, sa, _ = _twin("reference", num_pages=400, page_capacity=1024)
    pb, sb, _ = _twin("reference", num_pages=400, page_capacity=1024)
    for _ in range(90):
        sa.begin()
        _general_begin(sb)
        _write(sa, sb)
    _same(_state(pa, sa, be), _state(pb, sb, be), "after 90 begins")
    assert count.applied == 89, count.applied
