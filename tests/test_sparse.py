"""Sparse decode: a selection through a page_size = 1 table, the gate, the dense path."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import IgnoresIndices, assert_matches_oracle, out_tol

import paged_decode as pd
from paged_decode import InvalidArgumentError
from paged_decode.reference import attention_f64, max_rel_error
from paged_decode.sparse import (
    make_selection,
    pool_view,
    selection_from_blocks,
    selection_mask,
    sparse_decode,
    sparse_table,
)

#: small head dims on the reference backend, which refuses geometries no kernel has by default
pytestmark = pytest.mark.usefixtures("any_geometry")

B, HKV, G, D, CAP = 3, 2, 4, 16, 96
LIVE = np.array([96, 57, 80])


def caches(dtype="float32", seed=0):
    """Caches with NaN past each request's live window (a read there poisons the output)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, HKV, CAP, D), dtype=np.float32)
    v = rng.standard_normal((B, HKV, CAP, D), dtype=np.float32)
    for b, n in enumerate(LIVE):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.nan
    q = rng.standard_normal((B, HKV * G, D), dtype=np.float32) * 2.0
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def topk_positions(s, seed=1):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(int(LIVE[b]), s, replace=False) for _ in range(HKV)])
                     for b in range(B)]).astype(np.int32)


def oracle_masked(q, k, v, mask):
    """float64 attention of each (request, KV head) over the rows where ``mask`` is set."""
    out = np.zeros((B, HKV * G, D))
    lse = np.full((B, HKV * G), -np.inf)
    for b in range(B):
        for h in range(HKV):
            rows = np.nonzero(mask[b, h])[0]
            o, lo = attention_f64(np.asarray(q[b, h * G:(h + 1) * G], np.float64),
                                  np.asarray(k[b, h, rows], np.float64)[:, None, :],
                                  np.asarray(v[b, h, rows], np.float64)[:, None, :],
                                  1.0 / np.sqrt(D))
            out[b, h * G:(h + 1) * G], lse[b, h * G:(h + 1) * G] = o, lo
    return out, lse


def mask_of(sel, length=CAP):
    """``bool [B, Hkv, length]`` from a selection's positions and counts, written here
    (not ``sparse.selection_mask``, which the masked path itself uses)."""
    mask = np.zeros((B, HKV, length), bool)
    for b in range(B):
        for h in range(HKV):
            mask[b, h, sel.positions[b, h, :int(sel.counts[b, h])]] = True
    return mask


def dense_full(q, k, v):
    mask = np.zeros((B, HKV, CAP), bool)
    for b, n in enumerate(LIVE):
        mask[b, :, :n] = True
    return oracle_masked(q, k, v, mask)


# ---------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("min_sparsity", [0.0, 1e9])   # fused, then the dense masked path
def test_sparse_equals_oracle_on_selection_and_differs_from_dense(dtype, min_sparsity):
    q, k, v = caches(dtype)
    pos = topk_positions(10)
    sel = make_selection(pos)
    ref_out, ref_lse = oracle_masked(q, k, v, mask_of(sel))
    out, lse, o = sparse_decode(q, k, v, sel, live_lens=LIVE, min_sparsity=min_sparsity,
                                return_lse=True, return_outcome=True)
    assert o.path == ("sparse" if min_sparsity == 0 else "sparse-masked")
    assert o is pd.last_outcome()
    assert out.dtype == np.dtype(dtype) and out.shape == (B, HKV * G, D)
    assert_matches_oracle(out, lse, ref_out, ref_lse, dtype, o.path)
    full, _ = dense_full(q, k, v)
    assert max_rel_error(out, full) > 1e-2      # a kernel ignoring the page list fails


@pytest.mark.parametrize("min_sparsity", [0.0, 1e9])   # fused, then the dense masked path
def test_a_duplicate_counts_as_often_as_it_is_selected(min_sparsity):
    """check_duplicates=False: a position selected c times weighs c times (the float64
    oracle attends over the rows with their repeats), on both paths alike."""
    q, k, v = caches()
    pos = topk_positions(12)
    pos[0, 0, 3:6] = pos[0, 0, 0]          # three more copies of one position
    pos[2, 1, 4] = pos[2, 1, 1]
    pos[1, 1, :] = pos[1, 1, 0]            # one position, twelve times
    got, lse = sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=min_sparsity,
                             check_duplicates=False, return_lse=True)
    want = np.zeros((B, HKV * G, D))
    want_lse = np.zeros((B, HKV * G))
    for b in range(B):
        for h in range(HKV):
            rows = pos[b, h]
            o, lo = attention_f64(np.asarray(q[b, h * G:(h + 1) * G], np.float64),
                                  k[b, h, rows].astype(np.float64)[:, None, :],
                                  v[b, h, rows].astype(np.float64)[:, None, :],
                                  1.0 / np.sqrt(D))
            want[b, h * G:(h + 1) * G], want_lse[b, h * G:(h + 1) * G] = o, lo
    assert_matches_oracle(got, lse, want, want_lse, "float32",
                          f"duplicates, min_sparsity={min_sparsity}")


