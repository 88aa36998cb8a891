"""decode(): every path against the float64 oracle, buffers, plans, outcomes, controls."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from helpers import IgnoresIndices, assert_matches_oracle, out_tol, relabel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_decode as pd
from paged_decode import (
    InvalidArgumentError,
    InvalidDtypeError,
    PagePool,
    PageTable,
    PlanMismatchError,
    decode,
    plan_decode,
)
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.dtypes import numpy_dtype
from paged_decode.problems import Problem, ProblemSpec, make_problem
from paged_decode.reference import max_rel_error, oracle_decode

SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


# ---------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    tag: str                              # what is special: "ctx1000", "odd", ...
    lengths: tuple[int, ...] | int        # visible lengths, or a context to jitter around
    page_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    q_dtype: str = "float16"
    kv_dtype: str = "float16"
    out_dtype: str | None = None
    offsets: tuple[int, ...] | None = None   # first_page_offset per request (mid-page)
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.lengths) if isinstance(self.lengths, tuple) else 4

    @property
    def num_qo_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def out(self) -> str:
        return self.out_dtype or self.q_dtype

    @property
    def id(self) -> str:
        dt = SHORT[self.q_dtype] if self.q_dtype == self.kv_dtype else \
            f"q{SHORT[self.q_dtype]}-kv{SHORT[self.kv_dtype]}"
        if self.out_dtype:
            dt += f"-out{SHORT[self.out_dtype]}"
        return (f"B{self.batch}-{self.tag}-ps{self.page_size}-g{self.group}"
                f"-d{self.head_dim}-{dt}")

    def problem(self) -> Problem:
        ctx = self.lengths if isinstance(self.lengths, int) else max(self.lengths)
        spec = ProblemSpec(self.batch, ctx, self.num_qo_heads, self.num_kv_heads,
                           self.head_dim, self.page_size, self.q_dtype, self.kv_dtype,
                           seed=self.seed)
        if isinstance(self.lengths, int):   # jittered: partial last pages, odd ones mid-page
            return make_problem(spec)
        offsets = list(self.offsets) if self.offsets else None
        return make_problem(spec, lengths=list(self.lengths), offsets=offsets)


CASES = [
    Case("ctx1000", 1000, 16, 8, 4, 128),
    Case("odd", (1, 17, 333), 16, 2, 1, 64, seed=1),
    Case("fullpage", (64, 32, 16), 16, 2, 4, 128, "bfloat16", "bfloat16", seed=2),
    Case("singlepage", (1, 5, 32), 32, 1, 8, 64, "float32", "float32", seed=3),
    Case("mixedempty", (0, 50, 0, 17, 0), 16, 2, 4, 128, seed=4),
    Case("allempty", (0, 0, 0), 16, 2, 4, 64, seed=5),
    Case("midpage", (40, 1, 15, 100), 16, 2, 4, 128, offsets=(3, 15, 1, 8), seed=6),
    Case("gqa1", (70, 129), 16, 4, 1, 96, seed=7),
    Case("gqa7", (77, 130), 16, 2, 7, 64, seed=8),
    Case("gqa8", (50, 200), 16, 1, 8, 256, seed=9),
    Case("gqa16", (90, 33), 16, 1, 16, 64, "bfloat16", "bfloat16", seed=10),
    Case("ps1", (1, 9, 40), 1, 2, 4, 64, seed=11),
    Case("ps64", (64, 100, 129), 64, 2, 4, 128, offsets=(0, 10, 63), seed=12),
    Case("ps32", (300, 45), 32, 2, 4, 64, "float32", "float32", offsets=(5, 0), seed=13),
    Case("ctx300", (300, 45), 16, 2, 8, 128, "bfloat16", "bfloat16", seed=14),
    Case("mixed", (120, 31), 16, 2, 4, 64, "float32", "bfloat16", seed=15),
    Case("mixed", (120, 31), 16, 2, 4, 64, "bfloat16", "float32", seed=16),
    Case("mixed", (120, 31), 16, 2, 4, 64, "float16", "float32", seed=17),
    Case("outf32", (200, 7), 16, 2, 4, 128, out_dtype="float32", seed=18),
    Case("outf32", (200, 7), 16, 2, 4, 128, "bfloat16", "bfloat16", "float32", seed=19),
]
assert len({c.id for c in CASES}) == len(CASES)

#: path name -> (decode path, forced pages_per_chunk or None)
PATHS = {
    "v2": ("v2", None),
    "v2-merge": ("v2", 1),
    "v1": ("v1", None),
    "gather": ("gather", None),
    "auto": ("auto", None),
}


def run_path(pr: Problem, path_name: str, **kw):
    """Decode ``pr`` along ``path_name``; returns ``(out, lse, plan)``."""
    path, ppc = PATHS[path_name]
    spec = pr.spec
    plan = plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                       pages_per_chunk=ppc)
    out, lse = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                      return_lse=True, **kw)
    return out, lse, plan


def expected_ran(path_name: str, plan) -> str:
    path = PATHS[path_name][0]
    if path in ("v2", "auto"):
        return "v2+merge" if plan.needs_merge else "v2"
    return path


def assert_empty_rows_exact(out, lse, table: PageTable) -> None:
    for r in np.nonzero(table.visible_lens == 0)[0]:
        assert (np.asarray(out[r], np.float64) == 0).all(), f"request {r} not zero"
        assert np.isneginf(lse[r]).all(), f"request {r} lse not -inf"


# ---------------------------------------------------------------------------- curated
@pytest.mark.parametrize("path_name", list(PATHS))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_decode_matches_oracle(case: Case, path_name: str):
    pr = case.problem()
    out, lse, plan = run_path(pr, path_name, out_dtype=case.out_dtype)
    assert out.shape == (case.batch, case.num_qo_heads, case.head_dim)
    assert str(out.dtype) == case.out and lse.dtype == np.float32
    ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, lse, ref_out, ref_lse, case.out, f"{case.id}/{path_name}")
    assert_empty_rows_exact(out, lse, pr.table)
    assert pd.last_outcome().path == expected_ran(path_name, plan)


def test_forced_split_really_merges():
    pr = CASES[0].problem()
    _, _, plan = run_path(pr, "v2-merge")
    assert plan.num_chunks == pr.table.total_pages and plan.needs_merge
    assert pd.last_outcome().path == "v2+merge"
    assert pd.last_outcome().num_chunks == pr.table.total_pages


@pytest.mark.parametrize("path_name", list(PATHS))
def test_empty_requests_do_not_affect_neighbours(path_name):
    pr = Case("mixedempty", (0, 50, 0, 17, 0, 1), 16, 2, 4, 64, seed=20).problem()
    keep = [r for r in range(pr.table.batch_size) if pr.table.visible_lens[r] > 0]
    path = PATHS[path_name][0]
    full_plan = plan_decode(pr.table, 8, 2, 64, pages_per_chunk=2)
    sub = pr.table.subset(keep)
    sub_plan = plan_decode(sub, 8, 2, 64, pages_per_chunk=2)
    out = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, full_plan, path=path)
    alone = decode(np.ascontiguousarray(pr.q[keep]), pr.k_pages, pr.v_pages, sub, sub_plan,
                   path=path)
    np.testing.assert_array_equal(out[keep], alone)    # bit for bit: same chunks, same math
    assert (out[[0, 2, 4]] == 0).all()


def pool_problem(dtype: str = "float16") -> tuple[np.ndarray, PagePool, PageTable]:
    """Shared prefixes, copy-on-write, a trimmed window and a fully trimmed request."""
    rng = np.random.default_rng(21)
    hkv, d = 2, 64
    pool = PagePool(64, 16, hkv, d, dtype)

    def put(seq, n):
        pool.append(seq, rng.standard_normal((n, hkv, d), np.float32),
                    rng.standard_normal((n, hkv, d), np.float32))

    a = pool.new_sequence()
    put(a, 100)
    b = pool.fork(a)
    put(b, 7)                      # copy-on-write of the shared partial page
    c = pool.fork(a)
    pool.trim_front(c, 60)
    put(c, 5)
    e = pool.new_sequence()
    put(e, 20)
    pool.trim_front(e, 20)         # holds a page, sees nothing
    table = pool.page_table([a, b, c, e, a])
    q = (rng.standard_normal((5, 8, d)) * 1.5).astype(numpy_dtype(dtype))
    return q, pool, table


@pytest.mark.parametrize("path_name", list(PATHS))
def test_decode_through_pool_with_shared_and_trimmed_sequences(path_name):
    q, pool, table = pool_problem()
    assert table.visible_lens.tolist() == [100, 107, 45, 0, 100]
    plan = plan_decode(table, 8, 2, 64, pages_per_chunk=PATHS[path_name][1])
    out, lse = decode(q, pool.k, pool.v, table, plan, path=PATHS[path_name][0],
                      return_lse=True)
    ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    assert_matches_oracle(out, lse, ref_out, ref_lse, "float16", path_name)
    assert_empty_rows_exact(out, lse, table)


# ---------------------------------------------------------------------------- fuzz
@st.composite
def geometries(draw):
    b = draw(st.integers(1, 4))
    p = draw(st.sampled_from([1, 2, 4, 8, 16]))
    lengths = draw(st.lists(st.integers(0, 70), min_size=b, max_size=b))
    offsets = [draw(st.integers(0, p - 1)) if n else 0 for n in lengths]
    return dict(
        lengths=lengths, offsets=offsets, page_size=p,
        hkv=draw(st.integers(1, 3)), group=draw(st.integers(1, 9)),
        head_dim=draw(st.sampled_from([8, 16, 32, 64])),
        q_dtype=draw(st.sampled_from(list(SHORT))), kv_dtype=draw(st.sampled_from(list(SHORT))),
        out_dtype=draw(st.sampled_from([None, "float32"])),
        path=draw(st.sampled_from(list(PATHS))),
        ppc=draw(st.one_of(st.none(), st.integers(1, 3))),
        sm_scale=draw(st.one_of(st.none(), st.floats(0.01, 2.0))),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.usefixtures("any_geometry")   # head dims 8-32 on the reference backend
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(g=geometries())
def test_fuzz_random_geometries(g):
    hq = g["hkv"] * g["group"]
    spec = ProblemSpec(len(g["lengths"]), max(g["lengths"]), hq, g["hkv"], g["head_dim"],
                       g["page_size"], g["q_dtype"], g["kv_dtype"], seed=g["seed"])
    pr = make_problem(spec, lengths=g["lengths"], offsets=g["offsets"])
    path, forced = PATHS[g["path"]]
    plan = plan_decode(pr.table, hq, g["hkv"], g["head_dim"], pages_per_chunk=forced or g["ppc"])
    out, lse = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                      sm_scale=g["sm_scale"], out_dtype=g["out_dtype"], return_lse=True)
    ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, g["sm_scale"])
    out_dtype = g["out_dtype"] or g["q_dtype"]
    assert_matches_oracle(out, lse, ref_out, ref_lse, out_dtype, str(g))
    assert_empty_rows_exact(out, lse, pr.table)


# ---------------------------------------------------------------------------- buffers
SMALL = Case("small", (37, 80, 0), 16, 2, 4, 64, offsets=(5, 0, 0), seed=22)


@pytest.mark.parametrize("path_name", list(PATHS))
@pytest.mark.parametrize("out_dtype", [None, "float32"])
def test_out_and_lse_written_in_place(path_name, out_dtype):
    pr = SMALL.problem()
    dt = out_dtype or "float16"
    out = np.full(pr.q.shape, np.nan, numpy_dtype(dt))
    lse = np.full(pr.q.shape[:2], np.nan, np.float32)
    path, ppc = PATHS[path_name]
    plan = plan_decode(pr.table, 8, 2, 64, pages_per_chunk=ppc)
    got_out, got_lse = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                              out=out, lse=lse, return_lse=True, out_dtype=out_dtype)
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, lse, ref_out, ref_lse, dt, path_name)


@pytest.mark.parametrize("path_name", list(PATHS))
def test_lse_buffer_without_return_lse_and_plain_return(path_name):
    pr = SMALL.problem()
    path, ppc = PATHS[path_name]
    plan = plan_decode(pr.table, 8, 2, 64, pages_per_chunk=ppc)
    lse = np.full(pr.q.shape[:2], np.nan, np.float32)
    res = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path, lse=lse)
    assert isinstance(res, np.ndarray) and res.shape == pr.q.shape
    ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(res, lse, ref_out, ref_lse, "float16", path_name)
    plain = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path)
    np.testing.assert_array_equal(plain, res)


@pytest.mark.parametrize("path_name", list(PATHS))
@pytest.mark.parametrize("scale", [0.02, 0.5, 1.7, -0.3])
def test_sm_scale(path_name, scale):
    pr = SMALL.problem()
    out, lse, _ = run_path(pr, path_name, sm_scale=scale)
    ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, scale)
    assert_matches_oracle(out, lse, ref_out, ref_lse, "float16", f"scale {scale}")
    default_out, _, _ = run_path(pr, path_name)
    explicit_out, _, _ = run_path(pr, path_name, sm_scale=1 / math.sqrt(64))
    np.testing.assert_array_equal(default_out, explicit_out)


def test_poison_is_active(backend):
    """The finiteness checks mean something only if fresh buffers start as NaN."""
    assert np.isnan(backend.empty((3, 4), "float32")).all()
    assert np.isnan(backend.empty((3, 4), "float16").astype(np.float32)).all()


# ---------------------------------------------------------------------------- plans
@pytest.mark.usefixtures("any_geometry")   # head_dim 32 on the reference backend
def test_plan_reused_across_a_grown_table():
    rng = np.random.default_rng(23)
    hkv, d = 2, 32
    pool = PagePool(32, 16, hkv, d, "float32")
    seqs = [pool.new_sequence(), pool.new_sequence()]

    def grow(seq, n):
        pool.append(seq, rng.standard_normal((n, hkv, d), np.float32),
                    rng.standard_normal((n, hkv, d), np.float32))

    grow(seqs[0], 40)                                  # 3 pages -> 2 chunks of 2
    grow(seqs[1], 70)                                  # 5 pages -> 3 chunks
    q = rng.standard_normal((2, 4, d)).astype(np.float32)
    plan = plan_decode(pool.page_table(seqs), 4, hkv, d, pages_per_chunk=2)
    assert plan.chunks_per_request.tolist() == [2, 3]
    grow(seqs[0], 24)                                  # 64 tokens: 4 pages, still 2 chunks
    grow(seqs[1], 10)                                  # 80 tokens: 5 pages
    table = pool.page_table(seqs)
    assert plan.matches(table)
    for path in ("v2", "auto"):
        out, lse = decode(q, pool.k, pool.v, table, plan, path=path, return_lse=True)
        ref_out, ref_lse = oracle_decode(q, pool.k, pool.v, table)
        assert_matches_oracle(out, lse, ref_out, ref_lse, "float32", path)
    grow(seqs[0], 1)                                   # 65 tokens: 5 pages, 3 chunks
    with pytest.raises(PlanMismatchError, match=r"decode: plan does not match the table: "
                                                r"request 0 needs 3 chunks of 2 pages, "
                                                r"plan has 2"):
        decode(q, pool.k, pool.v, pool.page_table(seqs), plan)


def test_plan_for_other_geometry_is_rejected():
    pr = SMALL.problem()
    plan = plan_decode(pr.table, 8, 1, 64)
    with pytest.raises(PlanMismatchError, match=r"plan was made for \(Hq, Hkv, D\) = "
                                                r"\(8, 1, 64\), got \(8, 2, 64\)"):
        decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan)


# ---------------------------------------------------------------------------- outcomes
def test_outcome_recording():
    pr = CASES[0].problem()
    pd.reset_counters()
    assert pd.last_outcome() is None
    _, _, plan = run_path(pr, "v2-merge")
    o = pd.last_outcome()
    assert (o.path, o.backend, o.batch_size) == ("v2+merge", "reference", 4)
    assert o.visible_tokens == pr.table.total_visible and o.num_chunks == plan.num_chunks
    run_path(pr, "v1")
    assert pd.last_outcome().path == "v1" and pd.last_outcome().num_chunks == 4
    run_path(pr, "gather")
    assert pd.last_outcome().path == "gather"
    big = plan_decode(pr.table, 32, 8, 128, pages_per_chunk=10**6)
    decode(pr.q, pr.k_pages, pr.v_pages, pr.table, big, path="v2")
    assert pd.last_outcome().path == "v2" and pd.last_outcome().num_chunks == 4
    _, _, auto_plan = run_path(pr, "auto")
    assert "auto" in pd.last_outcome().reason
    expected = {"reference:v2+merge": 1, "reference:v1": 1, "reference:gather": 1,
                "reference:v2": 1}
    expected[f"reference:{expected_ran('auto', auto_plan)}"] += 1
    assert pd.counters() == expected


# ---------------------------------------------------------------------------- controls
class SkipsLastChunk(ReferenceBackend):
    """A broken partial that leaves the last chunk's outputs unwritten."""

    name = "skips-last-chunk"

    def partial(self, q, k_pages, v_pages, table, plan, sm_scale, v_out, lse_out):
        full_v, full_lse = np.zeros_like(v_out), np.zeros_like(lse_out)
        super().partial(q, k_pages, v_pages, table, plan, sm_scale, full_v, full_lse)
        v_out[:-1], lse_out[:-1] = full_v[:-1], full_lse[:-1]


