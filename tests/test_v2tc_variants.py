"""Decode variants on the tensor-core v2 partial (``path="v2tc"``; issue #14 items 2-3):
sliding window, logits soft cap and attention sinks, alone and combined, in both dialects
(the CUDA ``mma.sync`` body and the Metal ``simdgroup_matrix`` body, run by the CPU
emulator) against the float64 oracle (``reference.oracle_decode``, which writes out the
window, cap and sink independently of the package's window table and merge).

What is covered: float16 and bfloat16, GQA 1/4/7/8/16/24/32 (one and two 16-row tiles,
8- and 16-row Metal threadgroups), head_dim 64/96/128/256, page sizes 1 and 16, first-page
offsets (``make_problem``'s jitter, and explicit ones), empty requests, one chunk per
request (the partial writes the output and joins the sink in its final store) and split
plans (float32 partials without sinks, the merge joins each sink once), NaN-poisoned
outputs; sinks over an all-empty batch; a window that cuts mid-page; the non-finite rules;
multi-token calls on v2tc with every variant; ``path="auto"`` choosing v2tc for a call with
variants; prepared calls and the engine step. ``tests/mutants.py`` plants the bugs these
tests must catch (``v2tc-*`` variant mutants). The GPU repeat is
``tests/test_variants_gpu.py`` (marked ``gpu``). Nothing here ran on Apple hardware.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import LSE_ATOL, assert_matches_oracle, sinks_for, table_of, tc_out_tol, variant_kwargs
from helpers import VARIANTS as BASE_VARIANTS

import paged_decode as pd
from paged_decode import crossover, get_backend
from paged_decode.backends import availability
from paged_decode.kernels import decode_v2_tc
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk, v2tc_metal_spec, v2tc_spec
from paged_decode.variants import window_table

pytestmark = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                reason=f"emulator unavailable: "
                                       f"{availability('emulated-cuda').reason}")

LOG2E = 1.0 / math.log(2.0)
BACKENDS = ["emulated-cuda", "emulated-metal"]
SINGLE = 10 ** 6          # pages per chunk: one chunk per request (the final store)
SPLITS = {"one": SINGLE, "split": 1}


#: the variant tests' table (``helpers.VARIANTS``) with cap and sinks together, before
#: all three
VARIANTS = {**{k: v for k, v in BASE_VARIANTS.items() if k != "all"},
            "cap-sinks": {"logits_soft_cap": 3.0, "sinks": True}, "all": BASE_VARIANTS["all"]}


def run_v2tc_variant(be, pr, kw: dict, ppcs, *, out_dtypes=None) -> list:
    """Decode problem ``pr`` on ``path="v2tc"`` with variants ``kw`` under each forced
    ``pages_per_chunk`` (``None``: the plan searched for the tensor-core partial), into
    NaN-poisoned outputs, and compare with the float64 oracle: the float32 output always,
    the pools' 16-bit output where a plan needs no merge (the partial's own store).
    Returns the plans."""
    hq, d = int(pr.q.shape[1]), int(pr.q.shape[2])
    hkv = int(pr.k_pages.shape[2])
    dtype = be.dtype_of(be.asarray(pr.q))
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    kwb = {**kw, "sinks": None if kw.get("sinks") is None else be.asarray(kw["sinks"])}
    b = pr.table.batch_size
    plans = []
    for ppc in ppcs:
        plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(),
                              pages_per_chunk=ppc, ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv),
                              window_left=kw.get("window_left", -1))
        plans.append(plan)
        outs = out_dtypes or (["float32"] if plan.needs_merge else ["float32", dtype])
        for od in outs:
            out = be.asarray(np.full((b, hq, d), np.nan, od))
            lse = be.asarray(np.full((b, hq), np.nan, np.float32))
            got, got_lse = pd.decode(q, k, v, pr.table, plan, path="v2tc", out=out, lse=lse,
                                     return_lse=True, out_dtype=od, backend=be, **kwb)
            o = pd.last_outcome()
            assert o.path == ("v2tc+merge" if plan.needs_merge else "v2tc"), o
            for name in kw:
                assert name in o.detail, o
            assert_matches_oracle(be.to_numpy(got), be.to_numpy(got_lse), ref, ref_lse, od,
                                  f"{be.name} ppc={ppc} {od} {sorted(kw)}",
                                  tol=tc_out_tol(dtype, od))
    return plans


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_each_variant_alone_and_combined(backend_name, variant, split):
    be = get_backend(backend_name)
    pr = make_problem(ProblemSpec(3, 70, 8, 2, 64, 16, seed=0))   # mid-page starts
    plans = run_v2tc_variant(be, pr, variant_kwargs(VARIANTS[variant], 8), [SPLITS[split]])
    # one chunk: the partial's store; split: the merge (W = 0 leaves one page)
    assert plans[0].needs_merge == (split == "split" and variant != "w0")


#: (id, spec, pages per chunk): every GQA class of both dialects, every head dim, pages of
#: 1 and 16, both 16-bit dtypes, each with all three variants
GEOMETRIES = [
    ("d64-g1-ps16-f16", ProblemSpec(3, 70, 4, 4, 64, 16, seed=41), [None, SINGLE]),
    ("d128-g4-ps1-bf16", ProblemSpec(2, 45, 8, 2, 128, 1, "bfloat16", "bfloat16", seed=42),
     [7, SINGLE]),
    ("d96-g7-ps16-f16", ProblemSpec(2, 90, 7, 1, 96, 16, seed=43), [1, SINGLE]),
    ("d256-g8-ps16-bf16", ProblemSpec(1, 60, 8, 1, 256, 16, "bfloat16", "bfloat16", seed=44),
     [1, SINGLE]),
    ("d64-g16-ps1-f16", ProblemSpec(2, 37, 32, 2, 64, 1, seed=45), [5, SINGLE]),
    ("d128-g32-ps16-bf16", ProblemSpec(1, 80, 32, 1, 128, 16, "bfloat16", "bfloat16", seed=46),
     [1, SINGLE]),
    ("d64-g24-ps16-f16", ProblemSpec(2, 40, 24, 1, 64, 16, seed=47), [1]),
]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("spec,ppcs", [g[1:] for g in GEOMETRIES], ids=[g[0] for g in GEOMETRIES])
def test_every_geometry_with_all_variants(backend_name, spec, ppcs):
    be = get_backend(backend_name)
    pr = make_problem(spec)
    kw = {"window_left": 29, "logits_soft_cap": 2.5, "sinks": sinks_for(spec.num_qo_heads)}
    run_v2tc_variant(be, pr, kw, ppcs)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_ragged_batch_with_empty_requests_and_offsets(backend_name):
    # empty requests in the middle and at the end, first page offsets up to P - 1, a
    # request of one token, a window longer than some requests and shorter than others
    be = get_backend(backend_name)
    pr = make_problem(ProblemSpec(6, 0, 8, 2, 64, 16, seed=49),
                      lengths=[70, 0, 33, 1, 129, 0], offsets=[3, 0, 15, 0, 9, 0])
    kw = {"window_left": 40, "logits_soft_cap": 2.0, "sinks": sinks_for(8)}
    run_v2tc_variant(be, pr, kw, [None, 1, SINGLE])


def _empty_problem(lengths, hq=8, hkv=2, d=64, p=16):
    t = table_of(lengths=lengths, page_size=p, spare_pages=2)
    rng = np.random.default_rng(4)
    k = rng.standard_normal((t.num_pages, p, hkv, d)).astype(np.float16)
    v = rng.standard_normal(k.shape).astype(np.float16)
    q = rng.standard_normal((len(lengths), hq, d)).astype(np.float16)
    return type("Pr", (), {"q": q, "k_pages": k, "v_pages": v, "table": t})


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_sinks_over_empty_requests_give_zeros_and_the_sinks_lse(backend_name, split):
    """A request without a visible token has the sink's state alone: zeros and
    LSE = sink * log2(e), in the final store and through the merge; an all-empty batch
    too (every chunk of the plan empty)."""
    be = get_backend(backend_name)
    sk = sinks_for(8)
    for lengths in ([0, 45, 0, 17], [0, 0]):
        pr = _empty_problem(lengths)
        ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, sinks=sk)
        empty = np.asarray(lengths) == 0
        assert np.array_equal(ref[empty], np.zeros((int(empty.sum()), 8, 64)))
        assert np.allclose(ref_lse[empty], sk * LOG2E)
        for kw in ({"sinks": sk}, {"sinks": sk, "window_left": 4, "logits_soft_cap": 2.0}):
            run_v2tc_variant(be, pr, kw, [SPLITS[split]])
            plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(),
                                  pages_per_chunk=SPLITS[split],
                                  ctas_per_chunk=v2tc_ctas_per_chunk(8, 2),
                                  window_left=kw.get("window_left", -1))
            out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                                 return_lse=True, out_dtype="float32", backend=be, **kw)
            out, lse = be.to_numpy(out), be.to_numpy(lse)
            assert np.array_equal(out[empty], np.zeros_like(out[empty]))
            assert np.abs(lse[empty] - sk * LOG2E).max() <= LSE_ATOL


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_window_that_cuts_mid_page_reads_only_its_pages(backend_name):
    """A window whose first token lies inside a page (and a first page offset before it):
    the window table starts mid-page, the v2tc plan has chunks over the window's pages
    only, and both the final store and the merge see exactly the last W + 1 tokens (one
    more or one fewer is outside the tolerance)."""
    be = get_backend(backend_name)
    p, w = 16, 42
    pr = make_problem(ProblemSpec(2, 0, 8, 2, 64, p, seed=70, jitter=False),
                      lengths=[200, 131], offsets=[5, 11])
    wt = window_table(pr.table, w)
    assert np.array_equal(wt.visible_lens, [w + 1, w + 1])
    assert (wt.first_page_offset > 0).all()                       # starts mid-page
    pages = -(-(wt.first_page_offset + w + 1) // p)               # pages the window spans
    assert np.array_equal(wt.pages_per_request, pages)
    plans = run_v2tc_variant(be, pr, {"window_left": w}, [1, SINGLE])
    assert plans[0].num_chunks == int(pages.sum())                # no chunk outside
    assert plans[1].num_chunks == 2
    # negative control: the window's neighbours are distinguishable from it
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, window_left=w)
    for other in (w - 1, w + 1):
        near, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, window_left=other)
        assert np.abs(near - ref).max() / np.abs(ref).max() > tc_out_tol("float16", "float32")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_non_finite_rules_hold_with_variants(backend_name):
    """An infinite K element poisons its heads under a soft cap (tanh would make the
    score finite); a NaN or +inf sink poisons its head; a -inf sink is no sink: in the
    final store and through the merge."""
    be = get_backend(backend_name)
    pr = make_problem(ProblemSpec(3, 70, 8, 2, 64, 16, seed=0))
    k = pr.k_pages.copy()
    k[int(pr.table.request_pages(1)[-1]), 0, 1, 0] = np.inf     # request 1, KV head 1
    sk = sinks_for(8)
    sk[0], sk[1], sk[2] = np.nan, np.inf, -np.inf
    kw = {"logits_soft_cap": 1.0, "sinks": sk}
    ref, ref_lse = oracle_decode(pr.q, k, pr.v_pages, pr.table, **kw)
    bad = np.isnan(ref_lse)
    assert bad[:, :2].all() and not bad[:, 2].any() and bad[1, 4:].any()
    for ppc in (SINGLE, 1):
        plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(),
                              pages_per_chunk=ppc, ctas_per_chunk=v2tc_ctas_per_chunk(8, 2))
        out, lse = pd.decode(pr.q, k, pr.v_pages, pr.table, plan, path="v2tc",
                             return_lse=True, out_dtype="float32", backend=be,
                             logits_soft_cap=1.0, sinks=be.asarray(sk))
        out, lse = be.to_numpy(out), be.to_numpy(lse)
        assert np.array_equal(np.isnan(lse), bad), ppc
        assert np.array_equal(np.isnan(out).any(-1), bad), ppc
        assert np.abs(out[~bad] - ref[~bad]).max() <= tc_out_tol("float16", "float32")
        assert np.abs(lse[~bad] - ref_lse[~bad]).max() <= LSE_ATOL


# ---------------------------------------------------------------------------- host paths
@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("variant", ["cap", "sinks", "all"])
def test_multi_token_calls_run_v2tc_with_variants(backend_name, variant):
    """Multi-token decode on v2tc: each token's window ends at its own position (the
    split), the cap applies in both passes, the sinks enter each token's merge once."""
    be = get_backend(backend_name)
    kw = variant_kwargs(VARIANTS[variant], 8)
    pr = make_problem(ProblemSpec(3, 0, 8, 2, 64, 4, seed=11), lengths=[6, 50, 40],
                      offsets=[1, 3, 0])
    counts = [4, 4, 1]
    qi = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    q = (np.random.default_rng(111).standard_normal((9, 8, 64)) * 1.5).astype(np.float16)
    ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi, **kw)
    kwb = {**kw, "sinks": None if kw.get("sinks") is None else be.asarray(kw["sinks"])}
    for ppc in (None, 2):
        plan = None if ppc is None else pd.plan_decode(
            pr.table, 8, 2, 64, device=be.device_info(), pages_per_chunk=ppc,
            window_left=kw.get("window_left", -1), query_tokens=4,
            ctas_per_chunk=v2tc_ctas_per_chunk(32, 2))
        out, lse = pd.decode(be.asarray(q), be.asarray(pr.k_pages), be.asarray(pr.v_pages),
                             pr.table, plan, path="v2tc", qo_indptr=qi, return_lse=True,
                             out_dtype="float32", backend=be, **kwb)
        o = pd.last_outcome()
        assert o.path == "v2tc+merge" and "query tokens" in o.detail, o
        for name in kw:
            assert name in o.detail, o
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                              f"{backend_name} {o}", tol=tc_out_tol("float16", "float32"))


