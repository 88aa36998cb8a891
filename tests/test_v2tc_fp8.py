"""fp8 K/V pools on the tensor-core v2 partial (``path="v2tc"``, ``kernels/decode_v2_tc.py``;
#14 item 1 on #17's kernel) on the CPU emulator, both dialects, against the float64 oracle
on the dequantized values (``oracle_decode(..., k_scale=, v_scale=)``).

The CUDA dialect streams the pools' bytes through its cp.async ring and each warp widens
its own 16 K and V rows into a 16-bit scratch tile (``fp8x4_to_pairs``, whose bit path
the emulator runs over all 256 codes here; the sm_89+ ``cvt`` path is checked by
``tests/test_fp8_gpu.py``); the Metal dialect widens the codes as it stages them. Cases:
both formats, float16 and bfloat16 queries, head_dim 64/96/128/256, page sizes 1/3/16/64,
GQA 1/4/7/8/16/32 (one and two row tiles), first-page offsets, empty requests, one ragged
batch, single-chunk (the partial writes q's dtype itself) and split + merge, NaN-poisoned
outputs and workspaces (``conftest.py``), NaN codes in every pool entry outside the
visible windows (``make_problem``), scales != 1 that a missing K or V scale fails, the
engine step, multi-token decode, prepared calls, the crossover's choice, refusals.
Nothing of the Metal dialect ran on Apple hardware.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_matches_oracle, tc_fp8_out_tol
from test_v2tc import run_v2tc

import paged_decode as pd
from paged_decode import UnsupportedProblemError, fp8
from paged_decode.backends import availability
from paged_decode.call import check_call, runnable_paths
from paged_decode.emulator import Buffer, launch
from paged_decode.kernels.common import CUDA_COMMON
from paged_decode.kernels.mma import CUDA_MMA
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk

needs_emulator = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                    reason=f"emulator unavailable: "
                                           f"{availability('emulated-cuda').reason}")

FORMATS = list(fp8.FORMATS)
DIALECTS = ["emulated-cuda", "emulated-metal"]
SINGLE = 10 ** 6            # pages per chunk: one chunk per request (no merge)
K_SCALE, V_SCALE = 0.37, 2.5   # != 1: a scale left out fails the oracle


# ---------------------------------------------------------------------------- conversion
_PAIRS_TEST = CUDA_COMMON + CUDA_MMA + r"""
// every code of format T, four per thread, as two 16-bit pairs of H (fp8x4_to_pairs)
template <typename T, typename H>
__global__ void pd_fp8_pairs_test(const unsigned* __restrict__ words, unsigned* pairs) {
  const int t = threadIdx.x;
  unsigned p[2];
  pd::fp8x4_to_pairs<T, pd::Pair<H>>(words[t], p);
  pairs[2 * t] = p[0];
  pairs[2 * t + 1] = p[1];
}
"""
_FMT_CUDA = {"float8_e4m3fn": "pd::fp8_e4m3", "float8_e5m2": "pd::fp8_e5m2"}
_H_CUDA = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def expected_pairs(fmt: str, to: str) -> np.ndarray:
    """``uint16 [256]``: code i of ``fmt`` as a ``to`` value (ml_dtypes' widening)."""
    codes = np.arange(256, dtype=np.uint8).view(fp8.numpy_fp8(fmt)).astype(np.float32)
    dt = np.float16 if to == "float16" else ml_dtypes.bfloat16
    return codes.astype(dt).view(np.uint16)


def check_pairs(fmt: str, to: str, got: np.ndarray, nan_sign: bool = True) -> None:
    """``got`` (``uint32 [128]``, two codes per word, the lower code in the lower half)
    equals ml_dtypes' widening bit for bit, NaN codes as NaNs (of their sign unless
    ``nan_sign`` is off: the sm_89+ ``cvt`` clears it, measured on the H200 in S7-R3)."""
    bits = got.view(np.uint16)
    want = expected_pairs(fmt, to)
    dt = np.float16 if to == "float16" else ml_dtypes.bfloat16
    gv, wv = bits.view(dt).astype(np.float32), want.view(dt).astype(np.float32)
    nan = np.isnan(wv)
    assert (np.isnan(gv) == nan).all(), np.flatnonzero(np.isnan(gv) != nan)[:8]
    assert (bits[~nan] == want[~nan]).all(), np.flatnonzero((bits != want) & ~nan)[:8]
    signed = slice(None) if nan_sign else ~nan
    assert (np.signbit(gv[signed]) == np.signbit(wv[signed])).all()


def run_pairs_kernel(fmt: str, to: str, runner) -> np.ndarray:
    words = np.arange(256, dtype=np.uint8).view(np.uint32).copy()   # 4 codes per word
    return runner(_PAIRS_TEST, f"pd_fp8_pairs_test<{_FMT_CUDA[fmt]}, {_H_CUDA[to]}>", words)


@pytest.mark.parametrize("to", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8x4_to_pairs_every_code(fmt, to):
    """The emulator compiles the bit path (``fp8_to_float`` per code): all 256 codes,
    exactly, into float16 and bfloat16 pairs."""
    def emulate(src, name, words):
        pairs = np.full(128, 0xDEADBEEF, np.uint32)
        launch(src, name, (1, 1, 1), 64, [Buffer("words", words), Buffer("pairs", pairs, True)],
               check_races=False)
        return pairs
    check_pairs(fmt, to, run_pairs_kernel(fmt, to, emulate))


# ---------------------------------------------------------------------------- decode
def fp8_problem(spec: ProblemSpec, *, lengths=None, offsets=None):
    """``spec``'s random problem with pools of ``spec.kv_dtype`` codes (every entry no
    request may read a NaN code) and the float64 oracle on the dequantized values."""
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, k_scale=K_SCALE,
                                 v_scale=V_SCALE)
    return pr, ref, ref_lse


def run_fp8_v2tc(be, spec: ProblemSpec, ppcs, *, lengths=None, offsets=None) -> None:
    """``test_v2tc.run_v2tc`` over fp8 pools with the module's scales."""
    run_v2tc(be, spec, ppcs, lengths=lengths, offsets=offsets, k_scale=K_SCALE,
             v_scale=V_SCALE)

E4, E5, F16, BF16 = "float8_e4m3fn", "float8_e5m2", "float16", "bfloat16"
CASES = [
    ("d64-g1-ps16-e4m3-f16", ProblemSpec(3, 70, 4, 4, 64, 16, F16, E4, seed=61), [None, SINGLE]),
    # page size 3: every 16-token warp tile spans six pages, mid-page starts
    ("d128-g4-ps3-e5m2-bf16", ProblemSpec(2, 50, 8, 2, 128, 3, BF16, E5, seed=62), [2, SINGLE]),
    ("d96-g7-ps64-e4m3-bf16", ProblemSpec(2, 150, 7, 1, 96, 64, BF16, E4, seed=63), [1, SINGLE]),
    ("d256-g8-ps1-e5m2-f16", ProblemSpec(1, 40, 8, 1, 256, 1, F16, E5, seed=64), [16, SINGLE]),
    ("d64-g16-ps16-e5m2-bf16", ProblemSpec(2, 45, 16, 1, 64, 16, BF16, E5, seed=65), [SINGLE]),
    # two row tiles of 16 query heads
    ("d64-g32-ps16-e4m3-f16", ProblemSpec(1, 90, 32, 1, 64, 16, F16, E4, seed=66), [1, SINGLE]),
]


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("spec,ppcs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_v2tc_fp8_matches_oracle(name, spec, ppcs):
    run_fp8_v2tc(pd.get_backend(name), spec, ppcs)


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_v2tc_fp8_ragged_batch_with_empty_requests(name):
    # empty requests in the middle and at the end, first page offsets up to page_size - 1,
    # a request of one token, a 129-token one: more than one 64-token stage per chunk
    spec = ProblemSpec(6, 0, 8, 2, 64, 16, F16, E4, seed=67)
    run_fp8_v2tc(pd.get_backend(name), spec, [None, 1, SINGLE],
                 lengths=[70, 0, 33, 1, 129, 0], offsets=[3, 0, 15, 0, 9, 0])


@needs_emulator
def test_v2tc_fp8_long_chunk_every_schedule():
    # one chunk of 330 tokens: six 64-token stages through the byte ring, each warp's
    # scratch tile rewritten every stage, under every emulator schedule
    run_fp8_v2tc(pd.get_backend("emulated-cuda"),
                 ProblemSpec(1, 330, 4, 1, 64, 8, F16, E5, seed=68, jitter=False), [SINGLE])


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_v2tc_fp8_scales_are_applied(name):
    """The result matches the oracle with both scales and misses it by far with either
    left out (so a kernel or host that drops one fails the tests above)."""
    be = pd.get_backend(name)
    spec = ProblemSpec(2, 40, 8, 2, 64, 16, F16, E4, seed=69)
    pr, ref, ref_lse = fp8_problem(spec)
    out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc",
                         return_lse=True, out_dtype="float32", backend=be, k_scale=K_SCALE,
                         v_scale=V_SCALE)
    out, lse = be.to_numpy(out), be.to_numpy(lse)
    tol = tc_fp8_out_tol(F16, "float32")
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", "scaled", tol=tol)
    for ks, vs in ((1.0, V_SCALE), (K_SCALE, 1.0)):
        wrong, wrong_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table,
                                         k_scale=ks, v_scale=vs)
        with pytest.raises(AssertionError):
            assert_matches_oracle(out, lse, wrong, wrong_lse, "float32", "wrong", tol=tol)


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_v2tc_fp8_nan_code_poisons(name):
    """A visible NaN code in K (e4m3fn's S.1111.111, an e5m2 NaN) poisons its KV head's
    query heads of that request, output and LSE, and nothing else; in V it reaches only
    that column of those heads' outputs."""
    be = pd.get_backend(name)
    for fmt, pool, code in ((E4, "k", 0x7F), (E5, "k", 0xFE), (E4, "v", 0xFF)):
        pr = make_problem(ProblemSpec(3, 0, 8, 2, 64, 16, F16, fmt, seed=76),
                          lengths=[40, 70, 9], offsets=[0, 0, 0])
        arr = (pr.k_pages if pool == "k" else pr.v_pages).view(np.uint8)
        page = int(pr.table.indices[pr.table.indptr[1] + 2])
        arr[page, 5, 1, 17] = code                   # request 1, token 37, KV head 1
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc",
                             return_lse=True, out_dtype="float32", backend=be,
                             k_scale=K_SCALE, v_scale=V_SCALE)
        out, lse = be.to_numpy(out), be.to_numpy(lse)
        bad = np.zeros(out.shape, bool)
        if pool == "k":
            bad[1, 4:] = True
            assert np.isnan(lse[1, 4:]).all(), fmt
        else:
            bad[1, 4:, 17] = True
            assert np.isfinite(lse).all()
        assert np.array_equal(np.isnan(out), bad), (fmt, pool)


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_v2tc_fp8_byte_pools_name_their_format(name):
    # uint8 pools (what CuPy and MLX hold): the format travels as kv_dtype
    be = pd.get_backend(name)
    spec = ProblemSpec(2, 40, 8, 2, 64, 16, BF16, E5, seed=70)
    pr, ref, ref_lse = fp8_problem(spec)
    out = pd.decode(pr.q, fp8.codes(pr.k_pages), fp8.codes(pr.v_pages), pr.table, path="v2tc",
                    out_dtype="float32", backend=be, kv_dtype=E5, k_scale=K_SCALE,
                    v_scale=V_SCALE)
    assert pd.last_outcome().path.startswith("v2tc")
    assert_matches_oracle(be.to_numpy(out), None, ref, None, "float32", "uint8 pools",
                          tol=tc_fp8_out_tol(BF16, "float32"))


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_v2tc_fp8_several_query_tokens(name):
    """Multi-token decode over fp8 pools on v2tc: the tokens folded into the GQA group
    (T x G = 12 rows) and the causal pieces, both dequantized like one-token decode."""
    be = pd.get_backend(name)
    spec = ProblemSpec(3, 0, 4, 1, 64, 16, F16, E4, seed=71)
    pr = make_problem(spec, lengths=[50, 9, 33], offsets=[0, 4, 0])
    t = 3
    q = np.random.default_rng(7).standard_normal((3, t, 4, 64)).astype(np.float16)
    ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, k_scale=K_SCALE,
                                 v_scale=V_SCALE)
    out, lse = pd.decode(q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", return_lse=True,
                         out_dtype="float32", backend=be, k_scale=K_SCALE, v_scale=V_SCALE)
    assert "v2tc" in pd.last_outcome().path, pd.last_outcome()
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                          f"{name} T={t}", tol=tc_fp8_out_tol(F16, "float32"))


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_engine_step_on_fp8_pool_runs_v2tc(name):
    """``DecodeStep(path="v2tc")`` over an fp8 pool with per-layer scales: the quantizing
    append and each layer's decode on the tensor-core partial, two steps, against the
    oracle on the pool's bytes with that layer's scales."""
    be = pd.get_backend(name)
    rng = np.random.default_rng(72)
    layers, b, hq, hkv, d = 2, 3, 8, 2, 64
    pool = pd.PagePool(48, 16, hkv, d, dtype=E4, num_layers=layers,
                       k_scale=[0.02, 0.05], v_scale=[0.01, 0.3], backend=be)
    seqs = [pool.new_sequence() for _ in range(b)]
    for i, s in enumerate(seqs):
        x = rng.standard_normal((layers, 10 + 27 * i, hkv, d)).astype(np.float16)
        pool.append(s, x, -x)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=hq, capacity=4, path="v2tc")
    q = be.asarray(rng.standard_normal((4, hq, d)).astype(np.float16))
    kv = be.asarray(rng.standard_normal((4, hkv, d)).astype(np.float16))
    out = be.asarray(np.full((4, hq, d), np.nan, np.float16))
    for _ in range(2):
        step.begin()
        for layer in range(layers):
            step.append(layer, kv, kv)
            step.decode(layer, q, out=out)
            assert pd.last_outcome().path.startswith("v2tc"), pd.last_outcome()
            k, v = (be.to_numpy(x)[layer] for x in (pool.k, pool.v))
            ref, _ = oracle_decode(be.to_numpy(q)[:b], k, v, pool.page_table(seqs),
                                   k_scale=float(pool.k_scale[layer]),
                                   v_scale=float(pool.v_scale[layer]))
            assert_matches_oracle(be.to_numpy(out)[:b], None, ref, None, "float16",
                                  f"{name} layer {layer}", tol=tc_fp8_out_tol(F16, "float16"))
    assert "kv float8_e4m3fn" in pd.last_outcome().detail


