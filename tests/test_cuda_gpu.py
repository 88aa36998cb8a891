"""The CUDA backend on a real GPU (skipped cleanly where CuPy or a GPU is missing).

Every output and workspace is NaN-poisoned (conftest); results are compared with the
float64 oracle per dtype; negative controls show the comparisons can fail.
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.problems import ProblemSpec, make_problem, make_table
from paged_decode.reference import lse_error, max_rel_error, oracle_decode, row_rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

from helpers import LSE_ATOL as LSE_TOL  # noqa: E402  (one place for tolerances)
from helpers import OUT_RTOL as TOL  # noqa: E402  (keyed by the output dtype)
from helpers import PREFIX_RTOL, assert_matches_oracle, path_out_tol, ref_merge, relabel, table_of  # noqa: E402

PATHS = [("v2", None), ("v2", 1), ("v1", None), ("gather", None)]


@pytest.fixture(scope="module")
def cuda():
    import os

    import cupy as cp
    if os.environ.get("PAGED_DECODE_PLAIN_MALLOC"):
        # every allocation its own cudaMalloc, so compute-sanitizer sees exact bounds
        cp.cuda.set_allocator(None)
    return pd.get_backend("cuda")


def _run(cuda, spec, *, lengths=None, offsets=None, paths=PATHS, out_dtype="float32"):
    import cupy as cp
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    errs = {}
    for path, ppc in paths:
        plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                              device=cuda.device_info(), pages_per_chunk=ppc)
        out, lse = pd.decode(q, k, v, pr.table, plan, path=path, return_lse=True,
                             out_dtype=out_dtype)
        assert isinstance(out, cp.ndarray)
        # each (request, head) row on its own scale: a long request's averaged output is
        # far smaller than a short one's, and one batch-wide scale would hide its error
        e, le = row_rel_error(cp.asnumpy(out), ref), lse_error(cp.asnumpy(lse), ref_lse)
        errs[(path, ppc)] = (e, le, pd.last_outcome().path)
        assert e <= TOL[out_dtype], (spec.label, path, ppc, e)
        assert le <= LSE_TOL, (spec.label, path, ppc, le)
    return errs


CASES = [
    # (id, spec)
    ("llama-B4-ctx1000-ps16-f16", ProblemSpec(4, 1000, 32, 8, 128, 16)),
    ("g1-d64-ps32-f16", ProblemSpec(3, 700, 8, 8, 64, 32, seed=1)),
    ("g8-d128-ps64-bf16", ProblemSpec(3, 900, 16, 2, 128, 64, "bfloat16", "bfloat16", seed=2)),
    ("g16-d128-ps16-f16", ProblemSpec(2, 600, 32, 2, 128, 16, seed=3)),
    ("g7-d128-ps16-f16", ProblemSpec(2, 650, 28, 4, 128, 16, seed=4)),
    ("g4-d256-ps16-f32", ProblemSpec(2, 500, 8, 2, 256, 16, "float32", "float32", seed=5)),
    ("g4-d96-ps8-f16", ProblemSpec(2, 333, 16, 4, 96, 8, seed=6)),
    ("g2-d64-ps1-f16", ProblemSpec(2, 70, 4, 2, 64, 1, seed=7)),
    ("g4-d128-ps256-f16", ProblemSpec(2, 700, 8, 2, 128, 256, seed=8)),
    ("g4-d128-ps7-bf16", ProblemSpec(3, 300, 8, 2, 128, 7, "bfloat16", "bfloat16", seed=9)),
    ("qf32-kvf16", ProblemSpec(2, 400, 8, 2, 128, 16, "float32", "float16", seed=10)),
    ("qbf16-kvf32", ProblemSpec(2, 400, 8, 2, 64, 16, "bfloat16", "float32", seed=11)),
]


@pytest.mark.parametrize("spec", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_paths_match_oracle(cuda, spec):
    _run(cuda, spec)


@pytest.mark.parametrize("path", ["v2", "v2tc", "auto"])
def test_output_in_query_dtype_and_merge_skipped(cuda, path):
    """Without ``out_dtype`` the output takes the query's dtype, and a plan of one chunk
    per request runs no merge, on either flat partial and on the one ``auto`` picks (the
    device's crossover table decides which: v2 on the H200's, v2tc on the H100's)."""
    spec = ProblemSpec(8, 256, 32, 8, 128, 16, seed=12)
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    plan = pd.plan_decode(pr.table, 32, 8, 128, target_ctas=1)
    assert not plan.needs_merge
    out = pd.decode(q, k, v, pr.table, plan, path=path)
    ran = pd.last_outcome().path
    assert ran == path if path != "auto" else ran in ("v2", "v2tc", "v1")
    assert out.dtype == np.float16
    assert max_rel_error(out.get(), ref) <= TOL["float16"]


def test_empty_requests_give_zeros_and_neg_inf(cuda):
    spec = ProblemSpec(4, 300, 16, 4, 128, 16, seed=13)
    errs = _run(cuda, spec, lengths=[300, 0, 17, 0], offsets=[0, 0, 5, 0])
    assert errs
    pr = make_problem(spec, lengths=[0, 0, 0, 0], offsets=[0, 0, 0, 0])
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    for path in ("v2", "v1", "gather"):
        out, lse = pd.decode(q, k, v, pr.table, path=path, return_lse=True)
        assert (out.get() == 0).all() and np.isneginf(lse.get()).all(), path


def test_many_chunks_forced_and_large_context(cuda):
    spec = ProblemSpec(2, 20000, 32, 8, 128, 16, seed=14)
    _run(cuda, spec, paths=[("v2", None), ("v2", 1), ("v2", 3)])


def _mutated_backend(cuda, name):
    """A CUDA backend whose kernel is compiled from ``GPU_NEGATIVE_CONTROLS[name]``'s
    mutated source (tests/mutants.py; checked on the CPU by tests/test_mutants.py)."""
    import cupy as cp
    from mutants import GPU_NEGATIVE_CONTROLS

    from paged_decode.backends import cuda as cuda_mod
    from paged_decode.specs import cuda_source
    mutation = GPU_NEGATIVE_CONTROLS[name]
    (kernel,) = mutation.kernels

    class Mutant(type(cuda)):
        name = "cuda"

        def kernel(self, spec):
            if spec.kernel != kernel:
                return super().kernel(spec)
            src = mutation.apply(cuda_source(kernel), f"cuda {kernel}")
            expr = spec.cuda_name_expression()
            return cp.RawModule(code=src, options=cuda_mod.COMPILE_OPTIONS,
                                name_expressions=[expr]).get_function(expr)
    return Mutant()


@pytest.mark.parametrize("mutation", ["v2-ignores-indices", "v2-drops-first-page-offset"])
def test_negative_control_mutated_kernel_fails(cuda, mutation):
    bad = _mutated_backend(cuda, mutation)
    pr = make_problem(ProblemSpec(4, 500, 16, 4, 128, 16, seed=15))
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = (bad.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    out = pd.decode(q, k, v, pr.table, path="v2", out_dtype="float32", backend=bad)
    assert max_rel_error(out.get(), ref) > 0.1


# ---------------------------------------------------------------------------- v2tc
#: the emulator's cases (test_v2tc.py) plus contexts and batches the emulator cannot afford
V2TC_GPU_CASES = [
    ("llama-B4-ctx1000-ps16-f16", ProblemSpec(4, 1000, 32, 8, 128, 16, seed=60), [None, 10**6]),
    ("g16-ctx20000-ps16-f16", ProblemSpec(2, 20000, 32, 2, 128, 16, seed=61), [None, 3]),
    ("g7-d128-ps16-bf16", ProblemSpec(8, 3000, 28, 4, 128, 16, "bfloat16", "bfloat16",
                                      seed=62), [None, 10**6]),
    ("g32-d256-ps64-f16", ProblemSpec(3, 2500, 32, 1, 256, 64, seed=63), [None, 10**6]),
    ("g1-d96-ps1-f16", ProblemSpec(4, 900, 8, 8, 96, 1, seed=64), [None, 10**6]),
]


def _v2tc_cases():
    from test_v2tc import CASES as EMULATOR_CASES
    return [*EMULATOR_CASES, *V2TC_GPU_CASES]


@pytest.mark.parametrize("case", _v2tc_cases(), ids=[c[0] for c in _v2tc_cases()])
def test_v2tc_on_cuda_matches_oracle(cuda, case):
    from test_v2tc import run_v2tc
    _, spec, ppcs = case
    run_v2tc(cuda, spec, ppcs)


def test_v2tc_on_cuda_ragged_with_empty_requests(cuda):
    from test_v2tc import run_v2tc
    run_v2tc(cuda, ProblemSpec(7, 0, 32, 8, 128, 16, seed=65), [None, 1, 10**6],
             lengths=[4000, 0, 1, 777, 0, 8191, 64], offsets=[3, 0, 0, 15, 0, 9, 0])


@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_flat_partials_on_cuda_under_the_row_hint(cuda, path, monkeypatch):
    from test_v2tc import run_row_hint
    run_row_hint(cuda, path, monkeypatch)


@pytest.mark.parametrize("batch", [31, 127, 128, 129])
def test_v2tc_on_cuda_request_entries_at_every_batch_size(cuda, batch):
    from test_v2tc import run_request_entries
    run_request_entries(cuda, batch)


def test_v2tc_on_cuda_reads_a_q_off_16_byte_alignment(cuda):
    # a contiguous q one element past a 16-byte boundary (a view into a larger buffer;
    # the host passes it as is): the kernel's 16-bit Q loads, float16 and fp8 pools
    import cupy as cp
    from test_v2tc import run_v2tc

    def offset(q):
        buf = cp.zeros(q.size + 8, q.dtype)
        view = buf[1:1 + q.size].reshape(q.shape)
        view[...] = q
        assert view.data.ptr % 16 and view.flags.c_contiguous
        return view
    run_v2tc(cuda, ProblemSpec(3, 700, 32, 8, 128, 16, seed=67), [None, 10**6], q_of=offset)
    run_v2tc(cuda, ProblemSpec(2, 500, 28, 4, 128, 16, "bfloat16", "float8_e4m3fn", seed=68),
             [None, 10**6], q_of=offset, k_scale=0.37, v_scale=2.5)


def test_v2tc_negative_control_mutated_kernel_fails(cuda):
    bad = _mutated_backend(cuda, "v2tc-ignores-indices")
    pr = make_problem(ProblemSpec(4, 500, 16, 4, 128, 16, seed=66))
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = (bad.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    out = pd.decode(q, k, v, pr.table, path="v2tc", out_dtype="float32", backend=bad)
    assert pd.last_outcome().path.startswith("v2tc")
    assert max_rel_error(out.get(), ref) > 0.1


def test_pool_beyond_2_pow_31_elements(cuda):
    import cupy as cp
    p, hkv, d = 16, 8, 128
    per_page = p * hkv * d
    num_pages = (1 << 31) // per_page + 4096            # > 2^31 elements per pool
    k = cp.zeros((num_pages, p, hkv, d), cp.float16)
    v = cp.zeros_like(k)
    assert k.size > 2**31
    rng = np.random.default_rng(17)
    ids = num_pages - 1 - rng.permutation(64)          # pages at the far end of the pool
    lengths = [600, 380]
    table = table_of(lengths=lengths, page_size=p, ids=ids, num_pages=num_pages)
    used = cp.asarray(table.indices)
    k[used] = cp.random.standard_normal((used.size, p, hkv, d), dtype=cp.float32).astype(cp.float16)
    v[used] = cp.random.standard_normal((used.size, p, hkv, d), dtype=cp.float32).astype(cp.float16)
    q = cp.random.standard_normal((2, 32, d), dtype=cp.float32).astype(cp.float16)
    # oracle on a compact host copy of the used pages
    small = relabel(table)
    ref, _ = oracle_decode(q.get(), k[used].get(), v[used].get(), small)
    for path, ppc in PATHS:
        plan = pd.plan_decode(table, 32, hkv, d, pages_per_chunk=ppc)
        out = pd.decode(q, k, v, table, plan, path=path, out_dtype="float32")
        # without an LSE the gather arm runs torch SDPA, which computes in q's dtype
        tol = TOL["float16"] if path == "gather" else TOL["float32"]
        assert max_rel_error(out.get(), ref) <= tol, path
    del k, v


def test_torch_tensors_on_a_side_stream(cuda):
    torch = pytest.importorskip("torch")
    spec = ProblemSpec(4, 800, 32, 8, 128, 16, seed=18)
    pr = make_problem(spec)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q = torch.from_numpy(pr.q).cuda()
    k = torch.from_numpy(pr.k_pages).cuda()
    v = torch.from_numpy(pr.v_pages).cuda()
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        out, lse = pd.decode(q, k, v, pr.table, path="v2", return_lse=True,
                             out_dtype="float32")
        plan = pd.plan_decode(pr.table, 32, 8, 128, pages_per_chunk=1)
        out2 = pd.decode(q, k, v, pr.table, plan)
    s.synchronize()
    assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
    assert max_rel_error(out.cpu().numpy(), ref) <= TOL["float32"]
    assert lse_error(lse.cpu().numpy(), ref_lse) <= LSE_TOL
    assert max_rel_error(out2.float().cpu().numpy(), ref) <= TOL["float16"]


def test_torch_bfloat16_zero_copy(cuda):
    torch = pytest.importorskip("torch")
    spec = ProblemSpec(2, 300, 8, 2, 128, 16, "bfloat16", "bfloat16", seed=19)
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q = torch.from_numpy(pr.q.view(np.int16)).cuda().view(torch.bfloat16)
    k = torch.from_numpy(pr.k_pages.view(np.int16)).cuda().view(torch.bfloat16)
    v = torch.from_numpy(pr.v_pages.view(np.int16)).cuda().view(torch.bfloat16)
    assert cuda.asarray(k).data.ptr == k.data_ptr()          # no copy
    out = pd.decode(q, k, v, pr.table)
    assert out.dtype == torch.bfloat16
    assert max_rel_error(out.float().cpu().numpy(), ref) <= TOL["bfloat16"]


def test_dtype_switch_at_one_geometry_compiles_separately(cuda):
    for dt in ("float16", "float32", "bfloat16", "float16"):
        _run(cuda, ProblemSpec(2, 300, 8, 2, 128, 16, dt, dt, seed=20), paths=[("v2", 1)])


def test_assert_no_compile(cuda, monkeypatch):
    from paged_decode.specs import UnexpectedCompileError
    spec = ProblemSpec(2, 200, 8, 2, 128, 16, seed=21)
    pr = make_problem(spec)
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    pd.decode(q, k, v, pr.table, path="v2")                # warm
    monkeypatch.setenv("PAGED_DECODE_ASSERT_NO_COMPILE", "1")
    pd.decode(q, k, v, pr.table, path="v2")                # cached: fine
    pr2 = make_problem(ProblemSpec(2, 200, 8, 2, 128, 48, seed=21))
    q2, k2, v2 = (cuda.asarray(x) for x in (pr2.q, pr2.k_pages, pr2.v_pages))
    with pytest.raises(UnexpectedCompileError, match="ps-48"):
        pd.decode(q2, k2, v2, pr2.table, path="v2")


def test_pool_on_cuda_with_fork_and_trim(cuda):
    import cupy as cp
    rng = np.random.default_rng(22)
    pool = pd.PagePool(64, 16, 2, 128, "float16", backend="cuda")
    a = pool.new_sequence()
    pool.append(a, *(rng.standard_normal((2, 37, 2, 128)).astype(np.float16)))
    b = pool.fork(a)
    pool.append(b, *(rng.standard_normal((2, 20, 2, 128)).astype(np.float16)))
    pool.append(a, *(rng.standard_normal((2, 5, 2, 128)).astype(np.float16)))
    pool.trim_front(a, 19)
    table = pool.page_table([a, b])
    assert isinstance(pool.k, cp.ndarray)
    q = rng.standard_normal((2, 8, 128)).astype(np.float16)
    ref, _ = oracle_decode(q, pool.k.get(), pool.v.get(), table)
    out = pd.decode(cp.asarray(q), pool.k, pool.v, table, out_dtype="float32")
    tol = path_out_tol(pd.last_outcome().path, "float16", "float32")
    assert max_rel_error(out.get(), ref) <= tol


def test_merge_states_on_cuda_matches_reference(cuda):
    import cupy as cp
    rng = np.random.default_rng(23)
    v = rng.standard_normal((9, 4, 128)).astype(np.float32)
    lse = (rng.standard_normal((9, 4)) * 3).astype(np.float32)
    lse[2] = -np.inf
    lse[5:7] = -np.inf
    ip = np.array([0, 3, 3, 5, 7, 9])
    got_v, got_l = pd.merge_states(cp.asarray(v), cp.asarray(lse), ip)
    ref_v, ref_l = ref_merge(v, lse, ip)            # float64 closed form
    assert_matches_oracle(got_v.get(), got_l.get(), ref_v, ref_l, "float32", "merge")
    assert (got_v.get()[1] == 0).all() and np.isneginf(got_l.get()[1]).all()


def test_second_device_if_present(cuda):
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU on this machine")
    spec = ProblemSpec(2, 300, 8, 2, 128, 16, seed=24)
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    with cp.cuda.Device(1):
        q, k, v = (cp.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    out = pd.decode(q, k, v, pr.table, out_dtype="float32")
    assert out.device.id == 1
    tol = path_out_tol(pd.last_outcome().path, "float16", "float32")
    assert max_rel_error(out.get(), ref) <= tol


def test_table_helper_used_here_is_sane():
    table, n = make_table([5, 0, 33], 16, offsets=[0, 0, 3])
    assert table.visible_lens.tolist() == [5, 0, 33] and n >= table.total_pages


def test_cascade_on_cuda_matches_flat_and_oracle(cuda):
    import cupy as cp
    rng = np.random.default_rng(25)
    hkv, g, d, p = 4, 4, 128, 16
    pool = pd.PagePool(512, p, hkv, d, "float16", backend="cuda")
    root = pool.new_sequence()
    pool.append(root, *(rng.standard_normal((2, 70 * p, hkv, d)).astype(np.float16)))
    seqs = []
    for i in range(4):                                    # 4 members sharing 70 pages
        s = pool.fork(root)
        pool.append(s, *(rng.standard_normal((2, 37 + 11 * i, hkv, d)).astype(np.float16)))
        seqs.append(s)
    other = pool.new_sequence()                           # a non-member
    pool.append(other, *(rng.standard_normal((2, 300, hkv, d)).astype(np.float16)))
    table = pool.page_table([seqs[0], other, *seqs[1:]])
    prefix = pd.detect_shared_prefix(table)
    assert prefix is not None and prefix.num_members == 4
    q = rng.standard_normal((5, hkv * g, d)).astype(np.float16)
    ref, ref_lse = oracle_decode(q, pool.k.get(), pool.v.get(), table)
    out, lse = pd.decode(cp.asarray(q), pool.k, pool.v, table, cascade=True, return_lse=True,
                         out_dtype="float32")
    oc = pd.last_outcome()
    assert oc.path == "cascade" and "level 0: tensor-core prefix" in oc.detail
    # level 0 rounds P to float16 for the tensor cores (helpers.PREFIX_RTOL)
    assert max_rel_error(out.get(), ref) <= PREFIX_RTOL["float16"]
    assert lse_error(lse.get(), ref_lse) <= LSE_TOL
    flat = pd.decode(cp.asarray(q), pool.k, pool.v, table, cascade=False, out_dtype="float32")
    assert max_rel_error(flat.get(), ref) <= TOL["float32"]
    # the v2 level 0 (stacked queries) keeps float32 arithmetic: equal to flat
    cplan = pd.plan_cascade(table, hkv * g, hkv, d, level0="v2")
    out2 = pd.decode(cp.asarray(q), pool.k, pool.v, table, cascade=cplan, out_dtype="float32")
    assert "level 0: v2 on stacked queries" in pd.last_outcome().detail
    assert np.abs(flat.get() - out2.get()).max() <= 1e-5


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_prefix_kernel_on_cuda_matches_oracle(cuda, dtype, head_dim):
    import cupy as cp
    from test_prefix_tc import prefix_case
    out_err, lse_err = prefix_case(cuda, cp, dtype=dtype, head_dim=head_dim, seed=head_dim)
    print(f"prefix {dtype} hd{head_dim}: out max-rel {out_err:.2e}, lse {lse_err:.2e}")


@pytest.mark.parametrize("members,group,hkv,page_size,pages,ppc", [
    (24, 3, 1, 16, 4, 3), (1, 1, 2, 16, 4, 3), (70, 1, 1, 16, 4, 3), (32, 4, 8, 16, 64, 8),
    (8, 4, 2, 1, 300, 100), (8, 4, 2, 64, 5, 2), (128, 8, 4, 16, 20, 7),
    (16, 4, 8, 16, 70, 33)])
def test_prefix_kernel_on_cuda_geometries(cuda, members, group, hkv, page_size, pages, ppc):
    import cupy as cp
    from test_prefix_tc import prefix_case
    prefix_case(cuda, cp, members=members, group=group, hkv=hkv, page_size=page_size,
                shared_pages=pages, ppc=ppc, extra_requests=1, head_dim=128, seed=members)


def test_sparse_on_cuda_matches_oracle_on_selected_rows(cuda):
    import cupy as cp

    from paged_decode.reference import attention_f64
    from paged_decode.sparse import make_selection, sparse_decode
    rng = np.random.default_rng(26)
    b, hkv, g, d, cap, s = 2, 2, 4, 128, 4096, 256
    live = np.array([4096, 3000])
    k = rng.standard_normal((b, hkv, cap, d)).astype(np.float16)
    v = rng.standard_normal((b, hkv, cap, d)).astype(np.float16)
    q = rng.standard_normal((b, hkv * g, d)).astype(np.float16)
    pos = np.stack([np.stack([np.sort(rng.choice(int(live[i]), s, replace=False))
                              for _ in range(hkv)]) for i in range(b)]).astype(np.int32)
    sel = make_selection(pos)
    out = sparse_decode(cp.asarray(q), cp.asarray(k), cp.asarray(v), sel, live_lens=live,
                        out_dtype="float32")
    assert pd.last_outcome().path == "sparse"
    ref = np.zeros((b, hkv * g, d))
    for i in range(b):
        for h in range(hkv):
            rows = pos[i, h]
            ref[i, h * g:(h + 1) * g] = attention_f64(
                q[i, h * g:(h + 1) * g].astype(np.float64), k[i, h, rows][:, None, :].astype(
                    np.float64), v[i, h, rows][:, None, :].astype(np.float64), 1 / np.sqrt(d))[0]
    assert max_rel_error(out.get(), ref) <= TOL["float32"]