def _crossover_to_v2tc(tmp_path, monkeypatch, be, pr):
    b = pr.table.batch_size
    ctx = pr.table.total_visible / b
    path = tmp_path / "xt.json"
    path.write_text(json.dumps({"device": be.device_info().name, "cells": [
        {"batch": b, "context": ctx, "page_size": pr.table.page_size, "group": 4,
         "best": "v2tc", "times_us": {"v2tc": 5.0, "v2": 8.0, "v1": 9.0}}]}))
    monkeypatch.setenv(crossover.ENV, str(path))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_auto_chooses_v2tc_for_calls_with_variants(backend_name, tmp_path, monkeypatch):
    """``path="auto"`` takes v2tc from the crossover table for a call with every variant
    (v2tc implements them); float32 pools, which v2tc does not take, get the cell's
    fastest other path."""
    be = get_backend(backend_name)
    pr = make_problem(ProblemSpec(2, 90, 8, 2, 64, 16, seed=71))
    _crossover_to_v2tc(tmp_path, monkeypatch, be, pr)
    kw = {"window_left": 33, "logits_soft_cap": 2.0, "sinks": sinks_for(8)}
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    out, lse = pd.decode(be.asarray(pr.q), be.asarray(pr.k_pages), be.asarray(pr.v_pages),
                         pr.table, return_lse=True, out_dtype="float32", backend=be,
                         **{**kw, "sinks": be.asarray(kw["sinks"])})
    o = pd.last_outcome()
    assert o.path.startswith("v2tc") and "auto: v2tc" in o.reason, o
    assert "sinks" in o.detail and "window_left=33" in o.detail, o
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                          str(o), tol=tc_out_tol("float16", "float32"))
    f32 = make_problem(ProblemSpec(2, 90, 8, 2, 64, 16, "float32", "float32", seed=71))
    pd.decode(be.asarray(f32.q), be.asarray(f32.k_pages), be.asarray(f32.v_pages), f32.table,
              backend=be, **{**kw, "sinks": be.asarray(kw["sinks"])})
    assert pd.last_outcome().path.startswith("v2") and "v2tc" not in pd.last_outcome().path


