"""FlashInfer 0.3.1's finite mask over fp8 caches (``bench/flashinfer_mask.py``): a numpy
model of the order its tensor-core decode masks and scales in, which tests our
understanding of why its engine arm over an amax-calibrated e5m2 cache failed the oracle
on the H200 (S27-R3 / R5: 0.17-0.20) while e4m3 and tile-aligned lengths verified, not
FlashInfer itself; and the guard both FlashInfer arms refuse such scales with.

The model, as read from FlashInfer 0.3.1's source (file:line in ``flashinfer_mask``): the
raw logit ``q . k_code`` (``k_scale`` not applied) of every K position past the request's
length within the last ``CTA_TILE_KV``-position tile (a multiple of 16) is set to
``-5e4``; the padded V rows are zero; then ``exp2(logit * sm_scale * k_scale * log2(e) -
max)`` weighs every position of the tile, the output is normalized over them all and
multiplied by ``v_scale``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from paged_decode import fp8
from paged_decode.bench import flashinfer_arm as fa
from paged_decode.bench.engine_case import V_SIGMA, tolerance
from paged_decode.bench.flashinfer_mask import (
    FINITE_MASK,
    MASKED_LOG2_LIMIT,
    finite_mask_refusal,
    masked_logit_log2,
)
from paged_decode.reference import row_rel_error

HKV, G, D = 8, 4, 128
SM = D ** -0.5
#: the smallest KV tile of FlashInfer 0.3.1's tensor-core decode: CTA_TILE_KV = NUM_MMA_KV
#: x NUM_WARPS_KV x 16 (prefill.cuh:118), 4 KV warps at a 16-row query tile (:55-65)
TILE = 64


def finite_mask_then_scale(q, k_codes, v_codes, *, k_scale, v_scale, tile, mask_first=True):
    """One request's decode as FlashInfer 0.3.1's tensor-core kernel orders it (float64):
    ``q [Hkv, G, D]``, the cache's codes as values ``[n, Hkv, D]`` (unscaled). Positions
    ``n .. ceil(n / tile) * tile - 1`` are padding: raw logit ``-FINITE_MASK`` and V zero.
    ``mask_first=False``: the CUDA-core decode's order instead (scale, then mask in log2
    units)."""
    n = k_codes.shape[0]
    pad = -(-n // tile) * tile - n
    scale = SM * k_scale * math.log2(math.e)
    raw = np.einsum("hgd,nhd->hgn", q, k_codes)
    if mask_first:
        t = np.concatenate([raw, np.full((*raw.shape[:2], pad), -FINITE_MASK)], -1) * scale
    else:
        t = np.concatenate([raw * scale, np.full((*raw.shape[:2], pad), -FINITE_MASK)], -1)
    v = np.concatenate([v_codes, np.zeros((pad, *v_codes.shape[1:]))])
    p = np.exp2(t - t.max(-1, keepdims=True))
    return np.einsum("hgn,nhd->hgd", p, v) / p.sum(-1)[..., None] * v_scale


def exact(q, k_codes, v_codes, *, k_scale, v_scale):
    """The oracle: softmax over the request's positions only of the dequantized cache."""
    s = np.einsum("hgd,nhd->hgn", q, k_codes * k_scale) * SM
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hgn,nhd->hgd", p, v_codes * v_scale) / p.sum(-1)[..., None]


def _request(n, fmt, seed=0):
    """A request of ``n`` positions as the engine arm makes it: N(0, 1) queries and K,
    V at ``V_SIGMA``, the cache amax-calibrated (``fp8.amax_scales``) and quantized."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((HKV, G, D))
    k = rng.standard_normal((n, HKV, D)).astype(np.float16)
    v = (rng.standard_normal((n, HKV, D)) * V_SIGMA).astype(np.float16)
    ks, vs = (float(fp8.amax_scales([np.abs(x).max()], fmt)[0]) for x in (k, v))
    kc, vc = (fp8.dequantize(fp8.quantize(x, fmt, s), fmt).astype(np.float64)
              for x, s in ((k, ks), (v, vs)))
    return q, kc, vc, {"k_scale": ks, "v_scale": vs}


def test_the_finite_mask_before_the_scale_shrinks_e5m2_outputs_but_not_e4m3():
    """A ragged length (133: a partial last tile of 59 padded positions): over the e5m2
    cache the masked logit is about -0.5 in log2 units, the zero-V padding takes real
    weight and the output shrinks (as on the H200: 0.17-0.20); over e4m3 (about -65)
    it is masked and the output within the bench's bound."""
    n = 133
    q, kc, vc, sc = _request(n, "float8_e5m2")
    got = finite_mask_then_scale(q, kc, vc, **sc, tile=TILE)
    want = exact(q, kc, vc, **sc)
    err = row_rel_error(got, want)
    assert 0.1 < err < 0.3, err          # 0.19 here; the H200's engine arm: 0.17-0.20
    assert masked_logit_log2(SM, sc["k_scale"]) > -1
    # shrunk, not scrambled: every head's output is the right one times a factor < 1
    ratio = np.einsum("hgd,hgd->hg", got, want) / np.einsum("hgd,hgd->hg", want, want)
    assert np.all(ratio < 0.95) and np.all(ratio > 0.5), ratio
    np.testing.assert_allclose(got, want * ratio[..., None], rtol=0, atol=0.05)
    q, kc, vc, sc = _request(n, "float8_e4m3fn")
    err = row_rel_error(finite_mask_then_scale(q, kc, vc, **sc, tile=TILE),
                        exact(q, kc, vc, **sc))
    assert err <= tolerance("float16", "float8_e4m3fn"), err
    assert masked_logit_log2(SM, sc["k_scale"]) < MASKED_LOG2_LIMIT


