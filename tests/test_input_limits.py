"""Bad inputs at the edges of the integer types and of a call's life, found by session 24's
audit: unsigned and huge integers, outputs made read-only after a call was prepared,
caller-owned buffers edited between plan and run. Each must be this package's own error
naming the function and the argument, never a wrong answer, a numpy exception or an
out-of-bounds read; each refusal has a control that the valid neighbour still works."""

from __future__ import annotations

import re

import numpy as np
import pytest
from helpers import PREFIX_RTOL, assert_matches_oracle

import paged_decode as pd
import paged_decode.compat.flashinfer as fi
from paged_decode.errors import (
    InvalidArgumentError,
    PagedDecodeError,
    PageTableError,
    PoolExhaustedError,
)
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode

SPEC = ProblemSpec(2, 40, 8, 2, 64, 16, "float16", "float16", seed=3)
BACKENDS = ["reference", "emulated-cuda"]


@pytest.fixture
def pr():
    return make_problem(SPEC)


def _states(rng, n=4, h=3, d=64):
    return (rng.standard_normal((n, h, d)).astype(np.float32),
            rng.standard_normal((n, h)).astype(np.float32))


# ---------------------------------------------------------------------------- merge_states
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.uint32, np.uint64, np.int64])
def test_merge_refuses_a_decreasing_indptr_of_any_integer_type(backend, dtype):
    """An unsigned indptr's differences wrap: [0, 3, 2, 4] once passed as non-decreasing
    (row 2 merged twice, group 1 empty)."""
    v, lse = _states(np.random.default_rng(0))
    with pytest.raises(InvalidArgumentError, match=r"^merge_states: indptr must start at 0, "
                                                   r"be non-decreasing"):
        pd.merge_states(v, lse, np.array([0, 3, 2, 4], dtype), backend=backend)
    good = np.array([0, 3, 3, 4], dtype)             # control: the same type, valid
    vo, lo = pd.merge_states(v, lse, good, backend=backend)
    ref_v, ref_l = pd.merge_states(v, lse, good.astype(np.int64), backend="reference")
    np.testing.assert_allclose(vo, ref_v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lo, ref_l, rtol=1e-5, atol=1e-6)
    assert np.isneginf(lo[1]).all()


def test_merge_refuses_an_unsigned_indptr_past_int64():
    v, lse = _states(np.random.default_rng(1))
    with pytest.raises(InvalidArgumentError, match=r"^merge_states: indptr must hold values "
                                                   r"that fit int64, got 9223372036854775808"):
        pd.merge_states(v, lse, np.array([0, 2**63, 4], np.uint64), backend="reference")


# ---------------------------------------------------------------------------- FlashInfer shim
def test_fi_append_refuses_a_last_page_len_past_the_page():
    """kv_last_page_len 8 at page size 4 made position 6 of request 0 land in request 1's
    page, silently."""
    p, hkv, d = 4, 1, 64
    cache = np.zeros((8, 2, p, hkv, d), np.float16)
    indices, indptr = np.array([5, 6], np.int32), np.array([0, 1, 2], np.int32)
    row = np.ones((1, hkv, d), np.float16)
    for lpl, b in (([8, 1], 0), ([1, 8], 1)):
        with pytest.raises(InvalidArgumentError, match=rf"^append_paged_kv_cache: "
                           rf"kv_last_page_len must be in \[1, page_size = 4\], got 8 for "
                           rf"request {b}"):
            fi.append_paged_kv_cache(row, row, np.array([b]), np.array([6]), cache, indices,
                                     indptr, np.array(lpl, np.int32), backend="reference")
    assert not cache.any()                            # nothing was written
    fi.append_paged_kv_cache(row, row, np.array([0]), np.array([3]), cache, indices, indptr,
                             np.array([4, 1], np.int32), backend="reference")   # control
    assert (cache[5, :, 3] == 1).all() and cache.sum() == 2 * d


def _graph(backend, n_pages):
    bufs = [np.zeros(3, np.int32), np.zeros(8, np.int32), np.zeros(2, np.int32)]
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        np.zeros(1 << 20, np.uint8), use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
        backend=backend)
    return w, bufs


