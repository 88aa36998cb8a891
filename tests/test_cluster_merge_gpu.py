"""The tensor-core partial's cluster merge on a real GPU (sm_90+; skipped cleanly without).

With ``PAGED_DECODE_CLUSTER_MERGE=1`` a fused merge over a plan whose requests all have
the same 2-8 chunks runs each request's chunks of a head slot as one thread-block cluster:
the CTAs keep their rows in shared memory and merge them through each other's
(distributed shared memory) between two cluster barriers. Only a GPU runs the CTAs of a
cluster at once, so these tests compare, over NaN-poisoned outputs and many calls, the
cluster merge bit for bit with the counters' fused merge and the two launches, check
that the cluster specialization is what ran, and replay it captured in a graph.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    assert_same_bits,
    spy_specs,
    take_and_repoison,
    tc_fp8_out_tol,
    tc_out_tol,
)

import paged_decode as pd
from paged_decode.backends import availability, launches
from paged_decode.backends.launching import CLUSTER_MERGE_ENV, FUSED_MERGE_ENV, MERGE_SPLIT_ENV
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import GRID_ORDER_ENV, v2tc_ctas_per_chunk


def _clusters() -> bool:
    if not availability("cuda").ok:
        return False
    return pd.get_backend("cuda").runs_clusters()


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _clusters(),
                                 reason="needs a CUDA device with thread-block clusters "
                                        "(sm_90+)")]


@pytest.fixture(autouse=True)
def _unsplit_merge(monkeypatch):
    """The two launches run the merge kernel unsplit: the cluster merge repeats its
    one-warp arithmetic (``pd::merge_group`` with SPLIT 1)."""
    monkeypatch.setenv(MERGE_SPLIT_ENV, "1")


def _setup(spec, lengths, ppc, offsets=None, window_left=-1):
    """The problem of ``spec`` at ``lengths`` on the GPU: (problem, q, k, v, plan at
    ``ppc`` pages per chunk, NaN-filled float32 out and lse)."""
    import cupy as cp
    be = pd.get_backend("cuda")
    pr = make_problem(spec, lengths=lengths, offsets=offsets or [0] * len(lengths))
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    cp.cuda.Device().synchronize()
    hq, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv), window_left=window_left)
    out = cp.full(q.shape, np.nan, cp.float32)
    lse = cp.full(q.shape[:2], np.nan, cp.float32)
    return pr, q, k, v, plan, out, lse


def _run(spec, lengths, ppc, mode, calls=1, offsets=None, **kw):
    """``calls`` results of one v2tc decode, each into NaN-poisoned outputs, with the merge
    ``mode``: "two" (two launches), "counters" (fused, counters), "cluster", "default"
    (fused, the cluster setting unset) or "rules" (both settings unset); and the kernel
    specs launched."""
    import cupy as cp
    be = pd.get_backend("cuda")
    pr, q, k, v, plan, out, lse = _setup(spec, lengths, ppc, offsets,
                                         kw.get("window_left", -1))
    if "sinks" in kw:
        kw["sinks"] = cp.asarray(kw["sinks"])
    got = []
    with pytest.MonkeyPatch.context() as mp:
        if mode == "rules":
            mp.delenv(FUSED_MERGE_ENV, raising=False)
        else:
            mp.setenv(FUSED_MERGE_ENV, "0" if mode == "two" else "1")
        if mode in ("default", "rules"):
            mp.delenv(CLUSTER_MERGE_ENV, raising=False)
        else:
            mp.setenv(CLUSTER_MERGE_ENV, "1" if mode == "cluster" else "0")
        seen = spy_specs(mp, be)
        for _ in range(calls):
            pd.decode(q, k, v, pr.table, plan, path="v2tc", out=out, lse=lse,
                      out_dtype="float32", **kw)
            assert pd.last_outcome().path == "v2tc+merge"
            got.append(take_and_repoison(out, lse))
    return pr, plan, got, seen


_same = assert_same_bits


G = ProblemSpec
CASES = [
    # (id, spec, lengths, pages per chunk, chunks per request, decode keywords)
    ("g4-k4", G(8, 0, 32, 8, 128, 16, seed=1), [4096] * 8, 64, 4, {}),
    ("g4-k2-ragged-lengths", G(6, 0, 32, 8, 128, 16, seed=2),
     [4096, 3000, 4000, 2049, 3500, 2100], 128, 2, {}),
    ("g4-k3-offsets", G(4, 0, 32, 8, 128, 16, seed=3), [3000] * 4, 64, 3,
     {"offsets": [0, 5, 15, 9]}),
    ("g4-k5", G(3, 0, 32, 8, 128, 16, seed=4), [5000] * 3, 64, 5, {}),
    ("g4-k8", G(8, 0, 32, 8, 128, 16, seed=5), [8192] * 8, 64, 8, {}),
    ("g8-k4", G(4, 0, 64, 8, 128, 16, seed=6), [2048] * 4, 32, 4, {}),
    ("g16-d64-k4", G(4, 0, 32, 2, 64, 16, seed=7), [4096] * 4, 64, 4, {}),
    ("g32-two-tiles-ps1-k6", G(3, 0, 32, 1, 128, 1, seed=8), [3000] * 3, 500, 6, {}),
    ("g1-d64-k7", G(2, 0, 8, 8, 64, 16, seed=9), [1700] * 2, 16, 7, {}),
    ("g4-bf16-k4", G(4, 0, 32, 8, 128, 16, "bfloat16", "bfloat16", seed=10), [4096] * 4, 64, 4,
     {}),
    ("g4-e4m3-k8", G(8, 0, 32, 8, 128, 16, kv_dtype="float8_e4m3fn", seed=11), [8192] * 8, 64,
     8, {"k_scale": 0.5, "v_scale": 0.25, "kv_dtype": "float8_e4m3fn"}),
    ("g4-sinks-softcap-k4", G(4, 0, 32, 8, 128, 16, seed=12), [4096] * 4, 64, 4,
     {"sinks": (np.random.default_rng(0).standard_normal(32) * 2).astype(np.float32),
      "logits_soft_cap": 30.0}),
    ("g4-window-k4", G(4, 0, 32, 8, 128, 16, seed=13), [4096] * 4, 32, 4, {"window_left": 2000}),
]


@pytest.mark.parametrize("spec,lengths,ppc,k,kw", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_cluster_merge_equals_the_other_merges(monkeypatch, spec, lengths, ppc, k, kw):
    kw = dict(kw)
    offsets = kw.pop("offsets", None)
    pr, plan, two, seen = _run(spec, lengths, ppc, "two", offsets=offsets, **dict(kw))
    assert launches.cluster_merge_size(plan) == k, (plan.o_indptr, k)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    fp8 = spec.kv_dtype.startswith("float8")
    assert_matches_oracle(two[0][0], two[0][1], ref, ref_lse, "float32", spec.label,
                          tol=tc_fp8_out_tol(spec.q_dtype, "float32") if fp8
                          else tc_out_tol(spec.kv_dtype, "float32"))
    _, _, counted, _ = _run(spec, lengths, ppc, "counters", offsets=offsets, **dict(kw))
    _same(counted[0], two[0], f"{spec.label}: counters' fused merge")
    _, _, clustered, seen = _run(spec, lengths, ppc, "cluster", calls=20, offsets=offsets,
                                 **dict(kw))
    ran = [s for s in seen if s.kernel == "v2tc"]
    assert ran and all(s.cluster == k for s in ran), [s.uri for s in ran]
    assert len(seen) == len(ran), "the cluster merge is one launch"
    for i, got in enumerate(clustered):
        _same(got, two[0], f"{spec.label}: cluster merge, call {i}")


@pytest.mark.parametrize("order", ["heads", "chunks"])
def test_both_grid_orders(monkeypatch, order):
    spec = G(4, 0, 32, 8, 128, 16, seed=14)
    lengths = [4096] * 4
    _, _, two, _ = _run(spec, lengths, 64, "two")
    monkeypatch.setenv(GRID_ORDER_ENV, order)
    _, _, clustered, seen = _run(spec, lengths, 64, "cluster", calls=5)
    assert {(s.kernel, s.cluster) for s in seen} == {("v2tc", 4)}, [s.uri for s in seen]
    for i, got in enumerate(clustered):
        _same(got, two[0], f"{order} first, call {i}")


def test_a_captured_cluster_merge_replays_right(monkeypatch):
    import cupy as cp
    spec = G(8, 0, 32, 8, 128, 16, seed=15)
    lengths = [8192] * 8
    _, _, two, _ = _run(spec, lengths, 128, "two")
    pr, q, k, v, plan, out, lse = _setup(spec, lengths, 128)
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    monkeypatch.setenv(CLUSTER_MERGE_ENV, "1")
    seen = spy_specs(monkeypatch, pd.get_backend("cuda"))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        pd.decode(q, k, v, pr.table, plan, path="v2tc", out=out, lse=lse, out_dtype="float32")
        _same(take_and_repoison(out, lse), two[0], "eager on the capture stream")
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        try:
            pd.decode(q, k, v, pr.table, plan, path="v2tc", out=out, lse=lse,
                      out_dtype="float32")
        finally:
            g = s.end_capture()
        assert np.isnan(take_and_repoison(out, lse)[0]).all()
        # 8192 tokens in chunks of 128 pages of 16: clusters of 4
        assert {(sp.kernel, sp.cluster) for sp in seen} == {("v2tc", 4)}, [sp.uri for sp in seen]
        for i in range(10):
            g.launch(s)
            _same(take_and_repoison(out, lse), two[0], f"replay {i}")


@pytest.mark.parametrize("hq,hkv,lengths,ppc,want", [
    (32, 2, [1024] * 8, 16, 4),     # GQA 16, 4 chunks of 256 tokens: fused, in clusters
    (8, 1, [8192] * 4, 128, 4),     # GQA 8, 4 chunks of 2048 tokens
    (32, 2, [8192], 16, 0),         # GQA 16, 32 chunks: no cluster, the two launches
], ids=["gqa16-8x1k", "gqa8-4x8k", "gqa16-1x8k"])
def test_by_default_gqa_8_and_16_fuse_where_clusters_run(monkeypatch, hq, hkv, lengths, ppc,
                                                          want):
    """Both settings unset: at GQA 8 / 16 the merge is fused where it runs in clusters
    (session 46), equal to the counters' fused merge; elsewhere the two launches run.
    Five calls each into NaN-poisoned outputs."""
    monkeypatch.delenv(MERGE_SPLIT_ENV, raising=False)
    spec = G(len(lengths), 0, hq, hkv, 128, 16, seed=17)
    _, plan, got, seen = _run(spec, lengths, ppc, "rules", calls=5)
    assert launches.cluster_merge_size(plan) == want
    ran = sorted({(s.kernel, s.cluster) for s in seen})
    assert ran == ([("v2tc", want)] if want else [("merge", 0), ("v2tc", 0)]), ran
    _, _, other, _ = _run(spec, lengths, ppc, "counters" if want else "two")
    for i, g in enumerate(got):
        _same(g, other[0], f"call {i}")


def test_the_default_takes_clusters_where_the_rule_does():
    """Unset, the setting leaves it to ``launches.cluster_merge_pays``: 8 x 1K at Llama-3-8B
    heads (4 chunks of 256 tokens) merges in clusters, equal to the counters' merge."""
    spec = G(8, 0, 32, 8, 128, 16, seed=16)
    lengths = [1024] * 8
    _, _, counted, _ = _run(spec, lengths, 16, "counters")
    _, plan, got, seen = _run(spec, lengths, 16, "default")
    assert launches.cluster_merge_pays(plan, "float16")
    assert {(s.kernel, s.cluster) for s in seen} == {("v2tc", 4)}, [s.uri for s in seen]
    _same(got[0], counted[0], "the default")