def test_ragged_counts_and_empty_rows():
    q, k, v = caches()
    pos = topk_positions(12, seed=3)
    counts = np.array([[12, 5], [0, 7], [1, 12]])
    pos[0, 1, 5:] = 10_000                      # ignored: past the count
    sel = make_selection(pos, counts)
    ref_out, ref_lse = oracle_masked(q, k, v, mask_of(sel))
    for ms in (0, 1e9):
        out, lse = sparse_decode(q, k, v, sel, live_lens=LIVE, min_sparsity=ms,
                                 return_lse=True)
        assert_matches_oracle(out, lse, ref_out, ref_lse, "float32", f"ragged {ms}")
        assert (out[1, :G] == 0).all() and np.isneginf(lse[1, :G]).all()


def test_changing_one_selected_position_changes_the_output():
    q, k, v = caches()
    pos = topk_positions(8, seed=4)
    out = sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=0)
    moved = pos.copy()
    unused = sorted(set(range(int(LIVE[2]))) - set(pos[2, 1].tolist()))
    moved[2, 1, 3] = unused[0]
    out2 = sparse_decode(q, k, v, moved, live_lens=LIVE, min_sparsity=0)
    diff = np.abs(out2 - out).max(axis=-1)
    assert diff[2, G:2 * G].min() > 1e-4          # request 2, KV head 1's query heads
    diff[2, G:2 * G] = 0
    assert (diff == 0).all()                      # nothing else moved


def test_negative_control_kernel_ignoring_the_selection_fails():
    q, k, v = caches()
    pos = topk_positions(10)
    ref_out, _ = oracle_masked(q, k, v, mask_of(make_selection(pos)))
    bad = sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=0, backend=IgnoresIndices())
    assert max_rel_error(bad, ref_out) > 1e-2


# ---------------------------------------------------------------------------- blocks
def test_block_selection_agrees_with_dense_block_mask():
    q, k, v = caches(seed=5)
    bs = 8
    blocks = np.array([[[0, 5, 2], [1, 6, 3]], [[7, 0, 3], [2, 4, 1]], [[9, 1, 4], [0, 2, 8]]])
    sel = selection_from_blocks(blocks, block_size=bs, live_lens=LIVE)
    mask = np.zeros((B, HKV, CAP), bool)
    for b in range(B):
        for h in range(HKV):
            for blk in blocks[b, h]:
                mask[b, h, blk * bs:min((blk + 1) * bs, LIVE[b])] = True
    assert (selection_mask(sel, CAP) == mask).all()
    assert sel.counts[1, 0] == 8 + 1 + 8            # block 7 of request 1 is its tail (57)
    ref_out, ref_lse = oracle_masked(q, k, v, mask)
    fused, lse = sparse_decode(q, k, v, sel, live_lens=LIVE, min_sparsity=0, return_lse=True)
    assert_matches_oracle(fused, lse, ref_out, ref_lse, "float32", "blocks")
    dense, dlse = sparse_decode(q, k, v, sel, live_lens=LIVE, min_sparsity=1e9,
                                return_lse=True)
    assert max_rel_error(fused, np.asarray(dense, np.float64)) <= out_tol("float32")
    tail = selection_from_blocks(blocks[:, :, :1], block_size=bs, live_lens=LIVE,
                                 include_tail=True)
    assert set(tail.positions[1, 0, :tail.counts[1, 0]].tolist()) == set(range(56, 57))
    assert set(tail.positions[0, 0, :tail.counts[0, 0]].tolist()) == \
        set(range(0, 8)) | set(range(88, 96))
    with pytest.raises(InvalidArgumentError, match=r"selection_from_blocks: request 1, KV "
                                                   r"head 0: block 8 is outside"):
        selection_from_blocks(np.full((B, HKV, 1), 8), block_size=bs, live_lens=LIVE)