@pytest.mark.parametrize("backend", BACKENDS)
def test_fi_graph_run_checks_buffers_edited_after_plan(backend):
    """An eager graph-mode run reads the caller's buffers: an out-of-range page id was an
    out-of-bounds read of the cache, a last_page_len past the page a wrong answer, a new
    page count a chunk map that no longer covers the request."""
    rng = np.random.default_rng(0)
    p, hkv, d, hq, n = 16, 2, 64, 8, 12
    k = rng.standard_normal((n, p, hkv, d)).astype(np.float16)
    v = rng.standard_normal((n, p, hkv, d)).astype(np.float16)
    indptr, indices = np.array([0, 3, 5], np.int32), np.array([4, 1, 7, 2, 9], np.int32)
    lpl = np.array([5, 16], np.int32)
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    w, bufs = _graph(backend, n)
    w.plan(indptr, indices, lpl, hq, hkv, d, p)
    edits = [(1, 1, 1000, r"paged_kv_indices_buffer\[1\] holds page 1000, outside the "
                          r"cache's 12 pages"),
             (1, 2, -1, r"paged_kv_indices_buffer\[2\] holds page -1"),
             (2, 0, 40, r"paged_kv_last_page_len_buffer\[0\] holds 40, outside \[1, "
                        r"page_size = 16\] for request 0"),
             (2, 1, 0, r"paged_kv_last_page_len_buffer\[1\] holds 0, outside \[1,"),
             (0, 1, 2, r"paged_kv_indptr_buffer\[1\] holds 2, but the last plan wrote 3")]
    for buf, i, val, pattern in edits:
        old = bufs[buf][i]
        bufs[buf][i] = val
        with pytest.raises(InvalidArgumentError,
                           match=r"^BatchDecodeWithPagedKVCacheWrapper.run: " + pattern):
            w.run(q, (k, v))
        bufs[buf][i] = old
    # control: page ids and lengths rewritten in range run on the buffers' contents
    bufs[1][:5] = [0, 11, 3, 6, 10]
    bufs[2][:] = [16, 1]
    out = w.run(q, (k, v))
    table = pd.PageTable.build(bufs[1][:5], indptr, bufs[2], page_size=p)
    ref = oracle_decode(q, k, v, table)
    assert_matches_oracle(out, None, ref[0], None, "float16", "edited in range")


def test_fi_graph_run_with_a_combined_cache_needs_a_plan_after_new_page_ids():
    """A combined cache's kernels read the plan's doubled page ids: an id edited since is
    refused rather than silently not read."""
    rng = np.random.default_rng(2)
    p, hkv, d, hq, n = 16, 2, 64, 8, 12
    cache = rng.standard_normal((n, 2, p, hkv, d)).astype(np.float16)
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    w, bufs = _graph("emulated-cuda", n)
    w.plan(np.array([0, 3, 5]), np.array([4, 1, 7, 2, 9]), np.array([5, 16]), hq, hkv, d, p)
    w.run(q, cache)                                  # control
    bufs[1][0] = 0
    with pytest.raises(InvalidArgumentError, match=r"with a combined K/V cache call plan "
                                                   r"after changing page ids"):
        w.run(q, cache)


def test_fi_plan_checks_the_soft_cap_and_argument_types_up_front(pr):
    t = pr.table
    w = fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 16, np.uint8), backend="reference")
    args = (t.indptr, t.indices, t.last_page_len, 8, 2, 64, 16)
    for cap in (1e-40, 1e31, float("nan"), -1.0):
        with pytest.raises(InvalidArgumentError, match=r"^BatchDecodeWithPagedKVCacheWrapper"
                                                       r"\.plan: logits_soft_cap must be"):
            w.plan(*args, logits_soft_cap=cap)
    with pytest.raises(PagedDecodeError, match=r"plan: pos_encoding_mode must be one of"):
        w.plan(*args, pos_encoding_mode=np.array(["NONE", "x"]))
    w.plan(*args, logits_soft_cap=0.0)               # control: FlashInfer's 0 is no cap
    with pytest.raises(InvalidArgumentError, match=r"run: window_left must be an integer"):
        w.run(pr.q, (pr.k_pages, pr.v_pages), window_left=np.array([1, 2]))
    w.run(pr.q, (pr.k_pages, pr.v_pages), window_left=-1)


# ---------------------------------------------------------------------------- read-only outputs
def test_outputs_made_read_only_after_preparing_are_refused(pr):
    q, k, v, t = pr.q, pr.k_pages, pr.v_pages, pr.table
    plan = pd.plan_decode(t, 8, 2, 64)
    out = np.empty_like(q)
    pd.decode(q, k, v, t, plan, out=out)             # prepared and cached: the fast path
    out.setflags(write=False)
    with pytest.raises(InvalidArgumentError, match=r"^decode: out must be writable"):
        pd.decode(q, k, v, t, plan, out=out)
    out2 = np.empty_like(q)
    prep = pd.prepare_decode(q, k, v, t, plan, out=out2)
    prep()                                           # control
    out2.setflags(write=False)
    with pytest.raises(InvalidArgumentError, match=r"^PreparedDecode\(\): out must be "
                                                   r"writable"):
        prep()
    out2.setflags(write=True)
    prep()


