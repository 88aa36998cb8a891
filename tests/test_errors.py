"""Issue 18's bad inputs, one by one: each is this package's own error naming the function
and the argument (never a raw Python or numpy exception, never a silent wrong answer)."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import paged_decode as pd
from paged_decode.backends.emulated import EmulatedCudaBackend
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.errors import (
    InvalidArgumentError,
    InvalidDtypeError,
    PageTableError,
    PlanMismatchError,
    UnsupportedProblemError,
)
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode

SPEC = ProblemSpec(2, 50, 8, 2, 64, 16, "float32", "float32", seed=5)


@pytest.fixture
def pr():
    return make_problem(SPEC)


def _pool(head_dim=64):
    pool = pd.PagePool(16, 16, 2, head_dim, "float32")
    s = pool.new_sequence()
    kv = np.ones((20, 2, head_dim), np.float32)
    pool.append(s, kv, kv)
    return pool, s


# ---------------------------------------------------------------------------- zero sizes
@pytest.mark.parametrize("shape, pattern", [
    ((4, 16, 0, 64), r"decode: k_pages must have Hkv >= 1 in \[num_pages, P, Hkv, D\], got "
                     r"shape \[4, 16, 0, 64\]"),
    ((4, 16, 2, 0), r"decode: k_pages must have D >= 1"),
])
def test_zero_kv_heads_or_head_dim(pr, shape, pattern):
    k = np.zeros(shape, np.float32)
    with pytest.raises(InvalidArgumentError, match=pattern):
        pd.decode(pr.q, k, k, pr.table)


def test_zero_query_heads_is_a_decode_error(pr):
    with pytest.raises(InvalidArgumentError, match=r"^decode: q must have Hq >= 1 in "
                                                   r"\[B, Hq, D\], got shape \[2, 0, 64\]"):
        pd.decode(pr.q[:, :0], pr.k_pages, pr.v_pages, pr.table)


def test_sparse_decode_zero_kv_heads():
    q = np.ones((1, 4, 64), np.float32)
    k = np.zeros((1, 0, 8, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"^sparse_decode: k_cache must have Hkv >= 1"):
        pd.sparse_decode(q, k, k, np.zeros((1, 0, 1), np.int32), live_lens=[8])


@pytest.mark.parametrize("return_lse", [False, True])
def test_empty_batch_returns_empty_arrays(pr, return_lse):
    table = pd.PageTable.build([], [0], [], page_size=16)
    q = np.ones((0, 8, 64), np.float16)
    res = pd.decode(q, pr.k_pages, pr.v_pages, table, return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    assert out.shape == (0, 8, 64) and out.dtype == np.float16
    assert lse is None or (lse.shape == (0, 8) and lse.dtype == np.float32)
    assert pd.last_outcome().path == "empty"
    given = np.empty((0, 8, 64), np.float32)
    assert pd.decode(q, pr.k_pages, pr.v_pages, table, out=given, out_dtype="float32") is given
    with pytest.raises(InvalidArgumentError, match=r"decode: out must have shape"):
        pd.decode(q, pr.k_pages, pr.v_pages, table, out=np.empty((1, 8, 64), np.float16))
    plan = pd.plan_decode(pr.table, 8, 2, 64)
    with pytest.raises(PlanMismatchError, match=r"decode: plan does not match the table"):
        pd.decode(q, pr.k_pages, pr.v_pages, table, plan)
    with pytest.raises(InvalidArgumentError, match=r"prepare_decode: the table has no requests"):
        pd.prepare_decode(q, pr.k_pages, pr.v_pages, table)


def test_sparse_decode_empty_batch():
    q = np.ones((0, 4, 64), np.float32)
    k = np.zeros((0, 2, 8, 64), np.float32)
    out, lse = pd.sparse_decode(q, k, k, np.zeros((0, 2, 1), np.int32),
                                live_lens=np.zeros(0, np.int64), return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    assert "empty batch" in pd.last_outcome().reason


# ---------------------------------------------------------------------------- types
def test_read_only_out_is_refused(pr):
    out = np.empty((2, 8, 64), np.float32)
    out.setflags(write=False)
    with pytest.raises(InvalidArgumentError, match=r"^decode: out must be writable, got a "
                                                   r"read-only array"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, out=out)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(sm_scale="0.1"), r"decode: sm_scale must be a real number, got str '0.1'"),
    (dict(sm_scale=True), r"decode: sm_scale must be a real number, got bool True"),
    (dict(return_lse="yes"), r"decode: return_lse must be a bool, got 'yes'"),
    (dict(return_lse=1), r"decode: return_lse must be a bool, got 1"),
    (dict(path=["v2"]), r"decode: path must be one of auto, v2, v2tc, v1, gather"),
    (dict(backend=3), r"decode: backend must be a backend name, a Backend or None"),
    (dict(cascade=1), r"decode: cascade must be None, a bool or a cascade plan, got int"),
])
def test_lenient_decode_arguments_are_refused(pr, kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kwargs)


def test_out_dtype_is_never_defaulted_from_a_falsy_value(pr):
    for bad in ("", 0, False):
        with pytest.raises(InvalidDtypeError, match=r"decode: out_dtype must have dtype in "
                                                    r"\(float16, bfloat16, float32\), got"):
            pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, out_dtype=bad)


def test_unhashable_arguments_on_the_fast_path_get_the_checks(pr):
    plan = pd.plan_decode(pr.table, 8, 2, 64)
    out = np.empty((2, 8, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"decode: sm_scale must be a real number"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, out=out, sm_scale=[1.0])


def test_not_an_array_names_the_argument(pr):
    with pytest.raises(InvalidArgumentError, match=r"^decode: k_pages must be an array the "
                                                   r"reference backend can use, got str"):
        pd.decode(pr.q, "pages", pr.v_pages, pr.table)
    with pytest.raises(InvalidArgumentError, match=r"^decode: q must be an array"):
        pd.decode([[[1.0], [2.0, 3.0]]], pr.k_pages, pr.v_pages, pr.table)


def test_pool_refcount_and_ids():
    pool, s = _pool()
    assert pool.refcount(0) == 1 and pool.refcount(15) == 0
    for page in (10**6, -1, 16, True, 1.0):
        with pytest.raises(InvalidArgumentError, match=r"^PagePool.refcount: page must be an "
                                                       r"integer in \[0, 15\], got"):
            pool.refcount(page)
    pool.new_sequence()                                  # sequence 1 exists: True must not
    with pytest.raises(InvalidArgumentError, match=r"^PagePool.free: seq must be a sequence id "
                                                   r"\(an int\), got bool True"):
        pool.free(True)
    assert pool.sequences() == [0, 1]
    with pytest.raises(InvalidArgumentError, match=r"PagePool: page_size must be an integer "
                                                   r"in \[1, 2147483647\], got True"):
        pd.PagePool(4, True, 2, 64)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.page_table: seqs must be a "
                                                   r"sequence"):
        pool.page_table(s)


# ---------------------------------------------------------------------------- messages
def test_merge_state_names_itself_and_its_arguments():
    v = np.zeros((2, 4, 8), np.float32)
    lse = np.zeros((2, 4), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"^merge_state: v_a must have dtype float32, "
                                                   r"got float16"):
        pd.merge_state(v.astype(np.float16), lse, v, lse)
    with pytest.raises(InvalidDtypeError, match=r"^merge_state: lse_b must have dtype float32, "
                                                r"got float64"):
        pd.merge_state(v, lse, v, lse.astype(np.float64))
    with pytest.raises(InvalidDtypeError, match=r"^merge_state: out_dtype must have dtype"):
        pd.merge_state(v, lse, v, lse, out_dtype="int8")


def test_dtype_messages_list_only_what_the_argument_takes(pr):
    with pytest.raises(InvalidDtypeError, match=r"^merge_states: lse must have dtype float32, "
                                                r"got float64$"):
        pd.merge_states(np.zeros((1, 4, 8), np.float32), np.zeros((1, 4)), [0, 1])
    with pytest.raises(InvalidDtypeError, match=r"^decode: lse must have dtype float32, got "
                                                r"float64$"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, lse=np.zeros((2, 8)),
                  return_lse=True)


def test_cascade_decode_names_itself(pr):
    with pytest.raises(InvalidArgumentError, match=r"^cascade_decode: q must be 3-D"):
        pd.cascade_decode(pr.q[0], pr.k_pages, pr.v_pages, pr.table)
    with pytest.raises(InvalidArgumentError, match=r"^cascade_decode: cascade_plan must be "
                                                   r"None, a CascadePlan"):
        pd.cascade_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, cascade_plan=True)


def test_quick_start_fork_reports_the_minimum_span():
    """A fork shares every page, but 6 full pages are below the measured 1024-token span."""
    pool = pd.PagePool(num_pages=32, page_size=16, num_kv_heads=8, head_dim=128,
                       dtype="float16")
    seq = pool.new_sequence()
    k = np.random.default_rng(0).standard_normal((100, 8, 128)).astype(np.float16)
    pool.append(seq, k, k)
    table = pool.page_table([seq, pool.fork(seq)])
    q = np.ones((2, 32, 128), np.float16)
    pd.decode(q, pool.k, pool.v, table)
    why = pd.last_outcome().reason
    assert "no shared prefix" not in why
    assert ("requests [0, 1] share 6 full pages (96 tokens; each keeps its last page), below "
            "the minimum span of 64 pages (1024 tokens" in why), why
    plan, reason = pd.cascade.detect_with_reason(table, min_shared_pages=7)
    assert plan is None and "below min_shared_pages = 7" in reason


# ---------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("head_dim, page_size", [(65, 16), (1024, 16), (64, 512)])
def test_reference_refuses_what_the_kernels_refuse(head_dim, page_size):
    table = pd.PageTable.build([0], [0, 1], [3], page_size=page_size)
    q = np.ones((1, 2, head_dim), np.float32)
    k = np.zeros((1, page_size, 1, head_dim), np.float32)
    msgs = []
    for be in (ReferenceBackend(), EmulatedCudaBackend()):
        for path in ("v2", "v1", "gather"):
            with pytest.raises(UnsupportedProblemError) as exc:
                pd.decode(q, k, k, table, path=path, backend=be)
            msgs.append(str(exc.value).replace(repr(be.name), "B"))
    assert len(set(msgs[0::3])) == 1 and len(set(msgs[1::3])) == 1, msgs  # same per path
    assert "must be one of (64, 96, 128, 256)" in msgs[0] or "in [1, 256]" in msgs[0]
    out = pd.decode(q, k, k, table, backend=ReferenceBackend(any_geometry=True))
    assert np.allclose(out, oracle_decode(q, k, k, table)[0])


def test_any_geometry_setting(monkeypatch):
    table = pd.PageTable.build([0], [0, 1], [3], page_size=4)
    q = np.ones((1, 2, 8), np.float32)
    k = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(UnsupportedProblemError, match=r"head_dim must be one of"):
        pd.decode(q, k, k, table)
    monkeypatch.setenv("PAGED_DECODE_REFERENCE_ANY_GEOMETRY", "1")
    assert pd.decode(q, k, k, table).shape == (1, 2, 8)


# ---------------------------------------------------------------------------- immutability
def test_table_arrays_cannot_be_made_writable(pr):
    t = pr.table
    fields = ("indices", "indptr", "last_page_len", "first_page_offset", "rope_positions",
              "visible_lens", "pages_per_request")
    for name in fields:
        arr = getattr(t, name)
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.setflags(write=True)
        with pytest.raises(ValueError):
            arr[...] = 0
    direct = pd.PageTable(np.array([0]), np.array([0, 1]), np.array([3]), np.array([0]),
                          np.array([3]), 4)
    with pytest.raises(ValueError, match="WRITEABLE"):
        direct.indices.setflags(write=True)
    plan = pd.plan_decode(t, 8, 2, 64, pages_per_chunk=1)
    with pytest.raises(ValueError, match="WRITEABLE"):
        plan.request_indices.setflags(write=True)
    sel = pd.make_selection(np.zeros((1, 1, 2), np.int64))
    with pytest.raises(ValueError, match="WRITEABLE"):
        sel.positions.setflags(write=True)


def test_table_copies_are_rebuilt_read_only(pr):
    for other in (copy.copy(pr.table), copy.deepcopy(pr.table),
                  pickle.loads(pickle.dumps(pr.table))):
        assert np.array_equal(other.indices, pr.table.indices)
        assert other.num_pages == pr.table.num_pages
        with pytest.raises(ValueError, match="WRITEABLE"):
            other.indices.setflags(write=True)


def test_fast_path_revalidates_arrays_reshaped_in_place(pr):
    plan = pd.plan_decode(pr.table, 8, 2, 64)
    out = np.empty((2, 8, 64), np.float32)
    q = pr.q.copy()
    pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, out=out)
    pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, out=out)
    assert pd.last_outcome().reason.endswith("prepared call")       # the replay
    q.shape = (2, 4, 128)
    with pytest.raises(InvalidArgumentError, match=r"decode: q must have shape"):
        pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, out=out)
    q.shape = (2, 8, 64)
    out.shape = (2, 4, 128)
    with pytest.raises(InvalidArgumentError, match=r"decode: out must have shape"):
        pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, out=out)
    out.shape = (2, 8, 64)
    got = pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, out=out)
    assert not pd.last_outcome().reason.endswith("prepared call")   # validated afresh
    assert np.allclose(got, oracle_decode(q, pr.k_pages, pr.v_pages, pr.table)[0], atol=1e-5)


def test_page_table_arguments(pr):
    with pytest.raises(PageTableError, match=r"PageTable.build: page_size must be an integer "
                                             r"in \[1, 2147483647\], got True"):
        pd.PageTable.build([0], [0, 1], [1], page_size=True)
    with pytest.raises(PageTableError, match=r"PageTable.build: indices must be a 1-D integer"):
        pd.PageTable.build([[0], [1, 2]], [0, 1], [1], page_size=4)
    with pytest.raises(PageTableError, match=r"PageTable.request_pages: r must be an integer "
                                             r"in \[0, 1\], got 2"):
        pr.table.request_pages(2)
    with pytest.raises(PageTableError, match=r"PageTable.subset: requests\[i\] must be"):
        pr.table.subset([0, -1])


# ---------------------------------------------------------------------------- command line
def _cli(*args):
    from click.testing import CliRunner

    from paged_decode.cli import main
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert "Traceback" not in res.output
    return res


@pytest.mark.parametrize("option, value", [("--page", 0), ("--batch", 0), ("--context", -5),
                                           ("--reps", 0), ("--warmup", -1)])
def test_bench_refuses_non_positive_sizes(option, value):
    res = _cli("bench", "--backend", "reference", option, value)
    assert res.exit_code == 2 and f"Invalid value for '{option}'" in res.output


def test_bench_plot_on_cpu_results_keeps_every_file(tmp_path):
    pytest.importorskip("matplotlib")
    files = {k: tmp_path / f"b.{k}" for k in ("json", "csv", "md", "png")}
    res = _cli("bench", "--backend", "reference", "--context", 64, "--batch", 1, "--page", 16,
               "--arms", "v2", "--reps", 3, "--warmup", 0, "--plot", files["png"],
               "--json", files["json"], "--csv", files["csv"], "--markdown", files["md"])
    assert res.exit_code == 0, res.output
    assert all(f.stat().st_size > 0 for f in files.values())
    res = _cli("plot", files["json"], tmp_path / "again.png")           # default metric
    assert res.exit_code == 0 and (tmp_path / "again.png").exists(), res.output
    res = _cli("plot", files["json"], tmp_path / "gpu.png", "--metric", "gpu")
    assert res.exit_code == 1 and "try --metric call" in res.output
    res = _cli("plot", files["csv"], tmp_path / "csv.png")
    assert res.exit_code == 1
    assert "not a 'paged-decode bench --json' result (not JSON" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_output_folder_must_exist(tmp_path):
    missing = tmp_path / "no" / "x.json"
    for cmd in (("check", "--json", missing), ("bench", "--csv", missing),
                ("plot", __file__, missing)):
        res = _cli(*cmd)
        assert res.exit_code == 2 and "does not exist" in res.output, res.output


def test_check_header_names_the_dtypes_that_ran():
    res = _cli("check", "--backend", "reference", "--dtype", "float16", "--dtype", "bfloat16",
               "--max-configs", 1)
    assert res.exit_code == 0, res.output
    assert ("dtypes float16 (bfloat16 not reached within the configs selected)"
            in res.output)
    assert "errors of float32 outputs" in res.output and "rel(f32 out)=" in res.output
    assert _cli("check", "--backend", "reference", "--max-configs", 0).exit_code == 2


def test_bench_table_columns_fit_long_arm_names():
    from paged_decode.bench.report import table
    from paged_decode.bench.runner import ArmResult, BenchResult
    from paged_decode.bench.suites import CascadeCase
    arms = {"flashinfer-tc": ArmResult("flashinfer-tc", "unavailable", float("nan"), False),
            "v2": ArmResult("v2", "v2", 0.0, True, call={"median_us": 5.0}),
            "flashinfer": ArmResult("flashinfer", "unavailable", float("nan"), False)}
    for only in (["flashinfer"], list(arms)):
        lines = table([BenchResult(CascadeCase(1, 16), 1, 1,
                                   {a: arms[a] for a in only})]).splitlines()
        assert len(lines[0]) == len(lines[1]) == len(lines[2]), lines[:3]
        assert "flashinfer/v2" in lines[0] or only == ["flashinfer"]
    res = _cli("bench", "--backend", "reference", "--context", 64, "--batch", 1,
               "--arms", "flashinfer")
    assert res.exit_code == 1 and "no arm could run here" in res.output


# ---------------------------------------------------------------------------- direct construction
def test_a_table_built_directly_is_validated_like_build():
    from paged_decode import PageTable, PageTableError
    ok = dict(indices=[0], indptr=[0, 1], last_page_len=[1], first_page_offset=[0],
              rope_positions=[1], page_size=16)
    assert PageTable(**ok).visible_lens.tolist() == [1]
    for change, pattern in [
        (dict(indptr=[0, 5]), r"PageTable: len\(indices\) must equal indptr\[-1\] = 5, got 1"),
        (dict(indptr=[]), r"PageTable: indptr must have B\+1 >= 1 entries, got 0"),
        (dict(indices=[[0]]), r"PageTable: indices must be 1-D, got shape \[1, 1\]"),
        (dict(indices=["a"]), r"PageTable: indices must hold integers"),
        (dict(page_size="x"), r"PageTable: page_size must be an integer in \[1, 2147483647\], "
                             r"got 'x'"),
        (dict(last_page_len=[17]), r"PageTable: request 0: last_page_len must be in \[1, "
                                   r"page_size = 16\], got 17"),
        (dict(indices=[-1]), r"PageTable: request 0: indices\[0\] = -1 is not a page id"),
    ]:
        with pytest.raises(PageTableError, match=pattern):
            PageTable(**{**ok, **change})


def test_a_plan_built_by_hand_must_follow_its_chunk_counts():
    import dataclasses

    from paged_decode.problems import make_table
    table, _ = make_table([40, 70], 16)
    plan = pd.plan_decode(table, 8, 2, 64, pages_per_chunk=2)
    with pytest.raises(InvalidArgumentError, match=r"DecodePlan: request_indices does not "
                                                   r"follow from chunks_per_request"):
        dataclasses.replace(plan, request_indices=np.array([0, 0, 5, 1, 1, 1, 1]))
    with pytest.raises(InvalidArgumentError, match=r"DecodePlan: heads_per_cta x q_groups"):
        dataclasses.replace(plan, q_groups=3)
    with pytest.raises(InvalidArgumentError, match=r"DecodePlan: batch_size must be a "
                                                   r"positive integer, got True"):
        dataclasses.replace(plan, batch_size=True)


def test_a_pool_too_large_to_allocate_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match=r"PagePool: k and v pages of shape "
                       r"\[2147483647, 16, 8, 128\] \(float16\) need .* GiB, which "
                       r"backend 'reference' could not allocate"):
        pd.PagePool(2**31 - 1, 16, 8, 128)      # the most pages int32 ids can name


# ------------------------------------------------- session 38's fuzz pass over the API
def _q(pool):
    return np.ones((1, 2 * pool.num_kv_heads, pool.head_dim), np.float32)


@pytest.mark.parametrize("call, pattern", [
    (lambda p, s, t, q: pd.decode(q, p.k, p.v, t, sm_scale=2**1030),
     r"decode: sm_scale must be finite"),
    (lambda p, s, t, q: pd.decode(q, p.k, p.v, t, logits_soft_cap=2**1030),
     r"decode: logits_soft_cap must be None or a finite number"),
    (lambda p, s, t, q: pd.plan_decode(t, 4, 2, 64, ragged_split=2**1030),
     r"plan_decode: ragged_split must be a finite number >= 0"),
    (lambda p, s, t, q: pd.DeviceInfo("x", "d", 8, 2, ragged_split=2**1030),
     r"DeviceInfo: ragged_split must be a finite number >= 0"),
    (lambda p, s, t, q: pd.PagePool(8, 4, 2, 64, "float8_e4m3fn", k_scale=2**1030, v_scale=1.0),
     r"PagePool: k_scale must be a positive finite float32 number"),
    (lambda p, s, t, q: pd.DecodeStep(p, [s], num_qo_heads=4, sm_scale=2**1030),
     r"DecodeStep: sm_scale must be finite"),
])
def test_an_int_beyond_a_double_is_our_error(call, pattern):
    """float(2**1030) raises OverflowError: every number check turns it into ours."""
    pool, s = _pool()
    with pytest.raises(InvalidArgumentError, match=pattern):
        call(pool, s, pool.page_table([s]), _q(pool))


def test_sm_scale_must_stay_a_float32_number_in_log2_units():
    """The kernels scale scores by sm_scale * log2 e in float32: past float32's range that
    is inf and every output NaN (even for q = 0), so it is refused, with an fp8 pool's
    K scale folded in; the largest allowed scale still decodes."""
    pool, s = _pool()
    t, q = pool.page_table([s]), np.zeros((1, 4, 64), np.float32)
    for scale in (1e39, -1e39):
        with pytest.raises(InvalidArgumentError, match=r"decode: sm_scale must be at most "
                                                       r"2\.359e\+38 in magnitude"):
            pd.decode(q, pool.k, pool.v, t, sm_scale=scale)
        with pytest.raises(InvalidArgumentError, match="DecodeStep: sm_scale must be at most"):
            pd.DecodeStep(pool, [s], num_qo_heads=4, sm_scale=scale)
    out = pd.decode(q, pool.k, pool.v, t, sm_scale=2.3e38)
    assert np.isfinite(out).all()
    f8 = pd.PagePool(8, 16, 2, 64, "float8_e4m3fn", k_scale=1e10, v_scale=1.0)
    s8 = f8.new_sequence()
    f8.append(s8, np.ones((5, 2, 64), np.float32), np.ones((5, 2, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match="sm_scale times k_scale must be at most"):
        pd.decode(q, f8.k, f8.v, f8.page_table([s8]), sm_scale=1e30, **f8.decode_args())
    with pytest.raises(InvalidArgumentError, match="sm_scale must be at most"):
        cache = np.ones((1, 2, 8, 64), np.float32)         # [B, Hkv, capacity, D]
        pd.sparse_decode(np.zeros((1, 4, 64), np.float32), cache, cache,
                         pd.make_selection(np.zeros((1, 2, 1), np.int64)), live_lens=[5],
                         sm_scale=1e39)


def _begun_step():
    """A one-layer DecodeStep of one sequence, begun, and one token's K/V [1, 2, 64]."""
    pool = pd.PagePool(8, 4, 2, 64, "float32", num_layers=1)
    a = pool.new_sequence()
    kv = np.ones((1, 5, 2, 64), np.float32)
    pool.append(a, kv, kv)
    st = pd.DecodeStep(pool, [a], num_qo_heads=4)
    st.begin()
    return st, kv[0, :1]


