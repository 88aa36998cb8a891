"""The cluster merge (``PAGED_DECODE_CLUSTER_MERGE=1``), on the CPU emulator.

With the setting, a fused merge over a plan whose requests all have the same 2-8 chunks
runs each request's chunks of a head slot as one thread-block cluster
(``kernels/merge.py``: ``pd::cluster_merge``): the CTAs keep their rows in shared memory
and merge them through each other's between two cluster barriers. The emulator runs a
cluster's CTAs interleaved (a barrier of the whole cluster, ``cluster_map`` into a peer's
shared memory, a departed CTA's memory unmapped). Here: the cluster merge equals the
counters' fused merge and the two launches bit for bit over NaN-poisoned outputs at every
geometry the partial accepts (GQA 1-32, head_dim 64-256, pages 1-16, first-page offsets,
bfloat16, fp8 pools, sinks, soft cap, window, 2-8 CTAs per cluster, both grid orders),
and the float64 oracle; which plans a cluster takes; the specialization, its defines and
the launch's refusals; the setting's check; and every cluster size compiled by NVRTC.
``tests/mutants.py`` plants its bugs (``v2tc-cluster-*``); the GPU repeat is
``tests/test_cluster_merge_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    assert_same_bits,
    needs_backend,
    sinks_for,
    spy_specs,
    tc_fp8_out_tol,
    tc_out_tol,
)

import paged_decode as pd
from paged_decode import cuda_compile
from paged_decode.backends import launches
from paged_decode.backends.launching import CLUSTER_MERGE_ENV, FUSED_MERGE_ENV, MERGE_SPLIT_ENV
from paged_decode.device import DeviceInfo
from paged_decode.errors import InvalidArgumentError
from paged_decode.problems import ProblemSpec, make_problem, make_table
from paged_decode.reference import oracle_decode
from paged_decode.specs import (
    CLUSTER_SIZES,
    GRID_ORDER_ENV,
    cuda_defines,
    v2tc_ctas_per_chunk,
    v2tc_spec,
)


def _plan(lengths, ppc, hq=32, hkv=8, d=128, page=16, offsets=None):
    pr = make_problem(ProblemSpec(len(lengths), 0, hq, hkv, d, page, seed=3),
                      lengths=lengths, offsets=offsets or [0] * len(lengths))
    be = pd.get_backend("reference")
    plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv))
    return pr, plan


@pytest.mark.parametrize("k", CLUSTER_SIZES)
def test_every_request_in_k_chunks_takes_clusters_of_k(k):
    _, plan = _plan([k * 64 * 16] * 3, 64)
    assert launches.cluster_merge_size(plan) == k
    # lengths that differ but cut into the same chunk count still fit
    _, plan = _plan([k * 64 * 16, k * 64 * 16 - 700, (k - 1) * 64 * 16 + 1], 64)
    assert launches.cluster_merge_size(plan) == k


@pytest.mark.parametrize("lengths,ppc,why", [
    ([1024] * 4, 64, "one chunk per request: no merge"),
    ([9 * 1024] * 2, 64, "9 chunks: past CUDA's portable cluster size"),
    ([4096, 2048, 4096], 64, "4, 2, 4 chunks"),
    ([4096, 2048, 6144], 64, "4, 2, 6 chunks: as many in all as 3 x 4"),
    ([4096, 0, 4096], 64, "an empty request has one (empty) chunk"),
])
def test_plans_a_cluster_cannot_take(lengths, ppc, why):
    _, plan = _plan(lengths, ppc)
    assert launches.cluster_merge_size(plan) == 0, why


@pytest.mark.parametrize("lengths,ppc,kv,d,want", [
    ([16384] * 64, 512, "float16", 128, True),         # 2 chunks of 8192 tokens, batch 64
    ([16384] * 63, 512, "float16", 128, False),        # the same at batch 63: not measured
    ([2048] * 3, 32, "bfloat16", 128, True),           # 4 chunks of 512
    ([8192] * 2, 128, "float16", 128, True),           # 4 chunks of 2048: the bound
    ([4 * 2064] * 2, 129, "float16", 128, False),      # 4 chunks of 2064
    ([8 * 4096] * 2, 256, "float16", 128, False),      # 8 chunks of 4096
    ([2048] * 3, 32, "float8_e4m3fn", 128, False),     # fp8 pools (4 chunks of 512)
    ([4096] * 2, 128, "float16", 64, False),           # head_dim 64: not measured
    ([1024] * 2, 64, "float16", 128, False),           # one chunk: no merge
])
def test_where_clusters_are_the_default(lengths, ppc, kv, d, want):
    table, _ = make_table(lengths, 16, offsets=[0] * len(lengths), slack=1.0)
    plan = pd.plan_decode(table, 4, 1, d, device=pd.get_backend("reference").device_info(),
                          pages_per_chunk=ppc, ctas_per_chunk=v2tc_ctas_per_chunk(4, 1))
    assert launches.cluster_merge_pays(plan, kv) is want


@pytest.mark.parametrize("batch,k,want", [
    (2, 8, True),     # 16 CTAs: the target of 8 units x 2
    (3, 8, False),    # 24 CTAs past it
    (3, 6, False),
    (2, 6, True),     # 12 CTAs
    (5, 4, True),     # 20 CTAs: clusters of 4 or fewer take any grid
    (9, 3, True),     # 27 CTAs
])
def test_wide_clusters_only_within_the_cta_target(batch, k, want):
    """Clusters of more than ``CLUSTER_MERGE_WIDE_ABOVE`` CTAs only where the grid is within
    the plan's CTA target: 6 and 8 chunks per request past it measured slower (S45-R2)."""
    device = DeviceInfo("cuda", "model", 8, 2, arch="9.0")
    table, _ = make_table([k * 128] * batch, 16, offsets=[0] * batch, slack=1.0)
    plan = pd.plan_decode(table, 4, 1, 128, device=device, pages_per_chunk=8,
                          ctas_per_chunk=v2tc_ctas_per_chunk(4, 1))
    assert (launches.cluster_merge_size(plan), plan.target_ctas) == (k, 16)
    assert plan.num_ctas == batch * k
    assert launches.cluster_merge_pays(plan, "float16") is want