def test_fi_outputs_and_in_place_merges_must_be_writable(pr):
    t = pr.table
    w = fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 16, np.uint8), backend="reference")
    w.plan(t.indptr, t.indices, t.last_page_len, 8, 2, 64, 16)
    ro = np.zeros_like(pr.q)
    ro.setflags(write=False)
    with pytest.raises(InvalidArgumentError, match=r"run: out must be writable"):
        w.run(pr.q, (pr.k_pages, pr.v_pages), out=ro)
    s = np.zeros((2, 8), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"^merge_state_in_place: v must be "
                                                   r"writable"):
        fi.merge_state_in_place(ro, s, pr.q, s.copy(), backend="reference")


# ---------------------------------------------------------------------------- huge integers
def test_multi_token_fast_path_keys_the_counts_type_and_shape():
    """A view of a checked int64 qo_indptr as int32 has the same bytes: it must get the
    checks, not the prepared call."""
    p = make_problem(ProblemSpec(2, 20, 8, 2, 64, 16, "float16", "float16", seed=0),
                     lengths=[20, 9])
    q = np.random.default_rng(1).standard_normal((5, 8, 64)).astype(np.float16)
    plan = pd.plan_decode(p.table, 8, 2, 64, query_tokens=3)
    out = np.empty_like(q)
    good = np.array([0, 3, 5], np.int64)
    pd.decode(q, p.k_pages, p.v_pages, p.table, plan, out=out, qo_indptr=good)
    with pytest.raises(InvalidArgumentError, match=r"^decode: qo_indptr must have shape "
                                                   r"\[B\+1\] = \[3\], got \[6\]"):
        pd.decode(q, p.k_pages, p.v_pages, p.table, plan, out=out,
                  qo_indptr=good.view(np.int32))


def test_pool_counts_past_its_capacity_are_refused():
    pool = pd.PagePool(8, 4, 2, 64, "float32")
    s = pool.new_sequence()
    kv = np.ones((6, 2, 64), np.float32)
    pool.append(s, kv, kv)
    for c in (2**63 - 1, 33):
        with pytest.raises(PoolExhaustedError, match=rf"^PagePool\.reserve_batch: "
                                                       rf"counts\[0\] = {c} is more tokens "
                                                       rf"than the pool's 8 pages x 4 hold"):
            pool.reserve_batch([s], counts=[c])
    assert pool.seq_len(s) == 6 and pool.num_free == 6
    pool.reserve_batch([s], counts=[26])             # control: every free slot
    assert pool.seq_len(s) == 32 and pool.num_free == 0


def test_sequence_ids_outside_int64_name_no_sequence():
    pool = pd.PagePool(8, 4, 2, 64, "float32")
    pool.new_sequence()
    for call in (lambda: pool.free(2**63), lambda: pool.seq_len(-2**70),
                 lambda: pool.fork(2**64 - 1)):
        with pytest.raises(InvalidArgumentError, match=r"unknown sequence"):
            call()
    with pytest.raises(InvalidArgumentError, match=r"^PagePool\.page_table: seqs must hold "
                                                   r"values that fit int64"):
        pool.page_table(np.array([2**64 - 1], np.uint64))


def test_plan_sizes_are_bounded(pr):
    with pytest.raises(InvalidArgumentError, match=r"^plan_decode: pages_per_chunk must be "
                                                   r"an integer in \[1, 134217727\]"):
        pd.plan_decode(pr.table, 8, 2, 64, pages_per_chunk=2**40)
    for h in (2**31, 2**63 - 1):
        with pytest.raises(InvalidArgumentError, match=r"^plan_decode: headroom must be an "
                                                       r"integer in \[0, 2147483647\]"):
            pd.plan_decode(pr.table, 8, 2, 64, headroom=h)
    pool, s = _pool()
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep: headroom must be"):
        pd.DecodeStep(pool, [s], num_qo_heads=8, headroom=2**62)
    plan = pd.plan_decode(pr.table, 8, 2, 64, headroom=2**31 - 1)   # control: the bound
    assert plan.matches(pr.table)


@pytest.mark.parametrize("kw, pattern", [
    (dict(ragged_split=float("nan")), r"ragged_split must be a finite number >= 0, got nan"),
    (dict(ragged_split=-1), r"ragged_split must be a finite number >= 0, got -1"),
    (dict(ragged_split=True), r"ragged_split must be a finite number >= 0, got True"),
    (dict(kv_dtype="int8"), r"kv_dtype must have dtype in"),
])
def test_plan_arguments_are_checked_when_their_rule_is_not_reached(pr, kw, pattern):
    with pytest.raises(PagedDecodeError, match=r"^plan_decode: " + pattern):
        pd.plan_decode(pr.table, 8, 2, 64, **kw)


