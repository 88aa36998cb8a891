"""FP8 K/V caches (#14 item 1): the conversions, the quantizing append, every decode path.

The conversion routines of both dialects run on the CPU emulator over all 256 codes of
each format against ``ml_dtypes`` (and the quantizer over every float16 value, ties,
subnormals, saturation and NaN, against ``fp8.quantize``, whose rounding is
``ml_dtypes``'); the pools' appends against ``fp8.quantize``; every decode path (v2 one
chunk and split, v1, gather; cascade, sparse, the engine step) against the float64 oracle
on the dequantized values (``reference.oracle_decode(..., k_scale=, v_scale=)``), with
windows, soft caps, sinks, first-page offsets and empty requests; NaN-poisoned outputs;
one test per bad argument.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import assert_matches_oracle, fp8_out_tol, table_of

import paged_decode as pd
from paged_decode import fp8, get_backend
from paged_decode.emulator import Buffer, launch
from paged_decode.emulator.metal import launch_metal
from paged_decode.errors import InvalidArgumentError, InvalidDtypeError, UnsupportedProblemError
from paged_decode.kernels.common import CUDA_COMMON, METAL_COMMON
from paged_decode.reference import attention_f64, oracle_decode
from paged_decode.sparse import make_selection
from paged_decode.variants import window_table

BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]
FORMATS = list(fp8.FORMATS)
HQ, HKV, D, P = 8, 2, 64, 16
FMT_ID = {"float8_e4m3fn": 1, "float8_e5m2": 2}


# ---------------------------------------------------------------------------- conversions
_CUDA_TEST = CUDA_COMMON + r"""
// every code of format T widened by widen_piece (8 per call: both halves of each uint4)
// and by fp8_to_float; every float of x quantized by fp8_from_float
template <typename T>
__global__ void pd_fp8_test(const uint4* __restrict__ codes, float* widened, float* scalar,
                            const float* __restrict__ x, unsigned char* q, int n) {
  const int t = threadIdx.x;
  if (t < 32) pd::widen_piece<T>(codes[t / 2], widened + 8 * t, t);
  for (int i = t; i < 256; i += blockDim.x) scalar[i] = pd::fp8_to_float<T>((unsigned)i);
  for (int i = t; i < n; i += blockDim.x) q[i] = pd::fp8_from_float<T>(x[i]);
}
"""

_METAL_TEST = r"""
  const uint t = thread_position_in_threadgroup.x;
  for (uint i = t; i < 64u; i += 32u) {
    const float4 f = pd::load4kv<FMT>(codes + 4 * i);
    widened[4 * i] = f.x; widened[4 * i + 1] = f.y;
    widened[4 * i + 2] = f.z; widened[4 * i + 3] = f.w;
  }
  for (uint i = t; i < 256u; i += 32u) scalar[i] = pd::fp8_to_float<FMT>(i);
  for (uint i = t; i < uint(n); i += 32u) q[i] = pd::fp8_from_float<FMT>(x[i]);
"""


def _quant_inputs() -> np.ndarray:
    """Every float16 value (ties, subnormals, overflow, infinities, NaNs of fp8 scale are
    all among them), the midpoints between consecutive e4m3 / e5m2 values (exact ties)
    and their neighbours one float32 ulp away, and values far beyond both formats."""
    every = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids = []
    for fmt in FORMATS:
        vals = np.unique(fp8.decode_table(fmt)[np.isfinite(fp8.decode_table(fmt))])
        m = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
        mids += [m, np.nextafter(m, np.float32(np.inf)), np.nextafter(m, np.float32(-np.inf))]
    big = np.array([448, 464, 465, 479.9, 480, 1e4, 57344, 61440, 61441, 1e30, 3e38],
                   np.float32)
    return np.concatenate([every, *mids, big, -big])


def _codes_of(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    codes = np.arange(256, dtype=np.uint8)
    return codes, codes.view(fp8.numpy_fp8(fmt)).astype(np.float32)


def _check_conversions(fmt, widened, scalar, x, q, nan_sign=True):
    """Widened codes equal ml_dtypes' values (signed zeros with their sign; NaN codes as
    NaNs, of their sign unless ``nan_sign`` is off: the sm_89+ ``cvt`` returns NaNs with
    the sign cleared, measured on the H200 in run S7-R3), quantized inputs its codes."""
    _, want = _codes_of(fmt)
    for got in (widened, scalar):
        same = (got == want) | (np.isnan(got) & np.isnan(want))
        assert same.all(), np.flatnonzero(~same)[:8]
        signed = slice(None) if nan_sign else ~np.isnan(want)
        assert (np.signbit(got[signed]) == np.signbit(want[signed])).all()
    exp = fp8.quantize(x, fmt).view(np.uint8)
    bad = np.flatnonzero(q != exp)
    assert bad.size == 0, [(x[i], int(q[i]), int(exp[i])) for i in bad[:8]]


@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_conversions_every_code(fmt):
    """``fp8_to_float`` and ``widen_piece<fp8>`` (the emulator compiles the scalar path;
    sm_89+ takes cvt, checked by tests/test_fp8_gpu.py) over all 256 codes;
    ``fp8_from_float`` against ``ml_dtypes``' rounding with saturation."""
    codes, _ = _codes_of(fmt)
    x = _quant_inputs()
    widened, scalar = np.full(256, 7.0, np.float32), np.full(256, 7.0, np.float32)
    q = np.zeros(x.size, np.uint8)
    name = {"float8_e4m3fn": "pd::fp8_e4m3", "float8_e5m2": "pd::fp8_e5m2"}[fmt]
    launch(_CUDA_TEST, f"pd_fp8_test<{name}>", (1, 1, 1), 128,
           [Buffer("codes", codes), Buffer("widened", widened, True),
            Buffer("scalar", scalar, True), Buffer("x", x), Buffer("q", q, True),
            np.int32(x.size)], check_races=False)
    _check_conversions(fmt, widened, scalar, x, q)