def test_tile_aligned_lengths_and_the_cuda_core_order_hide_the_finite_mask():
    """Why the decode suite's e5m2 FlashInfer arms verified: lengths that fill their last
    tile (8K, 32K) have no padding; and the CUDA-core decode scales before it masks."""
    q, kc, vc, sc = _request(2 * TILE, "float8_e5m2", seed=1)
    assert row_rel_error(finite_mask_then_scale(q, kc, vc, **sc, tile=TILE),
                         exact(q, kc, vc, **sc)) < 1e-9
    q, kc, vc, sc = _request(133, "float8_e5m2", seed=1)
    assert row_rel_error(finite_mask_then_scale(q, kc, vc, **sc, tile=TILE, mask_first=False),
                         exact(q, kc, vc, **sc)) < 1e-9


def test_the_guard_refuses_the_scales_the_model_shrinks_at():
    """``finite_mask_refusal``: the masked logit in log2 units, refused above -30, the note
    naming the reason, the value and the fix; e5m2 calibrated to 57344 is refused, e4m3's
    calibration and e5m2 at 1.0 (or at an e4m3-like 448) are not."""
    e5m2 = fp8.max_finite("float8_e5m2")
    assert masked_logit_log2(SM, 1.0) == pytest.approx(-5e4 * SM * math.log2(math.e))
    assert masked_logit_log2(SM, 4.6 / e5m2) == pytest.approx(-0.5115, abs=1e-3)
    why = finite_mask_refusal(SM, 4.6 / e5m2)
    assert why is not None
    for part in ("finite -5e4", "before the scale", "k_scale 8e-05", "-0.51 in log2",
                 "> -30", "larger k_scale"):
        assert part in why, (part, why)
    for ks in (4.6 / 448, 4.6 / 448 / 2, 1.0):
        assert finite_mask_refusal(SM, ks) is None, ks
    # the threshold: k_scale * sm_scale * 5e4 * log2(e) = 30
    edge = -MASKED_LOG2_LIMIT / (FINITE_MASK * SM * math.log2(math.e))
    assert finite_mask_refusal(SM, edge * 1.001) is None
    assert finite_mask_refusal(SM, edge * 0.999) is not None
    # a soft cap scales after the mask by the cap: masked at any cap >= 1e-3
    assert finite_mask_refusal(SM, 4.6 / e5m2, logits_soft_cap=30.0) is None


def test_the_decode_suite_s_e5m2_pools_are_refused_on_tensor_cores():
    """``runner.fp8_scales``: k_scale 8 / 57344 at sm_scale 1/sqrt(128) gives a masked
    logit of -0.89 in log2 units: the decode suite's tensor-core FlashInfer arm over e5m2
    pools is refused (their H200 verification passed only because 8K and 32K fill their
    last tile); its e4m3 pools (8 / 448: -114) are not."""
    from paged_decode.bench.runner import fp8_scales
    e5, _ = fp8_scales("float8_e5m2")
    e4, _ = fp8_scales("float8_e4m3fn")
    assert masked_logit_log2(SM, e5) == pytest.approx(-0.889, abs=1e-3)
    assert finite_mask_refusal(SM, e5) is not None
    assert masked_logit_log2(SM, e4) == pytest.approx(-113.85, abs=0.01)
    assert finite_mask_refusal(SM, e4) is None


def test_make_flashinfer_decode_refuses_the_finite_mask_s_scales_on_tensor_cores_only():
    """Before importing anything: the tensor-core arm raises ``ValueError`` with the
    guard's reason (the bench reports it unavailable); the CUDA-core arm goes on to the
    next check (here: the import, or the CUDA tensors on a machine with FlashInfer)."""
    from helpers import table_of
    table = table_of(lengths=[33, 20], spare_pages=2)
    n = table.num_pages or table.total_pages
    q = np.zeros((table.batch_size, 8, D), np.float16)
    k = np.zeros((n, table.page_size, 2, D), fp8.numpy_fp8("float8_e5m2"))
    ks = 8 / fp8.max_finite("float8_e5m2")
    with pytest.raises(ValueError, match=r"finite -5e4.*-0.89 in log2"):
        fa.make_flashinfer_decode(q, k, k.copy(), table, sm_scale=SM, use_tensor_cores=True,
                                  k_scale=ks, v_scale=ks)
    with pytest.raises(Exception) as info:        # not the guard's refusal
        fa.make_flashinfer_decode(q, k, k.copy(), table, sm_scale=SM, use_tensor_cores=False,
                                  k_scale=ks, v_scale=ks)
    assert "finite" not in str(info.value)