def test_a_window_past_any_request_is_the_whole_request(pr):
    ref = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    for w in (2**31, 2**63, np.uint64(2**64 - 1)):
        got = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, window_left=w)
        np.testing.assert_array_equal(got, ref)
    plan = pd.plan_decode(pr.table, 8, 2, 64, window_left=2**70)
    assert plan.matches(pr.table)


def _pool():
    pool = pd.PagePool(64, 16, 2, 64, "float16")
    s = pool.new_sequence()
    kv = np.ones((20, 2, 64), np.float16)
    pool.append(s, kv, kv)
    return pool, s


def test_size_arguments_have_upper_bounds():
    pool, s = _pool()
    cases = [
        (lambda: pool.step_table([s], capacity=2**40),
         r"^PagePool\.step_table: capacity must be an integer in \[1, 2147483647\]"),
        (lambda: pool.step_table([s], page_capacity=2**70),
         r"^PagePool\.step_table: page_capacity must be an integer in \[1, 2147483647\]"),
        # past what the rows can ever hold: refused before a multi-GB allocation
        (lambda: pool.step_table([s], page_capacity=2**31 - 1),
         r"^PagePool\.step_table: page_capacity must be at most \d+ \(the largest of 64"),
        (lambda: pd.DecodeStep(pool, [s], num_qo_heads=8, capacity=2**40),
         r"^DecodeStep: capacity must be"),
        (lambda: pd.PagePool(2**31 + 8, 1, 1, 1, "float16"),
         r"^PagePool: num_pages must be an integer in \[1, 2147483647\]"),
        (lambda: pd.PageTable.build([1, 2], [0, 2], [3], page_size=2**63),
         r"^PageTable\.build: page_size must be an integer in \[1, 2147483647\]"),
    ]
    for call, pattern in cases:
        with pytest.raises((InvalidArgumentError, PageTableError), match=pattern):
            call()


def test_a_step_table_too_large_to_allocate_is_a_clear_error(monkeypatch):
    from paged_decode.step_table import StepTable
    pool, s = _pool()

    def no_memory(self, cap, pcap):
        raise MemoryError("simulated")
    monkeypatch.setattr(StepTable, "_alloc", no_memory)
    with pytest.raises(InvalidArgumentError, match=r"^PagePool\.step_table: a table of 1 rows "
                                                   r"and 64 pages needs .* GiB twice over, "
                                                   r"which backend 'reference' could not "
                                                   r"allocate \(MemoryError\)"):
        pool.step_table([s])


def test_sparse_sizes_are_bounded_and_a_huge_block_costs_no_memory():
    """selection_from_blocks built np.arange(block_size): a block of 2**40 asked for 8 TiB
    (a raw MemoryError), 2**64 a raw OverflowError; a ragged live_lens raised numpy's
    ValueError."""
    blocks = np.zeros((1, 1, 1), np.int64)
    sel = pd.selection_from_blocks(blocks, block_size=2**31 - 1, live_lens=[8])
    np.testing.assert_array_equal(sel.positions[0, 0], np.arange(8))
    for size in (2**40, 2**64):
        with pytest.raises(InvalidArgumentError, match=r"^selection_from_blocks: block_size "
                                                       r"must be an integer in \[1, "):
            pd.selection_from_blocks(blocks, block_size=size, live_lens=[8])
    with pytest.raises(InvalidArgumentError, match=r"^selection_from_blocks: live_lens must "
                                                   r"be in \[0, MAX_ENTRIES = 2147483647\]"):
        pd.selection_from_blocks(blocks, block_size=4, live_lens=[2**40])
    with pytest.raises(InvalidArgumentError, match=r"^selection_from_blocks: live_lens must "
                                                   r"be integers of shape \[B\] = \[1\], got "
                                                   r"a list that is not one"):
        pd.selection_from_blocks(blocks, block_size=4, live_lens=[3, [3]])
    sel = pd.selection_from_blocks(np.array([[[1, 0]]]), block_size=4, live_lens=[7])
    np.testing.assert_array_equal(sel.positions[0, 0], [4, 5, 6, 0, 1, 2, 3])   # control