@pytest.mark.parametrize("fmt", FORMATS)
def test_metal_conversions_every_code(fmt):
    """The Metal dialect's ``fp8_to_float`` / ``load4kv`` / ``fp8_from_float`` (uint8_t
    inputs, as MLX passes fp8 pools), the same checks."""
    codes, _ = _codes_of(fmt)
    x = _quant_inputs()
    widened, scalar = np.full(256, 7.0, np.float32), np.full(256, 7.0, np.float32)
    q = np.zeros(x.size, np.uint8)
    launch_metal("pd_fp8_test", ("codes", "x", "n"), ("widened", "scalar", "q"), _METAL_TEST,
                 METAL_COMMON, [codes, x, np.int32(x.size)], [widened, scalar, q], (32, 1, 1),
                 (32, 1, 1), [("FMT", FMT_ID[fmt])], check_races=False)
    _check_conversions(fmt, widened, scalar, x, q)


def test_host_conversions_follow_the_convention():
    """``fp8.quantize`` / ``dequantize``: x / scale in float32, clamped (infinities too),
    NaN kept, then ml_dtypes' round to nearest even; read = stored * scale."""
    x = np.array([1.0, -3.3, 1e6, -np.inf, np.inf, np.nan, 1e-9, 0.0], np.float32)
    for fmt in FORMATS:
        q = fp8.quantize(x, fmt, 0.5)
        lim = fp8.max_finite(fmt)
        want = np.where(np.isnan(x), x, np.clip(x / np.float32(0.5), -lim, lim))
        assert np.array_equal(q.astype(np.float32),
                              want.astype(fp8.numpy_fp8(fmt)).astype(np.float32),
                              equal_nan=True)
        back = fp8.dequantize(q, fmt, 0.5)
        assert back[2] == lim * 0.5 and back[3] == -lim * 0.5 and np.isnan(back[5])
        # no saturation would give NaN (e4m3fn) or inf (e5m2) for 1e6: the clamp matters
        assert np.isfinite(back[2])


# ---------------------------------------------------------------------------- problems
def _fp8_problem(fmt, q_dtype="float16", seed=0, lengths=(70, 0, 33, 17), fpo=(5, 0, 12, 0),
                 hq=HQ):
    """fp8 pools from float32 K (amplitude ~4) / V, scaled to each tensor's amax (the
    usual per-layer calibration); a table with first-page offsets and an empty request."""
    rng = np.random.default_rng(seed)
    table = table_of(lengths=list(lengths), fpo=list(fpo), page_size=P, spare_pages=3)
    n = table.num_pages
    k = (rng.standard_normal((n, P, HKV, D)) * 4).astype(np.float32)
    v = rng.standard_normal((n, P, HKV, D)).astype(np.float32)
    ks = float(np.abs(k).max() / fp8.max_finite(fmt))
    vs = float(np.abs(v).max() / fp8.max_finite(fmt))
    q = rng.standard_normal((table.batch_size, hq, D)).astype(q_dtype)
    return q, fp8.quantize(k, fmt, ks), fp8.quantize(v, fmt, vs), table, ks, vs


PATHS = [("v2", 10 ** 6), ("v2", 1), ("v1", None), ("gather", None)]


def _decode(be, q, k, v, table, path, ppc, out_dtype, **kw):
    plan = pd.plan_decode(table, q.shape[1], HKV, D, device=be.device_info(),
                          pages_per_chunk=None if ppc is None else min(ppc, 64),
                          window_left=kw.get("window_left", -1))
    if kw.get("sinks") is not None:
        kw["sinks"] = be.asarray(kw["sinks"])
    out = be.asarray(np.full((table.batch_size, q.shape[1], D), np.nan, out_dtype))
    got, lse = pd.decode(be.asarray(q), be.asarray(k), be.asarray(v), table, plan, path=path,
                         out=out, return_lse=True, out_dtype=out_dtype, backend=be, **kw)
    return be.to_numpy(got), be.to_numpy(lse)


