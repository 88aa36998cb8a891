"""The FlashInfer-compatible decode wrapper (``paged_decode.compat.flashinfer``) on the CPU:
against the float64 oracle over FlashInfer's own decode-test geometries (reference
backend; the real CUDA kernel sources on the emulator for a subset), both cache forms,
torch CPU tensors, graph mode over caller-owned buffers, and one test per refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from fi_cases import CPU_CASES, EMULATED_CASES, FiCase, fi_arrays, make_fi_problem
from helpers import assert_matches_oracle, out_tol

import paged_decode.compat.flashinfer as fi
from paged_decode import PageTable
from paged_decode.compat.fi_graph import chunk_map, fixed_chunking
from paged_decode.errors import InvalidArgumentError
from paged_decode.plan import chunk_counts
from paged_decode.reference import max_rel_error, oracle_decode

WS = 1 << 22          # bytes of float workspace: enough for every graph-mode case here


def wrapper(backend="reference", **kw):
    return fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8), backend=backend, **kw)


def planned(pr, backend="reference", **kw):
    c = pr.case
    w = wrapper(backend)
    w.plan(pr.indptr, pr.indices, pr.last_page_len, c.num_qo_heads, c.num_kv_heads,
           c.head_dim, c.page_size, q_data_type=c.dtype, **kw)
    return w


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype)


# ---------------------------------------------------------------------------- oracle
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_wrapper_matches_oracle_on_flashinfer_geometries(case):
    pr = make_fi_problem(case)
    ref_o, ref_l = pr.oracle()
    w = planned(pr)
    for form, cache in (("combined", pr.cache), ("pair", pr.pair())):
        out, lse = w.run(pr.q, cache, return_lse=True)
        assert isinstance(out, np.ndarray) and out.dtype == pr.q.dtype
        assert lse.dtype == np.float32 and lse.shape == pr.q.shape[:2]
        assert_matches_oracle(out, lse, ref_o, ref_l, case.dtype, f"{case.id} {form}")
    # caller-owned outputs, NaN-poisoned: every element must be written
    out = poisoned(pr.q.shape, pr.q.dtype)
    lse = poisoned(pr.q.shape[:2], np.float32)
    got = w.run(pr.q, pr.cache, out=out, lse=lse, return_lse=True)
    assert got[0] is out and got[1] is lse
    assert_matches_oracle(out, lse, ref_o, ref_l, case.dtype, f"{case.id} out=")
    # without return_lse: the output alone, and a given lse is still written
    lse2 = poisoned(pr.q.shape[:2], np.float32)
    only = w.run(pr.q, pr.cache, lse=lse2)
    assert isinstance(only, np.ndarray)
    assert_matches_oracle(only, lse2, ref_o, ref_l, case.dtype, f"{case.id} lse=")


@pytest.mark.parametrize("case", EMULATED_CASES, ids=lambda c: c.id)
def test_wrapper_on_emulated_cuda_kernels(case):
    pr = make_fi_problem(case, seed=1)
    ref_o, ref_l = pr.oracle()
    w = planned(pr, "emulated-cuda")
    for cache in (pr.cache, pr.pair()):
        out, lse = w.run(pr.q, cache, return_lse=True)
        assert_matches_oracle(out, lse, ref_o, ref_l, case.dtype, case.id)


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
@pytest.mark.parametrize("window, cap", [(0, None), (5, None), (37, None), (-1, 5.0),
                                         (20, 2.5), (-1, 0.0)],
                         ids=["w0", "w5", "w37", "cap5", "w20-cap2.5", "cap0-off"])
def test_window_left_and_soft_cap_match_the_oracle(backend, window, cap):
    """FlashInfer's window_left (the last W + 1 tokens) and logits_soft_cap (0: off), on
    paged-decode's decode variants; ragged requests, some shorter than the window."""
    case = FiCase(6, 54, 8, 8, 4, 128, ragged=True)
    pr = make_fi_problem(case, seed=3)
    ref_o, ref_l = oracle_decode(pr.q, pr.cache[:, 0], pr.cache[:, 1], pr.table,
                                 window_left=window, logits_soft_cap=cap or None)
    w = planned(pr, backend, window_left=window, logits_soft_cap=cap)
    for cache in (pr.cache, pr.pair()):
        out = poisoned(pr.q.shape, pr.q.dtype)
        lse = poisoned(pr.q.shape[:2], np.float32)
        w.run(pr.q, cache, out=out, lse=lse, window_left=window)   # repeating it is fine
        assert_matches_oracle(out, lse, ref_o, ref_l, case.dtype, f"w{window} cap{cap}")
    if window >= 0 or cap:     # the variants change the answer: a negative control
        plain, _ = pr.oracle()
        assert max_rel_error(out, plain) > 10 * out_tol(case.dtype)