@pytest.mark.parametrize("ppc", [None, 1])
def test_negative_control_decode_ignoring_indices_fails(ppc):
    pr = CASES[0].problem()                  # physical pages are shuffled with slack
    ref_out, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = plan_decode(pr.table, 32, 8, 128, pages_per_chunk=ppc)
    bad = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2",
                 backend=IgnoresIndices())
    assert max_rel_error(bad, ref_out) > 50 * out_tol("float16")
    # the same backend is right when the pages really sit in table order (a compacted
    # pool read through an arange table): only `indices` differs
    straight = relabel(pr.table)
    k2, v2 = pr.k_pages[pr.table.indices], pr.v_pages[pr.table.indices]
    ok = decode(pr.q, k2, v2, straight, plan, path="v2", backend=IgnoresIndices())
    assert max_rel_error(ok, ref_out) <= out_tol("float16")


def test_negative_control_unwritten_chunk_is_caught():
    pr = CASES[0].problem()
    plan = plan_decode(pr.table, 32, 8, 128, pages_per_chunk=1)
    out = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, backend=SkipsLastChunk())
    ref_out, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert np.isnan(out[-1].astype(np.float32)).any()
    assert max_rel_error(out, ref_out) == math.inf


# ---------------------------------------------------------------------------- input errors
@pytest.fixture
def errs():
    """B=4, Hq=32, Hkv=8, D=128, page size 16: the geometry of the README's error line."""
    return Case("errs", (20, 3, 33, 16), 16, 8, 4, 128, seed=24).problem()