@pytest.mark.parametrize("path,ppc", PATHS, ids=["v2-one", "v2-split", "v1", "gather"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fp8_decode_matches_oracle(backend_name, fmt, path, ppc):
    if path == "gather" and backend_name != "reference":
        pytest.skip("the emulated backends' gather arm is the reference backend's")
    be = get_backend(backend_name)
    q, k, v, table, ks, vs = _fp8_problem(fmt)
    ref, ref_lse = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    out, lse = _decode(be, q, k, v, table, path, ppc, "float32", k_scale=ks, v_scale=vs)
    o = pd.last_outcome()
    assert o.path.startswith(path) and f"kv {fmt}" in o.detail, o
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()       # the empty request
    assert_matches_oracle(out, lse, ref, ref_lse, "float32", f"{backend_name} {o}",
                          tol=fp8_out_tol("float32"))


@pytest.mark.parametrize("q_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fp8_with_every_variant(backend_name, q_dtype):
    """fp8 + window + soft cap + sinks at once, outputs in q's dtype, GQA groups 4 and 3
    (both softmax phases), one chunk and split, and v1."""
    be = get_backend(backend_name)
    for hq in (8, 6):
        q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn", q_dtype, seed=hq, hq=hq)
        sinks = (np.random.default_rng(3).standard_normal(hq) * 2).astype(np.float32)
        kw = {"window_left": 21, "logits_soft_cap": 2.0, "sinks": sinks}
        ref, ref_lse = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs, **kw)
        for path, ppc in (("v2", 10 ** 6), ("v2", 1), ("v1", None)):
            out, lse = _decode(be, q, k, v, table, path, ppc, q_dtype, k_scale=ks,
                               v_scale=vs, **kw)
            assert_matches_oracle(out, lse, ref, ref_lse, q_dtype,
                                  f"{backend_name} hq {hq} {path} {ppc}",
                                  tol=fp8_out_tol(q_dtype))


@pytest.mark.parametrize("backend_name", ["reference", "emulated-cuda"])
def test_prepared_and_replayed_calls_keep_their_scales(backend_name):
    """``prepare_decode`` binds the format and scales; ``decode``'s fast path replays a
    prepared call only for the same scales (a new v_scale is a new call, never a stale
    replay)."""
    be = get_backend(backend_name)
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    plan = pd.plan_decode(table, HQ, HKV, D, device=be.device_info())
    out = np.full((table.batch_size, HQ, D), np.nan, np.float32)
    ref, _ = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    prep = pd.prepare_decode(q, k, v, table, plan, path="v2", out=out, backend=be,
                             out_dtype="float32", k_scale=ks, v_scale=vs)
    assert_matches_oracle(prep(), None, ref, None, "float32", tol=fp8_out_tol("float32"))
    for scale in (vs, 2 * vs, vs):
        out.fill(np.nan)
        pd.decode(q, k, v, table, plan, path="v2", out=out, backend=be, out_dtype="float32",
                  k_scale=ks, v_scale=scale)
        assert_matches_oracle(out, None, ref * (scale / vs), None, "float32",
                              tol=fp8_out_tol("float32"))


def test_scales_enter_exactly_as_the_convention_says():
    """Negative controls on the oracle itself: doubling k_scale is the same as doubling
    sm_scale, doubling v_scale doubles the output and leaves the LSE."""
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    base, base_lse = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    o2, l2 = oracle_decode(q, k, v, table, k_scale=ks, v_scale=2 * vs)
    assert np.allclose(o2, 2 * base) and np.allclose(l2, base_lse, equal_nan=True)
    o3, _ = oracle_decode(q, k, v, table, 2 * D ** -0.5, k_scale=ks, v_scale=vs)
    o4, _ = oracle_decode(q, k, v, table, k_scale=2 * ks, v_scale=vs)
    assert np.allclose(o3, o4)
    assert not np.allclose(o4, base)      # the K scale changes the softmax


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fp8_nan_code_poisons(backend_name):
    """A NaN code in the cache (e4m3fn's S.1111.111, which a sloppy widen reads as 480)
    poisons its KV head's query heads, NaN output and LSE, and nothing else."""
    be = get_backend(backend_name)
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    k = k.copy()
    page = int(table.indices[table.indptr[2]])
    k.view(np.uint8)[page, 13, 1, 7] = 0x7F        # request 2, token 1, KV head 1
    out, lse = _decode(be, q, k, v, table, "v2", 10 ** 6, "float32", k_scale=ks,
                       v_scale=vs)
    g = HQ // HKV
    assert np.isnan(out[2, g:]).all() and np.isnan(lse[2, g:]).all()
    assert np.isfinite(out[2, :g]).all() and np.isfinite(out[0]).all()


# ---------------------------------------------------------------------------- pools
_SPECIAL = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e6, -1e6, 0.0, -0.0, 1e-12, -1e-12],
                    np.float32)


def _ties(fmt: str) -> np.ndarray:
    """Exact midpoints between consecutive finite values of ``fmt``, times 0.5 (layer 1's
    K scale, a power of two: x / scale stays exact), both signs: round to even decides."""
    vals = np.unique(fp8.decode_table(fmt)[np.isfinite(fp8.decode_table(fmt))])
    m = ((vals[1:].astype(np.float64) + vals[:-1]) / 2 * 0.5).astype(np.float32)
    return np.concatenate([m, -m])


def _rows(rng, n, amp=1.0, fmt="float8_e4m3fn"):
    x = (rng.standard_normal((2, n, HKV, D)) * amp).astype(np.float32)
    x[0, 0, 0, :_SPECIAL.size] = _SPECIAL
    ties = _ties(fmt)[: n * HKV * D]
    x[1].reshape(-1)[:ties.size] = ties
    return x