@needs_backend("emulated-cuda")
@pytest.mark.parametrize("d,want", [(128, 2), (64, 0)])
def test_the_default_follows_the_rule(d, want):
    be = pd.get_backend("emulated-cuda")
    pr = make_problem(G(2, 0, 4, 1, d, 16, seed=36), lengths=[100, 96], offsets=[0, 0])
    plan = pd.plan_decode(pr.table, 4, 1, d, device=be.device_info(), pages_per_chunk=4,
                          ctas_per_chunk=v2tc_ctas_per_chunk(4, 1))
    _, seen = _run(be, pr, plan, "default")
    assert {(s.kernel, s.cluster) for s in seen} == {("v2tc", want)}, [s.uri for s in seen]


@needs_backend("emulated-cuda")
@pytest.mark.parametrize("hq,hkv,lengths,clusters,k,want", [
    (32, 2, [128, 120], True, 4, 4),    # GQA 16, 4 chunks of 32 tokens per request
    (8, 1, [64, 60], True, 2, 2),       # GQA 8
    (28, 4, [96, 90], True, 3, 3),      # GQA 7
    (32, 2, [128, 120], False, 4, 0),   # no clusters on the device
    (32, 2, [8192, 8000], True, 4, 0),  # 4 chunks of 2064 tokens: no clusters by default
], ids=["gqa16", "gqa8", "gqa7", "gqa16-no-clusters", "gqa16-long-chunks"])
def test_by_default_a_cluster_merge_fuses_at_any_gqa(monkeypatch, hq, hkv, lengths, clusters,
                                                     k, want):
    """Where the merge runs in clusters (``cluster_merge_pays``) it is fused at any GQA: the
    request's CTAs share its merge, where the counters' merge would serialize 7-16 heads
    on the last CTA (S46-R1: 0.7-2.4 us faster at GQA 8 / 16 than two launches). Elsewhere
    at GQA 7-16 the two launches stay. Either way the result is the two launches' bits."""
    be = pd.get_backend("emulated-cuda")
    for env in (FUSED_MERGE_ENV, CLUSTER_MERGE_ENV, MERGE_SPLIT_ENV):
        monkeypatch.delenv(env, raising=False)
    if not clusters:
        monkeypatch.setattr(be, "runs_clusters", lambda: False)
    n = len(lengths)
    pr = make_problem(G(n, 0, hq, hkv, 128, 16, seed=38), lengths=lengths, offsets=[0] * n)
    ppc = 2 if max(lengths) < 1024 else 129
    plan = pd.plan_decode(pr.table, hq, hkv, 128, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv))
    assert launches.cluster_merge_size(plan) == k
    assert be.fuses_merge(plan, "float16") is (want > 0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(MERGE_SPLIT_ENV, "1")       # the merge kernel as the fused merges run it
        seen = spy_specs(mp, be)
        out = np.full(pr.q.shape, np.nan, np.float32)
        lse = np.full(pr.q.shape[:-1], np.nan, np.float32)
        got = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be,
                        out=out, lse=lse, return_lse=True, out_dtype="float32")
    ran = sorted({(s.kernel, s.cluster) for s in seen})
    assert ran == ([("v2tc", want)] if want else [("merge", 0), ("v2tc", 0)]), ran
    two, _ = _run(be, pr, plan, "two")
    _same(tuple(be.to_numpy(x) for x in got), two, f"GQA {hq // hkv} default")
    monkeypatch.setenv(CLUSTER_MERGE_ENV, "0")      # clusters off: the two launches
    assert not be.fuses_merge(plan, "float16")


