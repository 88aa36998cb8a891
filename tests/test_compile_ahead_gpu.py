"""Compiling ahead on a real GPU (skipped cleanly without one): after
``compile_ahead``, decodes at every chunk count (clusters of 2-8 included, on sm_90),
under every fused / cluster / split setting, and an engine step's appends and table
updates compile nothing (``PAGED_DECODE_ASSERT_NO_COMPILE`` raises on any compile) and
match the float64 oracle; a geometry not compiled ahead raises (the negative control).
The in-process kernel cache starts empty here, so each compile is NVRTC's or CuPy's disk
cache's; the seconds compile_ahead took are printed (``-s``). The CPU repeat, with the
listing checked launch by launch, is ``tests/test_compile_ahead.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from helpers import assert_matches_oracle, tc_out_tol

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.launching import CLUSTER_MERGE_ENV, FUSED_MERGE_ENV, MERGE_SPLIT_ENV
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import UnexpectedCompileError, v2tc_ctas_per_chunk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

HQ, HKV, D, P = 32, 8, 128, 16
SETTINGS = [{}, {FUSED_MERGE_ENV: "0"}, {FUSED_MERGE_ENV: "1", CLUSTER_MERGE_ENV: "0"},
            {CLUSTER_MERGE_ENV: "1"}, {FUSED_MERGE_ENV: "0", MERGE_SPLIT_ENV: "4"}]


@pytest.fixture
def fresh_cache(monkeypatch):
    """An empty in-process kernel cache for the test (CuPy's disk cache stays)."""
    from paged_decode.backends import cuda_launch
    monkeypatch.setattr(cuda_launch, "_compiled",
                        functools.cache(cuda_launch._compiled.__wrapped__))


def _settings(monkeypatch, values):
    for name in (FUSED_MERGE_ENV, CLUSTER_MERGE_ENV, MERGE_SPLIT_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_decodes_compiled_ahead_compile_nothing(monkeypatch, fresh_cache):
    be = pd.get_backend("cuda")
    report = pd.compile_ahead(be, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=P,
                              kv_dtype="float16")
    print(f"compile_ahead: {len(report.specs)} specializations in {report.seconds:.2f} s")
    assert report.note == "" and len(report.specs) >= 10
    monkeypatch.setenv("PAGED_DECODE_ASSERT_NO_COMPILE", "1")
    seen_clusters = set()
    for chunks in range(1, 10):
        pr = make_problem(ProblemSpec(4, 0, HQ, HKV, D, P, seed=chunks),
                          lengths=[chunks * 2 * P] * 4)
        ref_out, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
        q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
        for path in ("v2tc", "v2", "v1"):
            ctas = v2tc_ctas_per_chunk(HQ, HKV) if path == "v2tc" else None
            plan = pd.plan_decode(pr.table, HQ, HKV, D, backend=be, pages_per_chunk=2,
                                  ctas_per_chunk=ctas)
            for vals in (SETTINGS if path != "v1" else [{}]):
                _settings(monkeypatch, vals)
                out, lse = pd.decode(q, k, v, pr.table, plan, path=path, backend=be,
                                     return_lse=True)
                assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref_out, ref_lse,
                                      "float16", f"{chunks} chunks {path} {vals}",
                                      tol=tc_out_tol("float16", "float16"))
                if be.runs_clusters() and path == "v2tc" and vals.get(CLUSTER_MERGE_ENV) == "1":
                    seen_clusters.add(chunks)
    if be.runs_clusters():      # sm_90: clusters of 2-8 ran, each compiled ahead
        assert seen_clusters >= set(range(2, 9))
    with pytest.raises(UnexpectedCompileError, match="hd-64"):
        other = make_problem(ProblemSpec(1, 64, 8, 2, 64, P, seed=1))
        pd.decode(*(be.asarray(x) for x in (other.q, other.k_pages, other.v_pages)),
                  other.table, backend=be)


def test_a_step_compiled_ahead_compiles_nothing(monkeypatch, fresh_cache):
    be = pd.get_backend("cuda")
    rng = np.random.default_rng(3)
    pool = pd.PagePool(512, P, HKV, D, "float16", num_layers=2, backend=be)
    seqs = [pool.new_sequence() for _ in range(4)]
    for s, n in zip(seqs, (100, 700, 17, 1500)):
        x = rng.standard_normal((2, n, HKV, D)).astype(np.float16)
        pool.append(s, be.asarray(x), be.asarray(x))
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=6, headroom=4)
    report = step.compile_ahead()
    print(f"DecodeStep.compile_ahead: {len(report.specs)} in {report.seconds:.2f} s")
    monkeypatch.setenv("PAGED_DECODE_ASSERT_NO_COMPILE", "1")
    q = be.asarray(rng.standard_normal((6, HQ, D)).astype(np.float16))
    rows = be.asarray(rng.standard_normal((6, HKV, D)).astype(np.float16))
    for i in range(24):
        if i == 12:
            step.set_sequences(seqs[:2] + [pool.new_sequence()])
        step.begin()
        outs = []
        for layer in range(2):
            step.append(layer, rows, rows)
            outs.append(step.decode(layer, q))
        for layer in range(2):
            k, v = pool.layer(layer)
            want, _ = oracle_decode(be.to_numpy(q), be.to_numpy(k), be.to_numpy(v),
                                    step.table.page_table())
            assert_matches_oracle(be.to_numpy(outs[layer]).astype(np.float32), None, want,
                                  None, "float16", f"step {i} layer {layer}")
