"""The tensor-core partial's fused merge (CUDA dialect, ``decode_v2_tc.py`` with ``MERGE``;
``Backend.partial_tc_merged``), on the CPU emulator.

A split ``path="v2tc"`` decode on a CUDA-dialect backend is one launch: each CTA counts
itself done per (request, KV head, row tile), and the last one merges the request's
float32 partials with the merge kernel's own code (``pd::merge_group``). The tests hold it
to the two-launch path (``PAGED_DECODE_FUSED_MERGE=0``: the partial, then the merge
kernel) bit for bit, over NaN-poisoned outputs, at every geometry the partial accepts
(GQA 1-32, one and two row tiles; head_dim 64/96/128/256; page sizes 1-256; first-page
offsets; empty requests), with sinks, soft cap, window, fp8 pools and multi-token calls;
against the float64 oracle; and check the counters: one launch, counters left zero for
the next call, and a negative control (counters not zero) that must give wrong results.
The emulator runs blocks on several OS threads (``atomicAdd`` is a host atomic there), so
the last CTA is not always the last chunk. ``tests/mutants.py`` plants its bugs
(``v2tc-fused-*``). The GPU repeat is ``tests/test_fused_merge_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, needs_backend, sinks_for, tc_out_tol

import paged_decode as pd
from paged_decode.backends import launches
from paged_decode.backends.emulated import EmulatedCudaBackend
from paged_decode.backends.launching import CLUSTER_MERGE_ENV, FUSED_MERGE_ENV
from paged_decode.errors import InvalidArgumentError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk

pytestmark = needs_backend("emulated-cuda")


@pytest.fixture(autouse=True)
def _counters(monkeypatch):
    """The counters' fused merge throughout (``tests/test_cluster_merge.py`` holds the
    cluster merge, which the default rule takes at some of these geometries, to it)."""
    monkeypatch.setenv(CLUSTER_MERGE_ENV, "0")


@pytest.fixture(scope="module")
def emu():
    return pd.get_backend("emulated-cuda")


def _plan(be, pr, ppc, **kw):
    hq, hkv, d = (int(pr.q.shape[-2]), int(pr.k_pages.shape[2]), int(pr.q.shape[-1]))
    return pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv), **kw)


def _both(monkeypatch, be, pr, plan, **kw):
    """(fused, two-launch) results of one v2tc decode into NaN-poisoned outputs."""
    got = []
    for flag in ("1", "0"):
        monkeypatch.setenv(FUSED_MERGE_ENV, flag)
        out = np.full(pr.q.shape, np.nan, kw.get("out_dtype", pr.q.dtype))
        lse = np.full(pr.q.shape[:-1], np.nan, np.float32)
        res = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                        backend=be, out=out, lse=lse, return_lse=True, **kw)
        assert pd.last_outcome().path == "v2tc+merge"
        got.append(tuple(be.to_numpy(x) for x in res))
    return got


def _same(a, b, what):
    for x, y, name in zip(a, b, ("out", "lse")):
        assert np.array_equal(x, y, equal_nan=True), f"{what}: fused {name} differs"
        assert not np.isnan(x).any(), f"{what}: fused {name} left NaN"


GEOMETRIES = [
    # id, spec, pages per chunk
    ("g1-d64-ps16", ProblemSpec(3, 70, 4, 4, 64, 16, seed=1), 1),
    ("g2-d128-ps3-bf16", ProblemSpec(2, 50, 4, 2, 128, 3, "bfloat16", "bfloat16", seed=2), 2),
    ("g4-d96-ps16", ProblemSpec(3, 45, 8, 2, 96, 16, seed=3), 1),
    ("g7-d64-ps64", ProblemSpec(2, 150, 7, 1, 64, 64, seed=4), 1),
    ("g8-d256-ps16-bf16", ProblemSpec(2, 40, 8, 1, 256, 16, "bfloat16", "bfloat16", seed=5), 1),
    ("g16-d64-ps1", ProblemSpec(2, 37, 32, 2, 64, 1, seed=6), 5),
    ("g32-d128-ps256", ProblemSpec(1, 600, 32, 1, 128, 256, seed=7), 1),
    ("g24-d64-ps16-bf16", ProblemSpec(2, 40, 24, 1, 64, 16, "bfloat16", "bfloat16", seed=8), 1),
]


@pytest.mark.parametrize("spec,ppc", [g[1:] for g in GEOMETRIES], ids=[g[0] for g in GEOMETRIES])
def test_fused_equals_two_launches_and_the_oracle(emu, monkeypatch, spec, ppc):
    pr = make_problem(spec)
    plan = _plan(emu, pr, ppc)
    assert plan.needs_merge
    fused, plain = _both(monkeypatch, emu, pr, plan, out_dtype="float32")
    _same(fused, plain, spec.label)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(*fused, ref, ref_lse, "float32", spec.label,
                          tol=tc_out_tol(spec.kv_dtype, "float32"))


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_fused_writes_the_output_dtype(emu, monkeypatch, out_dtype):
    pr = make_problem(ProblemSpec(3, 90, 8, 2, 64, 16, seed=9))
    plan = _plan(emu, pr, 1)
    fused, plain = _both(monkeypatch, emu, pr, plan, out_dtype=out_dtype)
    assert fused[0].dtype == np.dtype(plain[0].dtype)
    _same(fused, plain, out_dtype)


def test_fused_with_offsets_and_empty_requests(emu, monkeypatch):
    spec = ProblemSpec(5, 60, 8, 2, 64, 16, seed=10)
    pr = make_problem(spec, lengths=[0, 61, 1, 0, 47], offsets=[0, 5, 15, 3, 9])
    plan = _plan(emu, pr, 1)
    fused, plain = _both(monkeypatch, emu, pr, plan, out_dtype="float32")
    _same((fused[0], np.where(np.isneginf(fused[1]), 0, fused[1])),
          (plain[0], np.where(np.isneginf(plain[1]), 0, plain[1])), "empty requests")
    assert np.isneginf(fused[1][[0, 3]]).all() and (fused[0][[0, 3]] == 0).all()


@pytest.mark.parametrize("variant", ["sinks", "cap", "window", "all"])
def test_fused_with_variants(emu, monkeypatch, variant):
    spec = ProblemSpec(3, 80, 16, 2, 64, 16, seed=11)
    pr = make_problem(spec)
    kw = {}
    if variant in ("sinks", "all"):
        kw["sinks"] = sinks_for(16)
    if variant in ("cap", "all"):
        kw["logits_soft_cap"] = 3.0
    win = {}
    if variant in ("window", "all"):
        kw["window_left"] = win["window_left"] = 37
    plan = _plan(emu, pr, 1, **win)
    assert plan.needs_merge
    fused, plain = _both(monkeypatch, emu, pr, plan, out_dtype="float32", **kw)
    _same(fused, plain, variant)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    assert_matches_oracle(*fused, ref, ref_lse, "float32", variant,
                          tol=tc_out_tol(spec.kv_dtype, "float32"))


def test_fused_over_fp8_pools(emu, monkeypatch):
    spec = ProblemSpec(3, 70, 8, 2, 64, 16, kv_dtype="float8_e4m3fn", seed=12)
    pr = make_problem(spec)
    plan = _plan(emu, pr, 1)
    kw = dict(k_scale=0.5, v_scale=0.25)
    fused, plain = _both(monkeypatch, emu, pr, plan, out_dtype="float32", **kw)
    _same(fused, plain, "fp8")


def test_fused_multi_token(emu, monkeypatch):
    spec = ProblemSpec(3, 70, 8, 2, 64, 16, seed=13)
    pr = make_problem(spec)
    t = 3
    q = np.random.default_rng(1).standard_normal((3, t, 8, 64)).astype(np.float16)
    plan = _plan(emu, pr, 1, query_tokens=t)
    got = []
    for flag in ("1", "0"):
        monkeypatch.setenv(FUSED_MERGE_ENV, flag)
        got.append(pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                             backend=emu, out_dtype="float32", return_lse=True))
    _same(*got, "multi-token")


def _launches(be, run):
    rec = be.compile_launches(run, None)
    return [lc.spec.kernel for lc in rec.launches]


def test_one_launch_fused_two_without(emu, monkeypatch):
    pr = make_problem(ProblemSpec(2, 70, 8, 2, 64, 16, seed=14))
    plan = _plan(emu, pr, 1)
    for flag, want in (("1", ["v2tc"]), ("0", ["v2tc", "merge"])):
        monkeypatch.setenv(FUSED_MERGE_ENV, flag)
        run = lambda: pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan,  # noqa: E731
                                path="v2tc", backend=emu, out_dtype="float32")
        assert _launches(emu, run) == want, flag


def test_metal_dialect_keeps_the_merge_launch(monkeypatch):
    be = pd.get_backend("emulated-metal")
    pr = make_problem(ProblemSpec(2, 70, 8, 2, 64, 16, seed=14))
    plan = _plan(be, pr, 1)
    for flag in ("1", ""):
        monkeypatch.setenv(FUSED_MERGE_ENV, flag)
        assert not be.fuses_merge(plan, "float16")


@pytest.mark.parametrize("hq,hkv,d,fused", [(8, 8, 64, True), (8, 2, 96, True),
                                            (12, 4, 128, True), (8, 4, 256, False),
                                            (8, 1, 64, False), (28, 4, 128, False),
                                            (32, 2, 64, False), (64, 2, 64, False)])
def test_by_default_the_merge_fuses_where_each_warp_merges_one_head(emu, monkeypatch, hq,
                                                                      hkv, d, fused):
    # S16-R4: with more heads per CTA than warps the fused merge serializes (GQA 7-16);
    # S16-R5: at head_dim 256 it was slower
    monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    pr = make_problem(ProblemSpec(2, 70, hq, hkv, d, 16, seed=15))
    plan = _plan(emu, pr, 1)
    assert emu.fuses_merge(plan, "float16") is fused
    run = lambda: pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan,  # noqa: E731
                            path="v2tc", backend=emu, out_dtype="float32")
    assert _launches(emu, run) == (["v2tc"] if fused else ["v2tc", "merge"])
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    assert emu.fuses_merge(plan, "float16")
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    assert not emu.fuses_merge(plan, "float16")
    for unset in ("", "  "):                # empty is unset: the rule decides
        monkeypatch.setenv(FUSED_MERGE_ENV, unset)
        assert emu.fuses_merge(plan, "float16") is fused
    monkeypatch.setenv(FUSED_MERGE_ENV, "false")
    with pytest.raises(InvalidArgumentError, match=f"{FUSED_MERGE_ENV} must be 0 or 1"):
        emu.fuses_merge(plan, "float16")


def test_by_default_the_merge_does_not_fuse_where_the_merge_kernel_splits(emu, monkeypatch):
    # S17-R3: at batch 1 over 32+ chunks per request the split merge's two launches were
    # faster than the fused merge (one warp per head)
    from paged_decode.backends.launching import MERGE_SPLIT_ENV
    monkeypatch.delenv(FUSED_MERGE_ENV, raising=False)
    monkeypatch.delenv(MERGE_SPLIT_ENV, raising=False)
    pr = make_problem(ProblemSpec(1, 1200, 8, 2, 64, 16, seed=16, jitter=False))
    plan = _plan(emu, pr, 1)
    assert emu.merge_split(1, 8, plan.num_chunks, plan.head_dim) > 1
    assert not emu.fuses_merge(plan, "float16")
    run = lambda: pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan,  # noqa: E731
                            path="v2tc", backend=emu, out_dtype="float32")
    assert _launches(emu, run) == ["v2tc", "merge"]
    monkeypatch.setenv(MERGE_SPLIT_ENV, "1")      # an unsplit merge: fused again
    assert emu.fuses_merge(plan, "float16")
    assert _launches(emu, run) == ["v2tc"]


def _kept_counters(monkeypatch, be, plan, start=0):
    counters = np.full(launches.fused_merge_slots(plan), start, np.int32)
    monkeypatch.setattr(be, "merge_counters", lambda p: counters)
    return counters


def test_counters_are_left_zero_for_the_next_call(monkeypatch):
    be = pd.get_backend("emulated-cuda")
    pr = make_problem(ProblemSpec(3, 90, 32, 1, 64, 16, seed=15))   # two row tiles
    plan = _plan(be, pr, 1)
    counters = _kept_counters(monkeypatch, be, plan)
    assert counters.size == 3 * 1 * 2
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    first = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be,
                      out_dtype="float32", return_lse=True)
    assert (counters == 0).all()
    second = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be,
                       out_dtype="float32", return_lse=True)
    assert (counters == 0).all()
    _same(first, second, "second call")


def test_negative_control_counters_not_zero_give_wrong_results(monkeypatch):
    # counters left at 1 (a kernel that does not reset them, seen by the next call): each
    # request's merge runs one CTA early, without the last partial, or never (one fiber
    # schedule: under several the emulator reports the early merge as schedule-dependent)
    be = EmulatedCudaBackend(check_races=False)
    pr = make_problem(ProblemSpec(3, 90, 8, 2, 64, 16, seed=16))
    plan = _plan(be, pr, 1)
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    want = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be,
                     out_dtype="float32")
    _kept_counters(monkeypatch, be, plan, start=1)
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    out = np.full(pr.q.shape, np.nan, np.float32)
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be, out=out,
              out_dtype="float32")
    assert not np.array_equal(out, want, equal_nan=True)