@pytest.mark.parametrize("body", [None, 5, lambda: 0, lambda st, extra: 0])
def test_capture_checks_its_body(body):
    """A body that is not a callable of one argument (the step) is our error before any
    recording; the step works on after it."""
    st, kv = _begun_step()
    with pytest.raises(InvalidArgumentError, match="DecodeStep.capture: body must be a "
                                                   "callable taking the step"):
        st.capture(body)
    st.append(0, kv, kv)
    assert np.isfinite(st.decode(0, np.ones((1, 4, 64), np.float32))).all()


def test_decode_step_names_an_output_that_is_not_an_array():
    st, kv = _begun_step()
    st.append(0, kv, kv)
    q = np.ones((1, 4, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match="DecodeStep.decode: out must be an array"):
        st.decode(0, q, out="o")
    with pytest.raises(InvalidArgumentError, match="DecodeStep.decode: lse must be an array"):
        st.decode(0, q, out=np.empty_like(q), lse="l", return_lse=True)
    with pytest.raises(InvalidDtypeError, match="DecodeStep.decode: q must have dtype"):
        st.decode(0, q.tolist(), out=np.empty_like(q))
    out = np.empty_like(q)
    st.decode(0, q, out=out)                     # the step still works after the refusals
    assert np.isfinite(out).all()


def test_decode_args_checks_the_layer_of_every_pool():
    one, _ = _pool()
    assert one.decode_args() == one.decode_args(0) == {}
    for bad in ("nonsense", 1, -5, True, 1.0):
        with pytest.raises(InvalidArgumentError, match=r"PagePool.decode_args: layer must be "
                                                       r"in \[0, 1\) or None"):
            one.decode_args(bad)
    two = pd.PagePool(8, 4, 2, 64, "float32", num_layers=2)
    assert two.decode_args(1) == {}
    for bad in (None, 2, 2**63):
        with pytest.raises(InvalidArgumentError, match=r"layer must be in \[0, 2\), got"):
            two.decode_args(bad)


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_step_table_send_checks_the_descriptor(backend):
    pool = pd.PagePool(8, 4, 2, 64, "float32", backend=backend)
    s = pool.new_sequence()
    pool.append(s, np.ones((5, 2, 64), np.float32), np.ones((5, 2, 64), np.float32))
    st = pool.step_table([s], capacity=3)
    for bad in ("x", np.zeros((2, 2), np.float32), np.zeros((5, 3), np.float32),
                np.zeros((5, 4), np.int32), np.zeros((3, 5), np.int32).T):
        with pytest.raises(InvalidArgumentError, match=r"StepTable.send: desc must be None or "
                                                       r"a C-contiguous int32 numpy array of "
                                                       r"shape \[5, 3\]"):
            st.send(bad)
    st.send(np.zeros((5, 3), np.int32))
    st.send()


def test_a_table_whose_host_rows_do_not_fit_is_our_error(monkeypatch):
    """A MemoryError filling the host rows (past the device allocation) is reported as the
    allocation's is: the sizes asked for, not numpy's _ArrayMemoryError."""
    from paged_decode.step_table import StepTable
    pool, s = _pool()

    def boom(*args, **kwargs):
        raise MemoryError("host rows")
    monkeypatch.setattr(StepTable, "_set_rows", boom)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.step_table: a table of 4 rows "
                                                   r"and 64 pages needs .* could not allocate "
                                                   r"\(MemoryError\)"):
        pool.step_table([s], capacity=4)