def test_prepared_v2tc_keeps_its_variants_and_reads_bound_sinks():
    be = get_backend("emulated-cuda")
    pr = make_problem(ProblemSpec(3, 90, 8, 2, 64, 16, seed=53))
    sk = sinks_for(8)
    for ppc in (2, SINGLE):
        plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(), pages_per_chunk=ppc,
                              window_left=20)
        prep = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                                 return_lse=True, out_dtype="float32", backend=be,
                                 window_left=20, logits_soft_cap=3.0, sinks=sk)
        assert prep.path == ("v2tc+merge" if plan.needs_merge else "v2tc")
        for _ in range(2):
            out, lse = prep()
            ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table,
                                         window_left=20, logits_soft_cap=3.0, sinks=sk)
            assert_matches_oracle(out, lse, ref, ref_lse, "float32", f"prepared ppc={ppc}",
                                  tol=tc_out_tol("float16", "float32"))
            sk[...] = sk * 0.5 - 1.0            # bound: the next call reads the new values


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_engine_step_runs_v2tc_with_cap_and_sinks(backend_name, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(9)
    layers, hkv, d, hq, p = 2, 2, 64, 8, 4
    pool = pd.PagePool(96, p, hkv, d, "float16", num_layers=layers, backend=backend_name)
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [5, 1, 10]):
        x = rng.standard_normal((layers, n, hkv, d)).astype(np.float16)
        pool.append(s, x, x)
    sinks = rng.standard_normal(hq).astype(np.float32)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=hq, capacity=4, headroom=4, path="v2tc",
                         logits_soft_cap=2.0, sinks=pool.backend.asarray(sinks))
    q = (3 * rng.standard_normal((4, hq, d))).astype(np.float16)   # scores the cap bends
    k = rng.standard_normal((4, hkv, d)).astype(np.float16)
    out = np.full((4, hq, d), np.nan, np.float16)
    lse = np.full((4, hq), np.nan, np.float32)
    for it in range(4):
        step.begin()
        for layer in range(layers):
            step.append(layer, k, k)
            got, got_lse = step.decode(layer, q, out=out, lse=lse, return_lse=True)
            o = pd.last_outcome()
            assert o.path.startswith("v2tc") and "sinks" in o.detail, o
            kk, vv = pool.layer(layer)
            want = oracle_decode(q, np.asarray(kk), np.asarray(vv), step.table.page_table(),
                                 logits_soft_cap=2.0, sinks=sinks)
            assert_matches_oracle(np.asarray(got), np.asarray(got_lse), *want, "float16",
                                  f"step {it} layer {layer}",
                                  tol=tc_out_tol("float16", "float16"))