@needs_emulator
def test_prepared_v2tc_fp8_equals_decode():
    be = pd.get_backend("emulated-cuda")
    pr, ref, _ = fp8_problem(ProblemSpec(3, 60, 8, 2, 64, 16, F16, E5, seed=73))
    kw = dict(path="v2tc", out_dtype="float32", backend=be, k_scale=K_SCALE, v_scale=V_SCALE)
    prep = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    assert prep.path.startswith("v2tc")
    got = be.to_numpy(prep())
    assert np.array_equal(got, be.to_numpy(pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table,
                                                     **kw)))
    assert_matches_oracle(got, None, ref, None, "float32", "prepared",
                          tol=tc_fp8_out_tol(F16, "float32"))


@needs_emulator
def test_crossover_may_choose_v2tc_for_fp8_pools(monkeypatch):
    """``path="auto"``: v2tc is among the paths an fp8 call can run (``runnable_paths``),
    so a crossover table whose fastest path is v2tc picks it; with float32 queries it is
    not."""
    from paged_decode import call as call_mod
    from paged_decode.crossover import Cell, CrossoverTable
    be = pd.get_backend("emulated-cuda")
    pr, ref, _ = fp8_problem(ProblemSpec(2, 40, 8, 2, 64, 16, F16, E4, seed=74))
    kw = dict(path="auto", sm_scale=None, out_dtype="float32", return_lse=False,
              k_scale=K_SCALE, v_scale=V_SCALE)
    a = check_call("decode", be, pr.q, pr.k_pages, pr.v_pages, pr.table, **kw)
    assert "v2tc" in runnable_paths(be, a)
    a32 = check_call("decode", be, pr.q.astype(np.float32), pr.k_pages, pr.v_pages,
                     pr.table, **kw)
    assert "v2tc" not in runnable_paths(be, a32)
    table = CrossoverTable("test", "test.json", (
        Cell(2, 40, 16, 4, "v2tc", {"v2": 2.0, "v2tc": 1.0, "v1": 3.0}),))
    monkeypatch.setattr(call_mod, "table_for", lambda name, arch="": table)
    out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=be, out_dtype="float32",
                    k_scale=K_SCALE, v_scale=V_SCALE)
    o = pd.last_outcome()
    assert o.path.startswith("v2tc") and "auto: v2tc" in o.reason, o
    assert_matches_oracle(be.to_numpy(out), None, ref, None, "float32", "auto",
                          tol=tc_fp8_out_tol(F16, "float32"))


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
def test_v2tc_refuses_float32_queries_on_fp8_pools(name):
    pr, _, _ = fp8_problem(ProblemSpec(2, 40, 8, 2, 64, 16, "float32", E4, seed=75))
    with pytest.raises(UnsupportedProblemError,
                       match=rf"^decode: backend '{name}' cannot run path 'v2tc': path 'v2tc' "
                             r"needs q one of \('float16', 'bfloat16'\) and the pools in q's "
                             r"dtype or one of \('float8_e4m3fn', 'float8_e5m2'\), got q "
                             r"float32 and pools float8_e4m3fn"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=name,
                  k_scale=K_SCALE, v_scale=V_SCALE)