def test_a_bool_among_listed_integers_is_refused():
    """numpy makes [True, 1] an int64 array; such lists are refused like all-bool ones."""
    pool = pd.PagePool(8, 4, 2, 64, "float32")
    a, b = pool.new_sequence(), pool.new_sequence()
    with pytest.raises(InvalidArgumentError, match=r"reserve_batch: counts\[0\] must be an "
                                                   r"integer, got True"):
        pool.reserve_batch([a, b], counts=[True, 1])
    with pytest.raises(InvalidArgumentError, match=r"make_selection: counts\[1\]\[0\] must be "
                                                   r"an integer, got True"):
        pd.make_selection([[[0, 1]], [[0, 1]]], counts=[[1], [True]])
    with pytest.raises(InvalidArgumentError, match=r"positions\[0\]\[0\]\[1\] must be an "
                                                   r"integer, got True"):
        pd.make_selection([[[0, True]], [[0, 1]]])
    with pytest.raises(PageTableError, match=r"PageTable.build: indptr\[1\] must be an "
                                             r"integer, got True"):
        pd.PageTable.build([0, 1], [0, True, 2], [3, 3], page_size=4)
    assert pool.reserve_batch([a, b], counts=[1, 1]) is not None


@pytest.mark.parametrize("name, call", [
    ("PAGED_DECODE_REFERENCE_ANY_GEOMETRY",
     lambda pr: pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="reference")),
    ("PAGED_DECODE_POISON",
     lambda pr: pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="reference")),
    ("PAGED_DECODE_EMULATOR_RACES",
     lambda pr: EmulatedCudaBackend()),
    ("PAGED_DECODE_WAVE_PLAN",
     lambda pr: pd.plan_decode(pr.table, 8, 2, 64, path="v2tc")),
])
@pytest.mark.parametrize("value", ["false", "no", "yes", "2"])
def test_a_switch_takes_only_0_or_1(monkeypatch, pr, name, call, value):
    """A 0/1 switch once read every value but "0" as on ("false" turned it on)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgumentError, match=f"{name} must be 0 or 1, got '{value}'"):
        call(pr)
    for ok in ("0", "1", ""):
        monkeypatch.setenv(name, ok)
        call(pr)


@pytest.mark.parametrize("value", ["abc", "nan", "1e400", "-1", "0"])
def test_emulator_threads_must_be_a_positive_integer(monkeypatch, value):
    from paged_decode.emulator.launch import default_threads
    monkeypatch.setenv("PAGED_DECODE_EMULATOR_THREADS", value)
    with pytest.raises(InvalidArgumentError, match="PAGED_DECODE_EMULATOR_THREADS must be a "
                                                   "positive integer"):
        default_threads()
    monkeypatch.setenv("PAGED_DECODE_EMULATOR_THREADS", "3")
    assert default_threads() == 3


def test_v2_row_loads_past_a_blocks_shared_memory_names_the_variable(monkeypatch):
    """64 loads per lane once reached the kernel as a 2 MB ring (a KernelFault naming no
    setting); the largest that fits still decodes."""
    pool = pd.PagePool(8, 16, 1, 64, "float16", backend="emulated-cuda")
    s = pool.new_sequence()
    pool.append(s, np.ones((40, 1, 64), np.float16), np.ones((40, 1, 64), np.float16))
    q = np.ones((1, 2, 64), np.float16)
    monkeypatch.setenv("PAGED_DECODE_V2_ROW_LOADS", "64")
    with pytest.raises(InvalidArgumentError, match=r"PAGED_DECODE_V2_ROW_LOADS = 64: a "
                                                   r"two-stage ring .* at most 7 here"):
        pd.decode(q, pool.k, pool.v, pool.page_table([s]), path="v2", backend="emulated-cuda")
    monkeypatch.setenv("PAGED_DECODE_V2_ROW_LOADS", "7")
    out = pd.decode(q, pool.k, pool.v, pool.page_table([s]), path="v2", backend="emulated-cuda")
    assert np.isfinite(out).all()


def test_a_bool_in_qo_indptr_is_refused(pr):
    q = np.ones((3, 8, 64), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"qo_indptr\[1\] must be an integer, got "
                                                   r"True"):
        pd.decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=[0, True, 3])


def test_a_run_past_any_pool_names_max_new_tokens():
    from paged_decode.integrations.prompts import pool_pages, prompt_batch
    batch = prompt_batch("generate", [[1, 2, 3]], 2**40, vocab_size=64, max_positions=None)
    with pytest.raises(InvalidArgumentError, match=r"generate: 1 prompts of up to 3 tokens "
                                                   r"plus max_new_tokens=1099511627776 need "):
        pool_pages("generate", batch, 16, None)


@pytest.mark.parametrize("value, expected", [
    (1, 1.0), (0.5, 0.5), (np.int16(3), 3.0), (np.float32(0.25), 0.25),
    (True, None), (np.bool_(False), None), ("0.5", None), (float("nan"), None),
    (float("inf"), None), (2**1030, None), (None, None), (1 + 0j, None),
])
def test_every_number_argument_takes_the_same_reals(value, expected):
    # one rule (errors.real_float) behind check_number, fp8 scales, the soft cap and the
    # ragged split: a bool, a string, a complex or a non-finite value is not a number
    from paged_decode.device import check_ragged_split
    from paged_decode.errors import check_number, real_float
    from paged_decode.fp8 import check_scale
    from paged_decode.variants import check_soft_cap
    assert real_float(value) == expected
    for check in (lambda v: check_number("f", "x", v), lambda v: check_scale("f", "x", v),
                  lambda v: check_soft_cap("f", v), lambda v: check_ragged_split("f", v)):
        if expected is None and value is not None:
            with pytest.raises(InvalidArgumentError, match=r"^f: "):
                check(value)
        elif expected is not None:
            assert check(value) == pytest.approx(expected)
