"""Compiling ahead (``paged_decode.compile_ahead``, ``DecodeStep.compile_ahead``).

The claim: ``kernel_specs`` lists every specialization a one-token decode, its appends and
its table updates can launch on a backend, whatever the plan and the kernel settings.
Checked on the emulated CUDA backend with its launches recorded, not run (host work only):
plans of 1-9 chunks per request (clusters of 2-8), the fused merge and the cluster merge
forced on and off, every merge split, the row hint's both choices (head_dim 96), each
path, fp8 pools, float32 outputs, soft cap and sinks, and an engine step's appends and
table updates; each launched spec must be listed. Then the real thing on the emulator: a
step compiled ahead runs under ``PAGED_DECODE_ASSERT_NO_COMPILE`` and matches the oracle,
while one not compiled ahead raises. The GPU repeat is ``tests/test_compile_ahead_gpu.py``;
``tests/mutants.py`` plants ``py-compile-ahead-*``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import assert_matches_oracle, needs_backend, tc_out_tol

import paged_decode as pd
from paged_decode.backends import emulated
from paged_decode.backends.launching import CLUSTER_MERGE_ENV, FUSED_MERGE_ENV, MERGE_SPLIT_ENV
from paged_decode.compile_ahead import kernel_specs
from paged_decode.errors import InvalidArgumentError, InvalidDtypeError, UnsupportedProblemError
from paged_decode.kernels.merge import SPLITS, split_fits
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.sparse import sparse_decode
from paged_decode.specs import UnexpectedCompileError, v2tc_ctas_per_chunk

pytestmark = needs_backend("emulated-cuda")

#: settings a serving process might set, each value a decode may meet
SETTINGS = [{}, {FUSED_MERGE_ENV: "1"}, {FUSED_MERGE_ENV: "0"}, {CLUSTER_MERGE_ENV: "1"},
            {FUSED_MERGE_ENV: "1", CLUSTER_MERGE_ENV: "0"}]


def _recorder(monkeypatch, be):
    """The specs of every launch ``be`` is asked for from now on; nothing runs."""
    seen = []
    monkeypatch.setattr(be, "_run", lambda launch: seen.append(launch.spec))
    return seen


def _settings(monkeypatch, values):
    for name in (FUSED_MERGE_ENV, CLUSTER_MERGE_ENV, MERGE_SPLIT_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def _splits(head_dim):
    return [str(s) for s in SPLITS if split_fits(head_dim, s)]


GEOMETRIES = [  # hq, hkv, d, page, q dtype, kv dtype, out dtype, soft cap, sinks
    (32, 8, 128, 16, "float16", "float16", None, False, False),
    (32, 2, 96, 16, "bfloat16", "bfloat16", "float32", False, True),     # row hint both ways
    (28, 4, 64, 8, "float16", "float8_e4m3fn", None, True, False),
    (8, 8, 256, 4, "float16", "float16", None, True, True),
    (8, 2, 128, 16, "float32", "float32", None, False, False),          # no v2tc
]


@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: f"{g[0]}-{g[1]}x{g[2]}-p{g[3]}-{g[5]}")
def test_every_decode_launch_is_listed(monkeypatch, geom):
    hq, hkv, d, page, qdt, kvdt, odt, cap, with_sinks = geom
    be = pd.get_backend("emulated-cuda")
    listed = {s.uri for s in kernel_specs(be, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                          page_size=page, kv_dtype=kvdt, q_dtype=qdt,
                                          out_dtype=odt, logits_soft_cap=cap,
                                          sinks=with_sinks)}
    seen = _recorder(monkeypatch, be)
    fp8 = kvdt.startswith("float8")
    extra = {"k_scale": 0.5, "v_scale": 0.25} if fp8 else {}
    if cap:
        extra["logits_soft_cap"] = 30.0
    if with_sinks:
        extra["sinks"] = np.linspace(-1, 1, hq).astype(np.float32)
    paths = [p for p in ("v2", "v2tc", "v1")
             if p != "v2tc" or qdt != "float32"]
    calls = 0
    for chunks, batch in itertools.product((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 3)):
        ppc = 2
        pr = make_problem(ProblemSpec(batch, 0, hq, hkv, d, page, q_dtype=qdt,
                                      kv_dtype=kvdt, seed=chunks),
                          lengths=[chunks * ppc * page] * batch)
        for path in paths:
            ctas = v2tc_ctas_per_chunk(hq, hkv) if path == "v2tc" else None
            plan = pd.plan_decode(pr.table, hq, hkv, d, backend=be, pages_per_chunk=ppc,
                                  ctas_per_chunk=ctas, kv_dtype=kvdt)
            values = SETTINGS + [{MERGE_SPLIT_ENV: s} for s in _splits(d)]
            for vals in (values if path != "v1" else [{}]):
                _settings(monkeypatch, vals)
                pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path, backend=be,
                          out_dtype=odt, **extra)
                calls += 1
    # the plan's own choice of chunks too (row hints follow the grid)
    _settings(monkeypatch, {})
    for batch, ctx in ((1, 40 * page), (16, 7 * page), (64, 3 * page)):
        pr = make_problem(ProblemSpec(batch, ctx, hq, hkv, d, page, q_dtype=qdt, kv_dtype=kvdt,
                                      seed=batch))
        for path in paths:
            pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path=path, backend=be,
                      out_dtype=odt, **extra)
            calls += 1
    if d == 96:     # grids and chunks long enough for the row hint (``row_hint_pays``)
        for path, batch, pages, ppc in (("v2", 64, 4, 1), ("v2tc", 1, 2048, 2048)):
            pr = make_problem(ProblemSpec(batch, 0, hq, hkv, d, page, q_dtype=qdt,
                                          kv_dtype=kvdt, seed=pages),
                              lengths=[pages * page] * batch)
            plan = pd.plan_decode(pr.table, hq, hkv, d, backend=be, pages_per_chunk=ppc)
            pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path, backend=be,
                      out_dtype=odt, **extra)
    got = {s.uri for s in seen}
    assert got and calls > 100
    assert got <= listed, sorted(got - listed)
    kinds = {(s.kernel, bool(s.merged_dtype), s.cluster > 0, s.num_warps > 0)
             for s in seen if s.kernel in ("v2tc", "merge")}
    if qdt != "float32":     # the test reached what a plan picks
        assert ("v2tc", True, True, True) in kinds and ("v2tc", True, False, True) in kinds
    assert ("merge", False, False, True) in kinds        # a split merge
    if d == 96:
        for kernel in ("v2", "v2tc"):
            assert {s.row_hint for s in seen if s.kernel == kernel} == {False, True}


def test_an_engine_steps_launches_are_listed(monkeypatch):
    """Appends (every word width the row allows), table updates and decodes of a step
    whose batch and contexts move."""
    be = pd.get_backend("emulated-cuda")
    pool = pd.PagePool(256, 16, 2, 64, "float16", num_layers=2, backend=be)
    seqs = [pool.new_sequence() for _ in range(4)]
    for s, n in zip(seqs, (100, 300, 17, 640)):
        pool.append(s, *(np.ones((2, n, 2, 64), np.float16) for _ in range(2)))
    seqs.append(pool.fork(seqs[2]))        # a shared partial page: copy-on-write
    step = pd.DecodeStep(pool, seqs, num_qo_heads=8, capacity=6, headroom=4)
    listed = {s.uri for s in kernel_specs(be, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                                          page_size=16, kv_dtype="float16")}
    assert set(step.compile_ahead().specs) == listed
    seen = _recorder(monkeypatch, be)
    rows = np.ones((6, 2, 64), np.float16)
    q = np.ones((6, 8, 64), np.float16)
    for i in range(12):
        if i == 6:
            step.set_sequences(seqs[:2] + [pool.new_sequence()])
        step.begin()
        for layer in range(2):
            step.append(layer, rows, rows)
            step.decode(layer, q)
    kinds = {s.kernel for s in seen}
    assert {"append", "table_update"} <= kinds and kinds & {"v2", "v2tc", "v1"}, kinds
    assert {s.uri for s in seen} <= listed, sorted({s.uri for s in seen} - listed)


def test_compiled_ahead_nothing_compiles_later(monkeypatch):
    """The emulator's libraries built ahead: the step's launches then compile nothing
    under ``PAGED_DECODE_ASSERT_NO_COMPILE`` and match the oracle; a geometry not
    compiled ahead raises (the negative control)."""
    monkeypatch.setattr(emulated, "_LOADED", set())
    be = pd.get_backend("emulated-cuda")
    spec = ProblemSpec(2, 0, 8, 2, 64, 16, seed=5)
    lengths = [4 * 2 * 16] * 2             # 4 chunks of 2 pages: clusters of 4
    pr = make_problem(spec, lengths=lengths)
    report = pd.compile_ahead(be, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                              kv_dtype="float16", paths=["v2tc"], appends=False)
    assert report.backend == "emulated-cuda" and report.note == "" and report.seconds > 0
    assert any("cl-4" in u for u in report.specs)
    monkeypatch.setenv("PAGED_DECODE_ASSERT_NO_COMPILE", "1")
    plan = pd.plan_decode(pr.table, 8, 2, 64, backend=be, pages_per_chunk=2,
                          ctas_per_chunk=v2tc_ctas_per_chunk(8, 2))
    ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    for vals in ({CLUSTER_MERGE_ENV: "1"}, {FUSED_MERGE_ENV: "0"}, {MERGE_SPLIT_ENV: "2"}):
        _settings(monkeypatch, vals)
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                             backend=be, return_lse=True)
        assert_matches_oracle(out, lse, ref_out, ref_lse, "float16", str(vals),
                              tol=tc_out_tol("float16", "float16"))
    with pytest.raises(UnexpectedCompileError, match="pd_v2tc.*hd-128"):
        other = make_problem(ProblemSpec(1, 64, 8, 2, 128, 16, seed=6))
        pd.decode(other.q, other.k_pages, other.v_pages, other.table, path="v2tc", backend=be)


def test_backends_that_compile_at_first_use_say_so():
    report = pd.compile_ahead("reference", num_qo_heads=8, num_kv_heads=2, head_dim=64,
                              page_size=16, kv_dtype="float16")
    assert report.specs == () and "runs no kernels" in report.note
    with pytest.raises(InvalidArgumentError, match="kernel_specs: backend 'reference' compiles"):
        kernel_specs("reference", num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                     kv_dtype="float16")
    # the arguments are checked there too
    with pytest.raises(InvalidArgumentError, match="compile_ahead: num_qo_heads must be"):
        pd.compile_ahead("reference", num_qo_heads=7, num_kv_heads=2, head_dim=64,
                         page_size=16, kv_dtype="float16")
    pool = pd.PagePool(8, 16, 2, 64, "float16", backend="reference")
    step = pd.DecodeStep(pool, [pool.new_sequence()], num_qo_heads=8)
    assert step.compile_ahead().note == report.note
    with pytest.raises(InvalidDtypeError, match="DecodeStep.compile_ahead: q_dtype must"):
        step.compile_ahead(q_dtype="int8")


@pytest.mark.parametrize("kwargs,match", [
    (dict(kv_dtype="float8_e4m3fn"), "compile_ahead: q_dtype must be given for float8_e4m3fn"),
    (dict(kv_dtype="float16", paths="v2"), "compile_ahead: paths must be a sequence"),
    (dict(kv_dtype="float16", paths=["v3"]), "compile_ahead: paths must be a sequence"),
    (dict(kv_dtype="float32", paths=["v2tc"]), "compile_ahead: backend 'emulated-cuda' cannot "
                                                "run path 'v2tc'"),
    (dict(kv_dtype="int8"), "compile_ahead: kv_dtype must have dtype in"),
    (dict(kv_dtype="float16", num_qo_heads=7), "compile_ahead: num_qo_heads must be a multiple"),
    (dict(kv_dtype="float16", page_size=0), "compile_ahead: page_size must be"),
    (dict(kv_dtype="float16", sinks="yes"), "compile_ahead: sinks must be"),
])
def test_bad_arguments_name_the_function(kwargs, match):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16) | kwargs
    cls = InvalidDtypeError if kwargs["kv_dtype"] == "int8" else InvalidArgumentError
    with pytest.raises(cls, match=match):
        pd.compile_ahead("emulated-cuda", **args)


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=80), "head_dim"), (dict(page_size=300), "page"),
])
def test_a_geometry_no_path_runs_is_refused(kwargs, match):
    args = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                kv_dtype="float16") | kwargs
    want = f"compile_ahead: backend 'emulated-cuda' runs no decode path.*{match}"
    with pytest.raises(UnsupportedProblemError, match=want):
        pd.compile_ahead("emulated-cuda", **args)


def test_a_step_over_fp8_pools_needs_the_query_dtype():
    be = pd.get_backend("emulated-cuda")
    pool = pd.PagePool(8, 16, 2, 64, "float8_e4m3fn", backend=be, k_scale=1.0, v_scale=1.0)
    step = pd.DecodeStep(pool, [pool.new_sequence()], num_qo_heads=8)
    with pytest.raises(InvalidArgumentError,
                       match="DecodeStep.compile_ahead: q_dtype must be given"):
        step.compile_ahead()
    listed = kernel_specs(be, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                          kv_dtype="float8_e4m3fn", q_dtype="bfloat16")
    assert {s.kernel for s in listed} >= {"v2tc", "append_fp8", "table_update"}


def _fp8_kwargs(kvdt):
    return {"k_scale": 0.5, "v_scale": 0.25} if kvdt.startswith("float8") else {}


def _variant_kwargs(hq, cap, with_sinks):
    kw = {}
    if cap:
        kw["logits_soft_cap"] = 30.0
    if with_sinks:
        kw["sinks"] = np.linspace(-1, 1, hq).astype(np.float32)
    return kw


OTHER_CALLS = [  # hq, hkv, d, page, q dtype, kv dtype, out dtype, soft cap, sinks
    (32, 8, 128, 16, "float16", "float16", None, False, False),
    (28, 4, 64, 8, "float16", "float8_e4m3fn", None, True, True),
    (8, 2, 96, 16, "bfloat16", "bfloat16", "float32", False, True),    # row hint both ways
]


def _listed(be, geom, **kw):
    hq, hkv, d, page, qdt, kvdt, odt, cap, with_sinks = geom
    return {s.uri for s in kernel_specs(be, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                        page_size=page, kv_dtype=kvdt, q_dtype=qdt,
                                        out_dtype=odt, logits_soft_cap=cap, sinks=with_sinks,
                                        appends=False, **kw)}


def _check_listed(be, geom, seen, option):
    """Every launch of ``seen`` is listed with ``option`` (a dict of kernel_specs' extra
    arguments); without it some are not (the option adds what those calls launch)."""
    got = {s.uri for s in seen}
    with_option = _listed(be, geom, **option)
    assert got <= with_option, sorted(got - with_option)
    assert got - _listed(be, geom), f"{option}: no launch beyond one-token decodes"


@pytest.mark.parametrize("geom", OTHER_CALLS, ids=lambda g: f"{g[0]}-{g[1]}x{g[2]}-{g[5]}")
def test_multitoken_launches_are_listed(monkeypatch, geom):
    """Uniform and ragged token counts up to 4 per request, on each path, over plans of
    1-5 chunks and under the fused / cluster / split settings: listed with
    ``query_tokens=4``."""
    hq, hkv, d, page, qdt, kvdt, odt, cap, with_sinks = geom
    be = pd.get_backend("emulated-cuda")
    extra = _fp8_kwargs(kvdt) | _variant_kwargs(hq, cap, with_sinks)
    seen = _recorder(monkeypatch, be)
    rng = np.random.default_rng(3)
    calls = 0
    for chunks, counts in itertools.product((1, 2, 5), ([1, 1], [4, 4], [2, 3, 1], [3, 4])):
        lengths = [chunks * 2 * page + c for c in counts]
        pr = make_problem(ProblemSpec(len(counts), 0, hq, hkv, d, page, q_dtype=qdt,
                                      kv_dtype=kvdt, seed=chunks), lengths=lengths)
        q = rng.standard_normal((sum(counts), hq, d)).astype(pr.q.dtype)
        qo = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        for path in ("v2", "v2tc", "v1"):
            for vals in SETTINGS + [{MERGE_SPLIT_ENV: s} for s in _splits(d)]:
                _settings(monkeypatch, vals)
                try:
                    pd.decode(q, pr.k_pages, pr.v_pages, pr.table, path=path, backend=be,
                              out_dtype=odt, qo_indptr=qo, **extra)
                except UnsupportedProblemError:     # v2tc past two tiles of rows
                    assert path == "v2tc" and max(counts) * hq // hkv > 16
                    break
                calls += 1
    _settings(monkeypatch, {})
    assert calls > 100
    _check_listed(be, geom, seen, {"query_tokens": 4})
    assert {s.kernel for s in seen} >= {"v2", "v1", "merge"}
    assert any(s.gather for s in seen if s.kernel == "merge")


def _forked_batch(be, hkv, d, page, kvdt, members, seed):
    """A pool whose requests are ``members`` forks of one prompt of 1024 tokens and two
    pages (cascade's least shared span is 1024) plus a few private tokens each, then a
    request of its own; returns ``(pool, table)``."""
    rng = np.random.default_rng(seed)
    pool = pd.PagePool(512, page, hkv, d, kvdt, backend="reference", **_fp8_kwargs(kvdt))

    def rows(n):
        return rng.standard_normal((n, hkv, d)).astype(np.float32)
    base = pool.new_sequence()
    n = 1024 + 2 * page
    pool.append(base, rows(n), rows(n))
    seqs = []
    for i in range(members):
        s = pool.fork(base)
        pool.append(s, rows(3 + i * page), rows(3 + i * page))
        seqs.append(s)
    solo = pool.new_sequence()
    pool.append(solo, rows(5 * page), rows(5 * page))
    return pool, pool.page_table(seqs + [solo])


@pytest.mark.parametrize("geom", OTHER_CALLS, ids=lambda g: f"{g[0]}-{g[1]}x{g[2]}-{g[5]}")
def test_cascade_launches_are_listed(monkeypatch, geom):
    """Forced cascade over 2-9 members (every CTA width the stacked level 0 can take),
    with its level 0 on the prefix kernel or on the v2 partial: listed with
    ``cascade=True``."""
    hq, hkv, d, page, qdt, kvdt, odt, cap, with_sinks = geom
    be = pd.get_backend("emulated-cuda")
    extra = _variant_kwargs(hq, cap, with_sinks)
    seen = _recorder(monkeypatch, be)
    for m in range(2, 10):
        pool, table = _forked_batch(be, hkv, d, page, kvdt, m, seed=m)
        q = make_problem(ProblemSpec(m + 1, page, hq, hkv, d, page, q_dtype=qdt,
                                     kv_dtype=kvdt, seed=m)).q
        for vals in ({}, {MERGE_SPLIT_ENV: _splits(d)[-1]}):
            _settings(monkeypatch, vals)
            pd.decode(q, pool.k, pool.v, table, backend=be, out_dtype=odt, cascade=True,
                      **extra, **pool.decode_args(0))
            assert pd.last_outcome().path == "cascade", str(pd.last_outcome())
    _settings(monkeypatch, {})
    _check_listed(be, geom, seen, {"cascade": True})
    tc0 = not cap and kvdt == qdt
    assert ("prefix" in {s.kernel for s in seen}) == tc0
    assert any(s.gather for s in seen if s.kernel == "merge")


@pytest.mark.parametrize("geom", OTHER_CALLS, ids=lambda g: f"{g[0]}-{g[1]}x{g[2]}-{g[5]}")
def test_sparse_launches_are_listed(monkeypatch, geom):
    """Fused sparse decodes with one chunk and with many (a merge), under every merge
    split: listed with ``sparse=True``."""
    hq, hkv, d, page, qdt, kvdt, odt, cap, with_sinks = geom
    be = pd.get_backend("emulated-cuda")
    extra = _fp8_kwargs(kvdt) | _variant_kwargs(hq, cap, with_sinks)
    if kvdt.startswith("float8"):
        extra["kv_dtype"] = kvdt
    rng = np.random.default_rng(7)
    b, capacity = 3, 4096
    pr = make_problem(ProblemSpec(b, page, hq, hkv, d, page, q_dtype=qdt, kv_dtype=kvdt))
    kc = np.zeros((b, hkv, capacity, d), pr.k_pages.dtype)   # launches are not run
    seen = _recorder(monkeypatch, be)
    for s in (8, 1024, 3000):
        pos = np.stack([np.stack([rng.choice(capacity, s, replace=False) for _ in range(hkv)])
                        for _ in range(b)]).astype(np.int32)
        for vals in [{}] + [{MERGE_SPLIT_ENV: v} for v in _splits(d)]:
            _settings(monkeypatch, vals)
            sparse_decode(pr.q, kc, kc, pos, live_lens=np.full(b, capacity), min_sparsity=0,
                          backend=be, out_dtype=odt, **extra)
            assert pd.last_outcome().path == "sparse", str(pd.last_outcome())
    _settings(monkeypatch, {})
    _check_listed(be, geom, seen, {"sparse": True})
    assert {s.page_size for s in seen if s.kernel == "v2"} == {1}


def test_a_speculative_steps_launches_are_listed(monkeypatch):
    """``step.compile_ahead(query_tokens=8)`` lists what steps of 2-8 tokens per sequence
    launch (their appends, table updates, both passes and the merge), beside one-token
    steps; without ``query_tokens`` some are missing."""
    be = pd.get_backend("emulated-cuda")
    pool = pd.PagePool(256, 16, 2, 64, "float16", num_layers=2, backend=be)
    seqs = [pool.new_sequence() for _ in range(4)]
    for s, n in zip(seqs, (100, 300, 17, 640)):
        pool.append(s, *(np.ones((2, n, 2, 64), np.float16) for _ in range(2)))
    step = pd.DecodeStep(pool, seqs, num_qo_heads=8, capacity=5, headroom=4)
    monkeypatch.setattr(be, "precompile", lambda spec: None)    # the list, not the builds
    listed = set(step.compile_ahead(query_tokens=8).specs)
    seen = _recorder(monkeypatch, be)
    for t in (1, 4, 8, 2, 1, 3):
        step.begin(tokens=t)
        shape = (5, t) if t > 1 else (5,)
        for layer in range(2):
            step.append(layer, np.ones((*shape, 2, 64), np.float16),
                        np.ones((*shape, 2, 64), np.float16))
            step.decode(layer, np.ones((*shape, 8, 64), np.float16))
        if t > 1:
            step.trim_back(np.array([t - 1, 0, 1, 0, 0]))
    got = {s.uri for s in seen}
    assert got <= listed, sorted(got - listed)
    assert got - set(step.compile_ahead().specs)