# ---------------------------------------------------------------------------- specializations
def test_variants_are_template_specializations_after_stages():
    """SOFT_CAP and SINK follow STAGES in the CUDA template, before the fused merge's
    MERGE and TF (and NUM_WARPS in Metal's, before its ROWS and KV_FP8); the URI names
    them, and a plain call compiles the plain kernel."""
    kd = decode_v2_tc.KERNEL
    assert kd.template[-5:] == ("STAGES", "SOFT_CAP", "SINK", "MERGE", "TF")
    plain = v2tc_spec("float16", "float32", 128, 16)
    both = v2tc_spec("float16", "float32", 128, 16, soft_cap=True, sink=True)
    assert not plain.soft_cap and not plain.sink
    assert both.uri == plain.uri + "_softcap_sink"
    assert kd.cuda_name_expression(plain).endswith(", false, false, false, float>")
    assert kd.cuda_name_expression(both).endswith(", true, true, false, float>")
    fused = v2tc_spec("float16", "float32", 128, 16, sink=True, merged_dtype="bfloat16")
    assert fused.uri == plain.uri + "_sink_merge-bf16"
    assert kd.cuda_name_expression(fused).endswith(", false, true, true, __nv_bfloat16>")
    m = v2tc_metal_spec("bfloat16", "float32", 64, 16, 7, soft_cap=True)
    assert [n for n, _ in kd.metal_template(m)][-4:] == ["SOFT_CAP", "SINK", "ROWS", "KV_FP8"]
    assert m.uri.endswith("_softcap")
    assert "sinks" in decode_v2_tc.METAL_INPUTS and "soft_cap_log2" in decode_v2_tc.METAL_INPUTS