def _v_rows_as_appended(s, a, b, c, pa, pb, step, layer, fmt, vs):
    """The V rows of sequence ``s`` in the dtypes they were appended in, quantized: the
    prompt (float16 for a and its fork c, bfloat16 for b), then its row of the batch
    (float16)."""
    with np.errstate(over="ignore"):
        prompt = pa.astype(np.float16) if s != b else pb.astype(ml_dtypes.bfloat16)
        row = step[:, [a, b, c].index(s):[a, b, c].index(s) + 1].astype(np.float16)
    return np.concatenate([fp8.quantize(prompt[layer], fmt, vs),
                           fp8.quantize(row[layer], fmt, vs)])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_append_quantizes_like_ml_dtypes(backend_name, fmt):
    """Batched and single appends into a two-layer fp8 pool with per-layer scales, a fork
    (copy-on-write of a partial page) and rows with NaN, infinities, overflow and
    underflow: every stored byte is ``fp8.quantize`` of its row (ml_dtypes' rounding with
    saturation); the copied slots keep their bytes."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(1)
    ks, vs = [0.01, 0.5], 0.02
    pool = pd.PagePool(24, P, HKV, D, dtype=fmt, num_layers=2, k_scale=ks, v_scale=vs,
                       backend=be)
    a, b = pool.new_sequence(), pool.new_sequence()
    pa, pb = _rows(rng, 21, 3.0, fmt), _rows(rng, 5, 1.0, fmt)
    with np.errstate(over="ignore"):      # 1e6 as float16 is inf: saturated too
        pool.append(a, pa, pa.astype(np.float16))
    pool.append(b, pb, pb.astype(ml_dtypes.bfloat16))
    c = pool.fork(a)
    step = _rows(rng, 3, 10.0, fmt)
    with np.errstate(over="ignore"):
        pool.append_batch([a, b, c], step, step.astype(np.float16))
    want = {a: np.concatenate([pa, step[:, :1]], 1), b: np.concatenate([pb, step[:, 1:2]], 1),
            c: np.concatenate([pa, step[:, 2:3]], 1)}
    kp, vp = be.to_numpy(pool.k), be.to_numpy(pool.v)
    for s, rows in want.items():
        pages = pool.seq_pages(s)
        for layer in range(2):
            n = rows.shape[1]
            got_k = kp[layer][pages].reshape(-1, HKV, D)[:n]
            got_v = vp[layer][pages].reshape(-1, HKV, D)[:n]
            exp_k = fp8.quantize(rows[layer], fmt, ks[layer])
            exp_v = _v_rows_as_appended(s, a, b, c, pa, pb, step, layer, fmt, vs)
            assert np.array_equal(fp8.codes(got_k), fp8.codes(exp_k)), (s, layer)
            assert np.array_equal(fp8.codes(got_v), fp8.codes(exp_v)), (s, layer)
    assert pool.decode_args(1) == {"kv_dtype": fmt, "k_scale": np.float32(0.5),
                                   "v_scale": np.float32(0.02)}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_k_and_v_rows_of_different_dtypes_are_each_quantized_from_their_own(backend_name,
                                                                            fmt):
    """float16 K with float32 V (and bfloat16 K with float16 V): each row is quantized from
    its own values, never through the narrower dtype (1e5 as float16 is inf, which would
    saturate; 0.3 would round twice)."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(7)
    for k_dt, v_dt, v_scale in ((np.float16, np.float32, 1000.0),
                                (ml_dtypes.bfloat16, np.float16, 0.002)):
        pool = pd.PagePool(4, P, HKV, D, dtype=fmt, k_scale=1.0, v_scale=v_scale, backend=be)
        s = pool.new_sequence()
        k = rng.standard_normal((5, HKV, D)).astype(k_dt)
        v = (rng.standard_normal((5, HKV, D)) * 90 * v_scale).astype(v_dt)
        if v_dt == np.float32:
            v[0, 0, :4] = [1e5, 7e4, -2.5e5, 0.3]
        pool.append(s, k, v)
        pages = pool.seq_pages(s)
        got_k = be.to_numpy(pool.k)[pages].reshape(-1, HKV, D)[:5]
        got_v = be.to_numpy(pool.v)[pages].reshape(-1, HKV, D)[:5]
        assert np.array_equal(fp8.codes(got_k), fp8.codes(fp8.quantize(k, fmt, 1.0)))
        assert np.array_equal(fp8.codes(got_v), fp8.codes(fp8.quantize(v, fmt, v_scale))), \
            (k_dt, v_dt)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_reserve_then_write_layers_on_fp8_pool(backend_name):
    """``reserve_batch`` (the copy-on-write copies alone, in every layer) then
    ``write_layer`` per layer with its own scale, three layers, a fork sharing a partial
    page: stored bytes are each layer's ``fp8.quantize``; the copied slots keep theirs."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(9)
    L, fmt, ks = 3, "float8_e4m3fn", [0.1, 0.2, 0.05]
    pool = pd.PagePool(16, P, HKV, D, dtype=fmt, num_layers=L, k_scale=ks, v_scale=0.1,
                       backend=be)
    a = pool.new_sequence()
    x = rng.standard_normal((L, 20, HKV, D)).astype(np.float32)
    pool.append(a, x, x)
    c = pool.fork(a)
    batch = pool.reserve_batch([a, c])
    rows = rng.standard_normal((L, 2, HKV, D)).astype(np.float32)
    for layer in range(L):
        pool.write_layer(batch, rows[layer], rows[layer], layer=layer)
    kp = be.to_numpy(pool.k)
    for i, s in enumerate((a, c)):
        got = kp[:, pool.seq_pages(s)].reshape(L, -1, HKV, D)[:, :21]
        for layer in range(L):
            want = np.concatenate([x[layer], rows[layer, i:i + 1]])
            assert np.array_equal(fp8.codes(got[layer]),
                                  fp8.codes(fp8.quantize(want, fmt, ks[layer]))), (s, layer)


def test_calls_over_fp8_pools_plan_for_the_fp8_target(monkeypatch):
    """The plans ``decode`` and ``DecodeStep`` make for themselves take the pools' dtype:
    over fp8 pools the device's fp8 target, over float16 pools the plain one."""
    import dataclasses

    from paged_decode import call, engine_step, multitoken_call
    be = get_backend("reference")
    dev = dataclasses.replace(be.device_info(), fp8_ctas_per_unit=be.device_info()
                              .ctas_per_unit * 3)
    monkeypatch.setattr(be, "device_info", lambda index=None: dev)
    made = []
    for mod in (call, engine_step, multitoken_call):
        real = mod.make_plan

        def spy(*a, _real=real, **kw):
            plan = _real(*a, **kw)
            if kw.get("pages_per_chunk") is None:   # (a forced chunk size needs no target)
                made.append(plan.target_ctas)
            return plan
        monkeypatch.setattr(mod, "make_plan", spy)
    fp8_target = dev.compute_units * dev.fp8_ctas_per_unit
    assert fp8_target != dev.default_target_ctas
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    pd.decode(q, k, v, table, k_scale=ks, v_scale=vs, backend=be)
    assert made and set(made) == {fp8_target}, made
    made.clear()
    q2, k2, v2, t2, ks2, vs2 = _fp8_problem("float8_e4m3fn", lengths=(70, 4, 33, 17))
    pd.decode(np.stack([q2, q2], axis=1), k2, v2, t2, k_scale=ks2, v_scale=vs2, backend=be)
    assert made and set(made) == {fp8_target}, made      # two query tokens per request
    made.clear()
    pd.decode(q, k.astype(np.float32).astype(np.float16), v.astype(np.float32)
              .astype(np.float16), table, backend=be)
    assert made and set(made) == {dev.default_target_ctas}, made
    made.clear()
    pool = pd.PagePool(16, P, HKV, D, dtype="float8_e4m3fn", k_scale=0.02, v_scale=0.01,
                       backend=be)
    seqs = [pool.new_sequence() for _ in range(2)]
    for s in seqs:
        x = np.ones((9, HKV, D), np.float16)
        pool.append(s, x, x)
    pd.DecodeStep(pool, seqs, num_qo_heads=HQ).begin()
    assert made and set(made) == {fp8_target}, made


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_engine_step_on_fp8_pool(backend_name):
    """``DecodeStep`` over an fp8 pool: the quantizing append and every layer's decode
    with that layer's scales, three steps, against the oracle on the pool's bytes."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(2)
    L, B = 2, 3
    pool = pd.PagePool(48, P, HKV, D, dtype="float8_e4m3fn", num_layers=L,
                       k_scale=[0.02, 0.05], v_scale=[0.01, 0.004], backend=be)
    seqs = [pool.new_sequence() for _ in range(B)]
    for i, s in enumerate(seqs):
        x = rng.standard_normal((L, 10 + 17 * i, HKV, D)).astype(np.float16)
        pool.append(s, x, x)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4)
    q = be.asarray(rng.standard_normal((4, HQ, D)).astype(np.float16))
    kv = be.asarray(rng.standard_normal((4, HKV, D)).astype(np.float16))
    out = be.asarray(np.full((4, HQ, D), np.nan, np.float16))
    for _ in range(3):
        step.begin()
        for layer in range(L):
            step.append(layer, kv, kv)
            step.decode(layer, q, out=out)
            k, v = (be.to_numpy(x)[layer] for x in (pool.k, pool.v))
            ref, _ = oracle_decode(be.to_numpy(q)[:B], k, v, pool.page_table(seqs),
                                   k_scale=float(pool.k_scale[layer]),
                                   v_scale=float(pool.v_scale[layer]))
            assert_matches_oracle(be.to_numpy(out)[:B], None, ref, None, "float16",
                                  f"layer {layer}", tol=fp8_out_tol("float16"))
    assert "kv float8_e4m3fn" in pd.last_outcome().detail


# ---------------------------------------------------------------------------- cascade, sparse
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_cascade_on_fp8_pool(backend_name):
    """Four requests forked from a 6-page prompt: cascade runs (level 0 on the v2 partial:
    the tensor-core prefix kernel reads 16-bit pools only, and the outcome says so), with
    sinks, against the oracle."""
    be = get_backend(backend_name)
    rng = np.random.default_rng(4)
    pool = pd.PagePool(64, P, HKV, D, dtype="float8_e5m2", k_scale=0.03, v_scale=0.01)
    root = pool.new_sequence()
    x = (rng.standard_normal((6 * P, HKV, D)) * 3).astype(np.float32)
    pool.append(root, x, x[::-1].copy())
    seqs = [pool.fork(root) for _ in range(4)]
    for s in seqs:
        y = rng.standard_normal((2 * P, HKV, D)).astype(np.float32)
        pool.append(s, y, -y)
    table = pool.page_table(seqs)
    q = rng.standard_normal((4, HQ, D)).astype(np.float16)
    sinks = (rng.standard_normal(HQ) * 2).astype(np.float32)
    ref, ref_lse = oracle_decode(q, pool.k, pool.v, table, sinks=sinks, k_scale=0.03,
                                 v_scale=0.01)
    prefix = pd.detect_shared_prefix(window_table(table, -1), min_shared_pages=2)
    out, lse = pd.cascade_decode(be.asarray(q), be.asarray(pool.k), be.asarray(pool.v), table,
                                 return_lse=True, out_dtype="float32", backend=be,
                                 cascade_plan=prefix, sinks=be.asarray(sinks),
                                 **pool.decode_args())
    o = pd.last_outcome()
    assert o.path == "cascade" and "kv float8_e5m2" in o.detail, o
    if be.device_info().prefix_tile_rows:
        assert "16-bit pools" in o.detail, o
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32", str(o),
                          tol=fp8_out_tol("float32"))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("min_sparsity", [0.0, 1e9], ids=["fused", "masked"])
def test_sparse_on_fp8_caches(backend_name, min_sparsity):
    be = get_backend(backend_name)
    rng = np.random.default_rng(8)
    b, cap_tokens, fmt, ks, vs = 2, 96, "float8_e4m3fn", 0.01, 0.005
    k = fp8.quantize(rng.standard_normal((b, HKV, cap_tokens, D)) * 2, fmt, ks)
    v = fp8.quantize(rng.standard_normal(k.shape), fmt, vs)
    q = rng.standard_normal((b, HQ, D)).astype(np.float32)
    live = np.array([90, 41])
    pos = np.stack([np.stack([rng.choice(live[bi], 20, replace=False) for _ in range(HKV)])
                    for bi in range(b)])
    kd, vd = fp8.dequantize(k, fmt, ks).astype(np.float64), fp8.dequantize(v, fmt, vs)
    g = HQ // HKV
    ref, ref_lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for bi in range(b):
        for h in range(HKV):
            hs = slice(h * g, (h + 1) * g)
            ref[bi, hs], ref_lse[bi, hs] = attention_f64(
                q[bi, hs].astype(np.float64), kd[bi, h, pos[bi, h]][:, None],
                vd[bi, h, pos[bi, h]][:, None].astype(np.float64), D ** -0.5,
                soft_cap=1.5)
    out, lse, o = pd.sparse_decode(
        be.asarray(q), be.asarray(k), be.asarray(v), make_selection(pos), live_lens=live,
        min_sparsity=min_sparsity, return_lse=True, return_outcome=True, backend=be,
        logits_soft_cap=1.5, kv_dtype=fmt, k_scale=ks, v_scale=vs)
    assert o.path == ("sparse" if min_sparsity == 0 else "sparse-masked"), o
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32", str(o),
                          tol=fp8_out_tol("float32"))


# ---------------------------------------------------------------------------- uint8 arrays
def test_uint8_pools_name_their_format():
    """Pools held as bytes (CuPy's and MLX's fp8 arrays) decode with ``kv_dtype``; the same
    bytes as e5m2 give another answer (the format is not guessed)."""
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    kb, vb = fp8.codes(k), fp8.codes(v)
    ref, _ = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    got = pd.decode(q, kb, vb, table, kv_dtype="float8_e4m3fn", k_scale=ks, v_scale=vs,
                    out_dtype="float32")
    assert_matches_oracle(got, None, ref, None, "float32", tol=fp8_out_tol("float32"))
    other = pd.decode(q, kb, vb, table, kv_dtype="float8_e5m2", k_scale=ks, v_scale=vs,
                      out_dtype="float32")
    assert not np.allclose(other, got)


def test_mlx_backend_fp8_pool():
    """The MLX ops backend: an fp8 pool is uint8 (MLX has no fp8 dtype), appended with
    host quantization, decoded by the gather arm with the format from the pool."""
    from helpers import require_mlx
    mx = require_mlx()
    rng = np.random.default_rng(5)
    pool = pd.PagePool(16, P, HKV, D, dtype="float8_e4m3fn", k_scale=0.02, v_scale=0.01,
                       backend="mlx")
    assert pool.k.dtype == mx.uint8
    seqs = [pool.new_sequence() for _ in range(2)]
    for s, n in zip(seqs, (30, 7)):
        x = rng.standard_normal((n, HKV, D)).astype(np.float16)
        pool.append(s, x, x)
    table = pool.page_table(seqs)
    q = rng.standard_normal((2, HQ, D)).astype(np.float16)
    kn, vn = np.array(pool.k), np.array(pool.v)
    ref, _ = oracle_decode(q, kn, vn, table, kv_dtype="float8_e4m3fn", k_scale=0.02,
                           v_scale=0.01)
    got = pd.decode(mx.array(q), pool.k, pool.v, table, out_dtype="float32",
                    **pool.decode_args())
    assert_matches_oracle(np.array(got), None, ref, None, "float32",
                          tol=fp8_out_tol("float32"))


def test_mlx_backend_takes_host_fp8_arrays():
    """numpy fp8 pools (ml_dtypes) on the MLX backend: uploaded as their bytes with the
    format read off the caller's arrays, the answer of the same pools as uint8 plus
    ``kv_dtype`` (not std::bad_cast out of ``mx.array``)."""
    from helpers import require_mlx
    mx = require_mlx()
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    be = pd.get_backend("mlx")
    assert be.asarray(k).dtype == mx.uint8
    ref, _ = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    got = pd.decode(q, k, v, table, k_scale=ks, v_scale=vs, out_dtype="float32", backend=be)
    assert_matches_oracle(np.array(got), None, ref, None, "float32", tol=fp8_out_tol("float32"))
    as_bytes = pd.decode(q, fp8.codes(k), fp8.codes(v), table, kv_dtype="float8_e4m3fn",
                         k_scale=ks, v_scale=vs, out_dtype="float32", backend=be)
    np.testing.assert_array_equal(np.array(got), np.array(as_bytes))


def test_an_fp8_q_is_refused_by_its_own_dtype_on_byte_backends():
    """The MLX backend holds a host fp8 array as its bytes; a q of an fp8 dtype is refused
    naming that dtype, not the uint8 the caller never wrote."""
    from helpers import require_mlx
    require_mlx()
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    q8 = fp8.quantize(q.astype(np.float32), "float8_e5m2", 1.0)
    with pytest.raises(pd.InvalidDtypeError, match=r"decode: q must have dtype in .*"
                                                   r"got float8_e5m2$"):
        pd.decode(q8, k, v, table, k_scale=ks, v_scale=vs, backend="mlx")


def test_byte_backends_judge_and_name_the_caller_s_dtype():
    """Arguments the MLX backend holds in another dtype than the caller's (fp8 as uint8
    bytes, float64 as float32) are judged and named by the caller's dtype, as on the
    reference backend; a 0-d fp8 array keeps its shape through the upload; a
    negative-stride host array is taken like any other view (found by a fuzz of this
    session's fp8 upload)."""
    from helpers import require_mlx
    require_mlx()
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    e4 = fp8.numpy_fp8("float8_e4m3fn")
    sinks = np.zeros(q.shape[1], np.float32)
    for be in ("mlx", "reference"):
        kw = {"k_scale": ks, "v_scale": vs, "backend": be}
        with pytest.raises(pd.InvalidArgumentError, match=r"sinks must be float32, got "
                                                          r"float8_e4m3fn$"):
            pd.decode(q, k, v, table, sinks=sinks.astype(e4), **kw)
        with pytest.raises(pd.InvalidDtypeError, match=r"got float64$"):
            pd.decode(q, k.astype(np.float64), v.astype(np.float64), table, backend=be)
        with pytest.raises(pd.InvalidArgumentError, match=r"got shape \[\]"):
            pd.decode(np.array(1.5, e4), k, v, table, **kw)
        va = np.zeros((2, 4, 8), np.float32)
        la = np.zeros((2, 4), np.float32)
        with pytest.raises(pd.InvalidDtypeError, match=r"merge_state: v_a must have dtype "
                                                       r"float32, got float8_e4m3fn"):
            pd.merge_state(va.astype(e4), la, va, la, backend=be)
        pool = pd.PagePool(8, P, HKV, D, dtype="float8_e4m3fn", k_scale=ks, v_scale=vs,
                           backend=be)
        rows = np.ones((3, HKV, D), np.float32).astype(e4)
        with pytest.raises(pd.InvalidDtypeError, match=r"PagePool.append: k must have dtype "
                                                       r"in .*got float8_e4m3fn$"):
            pool.append(pool.new_sequence(), rows, rows)
    flipped = np.ascontiguousarray(q[::-1])[::-1]          # q's values, negative strides
    assert flipped.strides[0] < 0
    got = pd.decode(flipped, k, v, table, k_scale=ks, v_scale=vs, out_dtype="float32",
                    backend="mlx")
    want = pd.decode(q, k, v, table, k_scale=ks, v_scale=vs, out_dtype="float32",
                     backend="mlx")
    np.testing.assert_array_equal(np.array(got), np.array(want))


class _ForeignDtype:
    """A dtype object spelled as another library spells it (TensorFlow: ``<dtype:
    'float16'>``), which the package does not parse."""

    def __str__(self) -> str:
        return "<dtype: 'float16'>"


class _ForeignArray:
    """An array-like of another library: numpy converts it, its ``dtype`` is foreign."""

    def __init__(self, a: np.ndarray) -> None:
        self._a, self.dtype, self.shape = a, _ForeignDtype(), a.shape

    def __array__(self, dtype=None, copy=None):
        return self._a


def test_a_dtype_spelled_by_another_library_falls_back_to_the_backend_s():
    """caller_dtype judges the caller's own dtype only where the package knows its
    spelling; another library's spelling falls back to the converted array's, as before
    session 27's change (which refused such arrays); float64 rows are refused on MLX's
    float32 pools too (MLX held them as float32, skipping the check)."""
    from paged_decode.dtypes import caller_dtype
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn")
    assert caller_dtype(_ForeignArray(q), "float16") == "float16"
    assert caller_dtype(k, "uint8") == "float8_e4m3fn"
    assert caller_dtype([1.0], "float32") == "float32"
    want = pd.decode(q, k, v, table, k_scale=ks, v_scale=vs, out_dtype="float32")
    got = pd.decode(_ForeignArray(q), k, v, table, k_scale=ks, v_scale=vs, out_dtype="float32")
    np.testing.assert_array_equal(got, want)
    from helpers import require_mlx
    require_mlx()
    for be in ("mlx", "reference"):
        pool = pd.PagePool(8, P, HKV, D, dtype="float32", backend=be)
        rows = np.ones((3, HKV, D), np.float64)
        with pytest.raises(pd.InvalidDtypeError, match=r"PagePool.append: k must have dtype "
                                                       r"in .*got float64$"):
            pool.append(pool.new_sequence(), rows, rows)


# ---------------------------------------------------------------------------- bad arguments
def _small():
    q, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn", lengths=(20,), fpo=(0,))
    return q, k, v, table


@pytest.mark.parametrize("kw,msg", [
    ({"v_scale": 0.1}, "k_scale is required with float8_e4m3fn pools"),
    ({"k_scale": 0.1}, "v_scale is required"),
    ({"k_scale": 0.0, "v_scale": 1.0}, "k_scale must be a positive finite float32"),
    ({"k_scale": -1.0, "v_scale": 1.0}, "k_scale must be a positive finite float32"),
    ({"k_scale": float("inf"), "v_scale": 1.0}, "k_scale must be a positive finite"),
    ({"k_scale": 1.0, "v_scale": float("nan")}, "v_scale must be a positive finite"),
    ({"k_scale": 1e39, "v_scale": 1.0}, "k_scale must be a positive finite float32"),
    ({"k_scale": True, "v_scale": 1.0}, "k_scale must be a positive finite"),
    ({"k_scale": "1", "v_scale": 1.0}, "k_scale must be a positive finite"),
    ({"k_scale": 1.0, "v_scale": 1.0, "kv_dtype": "float8_e5m2"},
     "k_pages has dtype float8_e4m3fn, but kv_dtype is float8_e5m2"),
    ({"k_scale": 1.0, "v_scale": 1.0, "kv_dtype": "int8"}, "kv_dtype must be None or one of"),
])
@pytest.mark.parametrize("entry", ["decode", "prepare_decode", "cascade_decode"])
def test_bad_fp8_arguments_are_refused(entry, kw, msg):
    q, k, v, table = _small()
    with pytest.raises(InvalidArgumentError, match=f"^{entry}: {msg}"):
        getattr(pd, entry)(q, k, v, table, **kw)


def test_the_oracle_takes_a_scale_as_decode_does():
    """A one-element array scale, which decode accepts, in the float64 oracle too (it
    raised numpy's TypeError: S25's Metal fuzzing)."""
    from paged_decode.reference import oracle_decode
    q, k, v, table = _small()
    want = oracle_decode(q, k, v, table, k_scale=0.5, v_scale=2.0)
    got = oracle_decode(q, k, v, table, k_scale=np.array([0.5]), v_scale=np.array([[2.0]]))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_a_scale_may_be_any_one_element_real_array():
    """A number, or a one-element numpy / torch array of a real dtype (int included), as
    any scalar is; bool and complex ones are refused like bool and complex numbers."""
    torch = pytest.importorskip("torch")
    for v in (2, 2.0, np.float32(2), np.array(2), np.array([2.0]), np.array([[2]]),
              torch.tensor(2.0), torch.tensor([2])):
        assert fp8.check_scale("f", "k_scale", v) == np.float32(2), repr(v)
    for v in (np.array([True]), torch.tensor(True), np.array(2j), np.array([1.0, 2.0])):
        with pytest.raises(InvalidArgumentError, match="k_scale must be a positive finite"):
            fp8.check_scale("f", "k_scale", v)


def test_a_device_scale_is_refused_inside_a_graph_capture(monkeypatch):
    """A device scale is read back every call; inside a CUDA graph capture that read
    would fail with the framework's own error (and a replay would keep one value), so it
    is refused by name, whichever framework captures (a CuPy scale may meet a torch
    capture). Stand-in torch and CuPy modules and arrays (no GPU here); outside a capture
    the same arrays are read as any one-element array is."""
    import sys
    import types
    state = {"cupy": False, "torch": False}

    class Stream:
        def is_capturing(self):
            return state["cupy"]
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: Stream())
    fake_torch = types.ModuleType("torch")
    fake_torch.cuda = types.SimpleNamespace(
        is_available=lambda: True, is_current_stream_capturing=lambda: state["torch"])
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setitem(sys.modules, "torch", fake_torch)

    def scale(module, **extra):
        cls = type("ndarray", (), {"__module__": module, "shape": (1,),
                                   "dtype": np.dtype(np.float32),
                                   "item": lambda self: 0.25, **extra})
        return cls()
    cupy_scale, torch_scale = scale("cupy._core.core"), scale("torch", is_cuda=True)
    host_like_torch = scale("torch", is_cuda=False)
    for who in ("cupy", "torch"):
        state.update(cupy=who == "cupy", torch=who == "torch")
        for v in (cupy_scale, torch_scale):
            with pytest.raises(InvalidArgumentError, match=r"^decode: k_scale is a device "
                               r"array, read back on the host every call; inside a CUDA "
                               r"graph capture"):
                fp8.check_scale("decode", "k_scale", v)
        assert fp8.check_scale("decode", "k_scale", host_like_torch) == np.float32(0.25)
    state.update(cupy=False, torch=False)
    for v in (cupy_scale, torch_scale):
        assert fp8.check_scale("decode", "k_scale", v) == np.float32(0.25)
    assert not fp8._capturing_device_array(np.array([1.0]))      # host arrays: never