def test_lse_is_base_2_of_the_scaled_logits():
    pr = make_fi_problem(FiCase(12, 97, 8, 4, 4, 128, dtype="float32"))
    _, lse = planned(pr, sm_scale=0.3).run(pr.q, pr.cache, return_lse=True)
    r, h = 5, 2
    ids = pr.indices[pr.indptr[r]:pr.indptr[r + 1]]
    keys = pr.cache[ids, 0].reshape(-1, 4, 128)[:97, h].astype(np.float64)
    s = 0.3 * keys @ pr.q[r, h].astype(np.float64)
    natural = s.max() + math.log(np.exp(s - s.max()).sum())
    assert abs(float(lse[r, h]) - natural / math.log(2)) < 1e-4


def test_negative_control_swapped_kv_fails_the_oracle():
    """The comparison can fail: V read as K (a wrong cache) is far off the oracle."""
    pr = make_fi_problem(FiCase(12, 97, 8, 4, 4, 128))
    ref_o, _ = pr.oracle()
    k, v = pr.pair()
    out = planned(pr).run(pr.q, (v, k))
    assert max_rel_error(out, ref_o) > 10 * out_tol("float16")


def test_scheduling_hints_are_accepted_and_change_nothing():
    pr = make_fi_problem(FiCase(12, 54, 16, 32, 4, 128))
    base = planned(pr).run(pr.q, pr.cache)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8), "NHD",
                                              use_tensor_cores=True, backend="reference")
    assert w.use_tensor_cores and not w.is_cuda_graph_enabled
    c = pr.case
    w.begin_forward(pr.indptr, pr.indices, pr.last_page_len, c.num_qo_heads, c.num_kv_heads,
                    c.head_dim, c.page_size, non_blocking=False, logits_soft_cap=0.0)
    got, lse = w.run_return_lse(pr.q, pr.cache, enable_pdl=True, window_left=-1)
    np.testing.assert_array_equal(got, base)
    w.end_forward()


def test_data_type_fills_both_dtypes_and_sm_scale_is_used():
    pr = make_fi_problem(FiCase(12, 97, 8, 4, 4, 128, dtype="float32"))
    ref_o, ref_l = oracle_decode(pr.q, pr.cache[:, 0], pr.cache[:, 1], pr.table, sm_scale=0.7)
    c = pr.case
    w = wrapper()
    w.plan(pr.indptr, pr.indices, pr.last_page_len, 4, 4, 128, 8, q_data_type=None,
           data_type="float32", sm_scale=0.7)
    out, lse = w.run(pr.q, pr.cache, return_lse=True)
    assert_matches_oracle(out, lse, ref_o, ref_l, c.dtype, "sm_scale 0.7")


def test_page_size_one_caches_may_leave_out_the_page_axis():
    pr = make_fi_problem(FiCase(12, 54, 1, 4, 4, 128))
    ref_o, ref_l = pr.oracle()
    w = planned(pr)
    k, v = pr.pair()
    for cache in (pr.cache[:, :, 0], (k[:, 0], v[:, 0])):
        out, lse = w.run(pr.q, cache, return_lse=True)
        assert_matches_oracle(out, lse, ref_o, ref_l, "float16", "3-D / 4-D page-size-1 cache")


def test_a_new_plan_replaces_the_old_one():
    a = make_fi_problem(FiCase(12, 97, 8, 4, 4, 128), seed=3)
    b = make_fi_problem(FiCase(17, 512, 16, 32, 4, 128, ragged=True), seed=4)
    w = planned(a)
    w.run(a.q, a.cache)
    w.plan(b.indptr, b.indices, b.last_page_len, 32, 4, 128, 16)
    out, lse = w.run(b.q, b.cache, return_lse=True)
    assert_matches_oracle(out, lse, *b.oracle(), "float16", "re-planned")


