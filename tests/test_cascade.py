"""Cascade decode: equals flat v2 and the float64 oracle; negative controls; planning."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import PREFIX_RTOL, assert_matches_oracle, out_tol, table_of

import paged_decode as pd
import paged_decode.cascade as cascade_mod
from paged_decode import InvalidArgumentError, PagePool, decode
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.cascade import (
    detect_shared_prefix,
    plan_cascade,
)
from paged_decode.cascade_policy import CASCADE_ENV
from paged_decode.decode import cascade_decode
from paged_decode.device import DeviceInfo
from paged_decode.reference import max_rel_error, oracle_decode

#: small head dims on the reference backend, which refuses geometries no kernel has by default
pytestmark = pytest.mark.usefixtures("any_geometry")

# ---------------------------------------------------------------------------- batches
def _tokens(rng, n, hkv, d):
    return (rng.standard_normal((n, hkv, d), dtype=np.float32),
            rng.standard_normal((n, hkv, d), dtype=np.float32))


def shared_batch(layout, *, page_size=4, hkv=2, group=2, head_dim=16, dtype="float32",
                 seed=0, num_pages=512, shuffle=True):
    """A pool batch where groups share prefix pages through ``fork``.

    ``layout`` entries: ``("group", prefix_len, [suffix_len, ...])`` (a prefix sequence
    forked once per suffix; the prefix's partial last page is copied on write),
    ``("solo", n)``, ``("empty",)``, ``("window", prefix_len, suffix_len, trim)`` (a fork
    whose window then starts mid-page). Requests are shuffled so members interleave with
    non-members. Returns ``(q, pool, table)``.
    """
    rng = np.random.default_rng(seed)
    pool = PagePool(num_pages, page_size, hkv, head_dim, dtype)
    seqs = []
    for entry in layout:
        kind = entry[0]
        if kind == "group":
            base = pool.new_sequence()
            pool.append(base, *_tokens(rng, entry[1], hkv, head_dim))
            for n in entry[2]:
                s = pool.fork(base)
                pool.append(s, *_tokens(rng, n, hkv, head_dim))
                seqs.append(s)
        elif kind == "solo":
            s = pool.new_sequence()
            pool.append(s, *_tokens(rng, entry[1], hkv, head_dim))
            seqs.append(s)
        elif kind == "empty":
            seqs.append(pool.new_sequence())
        elif kind == "window":
            base = pool.new_sequence()
            pool.append(base, *_tokens(rng, entry[1], hkv, head_dim))
            s = pool.fork(base)
            pool.append(s, *_tokens(rng, entry[2], hkv, head_dim))
            pool.trim_front(s, entry[3])
            seqs.append(s)
    if shuffle:
        seqs = [seqs[i] for i in rng.permutation(len(seqs))]
    table = pool.page_table(seqs)
    q = (rng.standard_normal((len(seqs), hkv * group, head_dim), dtype=np.float32) * 1.5)
    return q.astype(pool.k.dtype), pool, table


MIXED = [("group", 30, [5, 9, 2]), ("solo", 21), ("group", 17, [7, 4]), ("empty",),
         ("solo", 3), ("window", 20, 6, 6)]


# ---------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("hkv,group", [(1, 4), (2, 2), (4, 3)])
def test_cascade_equals_flat_and_oracle(dtype, hkv, group):
    q, pool, table = shared_batch(MIXED, hkv=hkv, group=group, dtype=dtype, seed=hkv)
    cplan = detect_shared_prefix(table, min_shared_pages=2)
    assert cplan is not None and cplan.num_members == 3 and cplan.shared_pages == 7
    ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    out, lse = cascade_decode(q, pool.k, pool.v, table, return_lse=True, cascade_plan=cplan)
    o = pd.last_outcome()
    assert o.path == "cascade" and "M=3" in o.detail and "shared pages 7" in o.detail
    assert_matches_oracle(out, lse, ref_out, ref_lse, dtype, "cascade")
    flat, flat_lse = decode(q, pool.k, pool.v, table, path="v2", return_lse=True,
                            cascade=False)
    assert pd.last_outcome().path.startswith("v2")
    assert max_rel_error(out, np.asarray(flat, np.float64)) <= out_tol(dtype)
    fin = np.isfinite(flat_lse)
    assert (np.isfinite(lse) == fin).all() and np.abs(lse[fin] - flat_lse[fin]).max() < 5e-5
    empty = np.nonzero(table.visible_lens == 0)[0]
    assert empty.size and (out[empty] == 0).all() and np.isneginf(lse[empty]).all()


def test_cascade_second_group_and_out_buffers():
    """The 2-member group (found once the 3-member group is left out); out=/lse=/out_dtype
    honoured."""
    q, pool, table = shared_batch(MIXED, hkv=2, group=2, dtype="float16", seed=3)
    best = detect_shared_prefix(table, min_shared_pages=2)
    rest = [r for r in range(table.batch_size) if r not in best.members.tolist()]
    sub, q_sub = table.subset(rest), np.ascontiguousarray(q[rest])
    cp = plan_cascade(sub, 4, 2, 16, prefix=detect_shared_prefix(sub, min_shared_pages=2))
    assert cp.prefix.num_members == 2 and cp.prefix.shared_pages == 4
    ref_out, ref_lse = oracle_decode(q_sub, pool.k, pool.v, sub)
    out = np.empty((sub.batch_size, 4, 16), np.float32)
    lse = np.empty((sub.batch_size, 4), np.float32)
    got = decode(q_sub, pool.k, pool.v, sub, cascade=cp, out=out, lse=lse,
                 out_dtype="float32", return_lse=True)
    assert got[0] is out and got[1] is lse and pd.last_outcome().path == "cascade"
    assert_matches_oracle(out, lse, ref_out, ref_lse, "float32", "cascade out=")


def test_two_groups_pick_the_bigger_saving():
    # group A: 3 members x 7 shared pages (saves 14); group B: 2 x 4 (saves 4)
    _, _, table = shared_batch(MIXED, seed=5)
    cp = detect_shared_prefix(table, min_shared_pages=2)
    assert cp.saved_page_reads == 14
    # drop group A's members: B is found
    others = [r for r in range(table.batch_size) if r not in cp.members.tolist()]
    sub = table.subset(others)
    cp_b = detect_shared_prefix(sub, min_shared_pages=2)
    assert cp_b.num_members == 2 and cp_b.shared_pages == 4 and cp_b.saved_page_reads == 4


# ---------------------------------------------------------------------------- controls
def _member_major_stack(xp, q, members, num_kv_heads):
    qm = xp.take(q, members, axis=0)
    m, hq, d = qm.shape
    return xp.ascontiguousarray(qm).reshape(1, m * hq, d)           # h0 = m * Hq + h


def _member_major_unstack(xp, v0, lse0, num_members, num_kv_heads):
    c0, h0, d = v0.shape
    m = num_members
    hq = h0 // m
    v = v0.reshape(c0, m, hq, d).transpose(1, 0, 2, 3)
    lse = lse0.reshape(c0, m, hq).transpose(1, 0, 2)
    return (xp.ascontiguousarray(v).reshape(m * c0, hq, d),
            xp.ascontiguousarray(lse).reshape(m * c0, hq))


@pytest.mark.parametrize("hkv", [1, 2])
def test_negative_control_member_major_stacking(monkeypatch, hkv):
    q, pool, table = shared_batch(MIXED, hkv=hkv, group=2, seed=7)
    cp = detect_shared_prefix(table, min_shared_pages=2)
    ref_out, _ = oracle_decode(q, pool.k, pool.v, table)
    monkeypatch.setattr(cascade_mod, "stack_member_queries", _member_major_stack)
    monkeypatch.setattr(cascade_mod, "unstack_member_states", _member_major_unstack)
    out = cascade_decode(q, pool.k, pool.v, table, cascade_plan=cp)
    err = max_rel_error(out, ref_out)
    if hkv == 1:   # one KV head: both stackings coincide (the control itself is sound)
        assert err <= out_tol("float32")
    else:          # the kernel reads KV head h0 // (M * G): the wrong one
        assert err > 1e-2, err


class NaturalLogLse(ReferenceBackend):
    """A broken partial whose LSEs are natural logs (the merge expects base 2)."""

    name = "natural-log-lse"

    def partial(self, q, k_pages, v_pages, table, plan, sm_scale, v_out, lse_out):
        super().partial(q, k_pages, v_pages, table, plan, sm_scale, v_out, lse_out)
        lse_out *= np.float32(math.log(2.0))


def test_negative_control_natural_log_lse_in_merge():
    q, pool, table = shared_batch(MIXED, seed=8)
    cp = detect_shared_prefix(table, min_shared_pages=2)
    ref_out, _ = oracle_decode(q, pool.k, pool.v, table)
    out = cascade_decode(q, pool.k, pool.v, table, cascade_plan=cp, backend=NaturalLogLse())
    assert max_rel_error(out, ref_out) > 1e-3
    good = cascade_decode(q, pool.k, pool.v, table, cascade_plan=cp)
    assert max_rel_error(good, ref_out) <= out_tol("float32")


# ---------------------------------------------------------------------------- planning
def test_64_shared_pages_by_4_members_save_192():
    shared = list(range(64))
    t = table_of([shared + [100 + i, 200 + i] for i in range(4)])
    cp = detect_shared_prefix(t, min_shared_pages=1)
    assert cp.shared_pages == 64 and cp.members.tolist() == [0, 1, 2, 3]
    assert cp.saved_page_reads == 192


def test_three_by_30_beats_two_by_40_and_members_can_be_dropped():
    a = list(range(40))
    b = list(range(1000, 1030))
    t = table_of([a + [90], b + [91], a + [92], b + [93], b + [94]])
    cp = detect_shared_prefix(t, min_shared_pages=1)
    assert cp.members.tolist() == [1, 3, 4] and cp.shared_pages == 30
    assert cp.saved_page_reads == 60
    # nested: {0,1,2} share 30 pages, {0,1} share 70: 70 * 1 > 30 * 2 drops member 2
    t2 = table_of([b + list(range(40)) + [90], b + list(range(40)) + [91], b + [92]])
    cp2 = detect_shared_prefix(t2, min_shared_pages=1)
    assert cp2.members.tolist() == [0, 1] and cp2.shared_pages == 70
    t3 = table_of([b + list(range(20)) + [90], b + list(range(20)) + [91], b + [92]])
    cp3 = detect_shared_prefix(t3, min_shared_pages=1)   # 3 x 30 (60) beats 2 x 50 (50)
    assert cp3.members.tolist() == [0, 1, 2] and cp3.shared_pages == 30


def test_span_cap_keeps_a_private_last_page():
    pages = list(range(10))
    t = table_of([pages, pages, pages[:6]], lpl=[3, 3, 16])  # identical lists share all
    cp = detect_shared_prefix(t, min_shared_pages=1)
    assert cp.shared_pages == 5 and cp.members.tolist() == [0, 1, 2]
    assert (cp.level1.pages_per_request >= 1).all()
    assert (cp.level1.visible_lens > 0).all()
    t2 = table_of([pages, pages], lpl=[3, 3])
    assert detect_shared_prefix(t2, min_shared_pages=1).shared_pages == 9


def test_conservation_and_level_tables():
    _, _, table = shared_batch(MIXED, seed=2)
    cp = detect_shared_prefix(table, min_shared_pages=2)
    m, s, p = cp.num_members, cp.shared_pages, table.page_size
    assert cp.level0.total_pages * m + cp.level1.total_pages == table.total_pages
    assert cp.level0.batch_size == 1 and cp.level0.visible_lens.tolist() == [s * p]
    assert cp.level0.first_page_offset.tolist() == [0]
    assert cp.level0.last_page_len.tolist() == [p]
    want = table.visible_lens.astype(np.int64).copy()
    want[cp.members] -= s * p
    assert cp.level1.visible_lens.tolist() == want.tolist()
    for r in cp.members:
        assert table.request_pages(int(r))[:s].tolist() == cp.level0.indices.tolist()
        assert (cp.level1.request_pages(int(r)) == table.request_pages(int(r))[s:]).all()
    for r in set(range(table.batch_size)) - set(cp.members.tolist()):
        assert (cp.level1.request_pages(r) == table.request_pages(r)).all()
    assert cp.matches(table) and not cp.matches(table.subset([0, 1]))


def test_merge_order_matches_the_original_example():
    shared = list(range(8))
    t = table_of([shared + [50], [60, 61], shared + [70]])
    one_cta = DeviceInfo("test", "one CTA", compute_units=1, ctas_per_unit=1)
    cp = plan_cascade(t, 4, 2, 16, device=one_cta,
                      prefix=detect_shared_prefix(t, min_shared_pages=1))
    assert cp.prefix.members.tolist() == [0, 2]
    assert cp.merge_rows.tolist() == [0, 3, 1, 2, 4]
    assert cp.o_indptr.tolist() == [0, 2, 3, 5]


def test_plans_built_directly_keep_no_caller_array():
    # the merge gathers through merge_rows and level 0 takes the members' queries every
    # call: a caller's later write to an array it built a plan from must not reach them
    q, pool, table = shared_batch(MIXED, dtype="float32", seed=6)
    cp = plan_cascade(table, 4, 2, 16, prefix=detect_shared_prefix(table, min_shared_pages=2))
    ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    arrays = {"merge_rows": np.array(cp.merge_rows), "o_indptr": np.array(cp.o_indptr)}
    members = np.array(cp.prefix.members)
    hand = dataclasses.replace(cp, prefix=dataclasses.replace(cp.prefix, members=members),
                               **arrays)
    for given in (members, *arrays.values()):
        given[...] = 10 ** 6
    out, lse = cascade_decode(q, pool.k, pool.v, table, return_lse=True, cascade_plan=hand)
    assert_matches_oracle(out, lse, ref_out, ref_lse, "float32", "cascade, hand-built plan")
    for got in (hand.prefix.members, hand.merge_rows, hand.o_indptr):
        assert not got.flags.writeable


def test_hand_built_plans_that_do_not_follow_from_their_table_are_refused():
    """A plan edited by ``dataclasses.replace`` still matches its table (``matches`` looks
    at the source only), so each field the kernels trust is re-derived: a level table with
    page ids past the pool, members that share nothing, a permuted merge order, a level
    plan of another geometry. Each must be refused, naming the class and the field."""
    q, pool, table = shared_batch(MIXED, dtype="float32", seed=7)
    pre = detect_shared_prefix(table, min_shared_pages=2)
    cp = plan_cascade(table, 4, 2, 16, prefix=pre)
    lv0 = pre.level0
    far = pd.PageTable.build(np.asarray(lv0.indices) + 10 ** 5, lv0.indptr, lv0.last_page_len,
                             page_size=lv0.page_size)
    solo = int(np.setdiff1d(np.arange(table.batch_size), pre.members)[0])
    bad = {
        "far level0": (lambda: dataclasses.replace(pre, level0=far),
                       r"CascadePlan: level0 does not follow from the source table"),
        "level1 swapped": (lambda: dataclasses.replace(pre, level1=table),
                           r"CascadePlan: level1 does not follow"),
        "a non-member": (lambda: dataclasses.replace(
            pre, members=np.sort(np.r_[pre.members[:2], solo])),
            r"CascadePlan: (request \d+ cannot share|the members do not list the same)"),
        "one member": (lambda: dataclasses.replace(pre, members=pre.members[:1]),
                       r"CascadePlan: members must be >= 2 ascending"),
        "members past B": (lambda: dataclasses.replace(pre, members=[0, 10 ** 6]),
                           r"CascadePlan: members\[1\] must be in \[0, 8\], got 1000000"),
        "longer span": (lambda: dataclasses.replace(pre, shared_pages=pre.shared_pages + 9),
                        r"CascadePlan: request \d+ cannot share"),
        "savings": (lambda: dataclasses.replace(pre, saved_page_reads=0),
                    r"CascadePlan: saved_page_reads is 0"),
        "merge order": (lambda: dataclasses.replace(cp, merge_rows=cp.merge_rows[::-1]),
                        r"CascadeDecodePlan: merge_rows does not follow from the level plans"),
        "o_indptr": (lambda: dataclasses.replace(cp, o_indptr=np.zeros_like(cp.o_indptr)),
                     r"CascadeDecodePlan: o_indptr does not follow"),
        "plan1 geometry": (lambda: dataclasses.replace(
            cp, plan1=pd.plan_decode(pre.level1, 8, 2, 16, backend="reference")),
            r"CascadeDecodePlan: plan1 must be planned for \(Hq, Hkv, D\) = \(4, 2, 16\)"),
        "plan0 of level1": (lambda: dataclasses.replace(cp, plan0=pd.plan_decode(
            pre.level1, 4 * pre.num_members, 2, 16, backend="reference")),
            r"CascadeDecodePlan: plan0 does not serve the prefix's level table: batch size"),
        "row tiles": (lambda: dataclasses.replace(cp, prefix_row_tiles=-1),
                      r"CascadeDecodePlan: prefix_row_tiles must be"),
    }
    for name, (make, pattern) in bad.items():
        with pytest.raises(InvalidArgumentError, match=pattern):
            make()
            pytest.fail(f"{name}: accepted")
    same = dataclasses.replace(cp, prefix=dataclasses.replace(pre))    # a faithful copy
    ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    out, lse = cascade_decode(q, pool.k, pool.v, table, return_lse=True, cascade_plan=same)
    assert_matches_oracle(out, lse, ref_out, ref_lse, "float32", "cascade, copied plan")


def test_rejections():
    shared = list(range(8))
    # look-alikes: same lengths, different pages
    assert detect_shared_prefix(table_of([list(range(i * 9, i * 9 + 9)) for i in range(4)]),
                                min_shared_pages=1) is None
    # empty batch, single request, all-empty requests
    assert detect_shared_prefix(table_of([]), min_shared_pages=1) is None
    assert detect_shared_prefix(table_of([shared + [9]]), min_shared_pages=1) is None
    assert detect_shared_prefix(table_of([[], []]), min_shared_pages=1) is None
    # mid-page start: the fpo != 0 request is excluded
    lists = [shared + [20], shared + [21], shared + [22]]
    assert detect_shared_prefix(table_of(lists[:2], fpo=[0, 3]), min_shared_pages=1) is None
    cp = detect_shared_prefix(table_of(lists, fpo=[0, 5, 0]), min_shared_pages=1)
    assert cp.members.tolist() == [0, 2]
    # a one-page request has no page to share; a fully trimmed window has nothing visible
    assert detect_shared_prefix(table_of([[1], [1]]), min_shared_pages=1) is None
    t = table_of([shared + [20], shared + [21]], lpl=[16, 4], fpo=[0, 0])
    assert detect_shared_prefix(t, min_shared_pages=1).num_members == 2
    # thresholds
    assert detect_shared_prefix(table_of(lists), min_shared_pages=9) is None
    assert detect_shared_prefix(table_of(lists), min_shared_pages=8).shared_pages == 8
    assert detect_shared_prefix(table_of(lists), min_shared_pages=1, min_members=4) is None
    # default threshold: 1024 tokens (64 pages of 16)
    assert detect_shared_prefix(table_of(lists)) is None
    assert detect_shared_prefix(table_of([list(range(63)) + [90], list(range(63)) + [91]])) \
        is None
    long = list(range(64))
    assert detect_shared_prefix(table_of([long + [90], long + [91]])).shared_pages == 64
    with pytest.raises(InvalidArgumentError, match="detect_shared_prefix: min_members"):
        detect_shared_prefix(table_of(lists), min_members=1)
    with pytest.raises(InvalidArgumentError, match="detect_shared_prefix: min_shared_pages"):
        detect_shared_prefix(table_of(lists), min_shared_pages=0)
    with pytest.raises(InvalidArgumentError, match="detect_shared_prefix: table"):
        detect_shared_prefix([1, 2])


# ---------------------------------------------------------------------------- decode option
BIG = [("group", 1030, [3, 20, 7, 15, 1, 9, 30, 2, 11]), ("solo", 40)]   # 64 pages x 9


def test_decode_cascade_option_and_env(monkeypatch):
    q, pool, table = shared_batch(BIG, page_size=16, hkv=2, group=2, head_dim=8, seed=4,
                                  num_pages=256)
    ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    pd.reset_counters()
    # the reference backend has no tensor-core prefix kernel: the automatic rule declines
    # whatever the savings (level 0 on the v2 partial measured no faster than flat)
    import paged_decode.cascade_policy as policy
    monkeypatch.setattr(policy, "AUTO_MIN_SAVED_BYTES", 1)
    decode(q, pool.k, pool.v, table)
    assert pd.last_outcome().path.startswith("v2")
    assert "level 0 would run on the v2 partial" in pd.last_outcome().reason
    out, lse = decode(q, pool.k, pool.v, table, return_lse=True, cascade=True)
    o = pd.last_outcome()
    assert o.path == "cascade" and "M=9" in o.detail, str(o)
    assert_matches_oracle(out, lse, ref_out, ref_lse, "float32", "forced cascade")
    decode(q, pool.k, pool.v, table, cascade=False)
    assert pd.last_outcome().path.startswith("v2")
    decode(q, pool.k, pool.v, table, path="v2")                         # explicit flat path
    assert pd.last_outcome().path.startswith("v2")
    monkeypatch.setenv(CASCADE_ENV, "0")
    decode(q, pool.k, pool.v, table)
    assert pd.last_outcome().path.startswith("v2") and "=0" in pd.last_outcome().reason
    out_t = decode(q, pool.k, pool.v, table, cascade=True)              # argument beats env
    assert pd.last_outcome().path == "cascade"
    assert_matches_oracle(out_t, None, ref_out, ref_lse, "float32", "forced")
    monkeypatch.setenv(CASCADE_ENV, "yes")
    with pytest.raises(InvalidArgumentError, match=f"decode: {CASCADE_ENV} must be 0 or 1"):
        decode(q, pool.k, pool.v, table)
    monkeypatch.delenv(CASCADE_ENV)
    assert pd.counters()["reference:cascade"] == 2
    with pytest.raises(InvalidArgumentError, match="decode: cascade runs on the v2 kernels"):
        decode(q, pool.k, pool.v, table, path="v1", cascade=True)
    with pytest.raises(InvalidArgumentError, match="decode: cascade must be"):
        decode(q, pool.k, pool.v, table, cascade="on")


@pytest.mark.skipif(not __import__("paged_decode.backends", fromlist=["x"]).availability(
    "emulated-cuda").ok, reason="emulator unavailable")
def test_decode_auto_takes_cascade_with_tensor_cores_when_it_pays(monkeypatch):
    """With the tensor-core level 0 (emulated CUDA, float16) the byte rule decides."""
    import paged_decode.cascade_policy as policy
    emu = pd.get_backend("emulated-cuda")
    q, pool, table = shared_batch([("group", 1030, [3, 20, 7, 15]), ("solo", 40)],
                                  page_size=16, hkv=2, group=2, head_dim=64, seed=4,
                                  num_pages=128, dtype="float16")
    ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    # 64 shared pages x 3 saved x 16 tokens x 2 x 2 x 64 x 2 bytes = 1.5 MiB saved
    decode(q, pool.k, pool.v, table, backend=emu)
    o = pd.last_outcome()
    assert o.path.startswith("v2") and "below the rule" in o.reason and "2 MiB" in o.reason
    monkeypatch.setattr(policy, "AUTO_MIN_SAVED_BYTES", 1024 * 1024)
    out, lse = decode(q, pool.k, pool.v, table, backend=emu, return_lse=True,
                      out_dtype="float32")
    o = pd.last_outcome()
    assert o.path == "cascade" and "saves" in o.reason and "tensor-core prefix" in o.detail
    from paged_decode.reference import lse_error
    assert max_rel_error(out, ref_out) <= PREFIX_RTOL["float16"]
    assert lse_error(lse, ref_lse) <= 5e-5


def test_decode_auto_declines_small_savings_and_env_forces(monkeypatch):
    q, pool, table = shared_batch([("group", 1100, [5, 9]), ("solo", 50)], page_size=16,
                                  hkv=1, group=2, head_dim=8, seed=6, num_pages=128)
    ref_out, _ = oracle_decode(q, pool.k, pool.v, table)
    decode(q, pool.k, pool.v, table)
    o = pd.last_outcome()
    assert o.path.startswith("v2") and "cascade declined" in o.reason, str(o)
    monkeypatch.setenv(CASCADE_ENV, "1")
    out = decode(q, pool.k, pool.v, table)
    assert pd.last_outcome().path == "cascade" and "=1" in pd.last_outcome().reason
    assert_matches_oracle(out, None, ref_out, None, "float32", "env forced")


def test_forced_cascade_without_sharing_runs_flat():
    q, pool, table = shared_batch([("solo", 40), ("solo", 33)], seed=9)
    ref_out, _ = oracle_decode(q, pool.k, pool.v, table)
    out = cascade_decode(q, pool.k, pool.v, table)
    o = pd.last_outcome()
    assert o.path.startswith("v2") and "no shared prefix" in o.reason
    assert_matches_oracle(out, None, ref_out, None, "float32", "no sharing")
    other = shared_batch(MIXED, seed=1)[2]
    cp = detect_shared_prefix(other, min_shared_pages=2)
    with pytest.raises(InvalidArgumentError, match="another page table"):
        cascade_decode(q, pool.k, pool.v, table, cascade_plan=cp)