# ---------------------------------------------------------------------------- layout
def test_pool_view_is_a_view_and_table_layout():
    _, k, _ = caches()
    view = pool_view(k)
    assert view.shape == (B * HKV * CAP, 1, 1, D) and np.shares_memory(view, k)
    pos = topk_positions(4)
    t = sparse_table(make_selection(pos), CAP)
    assert t.page_size == 1 and t.batch_size == B * HKV and t.num_pages == B * HKV * CAP
    assert t.request_pages(1 * HKV + 1).tolist() == (pos[1, 1] + (1 * HKV + 1) * CAP).tolist()
    assert (view[t.request_pages(3), 0, 0] == k[1, 1, pos[1, 1]]).all()


def test_non_contiguous_cache_is_rejected():
    q, k, v = caches()
    with pytest.raises(InvalidArgumentError, match="sparse_decode: k_cache must be "
                                                   "C-contiguous"):
        sparse_decode(q, k[:, :, ::2], v[:, :, ::2], topk_positions(4), live_lens=LIVE // 2)


# ---------------------------------------------------------------------------- rejections
def test_selection_rejections():
    q, k, v = caches()
    pos = topk_positions(6)
    past = pos.copy()
    past[1, 0, 2] = LIVE[1]                        # first row past request 1's window
    with pytest.raises(InvalidArgumentError, match=r"sparse_decode: selection: request 1, "
                                                   r"KV head 0: position 57 \(entry 2\) is "
                                                   r"outside the live window \[0, 57\)"):
        sparse_decode(q, k, v, past, live_lens=LIVE)
    neg = pos.copy()
    neg[0, 1, 0] = -1
    with pytest.raises(InvalidArgumentError, match="position -1"):
        sparse_decode(q, k, v, neg, live_lens=LIVE)
    dup = pos.copy()
    dup[2, 1, 4] = dup[2, 1, 1]
    with pytest.raises(InvalidArgumentError, match="request 2, KV head 1 selects position"):
        sparse_decode(q, k, v, dup, live_lens=LIVE)
    twice = sparse_decode(q, k, v, dup, live_lens=LIVE, min_sparsity=0, check_duplicates=False)
    assert np.isfinite(twice).all()                # documented: the duplicate counts twice
    with pytest.raises(InvalidArgumentError, match=r"live_lens must be in \[0, capacity"):
        sparse_decode(q, k, v, pos, live_lens=np.array([97, 1, 1]))
    with pytest.raises(InvalidArgumentError, match=r"live_lens must be integers of shape"):
        sparse_decode(q, k, v, pos, live_lens=LIVE[:2])
    with pytest.raises(InvalidArgumentError, match=r"selection must cover \[B, Hkv\]"):
        sparse_decode(q, k, v, pos[:, :1], live_lens=LIVE)
    with pytest.raises(InvalidArgumentError, match="make_selection: counts"):
        make_selection(pos, np.full((B, HKV), 7))
    with pytest.raises(InvalidArgumentError, match="make_selection: positions"):
        make_selection(pos[0])
    with pytest.raises(InvalidArgumentError, match="sparse_decode: min_sparsity"):
        sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=-1)
    with pytest.raises(InvalidArgumentError, match="sparse_decode: q must have shape"):
        sparse_decode(q[:, :, :8], k, v, pos, live_lens=LIVE)


# ---------------------------------------------------------------------------- the gate
def test_gate_picks_the_dense_path_below_the_ratio():
    q, k, v = caches()
    pos = topk_positions(10)                       # selected 60 of 2 * 233 = 466 live rows
    pd.reset_counters()
    _, o = sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=8, return_outcome=True)
    assert o.path == "sparse-masked" and "7.77 < min_sparsity 8" in o.reason
    _, o = sparse_decode(q, k, v, pos, live_lens=LIVE, return_outcome=True)   # default 2x
    assert o.path == "sparse" and "7.77 >= min_sparsity 2" in o.reason
    _, o = sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=7.5, return_outcome=True)
    assert o.path == "sparse" and "7.77 >= min_sparsity 7.5" in o.reason
    _, o = sparse_decode(q, k, v, pos[:, :, :5], live_lens=LIVE, return_outcome=True)
    assert o.path == "sparse"                      # 15.5x
    _, o = sparse_decode(q, k, v, pos, live_lens=LIVE, min_sparsity=0, return_outcome=True)
    assert o.path == "sparse" and "disabled" in o.reason
    assert pd.counters() == {"reference:sparse-masked": 1, "reference:sparse": 4}
    assert "selected 60 of 466" in o.detail