def test_the_specialization_and_its_defines():
    spec = v2tc_spec("float16", "float32", 128, 16, merged_dtype="float16", cluster=4)
    assert spec.uri.endswith("_merge-f16_cl-4")
    assert "-DPD_CLUSTER=4" in cuda_defines(spec=spec)
    plain = v2tc_spec("float16", "float32", 128, 16, merged_dtype="float16")
    assert plain.cluster == 0 and not any("PD_CLUSTER" in d for d in cuda_defines(spec=plain))
    with pytest.raises(ValueError, match="v2tc_spec: cluster must be 0 or, with merged_dtype"):
        v2tc_spec("float16", "float32", 128, 16, cluster=4)          # no fused merge
    for bad in (1, 9, 16):
        with pytest.raises(ValueError, match=f"got {bad}"):
            v2tc_spec("float16", "float32", 128, 16, merged_dtype="float16", cluster=bad)


@pytest.mark.parametrize("lengths,cluster,msg", [
    ([4096, 2048, 4096], 4, "v2tc_launch: a cluster merge of 4 CTAs needs every request of the "
                            "plan in exactly 4 chunks"),
    ([9 * 1024] * 3, 9, r"v2tc_launch: fused.cluster must be 0 or one of \(2, 3, 4, 5, 6, 7, "
                        r"8\), got 9"),
    ([2 * 1024] * 3, 1, r"v2tc_launch: fused.cluster must be 0 or one of .*, got 1"),
])
def test_the_launch_refuses_a_cluster_that_does_not_fit(lengths, cluster, msg):
    pr, plan = _plan(lengths, 16)
    fused = launches.FusedMerge(plan.o_indptr, np.zeros(24, np.int32),
                                np.zeros((3, 32, 128), np.float16), np.zeros((3, 32), np.float32),
                                "float16", cluster=cluster)
    with pytest.raises(ValueError, match=msg):
        launches.v2tc_launch(kv_dtype="float16", out_dtype="float32", plan=plan, sm_scale=0.1,
                             q=pr.q, k_pages=pr.k_pages, v_pages=pr.v_pages,
                             table=(pr.table.indices, pr.table.indptr, pr.table.last_page_len,
                                    pr.table.first_page_offset),
                             request_indices=plan.request_indices,
                             kv_tile_indices=plan.kv_tile_indices,
                             v_out=np.zeros((plan.num_chunks, 32, 128), np.float32),
                             lse_out=np.zeros((plan.num_chunks, 32), np.float32), fused=fused)


