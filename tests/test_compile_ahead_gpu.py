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
from paged_decode.sparse import make_selection, sparse_decode
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


def test_other_calls_compiled_ahead_compile_nothing(monkeypatch, fresh_cache):
    """``query_tokens``, ``cascade`` and ``sparse``: after compile_ahead, multi-token
    decodes of 1-4 tokens per request on each path, forced cascades of 2-9 forks of one
    prompt (level 0 on the prefix kernel, and with a soft cap on the v2 partial) and
    fused sparse decodes compile nothing and match the oracle (sparse: the reference
    backend's dense masked path)."""
    be = pd.get_backend("cuda")
    for cap in (False, True):
        report = pd.compile_ahead(be, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                  page_size=P, kv_dtype="float16", logits_soft_cap=cap,
                                  query_tokens=4, cascade=True, sparse=True)
        print(f"compile_ahead (soft cap {cap}, multi-token, cascade, sparse): "
              f"{len(report.specs)} specializations in {report.seconds:.2f} s")
    monkeypatch.setenv("PAGED_DECODE_ASSERT_NO_COMPILE", "1")
    rng = np.random.default_rng(9)
    tol = tc_out_tol("float16", "float16")
    for counts in ([1, 1, 1], [4, 4, 4], [2, 4, 1], [3, 1, 4]):
        pr = make_problem(ProblemSpec(3, 0, HQ, HKV, D, P, seed=len(counts)),
                          lengths=[40 + c for c in counts[:1]] + [3000 + c for c in counts[1:]])
        q = (rng.standard_normal((sum(counts), HQ, D))).astype(np.float16)
        qi = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi)
        for path in ("v2tc", "v2", "v1"):
            out, lse = pd.decode(be.asarray(q), be.asarray(pr.k_pages), be.asarray(pr.v_pages),
                                 pr.table, path=path, qo_indptr=qi, return_lse=True,
                                 backend=be)
            assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float16",
                                  f"{counts} {path}", tol=tol if path == "v2tc" else None)
    for m in range(2, 10):
        pool = pd.PagePool(2048, P, HKV, D, "float16", backend=be)
        base = pool.new_sequence()
        x = rng.standard_normal((1024 + 2 * P, HKV, D)).astype(np.float16)
        pool.append(base, be.asarray(x), be.asarray(x))
        seqs = [pool.fork(base) for _ in range(m)]
        for i, s in enumerate(seqs):
            y = be.asarray(rng.standard_normal((3 + 7 * i, HKV, D)).astype(np.float16))
            pool.append(s, y, y)
        table = pool.page_table(seqs)
        q = rng.standard_normal((m, HQ, D)).astype(np.float16)
        for cap in (None, 20.0):
            ref, ref_lse = oracle_decode(q, be.to_numpy(pool.k), be.to_numpy(pool.v), table,
                                         logits_soft_cap=cap)
            out, lse = pd.decode(be.asarray(q), pool.k, pool.v, table, cascade=True,
                                 logits_soft_cap=cap, return_lse=True, backend=be)
            assert pd.last_outcome().path == "cascade", str(pd.last_outcome())
            assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float16",
                                  f"cascade of {m} soft cap {cap}", tol=tol)
    b, capacity = 3, 4096
    kc = rng.standard_normal((b, HKV, capacity, D)).astype(np.float16)
    vc = rng.standard_normal((b, HKV, capacity, D)).astype(np.float16)
    q = rng.standard_normal((b, HQ, D)).astype(np.float16)
    live = np.array([4096, 3000, 100])
    for s in (64, 1000):            # one chunk per row, then a merge
        counts = np.minimum(s, live).astype(np.int32)[:, None].repeat(HKV, 1)
        pos = np.zeros((b, HKV, s), np.int32)
        for r, n in enumerate(live):
            for h in range(HKV):
                pos[r, h, :counts[r, h]] = rng.choice(int(n), counts[r, h], replace=False)
        sel = make_selection(pos, counts)
        want = sparse_decode(q, kc, vc, sel, live_lens=live, min_sparsity=1e9,
                             backend="reference", out_dtype="float32")
        got = sparse_decode(be.asarray(q), be.asarray(kc), be.asarray(vc), sel, live_lens=live,
                            min_sparsity=0, backend=be)
        assert pd.last_outcome().path == "sparse", str(pd.last_outcome())
        np.testing.assert_allclose(be.to_numpy(got).astype(np.float32), want, rtol=4e-3,
                                   atol=4e-3)