# ---------------------------------------------------------------------------- torch
def test_torch_cpu_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    for dtype in ("float16", "bfloat16", "float32"):
        pr = make_fi_problem(FiCase(12, 97, 16, 32, 4, 128, dtype=dtype), seed=5)
        ref_o, ref_l = pr.oracle()
        tdt = getattr(torch, dtype)
        q = torch.from_numpy(pr.q.astype(np.float32)).to(tdt)
        cache = torch.from_numpy(pr.cache.astype(np.float32)).to(tdt)
        ws = torch.zeros(WS, dtype=torch.uint8)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(torch.from_numpy(pr.indptr), torch.from_numpy(pr.indices),
               torch.from_numpy(pr.last_page_len), 32, 4, 128, 16, q_data_type=tdt)
        out, lse = w.run(q, cache, return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == tdt and lse.dtype == torch.float32
        assert_matches_oracle(out.float().numpy(), lse.numpy(), ref_o, ref_l, dtype,
                              f"torch {dtype}")
        given = torch.full_like(q, float("nan"))
        k, v = cache.unbind(1)
        assert w.run(q, (k.contiguous(), v.contiguous()), out=given) is given
        assert_matches_oracle(given.float().numpy(), None, ref_o, ref_l, dtype, "torch out=")


def test_torch_strided_halves_are_refused_and_the_combined_tensor_is_not():
    torch = pytest.importorskip("torch")
    pr = make_fi_problem(FiCase(12, 54, 8, 4, 4, 128))
    w = planned(pr)
    cache = torch.from_numpy(pr.cache)
    with pytest.raises(InvalidArgumentError, match="k_cache is not C-contiguous"):
        w.run(torch.from_numpy(pr.q), cache.unbind(1))
    assert isinstance(w.run(torch.from_numpy(pr.q), cache), torch.Tensor)


# ---------------------------------------------------------------------------- graph mode
def graph_wrapper(batch, max_pages, backend="reference", kind=np):
    bufs = (np.zeros(batch + 1, np.int32), np.zeros(max_pages, np.int32),
            np.zeros(batch, np.int32))
    return fi.BatchDecodeWithPagedKVCacheWrapper(
        np.zeros(WS, np.uint8), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
        backend=backend), bufs


def replan(w, pr):
    c = pr.case
    w.plan(pr.indptr, pr.indices, pr.last_page_len, c.num_qo_heads, c.num_kv_heads,
           c.head_dim, c.page_size, q_data_type=c.dtype)


def grown(pr, extra, seed):
    """The same batch with ``extra`` more tokens per request, over new pages of a pool
    of the same size (what decode steps do to a graph-mode batch)."""
    c = pr.case
    rng = np.random.default_rng(seed)
    lens = pr.table.visible_lens.astype(np.int64) + extra
    indptr, indices, lpl, n = fi_arrays(lens, c.page_size, rng, 0)
    pool = pr.cache.shape[0]
    assert n <= pool
    indices = rng.permutation(pool)[:n].astype(np.int32)
    table = PageTable.build(indices, indptr, lpl, page_size=c.page_size)
    return type(pr)(c, indptr, indices, lpl, pr.q, pr.cache, table)


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_requests_without_pages_are_empty(backend, graph):
    """FlashInfer's length of a request without pages is 0 whatever its last_page_len
    (CUDA-graph padding rows): zeros and a -inf LSE, the other rows untouched."""
    rng = np.random.default_rng(9)
    p, hq, hkv, d = 8, 8, 2, 64
    pages = np.array([3, 0, 2, 0, 1])
    lpl = np.array([5, 8, 8, 0, 2], np.int32)        # a page-less row's value is ignored
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(10)[: pages.sum()].astype(np.int32)
    k, v = (rng.standard_normal((10, p, hkv, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((5, hq, d)).astype(np.float16)
    if graph:
        w, bufs = graph_wrapper(5, 16, backend)
    else:
        w = wrapper(backend)
    w.plan(indptr, indices, lpl, hq, hkv, d, p)
    out, lse = poisoned(q.shape, q.dtype), poisoned(q.shape[:2], np.float32)
    w.run(q, (k, v), out=out, lse=lse, return_lse=True)
    table = PageTable.build(indices, indptr, np.where(pages > 0, lpl, 0), page_size=p)
    assert_matches_oracle(out, lse, *oracle_decode(q, k, v, table), "float16",
                          f"{backend} {'graph' if graph else 'eager'} with empty rows")
    assert (out[[1, 3]] == 0).all() and np.isneginf(lse[[1, 3]]).all()


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_graph_mode_plan_fills_the_buffers_and_run_reads_them(backend):
    case = FiCase(12, 97, 8, 32, 4, 128, ragged=True, spare_pages=80)
    a = make_fi_problem(case, seed=6)
    n = a.cache.shape[0]
    w, bufs = graph_wrapper(12, n, backend)
    assert w.is_cuda_graph_enabled
    replan(w, a)
    np.testing.assert_array_equal(bufs[0], a.indptr)
    np.testing.assert_array_equal(bufs[1][: a.indices.size], a.indices)
    np.testing.assert_array_equal(bufs[2], a.last_page_len)
    shape = (w._graph.plan.num_chunks, w._graph.plan.pages_per_chunk)
    for cache in (a.cache, a.pair()):
        out = poisoned(a.q.shape, a.q.dtype)
        lse = poisoned(a.q.shape[:2], np.float32)
        w.run(a.q, cache, out=out, lse=lse, return_lse=True)
        assert_matches_oracle(out, lse, *a.oracle(), "float16", f"{backend} graph plan 1")
    # a later plan of the same batch size: longer requests over other pages; the launch
    # shape (grid, chunk size: what a capture bakes in) stays, the buffers change
    b = grown(a, 45, seed=7)
    replan(w, b)
    assert (w._graph.plan.num_chunks, w._graph.plan.pages_per_chunk) == shape
    for cache in (b.cache, b.pair()):
        out, lse = w.run(b.q, cache, return_lse=True)
        assert_matches_oracle(out, lse, *b.oracle(), "float16", f"{backend} graph plan 2")
    # the run reads the buffers themselves: rewrite them by hand (same page counts, other
    # page ids and last-page lengths) and run again without a plan
    rng = np.random.default_rng(8)
    ids = rng.permutation(n)[: b.indices.size].astype(np.int32)
    lpl = rng.integers(1, case.page_size + 1, 12).astype(np.int32)
    bufs[1][: ids.size] = ids
    bufs[2][:] = lpl
    table = PageTable.build(ids, b.indptr, lpl, page_size=case.page_size)
    out, lse = w.run(b.q, b.pair(), return_lse=True)
    assert_matches_oracle(out, lse, *oracle_decode(b.q, b.cache[:, 0], b.cache[:, 1], table),
                          "float16", f"{backend} buffers edited in place")


def test_graph_mode_sizes_the_merge_without_reading_the_device_chunk_map(monkeypatch):
    """Graph mode merges over the wrapper's device ``o_indptr``: the launch is sized by the
    fixed chunk count (``inputs``), never by reading the map back, which would synchronize
    and is refused inside a CUDA capture (S25-R2 met that on the GPU)."""
    from paged_decode.backends.launching import LaunchingBackend
    case = FiCase(12, 97, 8, 32, 4, 128, ragged=True, spare_pages=80)
    a = make_fi_problem(case, seed=6)
    w, _ = graph_wrapper(12, a.cache.shape[0], "emulated-cuda")
    replan(w, a)
    seen = []
    real = LaunchingBackend.merge

    def spy(self, v, lse, o_indptr, *args, **kwargs):
        seen.append((o_indptr, kwargs.get("inputs")))
        return real(self, v, lse, o_indptr, *args, **kwargs)
    monkeypatch.setattr(LaunchingBackend, "merge", spy)
    out, lse = w.run(a.q, a.cache, return_lse=True)
    assert_matches_oracle(out, lse, *a.oracle(), "float16", "graph mode")
    assert len(seen) == 1
    ip, inputs = seen[0]
    assert ip is w._graph.plan.o_indptr and inputs == w._graph.plan.num_chunks


def test_the_kernel_merge_refuses_a_device_indptr_without_its_size():
    from paged_decode.backends import get_backend
    be = get_backend("emulated-cuda")
    v, lse = np.zeros((2, 4, 64), np.float32), np.zeros((2, 4), np.float32)
    out, lse_out = np.zeros((1, 4, 64), np.float32), np.zeros((1, 4), np.float32)

    class DeviceIndptr(list):
        """Stands in for a device array: not a host numpy array."""
    with pytest.raises(InvalidArgumentError, match="o_indptr is a device array, so inputs="):
        be.merge(v, lse, DeviceIndptr([0, 2]), out, lse_out)
    be.merge(v, lse, np.array([0, 2], np.int32), out, lse_out)      # host: read here
    be.merge(v, lse, np.array([0, 2], np.int32), out, lse_out, inputs=2)


def test_graph_mode_covers_a_request_holding_every_page():
    case = FiCase(12, 54, 8, 4, 4, 128, spare_pages=0)
    a = make_fi_problem(case, seed=9)
    n = a.cache.shape[0]
    w, _ = graph_wrapper(12, n)
    replan(w, a)
    # one request owns all pages but eleven (one each for the others)
    pages = np.ones(12, np.int64)
    pages[3] = n - 11
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    ids = np.random.default_rng(10).permutation(n).astype(np.int32)
    lpl = np.full(12, 5, np.int32)
    w.plan(indptr, ids, lpl, 4, 4, 128, 8)
    table = PageTable.build(ids, indptr, lpl, page_size=8)
    out, lse = w.run(a.q, a.cache, return_lse=True)
    assert_matches_oracle(out, lse, *oracle_decode(a.q, a.cache[:, 0], a.cache[:, 1], table),
                          "float16", "one long request in graph mode")


def test_fixed_chunking_bounds_every_later_table():
    rng = np.random.default_rng(11)
    from paged_decode import plan_decode
    from paged_decode.backends import get_backend
    dev = get_backend("reference").device_info()
    for _ in range(200):
        b = int(rng.integers(1, 40))
        max_pages = int(rng.integers(b, 5000))
        first = rng.multinomial(max_pages - b, np.ones(b) / b) + 1
        t = PageTable.build(np.arange(first.sum()), np.concatenate([[0], np.cumsum(first)]),
                            np.ones(b, np.int32), page_size=16)
        plan0 = plan_decode(t, 8, 2, 128, device=dev)
        ppc, c = fixed_chunking(plan0, max_pages, int(rng.integers(1, 600)))
        later = rng.multinomial(int(rng.integers(0, max_pages - b + 1)), np.ones(b) / b) + 1
        assert int(chunk_counts(later, ppc).sum()) <= c
        req, tiles, o_indptr = chunk_map(later, ppc, c)
        assert req.size == tiles.size == c and o_indptr[-1] <= c
        # spare chunks lie past their request's pages: they read nothing
        spare = np.arange(c) >= o_indptr[-1]
        assert (tiles[spare] * ppc >= later[req[spare]]).all()


def test_cuda_graph_subclass_takes_the_buffers_positionally():
    pr = make_fi_problem(FiCase(12, 54, 16, 4, 4, 128))
    bufs = (np.zeros(13, np.int32), np.zeros(100, np.int32), np.zeros(12, np.int32))
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8), *bufs)
    assert w.is_cuda_graph_enabled
    replan(w, pr)
    out, lse = w.run(pr.q, pr.cache, return_lse=True)
    assert_matches_oracle(out, lse, *pr.oracle(), "float16", "CUDAGraph subclass")


def test_graph_mode_with_torch_cpu_buffers():
    torch = pytest.importorskip("torch")
    pr = make_fi_problem(FiCase(12, 54, 8, 8, 4, 128, spare_pages=30), seed=12)
    bufs = (torch.zeros(13, dtype=torch.int32), torch.zeros(pr.cache.shape[0], dtype=torch.int32),
            torch.zeros(12, dtype=torch.int32))
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.zeros(WS, dtype=torch.uint8), *bufs)
    c = pr.case
    w.plan(torch.from_numpy(pr.indptr), torch.from_numpy(pr.indices),
           torch.from_numpy(pr.last_page_len), 8, 4, 128, 8)
    assert torch.equal(bufs[0], torch.from_numpy(pr.indptr))
    out, lse = w.run(torch.from_numpy(pr.q), torch.from_numpy(pr.cache), return_lse=True)
    assert isinstance(out, torch.Tensor)
    assert_matches_oracle(out.numpy(), lse.numpy(), *pr.oracle(), c.dtype, "torch graph")