def test_fp8_dtype_rules():
    q, k, v, table = _small()
    with pytest.raises(InvalidArgumentError, match="^decode: k_scale is for fp8 pools"):
        pd.decode(q, k.astype(np.float16), v.astype(np.float16), table, k_scale=1.0)
    with pytest.raises(InvalidDtypeError, match=r"^decode: q must have dtype in \(float16, "
                                                 r"bfloat16, float32\), got float8_e4m3fn"):
        pd.decode(q.astype(ml_dtypes.float8_e4m3fn), k, v, table, k_scale=1.0, v_scale=1.0)
    with pytest.raises(InvalidDtypeError, match="^decode: k_pages must have dtype in .*got "
                                                 "uint8"):
        pd.decode(q, fp8.codes(k), fp8.codes(v), table, k_scale=1.0, v_scale=1.0)
    with pytest.raises(InvalidArgumentError, match="^decode: v_pages must have k_pages' dtype "
                                                   "float8_e4m3fn, got float8_e5m2"):
        pd.decode(q, k, v.astype(np.float32).astype(ml_dtypes.float8_e5m2), table,
                  k_scale=1.0, v_scale=1.0)
    with pytest.raises(InvalidArgumentError, match="^decode: kv_dtype='float8_e4m3fn' needs "
                                                   "k_pages of dtype float8_e4m3fn or uint8"):
        pd.decode(q, k.astype(np.float16), v.astype(np.float16), table,
                  kv_dtype="float8_e4m3fn", k_scale=1.0, v_scale=1.0)
    # the tensor-core partial takes fp8 pools with 16-bit queries only
    # (tests/test_v2tc_fp8.py runs it)
    with pytest.raises(UnsupportedProblemError, match="^decode: backend 'emulated-cuda' "
                                                      "cannot run path 'v2tc'.*got q float32"):
        pd.decode(q.astype(np.float32), k, v, table, path="v2tc", k_scale=1.0, v_scale=1.0,
                  backend="emulated-cuda")