def test_a_selection_built_directly_is_checked_and_owns_its_arrays():
    """Selection is exported: built directly it checked nothing and kept the caller's
    writable arrays, while sparse_decode remembers per selection that it was checked (an
    edit after the first call: a position of -1 read row live - 1, or the old rows)."""
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
    vc = rng.standard_normal((1, 1, 8, 64)).astype(np.float32)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    bad = [((np.zeros((1, 1), np.int32), np.zeros(1, np.int32)), r"positions must be an "
            r"integer array \[B, Hkv, S\]"),
           ((np.array([[[2.9]]]), np.array([[1]])), r"positions must be an integer array"),
           ((np.zeros((1, 1, 1), np.int32), np.ones(1, np.int32)), r"counts must be an "
            r"integer array \[B, Hkv\]"),
           ((np.zeros((1, 1, 1), np.int32), np.full((1, 1), 3, np.int32)), r"counts must be "
            r"integers in \[0, 1\]")]
    for args, pattern in bad:
        with pytest.raises(InvalidArgumentError, match=r"^Selection: " + pattern):
            pd.Selection(*args)
    pos = np.array([[[1, 2]]], np.int32)
    sel = pd.Selection(pos, np.array([[2]], np.int32))
    assert not sel.positions.flags.writeable and sel.positions is not pos
    first = pd.sparse_decode(q, kc, vc, sel, live_lens=[6])
    pos[0, 0, 1] = -1                        # the caller's array, not the selection's
    np.testing.assert_array_equal(pd.sparse_decode(q, kc, vc, sel, live_lens=[6]), first)
    again = pd.sparse_decode(q, kc, vc, pd.make_selection([[[1, 2]]]), live_lens=[6])
    np.testing.assert_array_equal(again, first)          # control: the same rows


# ---------------------------------------------------------------------------- DecodeStep
def test_decode_step_checks_its_decode_arguments_up_front_and_names_itself():
    pool = pd.PagePool(64, 16, 2, 64, "float16")
    seqs = [pool.new_sequence() for _ in range(3)]
    kv = np.ones((20, 2, 64), np.float16)
    for s in seqs:
        pool.append(s, kv, kv)
    for kw, pattern in ((dict(sm_scale=float("nan")), r"sm_scale must be finite"),
                        (dict(out_dtype="int8"), r"out_dtype must have dtype in"),
                        (dict(logits_soft_cap=1e-40), r"logits_soft_cap must be None or")):
        with pytest.raises(PagedDecodeError, match=r"^DecodeStep: " + pattern):
            pd.DecodeStep(pool, seqs, num_qo_heads=8, **kw)
    st = pd.DecodeStep(pool, seqs, num_qo_heads=8, capacity=4)
    st.begin()
    st.append(0, np.ones((4, 2, 64), np.float16), np.ones((4, 2, 64), np.float16))
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep\.decode: q must have shape "
                                                   r"\[B, Hq, D\] = \[4, 8, 64\], got "
                                                   r"\[3, 8, 64\]"):
        st.decode(0, np.ones((3, 8, 64), np.float16))
    assert st.decode(0, np.ones((4, 8, 64), np.float16)).shape == (4, 8, 64)   # control


# ---------------------------------------------------------------------------- command line
@pytest.mark.parametrize("extra, pattern", [
    (["--soft-cap", "nan"], r"bench: --soft-cap must be 0 \(off\) or a number in "
                            r"\[1e-30, 1e\+30\], got nan"),
    (["--soft-cap", "1e-40"], r"--soft-cap must be 0"),
    (["--soft-cap", "1e31"], r"--soft-cap must be 0"),
    (["--context", "3000000000"], r"Invalid value for '--context'"),
])
def test_bench_options_the_functions_refuse_are_one_line_errors(extra, pattern):
    from click.testing import CliRunner

    from paged_decode.cli import main
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--batch", "1",
                                    "--context", "64", "--page", "16", "--arms", "v2",
                                    "--reps", "1", "--warmup", "0", *extra])
    assert res.exit_code in (1, 2), res.output
    assert isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output
    assert re.search(pattern, res.output), res.output


def test_bench_turns_package_errors_into_one_line():
    from click.testing import CliRunner

    from paged_decode.cli import main
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--batch", "1", "--context", "64", "--page", "16",
                                    "--steps", "2", "--layers", "100000000"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    assert res.output.strip().splitlines()[-1].startswith("Error: PagePool: k and v pages")


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize("value, pattern", [
    ("x", r"^PAGED_DECODE_STAGES must be a positive integer, got 'x'"),
    ("0", r"^PAGED_DECODE_STAGES must be a positive integer, got '0'"),
    ("1", r"^PAGED_DECODE_STAGES must be an integer >= 2 \(a ring of two stages or more\), "
          r"got '1'"),
])
def test_ring_depth_setting_is_checked_by_name(monkeypatch, pr, value, pattern):
    """A bad ring depth once raised int()'s ValueError ('x') or was quietly raised to 2
    ('0', '1')."""
    monkeypatch.setenv("PAGED_DECODE_STAGES", value)
    with pytest.raises(InvalidArgumentError, match=pattern):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="emulated-cuda", path="v2")
    monkeypatch.setenv("PAGED_DECODE_STAGES", "3")                    # control
    assert pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="emulated-cuda",
                     path="v2").shape == pr.q.shape