def test_v2tc_fp8_specializations():
    """The fp8 specializations: q's dtype and the pools' format in the URI and the
    template (T the mma type, TKV the byte struct); a 16-bit pool keeps TKV = T; the byte
    ring's shared memory; a spec for fp8 pools needs q's dtype."""
    from paged_decode.kernels import decode_v2_tc as tc
    from paged_decode.specs import v2tc_metal_spec, v2tc_spec
    s = v2tc_spec(E4, "float32", 128, 16, q_dtype=BF16)
    assert "_q-bf16_kv-e4m3_" in s.uri
    assert s.cuda_name_expression().startswith(
        "pd_decode_v2_tc<__nv_bfloat16, pd::fp8_e4m3, float, 128, 16, 4, ")
    assert v2tc_spec(F16, F16, 64, 16).cuda_name_expression().startswith(
        "pd_decode_v2_tc<__half, __half, __half, 64, 16, 4, ")
    # Q tile + 128 bytes to align the ring in + the larger of STAGES x (64 tokens x 128
    # codes (a swizzled row, no padding) of K and of V) and the 4 warps' combine rows
    # (16 x 136 floats each)
    assert s.dynamic_smem_bytes == (16 * 136 * 2 + 128
                                    + max(s.stages * 2 * 64 * 128, 4 * 16 * 136 * 4))
    # head_dim 64: 64-byte rows, unpadded (swizzled in groups of 4 chunks); head_dim 96:
    # 96-byte rows take 128 bytes of the ring
    for d, row in ((64, 64), (96, 128)):
        sd = v2tc_spec(E4, "float32", d, 16, q_dtype=BF16)
        assert sd.dynamic_smem_bytes == (16 * (d + 8) * 2 + 128
                                         + max(sd.stages * 2 * 64 * row, 4 * 16 * (d + 8) * 4))
    assert tc.max_stages(128, 4, 1) > tc.max_stages(128, 4, 2)
    m = v2tc_metal_spec(E5, "float32", 64, 16, 8, q_dtype=F16)
    assert [v for n, v in tc.KERNEL.metal_template(m) if n in ("T", "KV_FP8")] == [
        pd.kernels.kernel_def.Dtype(F16), 2]
    with pytest.raises(ValueError, match="needs q_dtype"):
        v2tc_spec(E4, "float32", 64, 16)


