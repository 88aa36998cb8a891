"""The tensor-core v2 partial (``path="v2tc"``, ``kernels/decode_v2_tc.py``) on the CUDA
emulator against the float64 oracle: every GQA ratio class (1, 2, 4, 7, 8, 16, 24, 32:
one and two 16-row tiles, full and partial), head dims 64/96/128/256, page sizes 1, 3, 16,
64, 256 with mid-page starts, ragged batches with empty requests, single-chunk (the partial
writes the output in its dtype) and split + merge, float16 and bfloat16, NaN-poisoned
outputs and workspaces (``conftest.py``) and NaN in every pool entry outside the visible
windows (``make_problem``). Where it may not run it must say so. Its non-finite rules are
checked in ``test_nan_semantics.py``; ``test_cuda_gpu.py`` runs ``run_v2tc`` and ``CASES``
on the GPU (plus longer contexts), ``test_cuda_graphs.py`` captures it in a CUDA graph.

The Metal dialect (``simdgroup_matrix``) runs the same cases on the ``emulated-metal``
backend (``test_v2tc_metal_*``, plus 8- and 16-row threadgroups with partial tiles), the
double buffer under every schedule, its plan, prepared calls, refusals and negative
controls; ``test_mlx_kernels.py`` pins its ``metal_kernel`` arguments. Nothing of it ran
on Apple hardware.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, spy_specs, tc_fp8_out_tol, tc_out_tol

import paged_decode as pd
from paged_decode import UnsupportedProblemError
from paged_decode.backends import availability
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk

needs_emulator = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                    reason=f"emulator unavailable: "
                                           f"{availability('emulated-cuda').reason}")

SINGLE = 10 ** 6          # pages per chunk: one chunk per request (no merge)


@pytest.fixture(scope="module")
def emu():
    return pd.get_backend("emulated-cuda")


@pytest.fixture(scope="module")
def metal():
    return pd.get_backend("emulated-metal")


def run_v2tc(be, spec: ProblemSpec, ppcs, *, lengths=None, offsets=None, k_scale=None,
             v_scale=None, q_of=None) -> None:
    """Decode ``spec``'s random problem on ``path="v2tc"`` under each forced
    ``pages_per_chunk`` (``None``: the plan searched for the tensor-core partial's CTAs)
    and compare with the float64 oracle: float32 outputs always, and q's dtype written by
    the partial itself when a plan needs no merge. Pools of an fp8 ``spec.kv_dtype`` take
    ``k_scale`` / ``v_scale`` (the oracle on the dequantized values; the outcome must
    name the format). ``q_of``: applied to the backend's q before the calls (a view of
    it at another address, say).
    """
    fp8 = k_scale is not None
    scales = {"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **scales)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))   # cupy on "cuda"
    if q_of is not None:
        q = q_of(q)
    hq, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    kw = {"kv_dtype": spec.kv_dtype, **scales} if fp8 else {}
    for ppc in ppcs:
        plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(),
                              pages_per_chunk=ppc, ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv))
        outs = ["float32"] if plan.needs_merge else ["float32", spec.q_dtype]
        for od in outs:
            out, lse = pd.decode(q, k, v, pr.table, plan, path="v2tc", return_lse=True,
                                 out_dtype=od, backend=be, **kw)
            o = pd.last_outcome()
            assert o.path == ("v2tc+merge" if plan.needs_merge else "v2tc"), o
            assert not fp8 or f"kv {spec.kv_dtype}" in o.detail, o
            tol = tc_fp8_out_tol(spec.q_dtype, od) if fp8 else tc_out_tol(spec.kv_dtype, od)
            assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, od,
                                  f"{be.name} {spec.label} ppc={ppc} {od}", tol=tol)

CASES = [
    ("d64-g1-ps16-f16", ProblemSpec(3, 70, 4, 4, 64, 16, seed=41), [None, SINGLE]),
    # page size 3: every 16-token warp tile spans six pages, mid-page starts (jitter)
    ("d128-g2-ps3-bf16", ProblemSpec(2, 50, 4, 2, 128, 3, "bfloat16", "bfloat16", seed=42),
     [2, SINGLE]),
    ("d96-g4-ps16-f16", ProblemSpec(2, 45, 8, 2, 96, 16, seed=43), [1, SINGLE]),
    ("d64-g7-ps64-f16", ProblemSpec(2, 150, 7, 1, 64, 64, seed=44), [1, SINGLE]),
    ("d256-g8-ps16-bf16", ProblemSpec(1, 40, 8, 1, 256, 16, "bfloat16", "bfloat16", seed=45),
     [1, SINGLE]),
    ("d64-g16-ps1-f16", ProblemSpec(2, 37, 32, 2, 64, 1, seed=46), [5, SINGLE]),
    # two row tiles (32 heads of one KV head), pages of 256 holding a whole chunk
    ("d128-g32-ps256-f16", ProblemSpec(1, 300, 32, 1, 128, 256, seed=47), [1, SINGLE]),
    # two row tiles, the second with 8 live rows
    ("d64-g24-ps16-bf16", ProblemSpec(2, 40, 24, 1, 64, 16, "bfloat16", "bfloat16", seed=48),
     [1]),
]


@needs_emulator
@pytest.mark.parametrize("spec,ppcs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_v2tc_matches_oracle(emu, spec, ppcs):
    run_v2tc(emu, spec, ppcs)


@needs_emulator
@pytest.mark.parametrize("order", ["heads", "chunks"])
def test_both_flat_partials_match_the_oracle_in_either_grid_order(emu, order, monkeypatch):
    """``PAGED_DECODE_GRID_ORDER`` numbers the CTAs of v2 and v2tc head slots first or
    chunks first (``pd::grid_cell``); the rule picks heads first only where the L2 prefetch
    runs past a K/V row, so each order is forced here over head_dim 128 and 96, split and
    ragged (three requests, 3-7 chunks each, against 2-8 head slots), to run both on each."""
    from paged_decode.specs import GRID_ORDER_ENV
    monkeypatch.setenv(GRID_ORDER_ENV, order)
    for spec in (ProblemSpec(3, 0, 8, 2, 128, 16, seed=61),
                 ProblemSpec(3, 0, 8, 4, 96, 16, seed=62)):
        lengths = [100, 45, 70]
        run_v2tc(emu, spec, [1], lengths=lengths)
        pr = make_problem(spec, lengths=lengths)
        ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
        plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                              device=emu.device_info(), pages_per_chunk=1)
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2",
                             return_lse=True, out_dtype="float32", backend=emu)
        assert pd.last_outcome().path == "v2+merge"
        assert_matches_oracle(emu.to_numpy(out), emu.to_numpy(lse), ref, ref_lse, "float32",
                              f"v2 {spec.label} {order}")


@needs_emulator
@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_both_flat_partials_match_the_oracle_under_the_row_hint(emu, path, monkeypatch):
    run_row_hint(emu, path, monkeypatch)


def run_row_hint(be, path: str, monkeypatch) -> None:
    """Where ``row_hint_pays`` fires (its thresholds lowered so that a small head_dim-96
    plan reaches them) the partials compile with ``row_hint`` (the emulator with the GPU's
    defines: a 64-byte hint, chunks first), and the results stay right."""
    from paged_decode import specs
    monkeypatch.setattr(specs, "ROW_HINT_V2_CTAS", 1)
    monkeypatch.setattr(specs, "ROW_HINT_TOKENS", 16)
    monkeypatch.setattr(specs, "ROW_HINT_TC_TOKENS", 16)
    monkeypatch.setattr(specs, "ROW_HINT_TC_MIN_TOKENS", 16)
    seen = spy_specs(monkeypatch, be)
    spec = ProblemSpec(3, 0, 8, 4, 96, 16, seed=63)
    lengths = [100, 45, 70]
    pr = make_problem(spec, lengths=lengths)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = pd.plan_decode(pr.table, 8, 4, 96, device=be.device_info(), pages_per_chunk=2)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    out, lse = pd.decode(q, k, v, pr.table, plan, path=path, return_lse=True,
                         out_dtype="float32", backend=be)
    partials = [s for s in seen if s.kernel == path]
    assert partials and all(s.row_hint for s in partials), [(s.kernel, s.row_hint) for s in seen]
    assert "#define PD_L2_PREFETCH 64" in specs.cuda_define_text(partials[0])
    assert "PD_HEADS_FIRST" not in specs.cuda_define_text(partials[0])
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                          f"{path} {spec.label} row hint",
                          tol=tc_out_tol("float16", "float32") if path == "v2tc" else None)


@needs_emulator
@pytest.mark.parametrize("name", ["emulated-cuda", "emulated-metal"])
def test_v2tc_ragged_batch_with_empty_requests(name):
    # empty requests in the middle and at the end of the batch, first page offsets up to
    # page_size - 1, a request of one token, chunks past a short request's end
    spec = ProblemSpec(6, 0, 8, 2, 64, 16, seed=49)
    run_v2tc(pd.get_backend(name), spec, [None, 1, SINGLE], lengths=[70, 0, 33, 1, 129, 0],
             offsets=[3, 0, 15, 0, 9, 0])


@needs_emulator
@pytest.mark.parametrize("batch", [31, 32, 127, 128, 129])
def test_v2tc_request_entries_at_every_batch_size(emu, batch):
    run_request_entries(emu, batch)


def run_request_entries(be, batch: int) -> None:
    """Below 128 requests the CUDA partial loads every request's table entries spread over
    the lanes and shuffles its own out (lane r % 32 of register r // 32): requests past
    lane 31 and the entry indptr[r + 1] of the last request come from the last registers;
    from 128 requests on it loads its own. Lengths and first page offsets differ request
    by request, so an entry taken from a neighbour shows."""
    rng = np.random.default_rng(batch)
    lengths = rng.integers(1, 40, batch).tolist()
    offsets = [int(rng.integers(0, 16)) for _ in range(batch)]
    spec = ProblemSpec(batch, 0, 1, 1, 64, 16, seed=batch)
    run_v2tc(be, spec, [1, SINGLE], lengths=lengths, offsets=offsets)


@needs_emulator
@pytest.mark.parametrize("spec", [ProblemSpec(2, 40, 8, 2, 64, 16, seed=58),
                                  ProblemSpec(2, 40, 8, 2, 128, 16, "bfloat16",
                                              "float8_e4m3fn", seed=59)],
                         ids=["f16", "e4m3-bf16"])
def test_v2tc_reads_a_q_off_16_byte_alignment(emu, monkeypatch, spec):
    # a q whose address is not 16-byte aligned (a view into a larger buffer) is read by
    # 16-bit loads, and over fp8 pools its columns take the same q_column order
    from paged_decode.emulator.launch import MISALIGN
    monkeypatch.setitem(MISALIGN, "q", 2)
    fp8 = spec.kv_dtype.startswith("float8")
    run_v2tc(emu, spec, [None, SINGLE],
             **({"k_scale": 0.37, "v_scale": 2.5} if fp8 else {}))


@needs_emulator
@pytest.mark.parametrize("head_dim", [64, 128])
def test_v2tc_long_chunk_every_schedule(emu, head_dim):
    # one chunk of 330 tokens over shuffled pages of 8: six stages of 64 tokens through the
    # default two-slot ring (every slot refilled after it was read; its token rows too), under
    # every schedule (one warp running ahead included) with copies in flight until their
    # wait; the running max moves between stages, so a missed rescale shows
    spec = ProblemSpec(1, 330, 4, 1, head_dim, 8, seed=50 + head_dim, jitter=False)
    run_v2tc(emu, spec, [SINGLE])


@needs_emulator
@pytest.mark.parametrize("stages", [3, 4])   # the default (2) runs everywhere else
def test_v2tc_ring_depths(emu, monkeypatch, stages):
    # PAGED_DECODE_STAGES sets the ring depth (the default is 2): a double buffer waits for
    # every group, a 4-deep ring keeps three in flight; the URI names the depth
    from paged_decode.specs import v2tc_spec
    monkeypatch.setenv("PAGED_DECODE_STAGES", str(stages))
    assert f"_st-{stages}" in v2tc_spec("float16", "float32", 64, 8).uri
    run_v2tc(emu, ProblemSpec(1, 330, 4, 1, 64, 8, seed=57, jitter=False), [SINGLE])


@needs_emulator
def test_v2tc_default_plan_is_searched_for_its_ctas(emu):
    # G = 16: the v2 partial runs two CTAs per KV head (8 heads each), v2tc one, so its own
    # plan splits the batch into more chunks to reach the same device target
    pr = make_problem(ProblemSpec(2, 200, 32, 2, 64, 16, seed=51))
    out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=emu)
    oc = pd.last_outcome()
    tc_plan = pd.plan_decode(pr.table, 32, 2, 64, device=emu.device_info(),
                             ctas_per_chunk=v2tc_ctas_per_chunk(32, 2))
    v2_plan = pd.plan_decode(pr.table, 32, 2, 64, device=emu.device_info())
    assert tc_plan.ctas_per_chunk == 2 and v2_plan.ctas_per_chunk == 4
    assert oc.path == "v2tc+merge" and oc.num_chunks == tc_plan.num_chunks
    assert tc_plan.num_chunks > v2_plan.num_chunks
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, None, ref, None, "float16", "default plan",
                          tol=tc_out_tol("float16", "float16"))
    # a v2 plan runs on the tensor-core partial too (same chunks, other CTAs per chunk)
    out2 = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, v2_plan, path="v2tc",
                     out_dtype="float32", backend=emu)
    assert pd.last_outcome().num_chunks == v2_plan.num_chunks
    assert_matches_oracle(out2, None, ref, None, "float32", "v2 plan",
                          tol=tc_out_tol("float16", "float32"))


@needs_emulator
def test_auto_does_not_choose_v2tc(emu):
    pr = make_problem(ProblemSpec(2, 60, 8, 2, 64, 16, seed=52))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=emu)
    assert pd.last_outcome().path.startswith("v2") and "v2tc" not in pd.last_outcome().path


@needs_emulator
def test_prepared_v2tc_equals_decode(emu):
    from paged_decode.prepared import PreparedDecode, decode_cache
    pr = make_problem(ProblemSpec(3, 90, 8, 2, 64, 16, seed=53))
    plan = pd.plan_decode(pr.table, 8, 2, 64, device=emu.device_info(), pages_per_chunk=2)
    call = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                             backend=emu, return_lse=True, out_dtype="float32")
    assert isinstance(call, PreparedDecode) and call.path == "v2tc+merge"
    out, lse = call()
    assert "prepared call" in pd.last_outcome().reason
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", "prepared",
                          tol=tc_out_tol("float16", "float32"))
    # decode's fast path replays a cached prepared call on the second identical call
    decode_cache.clear()
    o2 = np.full_like(out, np.nan)
    for _ in range(2):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc", out=o2,
                  out_dtype="float32", backend=emu)
    assert pd.last_outcome().path == "v2tc+merge"
    assert "prepared call" in pd.last_outcome().reason
    np.testing.assert_array_equal(o2, out)


# ---------------------------------------------------------------------------- Metal
#: CASES plus what only the Metal dialect's shapes have: a 16-row threadgroup with 4 padding
#: rows at head_dim 256 (two 8-row tiles, one SIMD group), 9 heads per KV head (the second
#: 8-row tile holds one live row) at head_dim 96 over pages of 1
METAL_CASES = CASES + [
    ("d256-g12-ps16-f16", ProblemSpec(1, 40, 12, 1, 256, 16, seed=60), [1, SINGLE]),
    ("d96-g9-ps1-bf16", ProblemSpec(2, 30, 18, 2, 96, 1, "bfloat16", "bfloat16", seed=61),
     [3, SINGLE]),
]


@needs_emulator
@pytest.mark.parametrize("spec,ppcs", [c[1:] for c in METAL_CASES],
                         ids=[c[0] for c in METAL_CASES])
def test_v2tc_metal_matches_oracle(metal, spec, ppcs):
    run_v2tc(metal, spec, ppcs)


@needs_emulator
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_v2tc_metal_long_chunk_every_schedule(metal, head_dim):
    # one chunk of 330 tokens over shuffled pages of 8: 11 stages of 32 tokens at head_dim
    # 64 (4 SIMD groups), 14 of 24 at 128 (3), 42 of 8 at 256 (1), each buffer of the
    # double buffer refilled after it was read, the last stage partial; the running max
    # moves between stages, so a missed rescale shows
    spec = ProblemSpec(1, 330, 4, 1, head_dim, 8, seed=50 + head_dim, jitter=False)
    run_v2tc(metal, spec, [SINGLE])


def test_v2tc_metal_geometry():
    # the SIMD groups are what Metal's 32 KB of threadgroup memory holds at 16 rows, and
    # the emulator's arena (capped at 32 KB) holds every specialization of the tests above
    from paged_decode.kernels import decode_v2_tc as tc
    from paged_decode.specs import SUPPORTED_HEAD_DIMS, v2tc_metal_spec
    got = {d: tc.metal_simdgroups(d) for d in SUPPORTED_HEAD_DIMS}
    assert {d: got[d] for d in (64, 96, 128, 256)} == {64: 4, 96: 4, 128: 3, 256: 1}
    for d, n in got.items():
        assert tc.metal_threadgroup_bytes(d, n) <= tc.METAL_TG_BYTES
        assert n == tc.METAL_MAX_SIMDGROUPS or (
            tc.metal_threadgroup_bytes(d, n + 1) > tc.METAL_TG_BYTES)
    assert [tc.metal_rows(g) for g in (1, 7, 8, 9, 16, 17, 32)] == [8, 8, 8, 16, 16, 16, 16]
    spec = v2tc_metal_spec("bfloat16", "float32", 128, 16, 7)
    assert (spec.heads_per_cta, spec.num_warps, spec.stages) == (8, 3, 0)
    assert tc.KERNEL.metal_kernel.template == ("T", "TO", "HEAD_DIM", "PAGE_SIZE",
                                               "NUM_WARPS", "SOFT_CAP", "SINK", "ROWS",
                                               "KV_FP8")
    assert [v for _, v in tc.KERNEL.metal_template(spec)][2:] == [128, 16, 3, False, False,
                                                                   8, 0]
    # the CUDA dialect's template is unchanged by the Metal-only parameter
    assert "ROWS" not in tc.KERNEL.cuda_name_expression(spec)


@needs_emulator
def test_v2tc_metal_default_plan_is_searched_for_its_threadgroups(metal):
    # the plan's CTAs per chunk are the Metal dialect's threadgroups per chunk (Hkv *
    # ceil(G / 16), as in CUDA: G = 16 takes one 16-row threadgroup per KV head)
    pr = make_problem(ProblemSpec(2, 200, 32, 2, 64, 16, seed=51))
    out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=metal)
    oc = pd.last_outcome()
    tc_plan = pd.plan_decode(pr.table, 32, 2, 64, device=metal.device_info(),
                             ctas_per_chunk=v2tc_ctas_per_chunk(32, 2))
    assert tc_plan.ctas_per_chunk == 2
    assert oc.path == "v2tc+merge" and oc.num_chunks == tc_plan.num_chunks
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, None, ref, None, "float16", "metal default plan",
                          tol=tc_out_tol("float16", "float16"))


@needs_emulator
def test_prepared_v2tc_metal_equals_decode(metal):
    from paged_decode.prepared import PreparedDecode
    pr = make_problem(ProblemSpec(3, 90, 8, 2, 64, 16, "bfloat16", "bfloat16", seed=53))
    plan = pd.plan_decode(pr.table, 8, 2, 64, device=metal.device_info(), pages_per_chunk=2)
    call = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2tc",
                             backend=metal, return_lse=True, out_dtype="float32")
    assert isinstance(call, PreparedDecode) and call.path == "v2tc+merge"
    out, lse = (np.array(x) for x in call())        # copies: a replay may reuse buffers
    assert "prepared call" in pd.last_outcome().reason
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", "metal prepared",
                          tol=tc_out_tol("bfloat16", "float32"))
    out2, lse2 = call()                              # a replay gives the same bits
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(lse2, lse)


#: planted bugs of the Metal body that the oracle comparison must catch (negative
#: controls; tests/mutants.py holds the full list run by ``make mutants``)
METAL_CONTROLS = [
    ("no-rescale", "    oe[0] *= alpha;\n    oe[1] *= alpha;\n", "", AssertionError),
    ("no-barrier-before-refill",
     "    threadgroup_barrier(mem_flags::mem_threadgroup);\n    if (stage + 1 < n_stages)",
     "    if (stage + 1 < n_stages)", None),
]


@needs_emulator
@pytest.mark.parametrize("old,new,error", [c[1:] for c in METAL_CONTROLS],
                         ids=[c[0] for c in METAL_CONTROLS])
def test_v2tc_metal_negative_controls_fail(old, new, error):
    from mutants import Mutation, backend

    from paged_decode.emulator import RaceError
    bad = backend(Mutation("metal", ("v2tc",), old, new))
    with pytest.raises(error or RaceError):
        run_v2tc(bad, ProblemSpec(1, 330, 4, 1, 64, 8, seed=114, jitter=False), [SINGLE])


# ---------------------------------------------------------------------------- refusals
def _problem(q_dtype="float16", kv_dtype="float16", hq=8, hkv=2):
    return make_problem(ProblemSpec(2, 40, hq, hkv, 64, 16, q_dtype, kv_dtype, seed=54))


@pytest.mark.parametrize("be", [pytest.param(ReferenceBackend(), id="reference"),
                                pytest.param(ReferenceBackend(any_geometry=True),
                                             id="reference-any-geometry")])
def test_v2tc_is_refused_without_the_kernel(be):
    pr = _problem()
    with pytest.raises(UnsupportedProblemError,
                       match=r"decode: backend 'reference' cannot run path 'v2tc': path "
                             r"'v2tc' is the tensor-core partial, which this backend does not "
                             r"run \(it runs on 'cuda', 'emulated-cuda', 'metal' and "
                             r"'emulated-metal'\)"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=be)
    with pytest.raises(UnsupportedProblemError, match=r"has no tensor-core decode partial"):
        plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info())
        be.partial_tc(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, 0.125,
                      np.zeros((plan.num_chunks, 8, 64), np.float32),
                      np.zeros((plan.num_chunks, 8), np.float32))


@needs_emulator
@pytest.mark.parametrize("name", ["emulated-cuda", "emulated-metal"])
@pytest.mark.parametrize("q_dtype,kv_dtype,hq,hkv,match", [
    ("float32", "float32", 8, 2, r"path 'v2tc' needs q one of \('float16', 'bfloat16'\) and "
                                 r"the pools in q's dtype or one of \('float8_e4m3fn', "
                                 r"'float8_e5m2'\), got q float32 and pools float32"),
    ("float32", "float16", 8, 2, r"path 'v2tc' needs .* got q float32 and pools float16"),
    ("bfloat16", "float16", 8, 2, r"path 'v2tc' needs .* got q bfloat16 and pools float16"),
    ("float16", "float16", 40, 1, r"path 'v2tc' takes at most 32 query heads per KV head, "
                                  r"got 40"),
])
def test_v2tc_refuses_what_its_kernel_cannot_take(name, q_dtype, kv_dtype, hq, hkv, match):
    pr = _problem(q_dtype, kv_dtype, hq, hkv)
    with pytest.raises(UnsupportedProblemError,
                       match=rf"decode: backend '{name}' cannot run path 'v2tc': " + match):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=name)
    # the same problem on path v2 runs
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2", backend=name)


def test_v2tc_cuda_dialect_refuses_pools_of_2_pow_32_rows():
    # its staged token rows are 32-bit; a pool that large cannot be allocated here, so the
    # launch is built from a stand-in with the pool's shape
    from types import SimpleNamespace

    from paged_decode.backends.launches import V2TC_MAX_POOL_ROWS, v2tc_launch
    pr = _problem()
    plan = pd.plan_decode(pr.table, 8, 2, 64)
    pages = V2TC_MAX_POOL_ROWS // 16 + 1                 # 2^32 rows at page size 16
    huge = SimpleNamespace(shape=(pages, 16, 2, 64))
    kw = dict(kv_dtype="float16", out_dtype="float32", plan=plan, sm_scale=0.125, q=pr.q,
              k_pages=huge, v_pages=huge, table=(), request_indices=None,
              kv_tile_indices=None, v_out=None, lse_out=None)
    with pytest.raises(UnsupportedProblemError,
                       match=rf"decode: path 'v2tc' addresses pool rows in 32 bits: k_pages "
                             rf"holds {pages} pages of 16 tokens \({pages * 16} rows\), at most "
                             rf"{V2TC_MAX_POOL_ROWS} rows; path 'v2' takes larger pools"):
        v2tc_launch(**kw)
    v2tc_launch(**{**kw, "k_pages": SimpleNamespace(shape=(pages - 1, 16, 2, 64))})
    v2tc_launch(**kw, metal=True)           # the Metal dialect has 64-bit offsets


@needs_emulator
def test_v2tc_pool_row_limit_is_a_support_refusal_auto_falls_back(tmp_path, monkeypatch):
    # the 32-bit row limit is judged by supports(), so path="auto" takes another path and
    # path="v2tc" names the limit; the limit is lowered so a small pool reaches it
    import json

    from paged_decode import crossover
    from paged_decode.backends import Problem, launches
    pr = _problem()                                  # 8/2 x 64, page 16
    pages = int(pr.k_pages.shape[0])
    be = pd.get_backend("emulated-cuda")
    prob = Problem("float16", "float16", 8, 2, 64, 16, "v2tc", pages)
    assert be.supports(prob)
    monkeypatch.setattr(launches, "V2TC_MAX_POOL_ROWS", pages * 16 - 1)
    sup = be.supports(prob)
    assert not sup and f"k_pages holds {pages} pages of 16 tokens" in sup.reason
    assert launches.support(prob, tensor_cores=True, metal=True)   # 64-bit offsets there
    with pytest.raises(UnsupportedProblemError,
                       match=r"decode: backend 'emulated-cuda' cannot run path 'v2tc': path "
                             r"'v2tc' addresses pool rows in 32 bits"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=be)
    dev = be.device_info().name
    b, ctx = pr.table.batch_size, pr.table.total_visible // pr.table.batch_size
    table = tmp_path / "tc.json"
    table.write_text(json.dumps({"device": dev, "cells": [
        {"batch": b, "context": ctx, "page_size": 16, "group": 4, "best": "v2tc",
         "times_us": {"v2tc": 1.0, "v1": 3.0, "v2": 2.0}}]}))
    monkeypatch.setenv(crossover.ENV, str(table))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=be)
    assert pd.last_outcome().path.startswith("v2") and pd.last_outcome().path != "v2tc"
    monkeypatch.setattr(launches, "V2TC_MAX_POOL_ROWS", pages * 16)     # fits again
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=be)
    assert pd.last_outcome().path.startswith("v2tc")


def test_v2tc_is_a_documented_path():
    from paged_decode.call import PATHS
    assert "v2tc" in PATHS
    with pytest.raises(pd.InvalidArgumentError, match=r"path must be one of"):
        pr = _problem()
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="tc")