def _run(be, pr, plan, mode, **kw):
    """(out, lse) of one v2tc decode into NaN-poisoned outputs with the merge ``mode``:
    "two" (two launches), "counters" (fused, counters), "cluster" or "default" (fused, the
    setting unset); and the specs run."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FUSED_MERGE_ENV, "0" if mode == "two" else "1")
        if mode == "default":
            mp.delenv(CLUSTER_MERGE_ENV, raising=False)
        else:
            mp.setenv(CLUSTER_MERGE_ENV, "1" if mode == "cluster" else "0")
        mp.setenv(MERGE_SPLIT_ENV, "1")    # the merge kernel as the fused merges run it
        seen = spy_specs(mp, be)
        out = np.full(pr.q.shape, np.nan, np.float32)
        lse = np.full(pr.q.shape[:-1], np.nan, np.float32)
        res = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                        backend=be, out=out, lse=lse, return_lse=True, out_dtype="float32",
                        **kw)
        assert pd.last_outcome().path == "v2tc+merge"
    return tuple(be.to_numpy(x) for x in res), seen


_same = assert_same_bits


G = ProblemSpec
CASES = [
    # (id, spec, lengths, offsets, pages per chunk, chunks per request, decode keywords)
    ("g4-d64-k2", G(3, 0, 8, 2, 64, 16, seed=21), [60, 50, 64], [0, 3, 0], 2, 2, {}),
    ("g4-d64-k3-offsets", G(2, 0, 8, 2, 64, 16, seed=22), [90, 85], [5, 11], 2, 3, {}),
    ("g4-d64-k5", G(2, 0, 8, 2, 64, 8, seed=23), [75, 80], [0, 0], 2, 5, {}),
    ("g4-d128-k8", G(2, 0, 8, 2, 128, 4, seed=24), [60, 64], [0, 0], 2, 8, {}),
    ("g1-d96-k4", G(2, 0, 4, 4, 96, 16, seed=25), [120, 128], [0, 0], 2, 4, {}),
    ("g8-d128-k3", G(2, 0, 16, 2, 128, 16, seed=26), [96, 90], [0, 0], 2, 3, {}),
    # 16 rows of 32 float4 columns over 2 x 128 threads: each thread merges two
    ("g16-d128-k2-two-per-thread", G(2, 0, 16, 1, 128, 16, seed=34), [64, 57], [0, 2], 2,
     2, {}),
    ("g32-two-tiles-ps1-k4", G(2, 0, 32, 1, 64, 1, seed=27), [30, 29], [0, 0], 8, 4, {}),
    ("g2-d256-k2", G(2, 0, 4, 2, 256, 16, seed=28), [60, 64], [0, 0], 2, 2, {}),
    ("g4-bf16-k4", G(2, 0, 8, 2, 64, 16, "bfloat16", "bfloat16", seed=29), [128, 120],
     [0, 0], 2, 4, {}),
    ("g4-e4m3-k4", G(2, 0, 8, 2, 64, 16, kv_dtype="float8_e4m3fn", seed=30), [128, 128],
     [0, 0], 2, 4, {"k_scale": 0.5, "v_scale": 0.25}),
    ("g4-e5m2-k2", G(2, 0, 8, 2, 128, 16, kv_dtype="float8_e5m2", seed=31), [64, 60],
     [0, 0], 2, 2, {"k_scale": 2.0, "v_scale": 0.5}),
    ("g4-sinks-softcap-k4", G(2, 0, 8, 2, 64, 16, seed=32), [128, 128], [0, 0], 2, 4,
     {"sinks": "sinks", "logits_soft_cap": 3.0}),
    ("g4-window-k3", G(2, 0, 8, 2, 64, 16, seed=33), [128, 128], [0, 0], 1, 3,
     {"window_left": 37}),
]


@needs_backend("emulated-cuda")
@pytest.mark.parametrize("spec,lengths,offsets,ppc,k,kw", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_cluster_merge_equals_the_other_merges_and_the_oracle(spec, lengths, offsets, ppc, k,
                                                              kw):
    be = pd.get_backend("emulated-cuda")
    kw = dict(kw)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = sinks_for(spec.num_qo_heads)
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    hq, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv),
                          window_left=kw.get("window_left", -1))
    assert launches.cluster_merge_size(plan) == k, plan.o_indptr
    two, _ = _run(be, pr, plan, "two", **kw)
    counted, _ = _run(be, pr, plan, "counters", **kw)
    clustered, seen = _run(be, pr, plan, "cluster", **kw)
    # one launch (recorded, then replayed), clustered
    assert {(s.kernel, s.cluster) for s in seen} == {("v2tc", k)}, [s.uri for s in seen]
    _same(counted, two, f"{spec.label}: counters")
    _same(clustered, two, f"{spec.label}: cluster merge")
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    fp8 = spec.kv_dtype.startswith("float8")
    assert_matches_oracle(*clustered, ref, ref_lse, "float32", spec.label,
                          tol=tc_fp8_out_tol(spec.q_dtype, "float32") if fp8
                          else tc_out_tol(spec.kv_dtype, "float32"))


@needs_backend("emulated-cuda")
@pytest.mark.parametrize("case", ["nan-k", "inf-v", "empty-trailing-chunks",
                                  "empty-requests", "empty-requests-sinks"])
def test_non_finite_and_empty_partials(case):
    """A NaN score poisons its head (a NaN LSE in one partial), +inf in V gives a
    non-finite row, plans made with headroom have empty trailing chunks (LSE -inf, no
    weight), a request with no tokens merges to zeros and -inf, or to its sink alone:
    the cluster merge gives what the two launches give, NaN where NaN."""
    be = pd.get_backend("emulated-cuda")
    empty = case.startswith("empty-requests")
    lengths = [0, 0] if empty else [64, 60]
    pr = make_problem(G(2, 0, 8, 2, 64, 16, seed=38), lengths=lengths, offsets=[0, 0])
    kw = {"sinks": sinks_for(8)} if case.endswith("sinks") else {}
    if case in ("nan-k", "inf-v"):
        page = int(pr.table.indices[1])                  # request 0's second chunk (ppc 1)
        pool = pr.k_pages if case == "nan-k" else pr.v_pages
        pool[page, 3, 0, 5] = np.nan if case == "nan-k" else np.inf
    headroom = 0 if case in ("nan-k", "inf-v") else 48
    plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(), pages_per_chunk=1,
                          ctas_per_chunk=v2tc_ctas_per_chunk(8, 2), headroom=headroom)
    k = launches.cluster_merge_size(plan)
    assert k >= 2, plan.chunks_per_request
    two, _ = _run(be, pr, plan, "two", **kw)
    clustered, seen = _run(be, pr, plan, "cluster", **kw)
    assert {(s.kernel, s.cluster) for s in seen} == {("v2tc", k)}
    _same(clustered, two, case)
    out, lse = clustered
    if case == "nan-k":
        assert np.isnan(out[0, :4]).all() and np.isnan(lse[0, :4]).all()   # KV head 0
        assert np.isfinite(out[0, 4:]).all() and np.isfinite(out[1]).all()
    elif case == "inf-v":
        assert not np.isfinite(out[0, :4]).all() and np.isfinite(out[1]).all()
    elif case == "empty-requests":
        assert (out == 0).all() and np.isneginf(lse).all()
    elif case == "empty-requests-sinks":
        assert (out == 0).all() and np.isfinite(lse).all()
    else:
        assert np.isfinite(out).all() and np.isfinite(lse).all()


@needs_backend("emulated-cuda")
@pytest.mark.parametrize("order", ["heads", "chunks"])
def test_both_grid_orders(monkeypatch, order):
    """Heads first numbers whole clusters head slots first (``pd::grid_cell``); a cluster
    is still one request's chunks of one head slot."""
    be = pd.get_backend("emulated-cuda")
    monkeypatch.setenv(GRID_ORDER_ENV, order)
    spec = G(3, 0, 8, 4, 64, 16, seed=34)
    pr = make_problem(spec, lengths=[96, 90, 95], offsets=[0, 0, 0])
    plan = pd.plan_decode(pr.table, 8, 4, 64, device=be.device_info(), pages_per_chunk=2,
                          ctas_per_chunk=v2tc_ctas_per_chunk(8, 4))
    assert launches.cluster_merge_size(plan) == 3
    two, _ = _run(be, pr, plan, "two")
    clustered, seen = _run(be, pr, plan, "cluster")
    assert ("-DPD_HEADS_FIRST=1" in cuda_defines(spec=seen[0])) == (order == "heads")
    _same(clustered, two, f"{order} first")