def call(pr: Problem, **over):
    args = dict(q=pr.q, k_pages=pr.k_pages, v_pages=pr.v_pages, table=pr.table)
    args.update(over)
    return decode(args.pop("q"), args.pop("k_pages"), args.pop("v_pages"), args.pop("table"),
                  **args)


def test_error_q_shape(errs):
    with pytest.raises(InvalidArgumentError, match=r"^decode: q must have shape \[B, Hq, D\] = "
                                                   r"\[4, 32, 128\], got \[4, 32, 64\]$"):
        call(errs, q=np.ascontiguousarray(errs.q[:, :, :64]))
    with pytest.raises(InvalidArgumentError, match=r"decode: q must have shape \[B, Hq, D\] = "
                                                   r"\[4, 32, 128\], got \[3, 32, 128\]"):
        call(errs, q=errs.q[:3])
    with pytest.raises(InvalidArgumentError, match=r"decode: q must be 3-D \[B, Hq, D\]"):
        call(errs, q=errs.q[0])


def test_error_kv_shapes(errs):
    n = errs.k_pages.shape[0]
    with pytest.raises(InvalidArgumentError,
                       match=rf"decode: v_pages must have shape \[num_pages, P, Hkv, D\] = "
                             rf"\[{n}, 16, 8, 128\], got \[{n}, 16, 4, 128\]"):
        call(errs, v_pages=np.ascontiguousarray(errs.v_pages[:, :, :4]))
    with pytest.raises(InvalidArgumentError, match=r"decode: k_pages must be 4-D"):
        call(errs, k_pages=errs.k_pages[0])


