"""fp8 K/V caches and the calibration scales through the FlashInfer drop-in, as FlashInfer
0.3.1's wrapper takes them: ``plan(kv_data_type=float8_e4m3fn | float8_e5m2)``, then
``run(q, cache, q_scale=, k_scale=, v_scale=)`` with ``q_scale`` and ``k_scale``
multiplying the softmax scale and ``v_scale`` the output, each 1 when not given; for
16-bit caches too. Against the float64 oracle on the dequantized values, eager and graph
mode, on the reference backend and the CUDA kernels on the emulator; caches as ml_dtypes
numpy arrays, raw ``uint8`` bytes (CuPy has no fp8 dtype) and torch fp8 tensors; the
append copies rows in the cache's format."""

from __future__ import annotations

import numpy as np
import pytest
from fi_cases import FiCase, make_fi_problem
from helpers import assert_matches_oracle, fp8_out_tol

import paged_decode.compat.flashinfer as fi
from paged_decode.errors import InvalidArgumentError, InvalidDtypeError
from paged_decode.fp8 import quantize
from paged_decode.reference import max_rel_error, oracle_decode

WS = 1 << 22
CASE = FiCase(7, 61, 8, 8, 4, 128, ragged=True)
K_SCALE, V_SCALE = 0.37, 2.5   # far from 1: a scale dropped or swapped fails the oracle


def fp8_problem(fmt: str, seed: int = 0):
    """A FlashInfer problem whose cache is ``fmt`` codes of ``K / K_SCALE`` and ``V /
    V_SCALE`` (so that the stored values times the scales are the real K / V)."""
    pr = make_fi_problem(CASE, seed=seed)
    cache = pr.cache.astype(np.float32)
    codes = np.empty(cache.shape, quantize(cache[:1, 0], fmt).dtype)
    codes[:, 0] = quantize(cache[:, 0], fmt, K_SCALE)
    codes[:, 1] = quantize(cache[:, 1], fmt, V_SCALE)
    return pr, codes


def oracle(pr, codes, fmt, sm_scale=None):
    return oracle_decode(pr.q, codes[:, 0], codes[:, 1], pr.table, sm_scale, kv_dtype=fmt,
                         k_scale=K_SCALE, v_scale=V_SCALE)


def plan(w, pr, kv_data_type, **kw):
    c = pr.case
    w.plan(pr.indptr, pr.indices, pr.last_page_len, c.num_qo_heads, c.num_kv_heads,
           c.head_dim, c.page_size, q_data_type="float16", kv_data_type=kv_data_type, **kw)
    return w


def graph_wrapper(pr, backend):
    b = pr.case.batch
    bufs = (np.zeros(b + 1, np.int32), np.zeros(pr.indices.size + 8, np.int32),
            np.zeros(b, np.int32))
    return fi.BatchDecodeWithPagedKVCacheWrapper(
        np.zeros(WS, np.uint8), use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
        backend=backend)


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_fp8_caches_match_the_oracle_on_the_dequantized_values(backend, fmt, graph):
    pr, codes = fp8_problem(fmt)
    ref_o, ref_l = oracle(pr, codes, fmt)
    w = graph_wrapper(pr, backend) if graph else \
        fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8), backend=backend)
    plan(w, pr, fmt)
    raw = codes.view(np.uint8)                      # CuPy's form: the bytes, format planned
    for name, cache in (("combined", codes), ("pair", (np.ascontiguousarray(codes[:, 0]),
                                                       np.ascontiguousarray(codes[:, 1]))),
                        ("uint8", raw)):
        out = np.full(pr.q.shape, np.nan, np.float16)
        lse = np.full(pr.q.shape[:2], np.nan, np.float32)
        w.run(pr.q, cache, out=out, lse=lse, k_scale=K_SCALE, v_scale=V_SCALE)
        assert_matches_oracle(out, lse, ref_o, ref_l, "float16", f"{fmt} {name}",
                              tol=fp8_out_tol("float16"))
    # the scales matter: without them (FlashInfer's default of 1) the answer is another
    got = w.run(pr.q, codes)
    assert max_rel_error(got, ref_o) > 10 * fp8_out_tol("float16")
    ref1, _ = oracle_decode(pr.q, codes[:, 0], codes[:, 1], pr.table, kv_dtype=fmt,
                            k_scale=1.0, v_scale=1.0)
    assert max_rel_error(got, ref1) < fp8_out_tol("float16")