def test_row_loads_setting_is_checked_by_name(monkeypatch, pr):
    monkeypatch.setenv("PAGED_DECODE_V2_ROW_LOADS", "two")
    with pytest.raises(InvalidArgumentError, match=r"^PAGED_DECODE_V2_ROW_LOADS must be a "
                                                   r"positive integer, got 'two'"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="emulated-cuda", path="v2")


def test_a_cascade_plan_for_other_prefix_tiles_is_refused():
    """A cascade plan made for a device whose prefix kernel takes 128 rows per CTA ran on
    this kernel's 64: stacked rows 64-119 were never computed and the merge read stale
    workspace (max-rel error ~3, no error; a session-24 audit)."""
    import dataclasses
    rng = np.random.default_rng(0)
    p, hkv, g, d, m = 16, 1, 40, 64, 3            # M * G = 120 stacked rows
    k = rng.standard_normal((20, p, hkv, d)).astype(np.float16)
    v = rng.standard_normal((20, p, hkv, d)).astype(np.float16)
    lists = [[0, 1, 2, 10 + i] for i in range(m)]
    t = pd.PageTable.build(np.concatenate(lists), np.arange(0, 4 * m + 1, 4), [5] * m,
                           page_size=p, num_pages=20)
    q = rng.standard_normal((m, hkv * g, d)).astype(np.float16)
    be = pd.get_backend("emulated-cuda")
    wide = dataclasses.replace(be.device_info(), prefix_tile_rows=128)
    cp = pd.plan_cascade(t, hkv * g, hkv, d, device=wide, min_shared_pages=1)
    with pytest.raises(InvalidArgumentError, match=r"^cascade_decode: the cascade plan's 1 "
                                                   r"level-0 row tile\(s\) of this kernel's 64 "
                                                   r"rows cover fewer than the 120 stacked"):
        pd.cascade_decode(q, k, v, t, cascade_plan=cp, backend=be, out_dtype="float32")
    cp = pd.plan_cascade(t, hkv * g, hkv, d, device=be.device_info(), min_shared_pages=1)
    out, lse = pd.cascade_decode(q, k, v, t, cascade_plan=cp, return_lse=True, backend=be,
                                 out_dtype="float32")             # control
    assert_matches_oracle(out, lse, *oracle_decode(q, k, v, t), "float32", "cascade",
                          tol=PREFIX_RTOL["float16"])


def test_a_scale_tensor_changed_in_place_is_read_again():
    """decode's fast path keyed an fp8 scale given as a torch tensor by identity: updated
    in place (calibrated scales), the prepared call kept its first value (max-rel error 5
    against the oracle; a session-24 audit). Such calls are not replayed from the cache."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    p, hkv, hq, d = 16, 2, 8, 64
    k16 = rng.standard_normal((4, p, hkv, d)).astype(np.float32)
    import ml_dtypes
    k8 = k16.astype(ml_dtypes.float8_e4m3fn)
    v8 = rng.standard_normal((4, p, hkv, d)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    t = pd.PageTable.build(np.arange(4, dtype=np.int32), [0, 2, 4], [16, 9], page_size=p)
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    plan = pd.plan_decode(t, hq, hkv, d)
    out = np.empty_like(q)
    ks = torch.tensor([0.5], dtype=torch.float32)
    for value in (0.5, 2.0):
        ks.fill_(value)
        pd.decode(q, k8, v8, t, plan, out=out, kv_dtype="float8_e4m3fn", k_scale=ks,
                  v_scale=1.0)
        want = oracle_decode(q, k8.astype(np.float32) * value, v8.astype(np.float32), t)
        assert_matches_oracle(out, None, want[0], None, "float16", f"k_scale {value}")


# ---------------------------------------------------------------------------- the shim, round 2
@pytest.mark.parametrize("backend", BACKENDS)
def test_fi_graph_padding_row_with_a_last_page_len_is_empty(backend):
    """A request without pages is empty whatever its last_page_len (CUDA-graph padding
    rows): the reference backend's graph run raised PageTableError naming PageTable.build
    where emulated-cuda served zeros and -inf."""
    rng = np.random.default_rng(0)
    p, hq, hkv, d = 8, 8, 2, 64
    k, v = (rng.standard_normal((10, p, hkv, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    w, bufs = _graph(backend, 10)
    w.plan(np.array([0, 3, 3]), np.array([4, 1, 7]), np.array([5, 0]), hq, hkv, d, p)
    bufs[2][1] = 1
    out, lse = w.run(q, (k, v), return_lse=True)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    t = pd.PageTable.build(np.array([4, 1, 7]), [0, 3, 3], [5, 0], page_size=p)
    assert_matches_oracle(out, lse, *oracle_decode(q, k, v, t), "float16", backend)


def test_fi_writes_check_their_targets_first():
    """A read-only cache made append_paged_kv_cache write K and then fail on V with numpy's
    error; a read-only or strided graph-mode workspace raised numpy's errors too."""
    p, hkv, d = 4, 1, 64
    k = np.zeros((8, p, hkv, d), np.float16)
    v = np.zeros((8, p, hkv, d), np.float16)
    v.setflags(write=False)
    row = np.ones((1, hkv, d), np.float16)
    with pytest.raises(InvalidArgumentError, match=r"^append_paged_kv_cache: v_cache must be "
                                                   r"writable"):
        fi.append_paged_kv_cache(row, row, np.array([0]), np.array([0]), (k, v),
                                 np.array([5]), np.array([0, 1]), np.array([1]),
                                 backend="reference")
    assert not k.any()                               # nothing written
    rng = np.random.default_rng(1)
    kc = rng.standard_normal((10, 8, 2, 64)).astype(np.float16)
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    for ws, pattern in ((np.zeros(1 << 20, np.uint8)[::2], r"must be a contiguous array"),
                        (np.zeros(1 << 20, np.uint8), r"must be writable")):
        if pattern == r"must be writable":
            ws.setflags(write=False)
        bufs = [np.zeros(3, np.int32), np.zeros(8, np.int32), np.zeros(2, np.int32)]
        w = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
            paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
            backend="reference")
        w.plan(np.array([0, 3, 5]), np.array([4, 1, 7, 2, 9]), np.array([5, 8]), 8, 2, 64, 8)
        with pytest.raises(InvalidArgumentError, match=r"run: float_workspace_buffer " + pattern):
            w.run(q, (kc, kc))


