"""fp8 K/V caches on the CUDA backend of a real GPU (skipped cleanly without CuPy or a
GPU): the sm_89+ hardware widen (``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``, which the emulator
never runs) over all 256 codes, the quantizing append kernel against ``ml_dtypes``, every
decode path on CuPy byte pools and on torch fp8 tensors (zero-copy) against the float64
oracle, and the engine step."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, fp8_out_tol
from test_fp8 import _CUDA_TEST, FORMATS, _check_conversions, _fp8_problem, _quant_inputs

import paged_decode as pd
from paged_decode import fp8
from paged_decode.backends import availability
from paged_decode.reference import oracle_decode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

HKV, D = 2, 64


@pytest.fixture(scope="module")
def cuda():
    return pd.get_backend("cuda")


@pytest.mark.parametrize("fmt", FORMATS)
def test_device_conversions_every_code(cuda, fmt):
    """The conversion test kernel of tests/test_fp8.py compiled for this GPU (sm_90: the
    widen takes the cvt path) against ml_dtypes."""
    import cupy as cp

    from paged_decode.backends.cuda_launch import COMPILE_OPTIONS
    name = {"float8_e4m3fn": "pd::fp8_e4m3", "float8_e5m2": "pd::fp8_e5m2"}[fmt]
    expr = f"pd_fp8_test<{name}>"
    mod = cp.RawModule(code=_CUDA_TEST, options=COMPILE_OPTIONS, name_expressions=[expr])
    x = _quant_inputs()
    codes = cp.asarray(np.arange(256, dtype=np.uint8))
    widened, scalar = cp.full(256, 7.0, cp.float32), cp.full(256, 7.0, cp.float32)
    xd, q = cp.asarray(x), cp.zeros(x.size, cp.uint8)
    mod.get_function(expr)((1,), (128,), (codes, widened, scalar, xd, q, np.int32(x.size)))
    _check_conversions(fmt, cp.asnumpy(widened), cp.asnumpy(scalar), x, cp.asnumpy(q),
                       nan_sign=False)


@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_decode_on_cuda(cuda, fmt, kind):
    import cupy as cp
    q, k, v, table, ks, vs = _fp8_problem(fmt)
    ref, ref_lse = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    if kind == "cupy":      # bytes: the format travels as kv_dtype
        qd, kd, vd = cp.asarray(q), cp.asarray(fp8.codes(k)), cp.asarray(fp8.codes(v))
        kw = {"kv_dtype": fmt}
    else:                   # torch fp8 tensors name their format
        torch = pytest.importorskip("torch")
        qd = torch.from_numpy(q).cuda()
        kd, vd = (torch.from_numpy(fp8.codes(x).copy()).cuda().view(getattr(torch, fmt))
                  for x in (k, v))
        kw = {}
    for path, ppc in (("v2", 10 ** 6), ("v2", 1), ("v1", None), ("gather", None)):
        plan = pd.plan_decode(table, q.shape[1], HKV, D, device=cuda.device_info(),
                              pages_per_chunk=None if ppc is None else min(ppc, 64))
        out, lse = pd.decode(qd, kd, vd, table, plan, path=path, return_lse=True,
                             out_dtype="float32", k_scale=ks, v_scale=vs, **kw)
        o = pd.last_outcome()
        assert f"kv {fmt}" in o.detail, o
        assert_matches_oracle(cuda.to_numpy(out), cuda.to_numpy(lse), ref, ref_lse, "float32",
                              f"{kind} {o}", tol=fp8_out_tol("float32"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_pool_append_and_engine_step_on_cuda(cuda, fmt):
    """The quantizing append kernel (in place, per-layer scales, a fork's copy-on-write)
    against fp8.quantize, then a captured engine step against the oracle."""
    import cupy as cp
    rng = np.random.default_rng(3)
    L, B, hq = 2, 3, 8
    pool = pd.PagePool(48, 16, HKV, D, dtype=fmt, num_layers=L, k_scale=[0.02, 0.5],
                       v_scale=0.01, backend=cuda)
    assert pool.k.dtype == np.uint8
    seqs = [pool.new_sequence() for _ in range(B)]
    prompts = []
    for i, s in enumerate(seqs):
        x = (rng.standard_normal((L, 9 + 13 * i, HKV, D)) * 3).astype(np.float32)
        x[0, 0, 0, :4] = [np.nan, np.inf, -1e9, 1e-12]
        pool.append(s, cp.asarray(x), cp.asarray(x))
        prompts.append(x)
    kp = cuda.to_numpy(pool.k)
    for s, x in zip(seqs, prompts):
        pages = pool.seq_pages(s)
        for layer in range(L):
            got = kp[layer][pages].reshape(-1, HKV, D)[:x.shape[1]]
            want = fp8.codes(fp8.quantize(x[layer], fmt, float(pool.k_scale[layer])))
            assert np.array_equal(got, want), (s, layer)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=hq, capacity=4)
    q = cp.asarray(rng.standard_normal((4, hq, D)).astype(np.float16))
    kv = cp.asarray(rng.standard_normal((4, HKV, D)).astype(np.float16))
    out = cp.full((4, hq, D), np.nan, cp.float16)
    step.begin()
    graph = step.capture(lambda st: [(st.append(i, kv, kv), st.decode(i, q, out=out))
                                     for i in range(L)])
    step.begin()
    out.fill(np.nan)
    graph.replay()
    cuda.synchronize()
    k, v = (cuda.to_numpy(x)[L - 1] for x in (pool.k, pool.v))
    ref, _ = oracle_decode(cuda.to_numpy(q)[:B], k, v, pool.page_table(seqs), kv_dtype=fmt,
                           k_scale=float(pool.k_scale[L - 1]),
                           v_scale=float(pool.v_scale[L - 1]))
    assert_matches_oracle(cuda.to_numpy(out)[:B], None, ref, None, "float16",
                          tol=fp8_out_tol("float16"))


# ---------------------------------------------------------------------------- v2tc
@pytest.mark.parametrize("to", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_device_pairs_every_code(cuda, fmt, to):
    """``fp8x4_to_pairs`` compiled for this GPU (sm_89+: the cvt path the tensor-core
    partial widens its byte ring with) gives the bits of the emulator's bit path and of
    ml_dtypes (``tests/test_v2tc_fp8.py``) on all 256 codes."""
    import cupy as cp
    from test_v2tc_fp8 import check_pairs, run_pairs_kernel

    from paged_decode.backends.cuda_launch import COMPILE_OPTIONS

    def on_gpu(src, name, words):
        mod = cp.RawModule(code=src, options=COMPILE_OPTIONS, name_expressions=[name])
        pairs = cp.full(128, 0xDEADBEEF, cp.uint32)
        mod.get_function(name)((1,), (64,), (cp.asarray(words), pairs))
        return cp.asnumpy(pairs)
    check_pairs(fmt, to, run_pairs_kernel(fmt, to, on_gpu), nan_sign=False)


@pytest.mark.parametrize("fmt,q_dtype", [("float8_e4m3fn", "float16"),
                                         ("float8_e5m2", "bfloat16")])
@pytest.mark.parametrize("hq,hkv,d,p,ctx", [(32, 8, 128, 16, 2048), (28, 4, 128, 16, 1500),
                                            (32, 2, 64, 1, 700), (64, 2, 256, 64, 900),
                                            (8, 8, 96, 3, 333)])
def test_v2tc_fp8_on_cuda(cuda, fmt, q_dtype, hq, hkv, d, p, ctx):
    """The tensor-core partial over fp8 pools on the GPU (the byte ring, the cvt widen
    into the warps' scratch tiles, mma.sync) against the float64 oracle on the dequantized
    values: GQA 4/7/16/32/1, head dims 64-256, pages 1-64, one chunk and split, q's dtype
    and float32 outputs, CuPy bytes and torch fp8 tensors."""
    import cupy as cp
    from helpers import tc_fp8_out_tol

    from paged_decode.problems import ProblemSpec, make_problem
    from paged_decode.specs import v2tc_ctas_per_chunk
    pr = make_problem(ProblemSpec(3, ctx, hq, hkv, d, p, q_dtype, fmt, seed=hq + d))
    ks, vs = 0.37, 2.5
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, k_scale=ks,
                                 v_scale=vs)
    q = cp.asarray(pr.q)
    kd, vd = (cp.asarray(fp8.codes(x)) for x in (pr.k_pages, pr.v_pages))
    for ppc in (None, 10 ** 6):
        plan = pd.plan_decode(pr.table, hq, hkv, d, device=cuda.device_info(),
                              pages_per_chunk=ppc, ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv))
        for od in (["float32"] if plan.needs_merge else ["float32", q_dtype]):
            out, lse = pd.decode(q, kd, vd, pr.table, plan, path="v2tc", return_lse=True,
                                 out_dtype=od, kv_dtype=fmt, k_scale=ks, v_scale=vs)
            o = pd.last_outcome()
            assert o.path.startswith("v2tc") and f"kv {fmt}" in o.detail, o
            assert_matches_oracle(cuda.to_numpy(out), cuda.to_numpy(lse), ref, ref_lse, od,
                                  f"{o}", tol=tc_fp8_out_tol(q_dtype, od))
    torch = pytest.importorskip("torch")
    kt, vt = (torch.from_numpy(fp8.codes(x).copy()).cuda().view(getattr(torch, fmt))
              for x in (pr.k_pages, pr.v_pages))
    out = pd.decode(torch.from_numpy(pr.q.view(np.uint16)).cuda().view(getattr(torch, q_dtype)),
                    kt, vt, pr.table, path="v2tc", out_dtype="float32", k_scale=ks, v_scale=vs)
    assert_matches_oracle(out.cpu().numpy(), None, ref, None, "float32", "torch fp8",
                          tol=tc_fp8_out_tol(q_dtype, "float32"))


def test_host_fp8_arrays_on_cuda(cuda):
    """numpy fp8 pools (ml_dtypes) given to the CUDA backend: uploaded as their bytes (CuPy
    has no fp8 dtype) with the format read off the caller's arrays; the answer of the same
    pools as CuPy bytes plus ``kv_dtype``."""
    import cupy as cp
    q, k, v, table, ks, vs = _fp8_problem("float8_e5m2")
    assert cuda.asarray(k).dtype == cp.uint8
    ref, _ = oracle_decode(q, k, v, table, k_scale=ks, v_scale=vs)
    from helpers import tc_fp8_out_tol
    for path in ("v2", "v2tc"):     # the CUDA-core and tensor-core partials' bounds differ
        got = pd.decode(q, k, v, table, k_scale=ks, v_scale=vs, out_dtype="float32",
                        backend=cuda, path=path)
        o = pd.last_outcome()
        assert o.path.startswith(path) and "kv float8_e5m2" in o.detail, o
        tol = tc_fp8_out_tol("float16", "float32") if path == "v2tc" else fp8_out_tol("float32")
        assert_matches_oracle(cuda.to_numpy(got), None, ref, None, "float32", str(o), tol=tol)
        as_bytes = pd.decode(cp.asarray(q), cp.asarray(fp8.codes(k)), cp.asarray(fp8.codes(v)),
                             table, kv_dtype="float8_e5m2", k_scale=ks, v_scale=vs,
                             out_dtype="float32", backend=cuda, path=path)
        np.testing.assert_array_equal(cuda.to_numpy(got), cuda.to_numpy(as_bytes))