def test_torch_fp8_tensors_are_read_zero_copy():
    torch = pytest.importorskip("torch")
    fmt = "float8_e4m3fn"
    pr, codes = fp8_problem(fmt, seed=2)
    ref_o, ref_l = oracle(pr, codes, fmt)
    w = plan(fi.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(WS, dtype=torch.uint8)), pr,
             torch.float8_e4m3fn)
    cache = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn)
    out, lse = w.run(torch.from_numpy(pr.q), cache, k_scale=K_SCALE, v_scale=V_SCALE,
                     return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert_matches_oracle(out.numpy(), lse.numpy(), ref_o, ref_l, "float16", "torch fp8",
                          tol=fp8_out_tol("float16"))
    with pytest.raises(InvalidArgumentError, match=r"paged_kv_cache has dtype float8_e5m2, "
                                                   r"but kv_dtype is float8_e4m3fn"):
        w.run(torch.from_numpy(pr.q), cache.view(torch.uint8).view(torch.float8_e5m2))


def test_q_and_k_scales_multiply_the_softmax_scale_and_v_scale_the_output():
    """FlashInfer's run on a 16-bit cache: ``sm_scale * q_scale * k_scale`` and the output
    times ``v_scale`` (the LSE unscaled); eager and graph mode agree."""
    pr = make_fi_problem(CASE, seed=4)
    s, qs, ks, vs = 0.11, 1.7, 0.6, 0.3
    ref_o, ref_l = oracle_decode(pr.q, pr.cache[:, 0], pr.cache[:, 1], pr.table, s * qs * ks)
    for w in (fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8)),
              graph_wrapper(pr, "reference")):
        plan(w, pr, "float16", sm_scale=s)
        out, lse = w.run(pr.q, pr.cache, q_scale=qs, k_scale=ks, v_scale=vs, return_lse=True)
        assert_matches_oracle(out, lse, ref_o * vs, ref_l, "float16", "scales")
        # 1 is the default of each
        plain = w.run(pr.q, pr.cache, q_scale=1.0, k_scale=1.0, v_scale=1.0)
        np.testing.assert_array_equal(plain, w.run(pr.q, pr.cache))


@pytest.mark.parametrize("kw, match", [
    ({"q_scale": 0.0}, "q_scale must be a positive finite float32 number, got 0.0"),
    ({"k_scale": -1.0}, "k_scale must be a positive finite float32 number, got -1.0"),
    ({"v_scale": float("nan")}, "v_scale must be a positive finite float32 number"),
    ({"v_scale": "1"}, "v_scale must be a positive finite float32 number, got '1'"),
    ({"k_scale": 1e39}, "k_scale must be a positive finite float32 number"),
])
def test_bad_scales_are_refused_by_name(kw, match):
    pr = make_fi_problem(CASE)
    w = plan(fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8)), pr, "float16")
    with pytest.raises(InvalidArgumentError, match=match) as e:
        w.run(pr.q, pr.cache, **kw)
    assert str(e.value).startswith("BatchDecodeWithPagedKVCacheWrapper.run: ")


def test_an_fp8_plan_refuses_16_bit_caches_and_the_reverse():
    pr, codes = fp8_problem("float8_e4m3fn")
    w = plan(fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8)), pr,
             "float8_e4m3fn")
    with pytest.raises(InvalidArgumentError, match=r"kv_dtype='float8_e4m3fn' needs "
                                                   r"paged_kv_cache of dtype float8_e4m3fn "
                                                   r"or uint8 \(its bytes\), got float16"):
        w.run(pr.q, pr.cache)
    w16 = plan(fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(WS, np.uint8)), pr, "float16")
    with pytest.raises(InvalidArgumentError, match=r"paged_kv_cache has dtype float8_e4m3fn, "
                                                   r"but plan's kv_data_type is float16"):
        w16.run(pr.q, codes)
    with pytest.raises(InvalidDtypeError, match=r"paged_kv_cache must have dtype in"):
        w16.run(pr.q, codes.view(np.uint8))


def test_append_copies_rows_into_an_fp8_cache_in_its_format():
    fmt = "float8_e5m2"
    pr, codes = fp8_problem(fmt, seed=5)
    cache = codes.copy()
    rng = np.random.default_rng(0)
    rows = quantize(rng.standard_normal((3, 4, 128)).astype(np.float32), fmt, 0.5)
    indptr, lpl = pr.indptr.copy(), pr.last_page_len.copy()
    b = pr.case.batch
    seq = fi.get_seq_lens(indptr, lpl, pr.case.page_size)
    batch, pos = np.array([0, 2, b - 1], np.int32), seq[[0, 2, b - 1]] - 1  # overwrite
    fi.append_paged_kv_cache(rows, rows[::-1].copy(), batch, pos, cache, pr.indices, indptr,
                             lpl)
    for i, (r, t) in enumerate(zip(batch, pos)):
        page = pr.indices[indptr[r] + t // pr.case.page_size]
        e = t % pr.case.page_size
        np.testing.assert_array_equal(cache[page, 0, e].view(np.uint8), rows[i].view(np.uint8))
        np.testing.assert_array_equal(cache[page, 1, e].view(np.uint8),
                                      rows[2 - i].view(np.uint8))
    raw = codes.view(np.uint8).copy()                   # the same bytes as uint8
    fi.append_paged_kv_cache(rows.view(np.uint8), rows.view(np.uint8), batch, pos, raw,
                             pr.indices, indptr, lpl)
    with pytest.raises(InvalidArgumentError, match=r"append_key must have the cache's dtype "
                                                   r"float8_e5m2, got float16"):
        fi.append_paged_kv_cache(rows.astype(np.float16), rows, batch, pos, cache,
                                 pr.indices, indptr, lpl)