@pytest.mark.parametrize("kw,msg", [
    ({}, "an fp8 pool needs k_scale"),
    ({"k_scale": 1.0}, "an fp8 pool needs v_scale"),
    ({"k_scale": [1.0, 2.0, 3.0], "v_scale": 1.0}, r"k_scale must be one number or one per "
                                                   r"layer \(\[2\]\), got shape \[3\]"),
    ({"k_scale": [1.0, -2.0], "v_scale": 1.0}, r"k_scale\[1\] must be a positive finite"),
    ({"k_scale": 1.0, "v_scale": np.inf}, "v_scale must be a positive finite"),
])
def test_bad_pool_scales_are_refused(kw, msg):
    with pytest.raises(InvalidArgumentError, match=f"^PagePool: {msg}"):
        pd.PagePool(4, P, HKV, D, dtype="float8_e4m3fn", num_layers=2, **kw)


def test_pool_refuses_scales_for_float_pools_and_fp8_rows():
    with pytest.raises(InvalidArgumentError, match="^PagePool: k_scale is for fp8 pools"):
        pd.PagePool(4, P, HKV, D, dtype="float16", k_scale=1.0)
    pool = pd.PagePool(4, P, HKV, D, dtype="float8_e4m3fn", k_scale=1.0, v_scale=1.0)
    s = pool.new_sequence()
    rows = np.zeros((3, HKV, D), ml_dtypes.float8_e4m3fn)
    with pytest.raises(InvalidDtypeError, match="^PagePool.append: k must have dtype in "
                                                r"\(float16, bfloat16, float32\)"):
        pool.append(s, rows, rows)