def test_error_page_size_mismatch(errs):
    k = errs.k_pages.reshape(-1, 8, 8, 128)
    v = errs.v_pages.reshape(-1, 8, 8, 128)
    with pytest.raises(InvalidArgumentError, match=r"decode: k_pages page size \(axis 1\) must "
                                                   r"equal table.page_size = 16, got 8"):
        call(errs, k_pages=k, v_pages=v)


def test_error_heads_not_a_multiple(errs):
    q = np.ascontiguousarray(errs.q[:, :30])
    with pytest.raises(InvalidArgumentError, match=r"decode: q's heads must be a multiple of "
                                                   r"k_pages' KV heads, got Hq = 30 and Hkv = 8"):
        call(errs, q=q)


def test_error_table_beyond_pool(errs):
    top = errs.table.max_page_id
    with pytest.raises(InvalidArgumentError, match=rf"decode: table references page {top}, "
                                                   rf"but k_pages has only {top} pages"):
        call(errs, k_pages=errs.k_pages[:top], v_pages=errs.v_pages[:top])


@pytest.mark.parametrize("arg", ["q", "k_pages"])
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int8])
def test_error_unsupported_dtype(errs, arg, dtype):
    over = {"q": {"q": errs.q.astype(dtype)},
            "k_pages": {"k_pages": np.nan_to_num(errs.k_pages).astype(dtype),
                        "v_pages": np.nan_to_num(errs.v_pages).astype(dtype)}}[arg]
    with pytest.raises(InvalidDtypeError, match=rf"decode: {arg} must have dtype in"):
        call(errs, **over)


