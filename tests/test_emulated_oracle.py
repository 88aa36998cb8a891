"""Both dialects' kernels (v2 partial, merge, v1) on the CPU emulator against the float64
oracle: every test runs on ``emulated-cuda`` (the CUDA strings) and ``emulated-metal``
(the Metal bodies in MLX's generated signature).

A subset of the GPU matrix, sized for CI on 2 cores: head_dim 64/96/128/256, GQA 1/2/4/7/8,
pages 1/16/32, partial last pages and mid-page starts (``make_problem`` jitter), empty
requests, multi-chunk merges (forced ``pages_per_chunk``), every K/V dtype. The dialect
specific checks (negative controls, launch packing, the signature pin) live in
``test_emulated_kernels.py`` and ``test_emulated_metal.py``. Nothing runs on Apple
hardware.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import LSE_ATOL, assert_matches_oracle, f32_accumulation_tol
from test_merge import ref_merge, run_merge_kernel

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.reference import combine_f32
from paged_decode.plan import MAX_HEADS_PER_CTA
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import lse_error, max_rel_error, oracle_decode
from paged_decode.specs import SUPPORTED_HEAD_DIMS

EMULATED = [pytest.param(name, marks=pytest.mark.skipif(
    not availability(name).ok, reason=f"emulator unavailable: {availability(name).reason}"))
    for name in ("emulated-cuda", "emulated-metal")]


@pytest.fixture(scope="module", params=EMULATED)
def emu(request):
    return pd.get_backend(request.param)


CASES = [
    ("d64-g1-ps16-f16", ProblemSpec(3, 70, 4, 4, 64, 16, seed=21),
     [("v2", None), ("v2", 1), ("v1", None)]),
    ("d128-g4-ps16-bf16", ProblemSpec(3, 90, 8, 2, 128, 16, "bfloat16", "bfloat16", seed=22),
     [("v2", None), ("v2", 2), ("v1", None)]),
    ("d128-g8-ps32-f16", ProblemSpec(2, 120, 16, 2, 128, 32, seed=23),
     [("v2", 1), ("v1", None)]),
    ("d64-g4-ps1-f32", ProblemSpec(2, 21, 8, 2, 64, 1, "float32", "float32", seed=24),
     [("v2", 5), ("v1", None)]),
    ("d128-g1-ps32-qf32-kvf16", ProblemSpec(2, 75, 2, 2, 128, 32, "float32", "float16",
                                            seed=25), [("v2", 1)]),
    ("d64-g8-ps16-qbf16-kvf32", ProblemSpec(2, 50, 8, 1, 64, 16, "bfloat16", "float32",
                                            seed=26), [("v2", 2)]),
    # head_dim 96: 24 of 32 lanes carry data; simd_sum over the whole SIMD group
    ("d96-g2-ps16-f32", ProblemSpec(2, 45, 4, 2, 96, 16, "float32", "float32", seed=34),
     [("v2", 1)]),
    # GQA 7 (QH 7): the per-head butterfly of both dialects (no head transposition)
    ("d64-g7-ps16-f16", ProblemSpec(2, 50, 7, 1, 64, 16, seed=35), [("v2", 1)]),
    # head_dim 256 at 8 heads per threadgroup: the combine runs in 8 rounds (32 KB limit)
    ("d256-g8-ps16-f16", ProblemSpec(1, 40, 8, 1, 256, 16, seed=32), [("v2", 1), ("v1", None)]),
    # GQA 16 and 12: two CTAs (q-groups) of 8 / 6 heads per KV head
    ("d64-g16-ps16-f16", ProblemSpec(2, 90, 32, 2, 64, 16, seed=36),
     [("v2", None), ("v2", 2), ("v1", None)]),
    ("d128-g12-ps16-bf16", ProblemSpec(2, 70, 12, 1, 128, 16, "bfloat16", "bfloat16", seed=37),
     [("v2", 1)]),
]


def _run(be, spec, paths, *, lengths=None, offsets=None, out_dtype="float32"):
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    for path, ppc in paths:
        plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                              device=be.device_info(), pages_per_chunk=ppc)
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                             return_lse=True, out_dtype=out_dtype, backend=be)
        assert pd.last_outcome().path.split("+")[0] == path
        if path == "v2" and ppc is not None:
            assert plan.needs_merge, "the case must exercise the merge kernel"
        assert_matches_oracle(out, lse, ref, ref_lse, out_dtype, f"{spec.label} {path} {ppc}")


@pytest.mark.parametrize("spec,paths", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernels_match_oracle(emu, spec, paths):
    _run(emu, spec, paths)


# Every K/V dtype x head_dim x query heads per CTA the kernels take, on one chunk of 150
# tokens from a mid-page start: each sub-warp (lane group) takes several tokens per step
# over several steps, so lane strides, vector loads, reduction widths and the broadcast
# of per-token weights all show. QH 3, 5, 6, 7 run the per-head butterfly, the powers of
# two the head transposition (both at 8, 16 and 32 lanes per row). The partial writes the
# float32 output itself (no merge).
LANE_CASES = [(dt, d, qh) for dt in ("float16", "bfloat16", "float32")
              for d in SUPPORTED_HEAD_DIMS for qh in range(1, MAX_HEADS_PER_CTA + 1)]
LANE_TOKENS = 150


@pytest.mark.parametrize("kv_dtype,head_dim,qh", LANE_CASES,
                         ids=[f"{dt}-d{d}-qh{qh}" for dt, d, qh in LANE_CASES])
def test_every_lane_geometry(emu, kv_dtype, head_dim, qh):
    spec = ProblemSpec(1, LANE_TOKENS, qh, 1, head_dim, 16, kv_dtype, kv_dtype,
                       seed=head_dim * 10 + qh)
    pr = make_problem(spec, lengths=[LANE_TOKENS], offsets=[5])
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = pd.plan_decode(pr.table, qh, 1, head_dim, device=emu.device_info(),
                          pages_per_chunk=int(pr.table.pages_per_request.max()))
    assert plan.heads_per_cta == qh and not plan.needs_merge
    out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2",
                         return_lse=True, out_dtype="float32", backend=emu)
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", f"{emu.name} {spec.label}")


# Accumulation precision: 16K tokens and more of 16-bit K/V on the float32-output path,
# held to a float32-accumulation bound, not the K/V dtype's: an output accumulated in
# the K/V type stays within the float16 / bfloat16 output tolerances at this length.
LONG_TOKENS = 16384 + 37


@pytest.mark.parametrize("path", ["v2", "v1"])
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_long_context_accumulates_in_float32(emu, kv_dtype, path):
    spec = ProblemSpec(1, LONG_TOKENS, 4, 1, 64, 16, kv_dtype, kv_dtype, seed=40)
    pr = make_problem(spec, lengths=[LONG_TOKENS], offsets=[3])
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path=path, return_lse=True,
                         out_dtype="float32", backend=emu)
    assert pd.last_outcome().path == ("v2+merge" if path == "v2" else "v1")
    err, tol = max_rel_error(out, ref), f32_accumulation_tol(LONG_TOKENS)
    assert err <= tol, f"{emu.name} {kv_dtype} {path}: max-rel {err:.2e} > {tol:.2e}"
    assert lse_error(lse, ref_lse) <= LSE_ATOL


def test_output_in_query_dtype_without_merge(emu):
    spec = ProblemSpec(2, 60, 8, 2, 128, 16, seed=27)
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = pd.plan_decode(pr.table, 8, 2, 128, target_ctas=1)
    assert not plan.needs_merge
    out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, backend=emu)
    assert pd.last_outcome().path == "v2" and out.dtype == np.float16
    assert_matches_oracle(out, None, ref, None, "float16", f"{emu.name} v2 direct f16")


def test_empty_requests_give_zeros_and_neg_inf(emu):
    spec = ProblemSpec(4, 40, 8, 2, 64, 16, seed=28)
    _run(emu, spec, [("v2", 1), ("v1", None)], lengths=[40, 0, 17, 0], offsets=[0, 0, 5, 0])
    pr = make_problem(spec, lengths=[0, 0, 0, 0], offsets=[0, 0, 0, 0])
    for path in ("v2", "v1"):
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path=path,
                             return_lse=True, backend=emu)
        assert (out == 0).all() and np.isneginf(lse).all(), path


def test_one_page_requests(emu):
    # one token; a full page; a page entered mid-way; one beside a longer request
    spec = ProblemSpec(4, 40, 8, 2, 64, 16, seed=38)
    _run(emu, spec, [("v2", None), ("v2", 1), ("v1", None)], lengths=[1, 16, 9, 40],
         offsets=[0, 0, 5, 2])


def test_merge_kernel_against_combine(emu):
    rng = np.random.default_rng(29)
    n, h, d = 9, 3, 128
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = (rng.standard_normal((n, h)) * 4).astype(np.float32)
    lse[2, :] = -np.inf                           # an empty chunk
    lse[5, 1] = np.nan                            # NaN poisons its group (3, head 1)
    lse[7, 0] = np.inf                            # so does +inf (group 5, head 0)
    indptr = np.array([0, 1, 1, 4, 6, 6, 9], np.int32)   # singleton, empty groups
    lse[4:6, 2] = -np.inf                         # an all-empty group (3) for one head
    out, lse_out = pd.merge_states(v, lse, indptr, backend=emu)
    for o in range(indptr.size - 1):
        a, b = indptr[o], indptr[o + 1]
        ro, rl = combine_f32(v[a:b], lse[a:b])
        np.testing.assert_allclose(out[o], ro, rtol=2e-6, atol=2e-6)     # NaN == NaN here
        np.testing.assert_allclose(lse_out[o], rl, rtol=1e-6, atol=1e-6)
    assert np.isneginf(lse_out[1]).all() and (out[1] == 0).all()
    assert np.isneginf(lse_out[3, 2]) and (out[3, 2] == 0).all()
    assert np.isnan(out[3, 1]).all() and np.isnan(lse_out[3, 1])
    assert np.isnan(out[5, 0]).all() and np.isnan(lse_out[5, 0])
    assert np.isfinite(out[[0, 2]]).all() and np.isfinite(lse_out[[0, 2]]).all()
    assert np.isfinite(out[3, 0]).all() and np.isfinite(out[5, 1:]).all()


def test_merge_large_groups_wide_lse_range(emu):
    """Groups of 12, 33, 65 and 100 partials (the CUDA kernel takes 32 rows per pass and
    reads 4 at a time) with LSEs spread over ~400 log2 units: +-80 inside a group around
    group levels +-120 apart. A running max taken from the wrong rows, or left lane-local,
    is then off by more than exp2's range and overflows (or underflows every weight)."""
    _merge_case(emu, gather=False)