def test_v2tc_fp8_specializations_compile_for_sm90():
    """Every head dim, both formats and query dtypes, both outputs, with the machine's
    NVRTC (or nvcc) for sm_90: ptxas checks the ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``
    widen the emulator never runs."""
    from paged_decode import cuda_compile
    from paged_decode.specs import SUPPORTED_HEAD_DIMS, v2tc_spec
    if cuda_compile.available() is None:
        pytest.skip("neither NVRTC nor nvcc is available")
    cuda_compile.compile_specs({v2tc_spec(f, o, d, p, q_dtype=q)
                                for f in FORMATS for q in (F16, BF16) for o in ("float32", q)
                                for d in SUPPORTED_HEAD_DIMS for p in (1, 16)})


@needs_emulator
@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("ppc", [2, SINGLE], ids=["split", "one-chunk"])
def test_v2tc_fp8_with_window_soft_cap_and_sinks(name, ppc):
    """fp8 pools and every other variant at once on v2tc (the byte ring with the SOFT_CAP /
    SINK specializations and a window table): against the oracle on dequantized values,
    split (the merge adds the sink) and one chunk (the partial's store does)."""
    be = pd.get_backend(name)
    spec = ProblemSpec(3, 90, 8, 2, 64, 16, "float16", "float8_e4m3fn", seed=67)
    pr = make_problem(spec)
    sinks = np.random.default_rng(3).standard_normal(8).astype(np.float32)
    kw = dict(window_left=37, logits_soft_cap=5.0)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, sinks=sinks,
                                 k_scale=K_SCALE, v_scale=V_SCALE, **kw)
    plan = pd.plan_decode(pr.table, 8, 2, 64, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(8, 2), window_left=37)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    out, lse = pd.decode(q, k, v, pr.table, plan, path="v2tc", return_lse=True,
                         out_dtype="float32", backend=be, kv_dtype=spec.kv_dtype,
                         k_scale=K_SCALE, v_scale=V_SCALE, sinks=be.asarray(sinks), **kw)
    o = pd.last_outcome()
    assert o.path.startswith("v2tc") and "kv float8_e4m3fn" in o.detail, o
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                          f"{name} ppc={ppc}", tol=tc_fp8_out_tol("float16", "float32"))