def test_fi_arguments_that_are_not_arrays_or_on_other_devices_are_named(pr):
    torch = pytest.importorskip("torch")
    t = pr.table
    w = fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 16, np.uint8), backend="reference")
    w.plan(t.indptr, t.indices, t.last_page_len, 8, 2, 64, 16)
    with pytest.raises(InvalidArgumentError, match=r"run: k_cache must be an array .*, got "
                                                   r"list"):
        w.run(pr.q, ([[0.0]], [[0.0]]))
    with pytest.raises(InvalidArgumentError, match=r"run: v_cache must be an array .*, got "
                                                   r"NoneType"):
        w.run(pr.q, (pr.k_pages, None))
    meta = torch.empty((2, 8, 64), dtype=torch.float16, device="meta")
    with pytest.raises(InvalidArgumentError, match=r"run: q is a torch tensor on device "
                                                   r"'meta'; paged-decode takes CPU or CUDA"):
        w.run(meta, (pr.k_pages, pr.v_pages))


def test_fi_merge_state_names_the_callers_arguments_and_takes_float64_s():
    rng = np.random.default_rng(2)
    va, vb = (rng.standard_normal((2, 4, 64)).astype(np.float32) for _ in range(2))
    sa, sb = (rng.standard_normal((2, 4)).astype(np.float32) for _ in range(2))
    with pytest.raises(InvalidArgumentError, match=r"^merge_state: s_a must have shape "
                                                   r"\[n, H\] = \[2, 4\], got \[2, 4, 1\]"):
        fi.merge_state(va, sa[..., None], vb, sb, backend="reference")
    with pytest.raises(InvalidArgumentError, match=r"^merge_state: s_b must have shape"):
        fi.merge_state(va, sa, vb, sb[:, 0], backend="reference")
    v64, s64 = fi.merge_state(va, sa.astype(np.float64), vb, sb, backend="reference")
    v32, s32 = fi.merge_state(va, sa, vb, sb, backend="reference")     # control
    np.testing.assert_array_equal(v64, v32)
    np.testing.assert_array_equal(s64, s32)


def test_fi_get_seq_lens_checks_its_table():
    """get_seq_lens wrapped 2**30 pages of 16 to -12 and took a last_page_len past the page
    and a decreasing indptr."""
    for args, pattern in (((np.array([0, 2**30]), np.array([4]), 16), r"a request of "
                           r"17179869172 tokens does not fit the int32 lengths"),
                          ((np.array([0, 1, 3]), np.array([9, 2]), 4), r"kv_last_page_len "
                           r"must be in \[1, page_size = 4\], got 9"),
                          ((np.array([0, 3, 1]), np.array([1, 2]), 4), r"kv_indptr must start "
                           r"at 0 and be non-decreasing")):
        with pytest.raises(InvalidArgumentError, match=r"^get_seq_lens: " + pattern):
            fi.get_seq_lens(*args)
    np.testing.assert_array_equal(fi.get_seq_lens(np.array([0, 1, 3]), np.array([4, 2]), 4),
                                  [4, 6])                            # control