@needs_backend("emulated-cuda")
def test_a_multi_token_call(monkeypatch):
    """Three query tokens per request folded into the GQA group (12 rows per CTA): the
    cluster merge writes each (request, token, head) row where the counters' merge does."""
    be = pd.get_backend("emulated-cuda")
    pr = make_problem(G(3, 0, 8, 2, 64, 16, seed=37), lengths=[64, 60, 52], offsets=[0, 0, 0])
    t = 3
    q = np.random.default_rng(2).standard_normal((3, t, 8, 64)).astype(np.float16)
    plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(), pages_per_chunk=1,
                          ctas_per_chunk=v2tc_ctas_per_chunk(8, 2), query_tokens=t)
    assert launches.cluster_merge_size(plan) == 4
    got = {}
    for mode in ("counters", "cluster"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(FUSED_MERGE_ENV, "1")
            mp.setenv(CLUSTER_MERGE_ENV, "1" if mode == "cluster" else "0")
            seen = spy_specs(mp, be)
            out, lse = pd.decode(q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                                 backend=be, out_dtype="float32", return_lse=True)
        # the common range's launch in clusters (a call's other launches may not be)
        assert (4 in {s.cluster for s in seen}) == (mode == "cluster"), [s.uri for s in seen]
        got[mode] = (be.to_numpy(out).reshape(3, t * 8, 64), be.to_numpy(lse).reshape(3, t * 8))
    assert np.isfinite(got["cluster"][0]).all()
    _same(got["cluster"], got["counters"], "multi-token")


@needs_backend("emulated-cuda")
def test_a_backend_without_clusters_keeps_the_counters(monkeypatch):
    """Where the backend runs no clusters (a CUDA device before sm_90) the setting changes
    nothing: the counters' fused merge runs; a bad value is refused everywhere."""
    be = pd.get_backend("emulated-cuda")
    monkeypatch.setattr(be, "runs_clusters", lambda: False)
    pr = make_problem(G(2, 0, 8, 2, 64, 16, seed=35), lengths=[128, 128], offsets=[0, 0])
    plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(), pages_per_chunk=2,
                          ctas_per_chunk=v2tc_ctas_per_chunk(8, 2))
    assert launches.cluster_merge_size(plan) == 4
    counted, _ = _run(be, pr, plan, "counters")
    got, seen = _run(be, pr, plan, "cluster")
    assert {(s.kernel, s.cluster) for s in seen} == {("v2tc", 0)}, [s.uri for s in seen]
    _same(got, counted, "no clusters")
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    monkeypatch.setenv(CLUSTER_MERGE_ENV, "yes")
    with pytest.raises(InvalidArgumentError, match="decode: PAGED_DECODE_CLUSTER_MERGE must be "
                                                   "0 or 1, got 'yes'"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be,
                  out_dtype="float32")