@pytest.mark.parametrize("fused", ["1", "0"], ids=["fused-merge", "merge-kernel"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_merged_partials_never_hold_the_sink(backend_name, fused, monkeypatch):
    """The split plan's partials run the plain-sink specialization (the merge adds the
    sink once; with the fused merge, CUDA's, the partial's SINK is that merge's, its
    combine leaves it out); the one-chunk plan's partial runs the sink specialization."""
    from paged_decode.backends.launching import FUSED_MERGE_ENV
    monkeypatch.setenv(FUSED_MERGE_ENV, fused)
    from paged_decode.backends import launches
    be = get_backend(backend_name)
    seen: list = []
    real = launches.v2tc_launch

    def spy(**kw):
        launch = real(**kw)
        seen.append(launch.spec)
        return launch

    pr = make_problem(ProblemSpec(2, 60, 8, 2, 64, 16, seed=72))
    sk = be.asarray(sinks_for(8))
    mp = pytest.MonkeyPatch()
    mp.setattr(launches, "v2tc_launch", spy)
    try:
        for ppc in (1, SINGLE):
            plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(),
                                  pages_per_chunk=ppc)
            pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", backend=be,
                      logits_soft_cap=2.0, sinks=sk)
    finally:
        mp.undo()
    merged = fused == "1" and "metal" not in backend_name
    assert [(s.soft_cap, s.sink, s.out_dtype, s.merged_dtype) for s in seen] == [
        (True, merged, "float32", "float16" if merged else ""), (True, True, "float16", "")]