def test_error_kv_dtype_mismatch(errs):
    with pytest.raises(InvalidArgumentError, match=r"decode: v_pages must have k_pages' dtype "
                                                   r"float16, got float32"):
        call(errs, v_pages=errs.v_pages.astype(np.float32))


def test_error_bad_path(errs):
    with pytest.raises(InvalidArgumentError, match=r"decode: path must be one of auto, v2, v2tc, "
                                                   r"v1, gather, got 'v3'"):
        call(errs, path="v3")


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_error_non_finite_sm_scale(errs, scale):
    with pytest.raises(InvalidArgumentError, match=r"decode: sm_scale must be finite"):
        call(errs, sm_scale=scale)


def test_error_out_and_lse_buffers(errs):
    with pytest.raises(InvalidArgumentError, match=r"decode: out must have shape \[B, Hq, D\] = "
                                                   r"\[4, 32, 128\], got \[4, 32, 64\]"):
        call(errs, out=np.zeros((4, 32, 64), np.float16))
    with pytest.raises(InvalidArgumentError, match=r"decode: out must have dtype float16, "
                                                   r"got float32"):
        call(errs, out=np.zeros((4, 32, 128), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"decode: lse must have shape \[B, Hq\] = "
                                                   r"\[4, 32\], got \[4, 31\]"):
        call(errs, lse=np.zeros((4, 31), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"decode: lse must have dtype float32, "
                                                   r"got float16"):
        call(errs, lse=np.zeros((4, 32), np.float16))
    with pytest.raises(InvalidArgumentError, match=r"decode: out must be C-contiguous"):
        call(errs, out=np.zeros((4, 128, 32), np.float16).transpose(0, 2, 1))


def test_error_layouts_and_types(errs):
    with pytest.raises(InvalidArgumentError, match=r"decode: q must be C-contiguous"):
        call(errs, q=np.asfortranarray(errs.q))
    with pytest.raises(InvalidArgumentError, match=r"decode: table must be a PageTable or "
                                                   r"StepTable, got dict"):
        call(errs, table={})
    with pytest.raises(InvalidArgumentError, match=r"decode: plan must be a DecodePlan, got str"):
        call(errs, plan="plan")