@pytest.mark.skipif(not availability("emulated-cuda").ok, reason="emulator unavailable")
def test_gathering_merge_large_groups_wide_lse_range():
    """The same partials stored permuted, merged through the row index (CUDA only): the
    rows a group's max is taken from are not its neighbours in storage."""
    _merge_case(pd.get_backend("emulated-cuda"), gather=True)


def _merge_case(emu, gather):
    rng = np.random.default_rng(51)
    sizes = [33, 1, 0, 65, 12, 100, 2]
    levels = [120.0, -40.0, 0.0, -120.0, 60.0, 0.0, -90.0]
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    n, h, d = int(indptr[-1]), 2, 64
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = np.concatenate([lv + rng.uniform(-80, 80, (sz, h)) for sz, lv in zip(sizes, levels)])
    lse = lse.astype(np.float32)
    lse[rng.random((n, h)) < 0.1] = -np.inf                  # empty chunks
    lse[indptr[4]:indptr[5], 1] = -np.inf                    # a group empty for one head
    ref_v, ref_lse = ref_merge(v, lse, indptr)
    v_out, lse_out = run_merge_kernel(emu, v, lse, indptr, rng, gather)
    np.testing.assert_allclose(v_out, ref_v, rtol=0, atol=5e-6)
    assert np.array_equal(np.isneginf(lse_out), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse_out[fin], ref_lse[fin], rtol=1e-6, atol=1e-5)