def test_bench_times_the_v2tc_arm_with_every_variant(tmp_path):
    """The bench's v2tc arm plans with the case's window (its own CTA search), runs the
    cap and the sinks, and verifies against the oracle before timing."""
    from click.testing import CliRunner

    from paged_decode.cli import main
    js = tmp_path / "b.json"
    res = CliRunner().invoke(main, [
        "bench", "--backend", "emulated-cuda", "--preset", "cpu", "--context", "512",
        "--batch", "1", "--page", "16", "--arms", "v2tc", "--window-left", "100",
        "--soft-cap", "30", "--sinks", "--reps", "1", "--warmup", "0", "--json", str(js)],
        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    (r,) = json.loads(js.read_text())["results"]
    arm = r["arms"]["v2tc"]
    assert arm["verified"] and arm["ran"] in ("v2tc", "v2tc+merge"), arm
    assert arm["max_rel_error"] <= tc_out_tol("float16", "float16") and arm["call"], arm
    assert "W100" in res.output and "cap30" in res.output and "sinks" in res.output


def test_auto_reads_the_folded_group_for_several_query_tokens(monkeypatch):
    """A multi-token ``auto`` call looks up the crossover cell of its common pass's
    folded group (T x G): a table with v2 fastest at G and v2tc at T x G picks v2tc for
    T = 4 query tokens and v2 for one; the multi-token answer matches the oracle."""
    from paged_decode import call as call_mod
    from paged_decode.crossover import Cell, CrossoverTable
    be = get_backend("emulated-cuda")
    table = CrossoverTable("test", "test.json", (
        Cell(2, 40, 16, 2, "v2", {"v2": 1.0, "v2tc": 2.0, "v1": 3.0}),
        Cell(2, 40, 16, 8, "v2tc", {"v2": 2.0, "v2tc": 1.0, "v1": 3.0})))
    monkeypatch.setattr(call_mod, "table_for", lambda name, arch="": table)
    pr = make_problem(ProblemSpec(2, 40, 4, 2, 64, 16, "float16", seed=81))
    rng = np.random.default_rng(82)
    q4 = rng.standard_normal((2, 4, 4, 64)).astype(np.float16)
    out = pd.decode(q4, pr.k_pages, pr.v_pages, pr.table, backend=be, out_dtype="float32")
    o = pd.last_outcome()
    assert o.path == "v2tc+merge" and "auto: v2tc" in o.reason and "G8" in o.reason, o
    qo = np.arange(3) * 4
    ref, _ = oracle_decode(q4.reshape(8, 4, 64), pr.k_pages, pr.v_pages, pr.table,
                           qo_indptr=qo)
    assert_matches_oracle(np.asarray(out).reshape(8, 4, 64), None, ref, None, "float32",
                          "auto multi-token", tol=tc_out_tol("float16", "float32"))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=be, out_dtype="float32")
    o = pd.last_outcome()
    assert o.path.startswith("v2") and not o.path.startswith("v2tc"), o
