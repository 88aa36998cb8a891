"""merge_states / merge_state: the base-2 closed form, empties, associativity, units."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import out_tol, ref_merge

from paged_decode import InvalidArgumentError, InvalidDtypeError, merge_state, merge_states

H, D = 3, 5
NEG_INF = -np.inf
#: D = 5 is no kernel's head dim: the reference backend runs it as an oracle only
pytestmark = pytest.mark.usefixtures("any_geometry")


# ---------------------------------------------------------------------------- helpers
def random_states(rng: np.random.Generator, n: int, *, empty_frac: float = 0.2):
    """``n`` normalized partial states; about ``empty_frac`` of the (row, head) entries are
    empty (-inf LSE) with junk-but-finite V that must be ignored."""
    v = rng.standard_normal((n, H, D)).astype(np.float32)
    lse = rng.uniform(-8, 12, (n, H)).astype(np.float32)
    empty = rng.random((n, H)) < empty_frac
    lse[empty] = NEG_INF
    v[empty] = 1e3
    return v, lse


def ragged_indptr(rng: np.random.Generator, groups: int, max_len: int = 5) -> np.ndarray:
    sizes = rng.integers(0, max_len + 1, groups)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def assert_close_to_ref(v_out, lse_out, ref_v, ref_lse, tol: float = 2e-6) -> None:
    """Close where ``ref`` is a number; NaN exactly where ``ref`` is NaN (poisoned groups,
    whole rows); ``-inf`` exactly where ``ref`` is ``-inf``."""
    v_out, lse_out = np.asarray(v_out, np.float64), np.asarray(lse_out, np.float64)
    assert np.array_equal(np.isnan(v_out), np.isnan(ref_v))
    assert np.array_equal(np.isnan(lse_out), np.isnan(ref_lse))
    assert np.array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
    np.testing.assert_allclose(v_out, ref_v, rtol=0, atol=tol)
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_out[fin], ref_lse[fin], rtol=0, atol=tol * 2)


def merged_rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------------------- closed form
def test_merge_states_matches_closed_form_on_ragged_groups():
    rng = np.random.default_rng(0)
    for _ in range(30):
        indptr = ragged_indptr(rng, int(rng.integers(1, 9)))
        v, lse = random_states(rng, int(indptr[-1]))
        v_out, lse_out = merge_states(v, lse, indptr)
        assert v_out.shape == (len(indptr) - 1, H, D) and v_out.dtype == np.float32
        assert lse_out.shape == (len(indptr) - 1, H) and lse_out.dtype == np.float32
        assert_close_to_ref(v_out, lse_out, *ref_merge(v, lse, indptr))


def test_merge_states_wide_lse_spread():
    # weights differing by 2^-100: the small state must vanish, not overflow or NaN
    v = np.stack([np.full((H, D), 1.0), np.full((H, D), -1.0)]).astype(np.float32)
    lse = np.array([[100.0] * H, [0.0] * H], np.float32)
    v_out, lse_out = merge_states(v, lse, [0, 2])
    np.testing.assert_allclose(v_out[0], 1.0, atol=1e-6)
    np.testing.assert_allclose(lse_out[0], 100.0, atol=1e-5)


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16", "float32"])
def test_merge_states_out_dtype(out_dtype):
    rng = np.random.default_rng(1)
    v, lse = random_states(rng, 7)
    indptr = [0, 3, 7]
    v_out, lse_out = merge_states(v, lse, indptr, out_dtype=out_dtype)
    assert str(v_out.dtype) == out_dtype and lse_out.dtype == np.float32
    ref_v, ref_lse = ref_merge(v, lse, indptr)
    err = np.abs(np.asarray(v_out, np.float64) - ref_v).max() / np.abs(ref_v).max()
    assert err <= out_tol(out_dtype)


def test_group_of_one_is_the_identity():
    rng = np.random.default_rng(2)
    v, lse = random_states(rng, 6, empty_frac=0.0)
    v_out, lse_out = merge_states(v, lse, np.arange(7))
    np.testing.assert_array_equal(v_out, v)
    np.testing.assert_array_equal(lse_out, lse)


def test_empty_and_all_inf_groups_give_zeros_and_minus_inf():
    rng = np.random.default_rng(3)
    v, lse = random_states(rng, 5, empty_frac=0.0)
    lse[2:4] = NEG_INF                     # group 2 holds only empty partials
    v[2:4] = 7.0
    indptr = [0, 2, 2, 4, 4, 5, 5]         # groups 1, 3, 5 are empty (indptr repeats)
    v_out, lse_out = merge_states(v, lse, indptr)
    for o in (1, 2, 3, 5):
        assert (v_out[o] == 0).all(), o
        assert np.isneginf(lse_out[o]).all(), o
    assert not np.isnan(v_out).any() and not np.isnan(lse_out).any()
    assert_close_to_ref(v_out, lse_out, *ref_merge(v, lse, indptr))


def test_no_partials_at_all():
    v = np.zeros((0, H, D), np.float32)
    lse = np.zeros((0, H), np.float32)
    v_out, lse_out = merge_states(v, lse, [0, 0, 0])
    assert v_out.shape == (2, H, D) and (v_out == 0).all() and np.isneginf(lse_out).all()


# ---------------------------------------------------------------------------- algebra
def merge_groups(v, lse, groups: list[list[int]]):
    """Merge the rows listed in each group (any order) -> stacked states."""
    order = [i for g in groups for i in g]
    indptr = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
    return merge_states(v[order], lse[order], indptr)


def test_associativity_and_commutativity_across_regroupings():
    rng = np.random.default_rng(4)
    for _ in range(25):
        n = int(rng.integers(2, 12))
        v, lse = random_states(rng, n)
        whole_v, whole_lse = merge_groups(v, lse, [list(range(n))])
        for _ in range(4):
            perm = rng.permutation(n).tolist()
            cuts = sorted(rng.choice(np.arange(1, n), int(rng.integers(0, n)), replace=False)
                          .tolist()) if n > 1 else []
            groups = [perm[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
            part_v, part_lse = merge_groups(v, lse, groups)          # merge of parts ...
            k = len(groups)
            sub = rng.permutation(k).tolist()
            again_v, again_lse = merge_states(part_v[sub], part_lse[sub], [0, k])
            np.testing.assert_allclose(again_v, whole_v, rtol=0, atol=1e-5)  # ... of merges
            fin = np.isfinite(whole_lse)
            assert np.array_equal(np.isneginf(again_lse), ~fin)
            np.testing.assert_allclose(again_lse[fin], whole_lse[fin], rtol=0, atol=1e-5)


def test_negative_control_natural_log_lse_is_wrong():
    """Feeding ln-based LSEs where base 2 is expected must visibly break the result."""
    rng = np.random.default_rng(5)
    v, lse = random_states(rng, 12, empty_frac=0.0)
    indptr = [0, 4, 9, 12]
    good_v, _ = merge_states(v, lse, indptr)
    ref_v, _ = ref_merge(v, lse, indptr)
    assert merged_rel_error(good_v, ref_v) < 1e-5
    wrong_v, _ = merge_states(v, (lse * math.log(2)).astype(np.float32), indptr)
    assert merged_rel_error(wrong_v, ref_v) > 1e-3


# ---------------------------------------------------------------------------- pairwise
def test_merge_state_pairwise():
    rng = np.random.default_rng(6)
    va, la = random_states(rng, 9)
    vb, lb = random_states(rng, 9)
    v_out, lse_out = merge_state(va, la, vb, lb)
    v = np.concatenate([va, vb])
    lse = np.concatenate([la, lb])
    pairs = [[i, 9 + i] for i in range(9)]
    ref_v = np.stack([ref_merge(v[p], lse[p], [0, 2])[0][0] for p in pairs])
    ref_lse = np.stack([ref_merge(v[p], lse[p], [0, 2])[1][0] for p in pairs])
    assert_close_to_ref(v_out, lse_out, ref_v, ref_lse)
    # commutative
    v_ba, lse_ba = merge_state(vb, lb, va, la)
    np.testing.assert_allclose(v_ba, v_out, rtol=0, atol=1e-6)


def test_merge_state_with_an_empty_side_returns_the_other():
    rng = np.random.default_rng(7)
    va, la = random_states(rng, 4, empty_frac=0.0)
    vb = np.full_like(va, 123.0)
    lb = np.full_like(la, NEG_INF)
    v_out, lse_out = merge_state(va, la, vb, lb)
    np.testing.assert_array_equal(v_out, va)
    np.testing.assert_array_equal(lse_out, la)
    v_out, lse_out = merge_state(vb, lb, vb, lb)
    assert (v_out == 0).all() and np.isneginf(lse_out).all()


# ---------------------------------------------------------------------------- validation
def _states(n=4):
    return np.zeros((n, H, D), np.float32), np.zeros((n, H), np.float32)


@pytest.mark.parametrize("make, pattern", [
    (lambda v, l: (v[0], l, [0, 4]), r"merge_states: v must be 3-D \[N, H, D\]"),
    (lambda v, l: (v, l[:3], [0, 4]), r"merge_states: lse must have shape \[N, H\] = \[4, 3\], "
                                      r"got \[3, 3\]"),
    (lambda v, l: (v.astype(np.float16), l, [0, 4]), r"merge_states: v must have dtype "
                                                      r"float32, got float16"),
    (lambda v, l: (v, l.astype(np.float16), [0, 4]), r"merge_states: lse must have dtype "
                                                      r"float32"),
    (lambda v, l: (v, l, [1, 4]), r"merge_states: indptr must start at 0"),
    (lambda v, l: (v, l, [0, 3]), r"end at N = 4, got \[0, 3\]"),
    (lambda v, l: (v, l, [0, 3, 2, 4]), r"be non-decreasing"),
    (lambda v, l: (v, l, [0.0, 4.0]), r"indptr must be a 1-D integer array"),
    (lambda v, l: (v, l, [[0, 4]]), r"indptr must be a 1-D integer array"),
    (lambda v, l: (v, l, np.zeros(0, np.int64)), r"indptr must be a 1-D integer array"),
])
def test_merge_states_rejects(make, pattern):
    v, lse = _states()
    with pytest.raises(InvalidArgumentError, match=pattern):
        merge_states(*make(v, lse))


def test_merge_states_rejects_float64():
    v, lse = _states()
    with pytest.raises(InvalidDtypeError, match=r"merge_states: v must have dtype"):
        merge_states(v.astype(np.float64), lse, [0, 4])
    with pytest.raises(InvalidDtypeError, match=r"merge_states: out_dtype must have dtype"):
        merge_states(v, lse, [0, 4], out_dtype="float64")


def test_merge_state_rejects_mismatched_shapes():
    v, lse = _states()
    with pytest.raises(InvalidArgumentError, match=r"merge_state: v_b must have shape "
                                                   r"\[n, H, D\] = \[4, 3, 5\], got \[3, 3, 5\]"):
        merge_state(v, lse, v[:3], lse[:3])
    with pytest.raises(InvalidArgumentError, match=r"merge_state: lse_a must have shape"):
        merge_state(v, lse[:, :2], v, lse)
    with pytest.raises(InvalidArgumentError, match=r"merge_state: lse_b must have shape"):
        merge_state(v, lse, v, lse[:2])
    with pytest.raises(InvalidArgumentError, match=r"merge_state: v_a must be 3-D"):
        merge_state(lse, lse, v, lse)


# ---------------------------------------------------------------------------- the kernel
@pytest.mark.skipif(not __import__("paged_decode.backends", fromlist=["x"]).availability(
    "emulated-cuda").ok, reason="emulator unavailable")
@pytest.mark.parametrize("gather", [False, True])
def test_merge_kernel_large_groups_nan_rows_and_gather(gather):
    """The CUDA merge kernel (emulated) on groups of 0..70 rows (its 32-row batches and
    4-row reads), empty rows holding NaN values (never read), rows with a NaN or +inf
    LSE (each poisons its group), and a row index."""
    from paged_decode.backends import get_backend
    be = get_backend("emulated-cuda")
    rng = np.random.default_rng(7)
    sizes = [0, 1, 3, 4, 5, 31, 32, 33, 70]
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    n, h, d = int(indptr[-1]), 2, 64
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = rng.uniform(-8, 12, (n, h)).astype(np.float32)
    empty = rng.random((n, h)) < 0.15
    lse[empty] = NEG_INF
    v[empty] = np.nan                       # must never be read into the result
    nan_lse = rng.random((n, h)) < 0.02
    lse[nan_lse] = np.nan
    v[nan_lse] = np.nan
    lse[indptr[6] + 3, 1] = np.inf             # one +inf in the group of 31
    ref_v, ref_lse = ref_merge(np.where(empty[..., None], 0, v), lse, indptr)
    assert np.isnan(ref_lse).any() and np.isfinite(ref_lse).any()   # both kinds of group
    v_out, lse_out = run_merge_kernel(be, v, lse, indptr, rng, gather)
    assert_close_to_ref(v_out, lse_out, ref_v, ref_lse, tol=5e-6)


def run_merge_kernel(be, v, lse, indptr, rng, gather):
    """``be.merge`` of states ``v [n, H, D]`` / ``lse [n, H]`` (float32, log2) over
    ``indptr`` into NaN-poisoned float32 outputs ``[M, H, D]`` / ``[M, H]``; with ``gather``
    the states are stored permuted and merged through the row index."""
    m, h, d = len(indptr) - 1, v.shape[1], v.shape[2]
    kw = {}
    if gather:
        perm = rng.permutation(v.shape[0]).astype(np.int32)
        stored_v, stored_l = np.empty_like(v), np.empty_like(lse)
        stored_v[perm], stored_l[perm] = v, lse
        v, lse, kw = stored_v, stored_l, {"rows": perm}
    v_out = np.full((m, h, d), np.nan, np.float32)
    lse_out = np.full((m, h), np.nan, np.float32)
    be.merge(v, lse, indptr, v_out, lse_out, **kw)
    return v_out, lse_out


def test_merge_head_dim_the_kernels_cannot_take_is_refused(monkeypatch):
    """Without ``any_geometry`` the reference backend refuses what the merge kernel
    refuses (float4 slices: a multiple of 4), as the kernel backends do."""
    from paged_decode import UnsupportedProblemError
    monkeypatch.delenv("PAGED_DECODE_REFERENCE_ANY_GEOMETRY")
    v, lse = np.zeros((2, H, 6), np.float32), np.zeros((2, H), np.float32)
    with pytest.raises(UnsupportedProblemError, match=r"merge_states: head_dim must be a "
                       r"positive multiple of 4 for the merge kernel, got 6"):
        merge_states(v, lse, [0, 2])
    # merge_state refuses under its own name (it merges through merge_states)
    with pytest.raises(UnsupportedProblemError, match=r"^merge_state: head_dim must be a "
                       r"positive multiple of 4 for the merge kernel, got 6"):
        merge_state(v, lse, v, lse)
    out, _ = merge_states(np.zeros((2, H, 8), np.float32), lse, [0, 2])
    assert out.shape == (1, H, 8)


# ---------------------------------------------------------------------------- the split merge
SPLIT_SIZES = [0, 1, 7, 8, 33, 64, 65, 130, 257, 300]


@pytest.mark.skipif(not __import__("paged_decode.backends", fromlist=["x"]).availability(
    "emulated-cuda").ok, reason="emulator unavailable")
@pytest.mark.parametrize("split, d, gather, sink", [
    (2, 64, False, False), (4, 128, True, False), (8, 128, False, True),
    (8, 256, True, True), (4, 96, False, False), (2, 256, False, True),
    (16, 128, True, True), (16, 64, False, False)])
def test_split_merge_kernel_matches_closed_form(monkeypatch, split, d, gather, sink):
    """The CUDA merge with ``split`` warps per (row, head) (emulated, forced through
    ``PAGED_DECODE_MERGE_SPLIT``) on groups of 0..300 rows: runs shorter than a warp's
    share, a group ending mid-run and mid-unroll, warps with no rows; empty rows holding
    NaN (never read), NaN / +inf LSEs poisoning their group; a row index; sinks joining
    once per group; NaN-poisoned outputs."""
    from paged_decode.backends import get_backend
    monkeypatch.setenv("PAGED_DECODE_MERGE_SPLIT", str(split))
    be = get_backend("emulated-cuda")
    assert be.merge_split(1, 1, 10**6, 128) == split
    rng = np.random.default_rng(split * 1000 + d)
    indptr = np.concatenate([[0], np.cumsum(SPLIT_SIZES)]).astype(np.int32)
    n, h = int(indptr[-1]), 2
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = rng.uniform(-8, 12, (n, h)).astype(np.float32)
    empty = rng.random((n, h)) < 0.15
    lse[empty] = NEG_INF
    v[empty] = np.nan
    lse[indptr[4] + 20, 0] = np.nan            # poisons (group 4, head 0) only
    lse[indptr[8] + 200, 1] = np.inf           # poisons (group 8, head 1), past warp 0's rows
    sinks = rng.uniform(-2, 6, h).astype(np.float32) if sink else None
    ref_v, ref_lse = ref_merge(np.where(empty[..., None], 0, v), lse, indptr)
    if sink:    # one more state per (group, head): LSE sink * log2(e), value 0
        sv = np.concatenate([v, np.zeros((len(SPLIT_SIZES), h, d), np.float32)])
        sl = np.concatenate([lse, np.tile(sinks * np.log2(np.e), (len(SPLIT_SIZES), 1))])
        order = np.concatenate([np.r_[indptr[o]:indptr[o + 1], n + o]
                                for o in range(len(SPLIT_SIZES))]).astype(np.int64)
        sindptr = np.concatenate([[0], np.cumsum(np.array(SPLIT_SIZES) + 1)])
        sempty = np.concatenate([empty, np.zeros((len(SPLIT_SIZES), h), bool)])
        ref_v, ref_lse = ref_merge(np.where(sempty[order][..., None], 0, sv[order]),
                                   sl[order], sindptr)
    assert np.isnan(ref_lse).sum() == 2 and np.isfinite(ref_lse).any()
    kw = {"sinks": sinks} if sink else {}
    if gather:
        perm = rng.permutation(n).astype(np.int32)
        sv_, sl_ = np.empty_like(v), np.empty_like(lse)
        sv_[perm], sl_[perm] = v, lse
        v, lse, kw = sv_, sl_, {**kw, "rows": perm}
    v_out = np.full((len(SPLIT_SIZES), h, d), np.nan, np.float32)
    lse_out = np.full((len(SPLIT_SIZES), h), np.nan, np.float32)
    be.merge(v, lse, indptr, v_out, lse_out, **kw)
    assert_close_to_ref(v_out, lse_out, ref_v, ref_lse, tol=5e-6)


def test_merge_split_rule():
    """``launches.merge_split``: the most warps per (row, head) whose warps stay within
    16 per SM and take 8+ partials each on average; 1 when the groups are many or short."""
    from paged_decode.backends.launches import merge_split
    sms = 132
    assert merge_split(1, 8, 256, sms, 128) == 16       # Llama-3-70B TP8, 1 x 32K: 256 chunks
    assert merge_split(1, 8, 64, sms, 128) == 8         # 1 x 8K: 64 chunks
    assert merge_split(1, 32, 33, sms, 128) == 4        # GQA 4, 1 x 16K: 33 chunks
    assert merge_split(1, 32, 16, sms, 128) == 2
    assert merge_split(1, 32, 15, sms, 128) == 1        # under 8 partials per warp
    assert merge_split(8, 8, 8 * 33, sms, 128) == 4     # 64 groups of 33
    assert merge_split(8, 32, 8 * 4, sms, 128) == 1     # short groups
    assert merge_split(64, 32, 64 * 64, sms, 128) == 1  # 2048 groups: 16 per SM already
    assert merge_split(0, 8, 0, sms, 128) == 1
    assert merge_split(1, 8, 256, 1, 128) == 2          # a one-unit device: 16 warps
    # the block's shared sums must fit CUDA's 48 KB of static shared memory
    assert merge_split(1, 8, 256, sms, 764) == 16       # 16 x 767 x 4 bytes = 49088
    assert merge_split(1, 8, 256, sms, 768) == 8
    assert merge_split(1, 8, 256, sms, 1536) == 4
    assert merge_split(1, 8, 256, sms, 12288) == 1


@pytest.mark.skipif(not __import__("paged_decode.backends", fromlist=["x"]).availability(
    "emulated-cuda").ok, reason="emulator unavailable")
@pytest.mark.parametrize("d", [4, 160, 768])
def test_merge_at_head_dims_beyond_the_kernels(d):
    """The merge alone takes any head_dim that is a multiple of 4: at 768 the rule's
    split (8, not 16: ``merge.split_smem_bytes``) must fit the static shared memory the
    emulator bounds as CUDA does, and match the closed form with the most partials."""
    from paged_decode.backends import get_backend
    be = get_backend("emulated-cuda")
    rng = np.random.default_rng(d)
    n, h = 256, 8
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = rng.uniform(-8, 12, (n, h)).astype(np.float32)
    indptr = np.array([0, n], np.int32)
    split = be.merge_split(1, h, n, d)
    assert split == {4: 16, 160: 16, 768: 8}[d]
    got_v, got_l = merge_states(v, lse, indptr, backend=be)
    ref_v, ref_l = merge_states(v, lse, indptr, backend="reference")
    assert_close_to_ref(got_v, got_l, ref_v, ref_l, tol=5e-6)


def test_merge_split_setting_is_checked(monkeypatch):
    from paged_decode.backends import get_backend
    be = get_backend("emulated-cuda") if __import__(
        "paged_decode.backends", fromlist=["x"]).availability("emulated-cuda").ok else None
    if be is None:
        pytest.skip("emulator unavailable")
    monkeypatch.setenv("PAGED_DECODE_MERGE_SPLIT", "3")
    with pytest.raises(InvalidArgumentError, match=r"merge: PAGED_DECODE_MERGE_SPLIT must be "
                       r"one of 1, 2, 4, 8, 16 or unset, got '3'"):
        be.merge_split(1, 8, 256, 128)
    monkeypatch.setenv("PAGED_DECODE_MERGE_SPLIT", "16")
    with pytest.raises(InvalidArgumentError, match=r"merge: PAGED_DECODE_MERGE_SPLIT=16 at "
                       r"head_dim 768 needs 49344 bytes of static shared memory, over "
                       r"CUDA's 49152"):
        be.merge_split(1, 8, 256, 768)
    monkeypatch.setenv("PAGED_DECODE_MERGE_SPLIT", "1")
    assert be.merge_split(1, 8, 256, 128) == 1
    monkeypatch.delenv("PAGED_DECODE_MERGE_SPLIT")
    assert be.merge_split(1, 8, 256, 128) == launches_rule(be)


def launches_rule(be) -> int:
    from paged_decode.backends.launches import merge_split
    return merge_split(1, 8, 256, be.device_info().compute_units, 128)