def test_fi_graph_plan_keeps_its_soft_cap_and_reports_a_dtype_as_a_dtype(pr):
    """Graph-mode plan reused a local name for the indices buffer's length, so the plan
    recorded a soft cap of 64; a byte cache under a 16-bit plan read as a shape error."""
    w, _ = _graph("reference", 16)
    t = pr.table
    w.plan(t.indptr, t.indices, t.last_page_len, 8, 2, 64, 16)
    assert w._planned["logits_soft_cap"] is None
    with pytest.raises(PagedDecodeError, match=r"run: paged_kv_cache must have dtype in "
                                               r".*, got uint8"):
        w.run(pr.q, (pr.k_pages.view(np.uint8), pr.v_pages.view(np.uint8)))


def _run_cli(*args, env=None):
    from click.testing import CliRunner

    from paged_decode.cli import main
    res = CliRunner().invoke(main, [str(a) for a in args], env=env)
    assert "Traceback" not in res.output
    return res


def test_every_command_turns_package_errors_into_one_line(tmp_path):
    """info and check printed a traceback for a bad setting (bench already did not)."""
    env = {"PAGED_DECODE_TARGET_CTAS": "abc"}
    for args in (("info",), ("check", "--backend", "reference", "--max-configs", "1")):
        res = _run_cli(*args, env=env)
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert res.output.strip().splitlines()[-1] == ("Error: PAGED_DECODE_TARGET_CTAS must "
                                                       "be a positive integer, got 'abc'")
    bad = tmp_path / "b.json"
    bad.write_text('{"header": [1], "results": []}')
    res = _run_cli("plot", bad, tmp_path / "b.png")
    assert "Traceback" not in res.output


def test_engine_bench_fails_when_nothing_ran_and_needs_a_timed_step(tmp_path):
    """The engine suite exited 0 (and wrote its JSON) with every arm 'not run', and
    --steps 1 timed nothing (its one step is the warm-up) and reported NaN."""
    base = ("bench", "--backend", "reference", "--suite", "engine", "--layers", "1",
            "--batch", "1", "--context", "16")
    out = tmp_path / "e.json"
    res = _run_cli(*base, "--steps", "2", "--arms", "flashinfer", "--json", out)
    assert res.exit_code == 1 and "no arm could run here" in res.output and not out.exists()
    res = _run_cli(*base, "--steps", "1")
    assert res.exit_code == 2 and "Invalid value for '--steps'" in res.output
    res = _run_cli(*base, "--steps", "2", "--arms", "eager")            # control
    assert res.exit_code == 0, res.output


def test_check_runs_a_path_named_twice_once():
    res = _run_cli("check", "--backend", "reference", "--max-configs", "1", "--path", "v1",
                   "--path", "v1")
    assert res.exit_code == 0, res.output
    assert "PASS: 1/1 checks passed" in res.output, res.output     # it ran twice: 2/2


def test_prefix_kernel_settings_are_checked_and_key_the_cascade_plan(monkeypatch):
    """PAGED_DECODE_PREFIX_CTAS_PER_SM "x" raised int()'s ValueError; the cascade plan
    memo was keyed without the two prefix-kernel settings that size level 0's chunks, so
    a sweep over them timed one cached plan."""
    import dataclasses

    from paged_decode import cascade_policy
    from paged_decode.kernels import prefix_tc
    monkeypatch.setenv("PAGED_DECODE_PREFIX_CTAS_PER_SM", "x")
    with pytest.raises(InvalidArgumentError, match=r"^PAGED_DECODE_PREFIX_CTAS_PER_SM must be "
                                                   r"a positive integer, got 'x'"):
        prefix_tc.ctas_per_sm(128, 233472)
    p, m, shared = 16, 3, 64                  # 64 shared pages, one private page each
    t = pd.PageTable.build(np.concatenate([list(range(shared)) + [shared + i]
                                           for i in range(m)]),
                           np.arange(0, (shared + 1) * m + 1, shared + 1), [5] * m,
                           page_size=p, num_pages=shared + m)
    dev = dataclasses.replace(pd.get_backend("emulated-cuda").device_info(),
                              shared_mem_per_unit=233472)
    plans = []
    for n in ("1", "4"):
        monkeypatch.setenv("PAGED_DECODE_PREFIX_CTAS_PER_SM", n)
        cp, _ = cascade_policy.resolve_cascade("decode", True, "auto", t, 8, 2, 64,
                                               lambda: dev)
        plans.append(cp)
    assert plans[0] is not plans[1]                     # not the cached plan of "1"
    assert plans[0].plan0.num_chunks != plans[1].plan0.num_chunks