def test_fp8_specializations_compile_for_sm90():
    """Every fp8 kernel specialization compiles with the machine's NVRTC (or nvcc) for
    sm_90, so ptxas checks the sm_89+ ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2`` widen the
    emulator never runs (the GPU tests check its values)."""
    from paged_decode import cuda_compile
    from paged_decode.specs import append_fp8_spec, v1_spec, v2_spec
    if cuda_compile.available() is None:
        pytest.skip("neither NVRTC nor nvcc is available")
    specs = [v2_spec(q, f, o, d, 16, qh) for f in FORMATS for q in ("float16", "bfloat16")
             for o in (q, "float32") for d, qh in ((128, 4), (64, 8))]
    specs += [v1_spec("float16", f, "float16", 128, 16) for f in FORMATS]
    specs += [append_fp8_spec(f, r) for f in FORMATS for r in fp8.ROW_DTYPES]
    cuda_compile.compile_specs(specs)


def test_fp8_v2_partial_does_not_spill():
    """ptxas for sm_90 (``-v`` through NVRTC or nvcc): the fp8 v2 partial takes 8
    elements per lane, so at 4 and 8 heads per CTA it spills nothing and uses no more
    registers than the float16 one (16 elements per lane spilled: docs/fp8.md). A
    compile fact."""
    from paged_decode import cuda_compile
    from paged_decode.specs import v2_spec
    if cuda_compile.available() is None:
        pytest.skip("neither NVRTC nor nvcc is available")
    for qh in (4, 8):
        f16 = cuda_compile.register_usage(v2_spec("float16", "float16", "float16", 128, 16, qh))
        for fmt in FORMATS:
            regs, spill = cuda_compile.register_usage(
                v2_spec("float16", fmt, "float16", 128, 16, qh))
            assert spill == 0 and regs <= f16[0], (fmt, qh, regs, spill, f16)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_fp8_pools_with_several_query_tokens(backend_name):
    """Multi-token decode over fp8 pools: both of its passes (the common range with the
    tokens folded into the group, the causal pieces) dequantize like one-token decode."""
    be = get_backend(backend_name)
    _, k, v, table, ks, vs = _fp8_problem("float8_e4m3fn", lengths=(70, 9, 33, 17))
    t = 3
    q = np.random.default_rng(5).standard_normal((table.batch_size, t, HQ, D)).astype(
        np.float16)
    ref, ref_lse = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    for path in ("v2", "v1"):
        out, lse = pd.decode(be.asarray(q), be.asarray(k), be.asarray(v), table, path=path,
                             return_lse=True, out_dtype="float32", backend=be,
                             k_scale=ks, v_scale=vs)
        assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float32",
                              f"{backend_name} {path} T={t}", tol=fp8_out_tol("float32"))