@pytest.mark.nvcc
@pytest.mark.skipif(cuda_compile.available() is None,
                    reason="no NVRTC library and no nvcc on this machine")
@pytest.mark.parametrize("order", ["heads", "chunks"])
def test_every_cluster_size_compiles(monkeypatch, order):
    """The cluster specializations with the real toolchain (sm_90: the cluster PTX, the
    distributed shared-memory loads), every size, 16-bit and fp8 pools, sinks, head_dim
    64 and 128, in both grid orders (``PD_HEADS_FIRST`` maps whole clusters)."""
    monkeypatch.setenv("PAGED_DECODE_GRID_ORDER", order)
    specs = {v2tc_spec(kv, "float32", d, 16, q_dtype="bfloat16" if kv == "bfloat16" else "float16",
                       merged_dtype=out, cluster=k, sink=sink)
             for kv, d, out, k, sink in [("float16", 128, "float16", 2, False),
                                         ("float16", 128, "float32", 3, True),
                                         ("bfloat16", 64, "bfloat16", 4, False),
                                         ("float8_e4m3fn", 128, "float16", 5, False),
                                         ("float8_e5m2", 64, "float16", 6, True),
                                         ("float16", 64, "float16", 7, False),
                                         ("float16", 128, "float16", 8, True)]}
    cuda_compile.compile_specs(specs)
