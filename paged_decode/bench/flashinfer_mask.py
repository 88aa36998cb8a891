"""FlashInfer 0.3.1's finite mask, and the fp8 scales it does not mask at.

As read from FlashInfer 0.3.1's source (``flashinfer_python-0.3.1``; paths under
``include/flashinfer/``): its tensor-core decode (``use_tensor_cores=True``: the "fa2"
prefill kernel with the query heads packed, ``flashinfer/decode.py:1004-1016``) masks
the K positions past a request's length within its last tile of ``CTA_TILE_KV``
positions (a multiple of 16, ``attention/prefill.cuh:118``) by writing a *finite* value
into the *raw* ``q . k`` logit: ``MaskFillValue = -math::inf`` (``prefill.cuh:154-161``),
``math::inf = 5e4`` (``math.cuh:32``), written by ``logits_mask`` (``prefill.cuh:787-788``).
The paged kernel's order is ``compute_qk``, ``logits_transform`` (the default variant
leaves the logit raw: ``attention/variants.cuh:69-78``), ``logits_mask``,
``update_mdo_states`` (``prefill.cuh:2295-2329``); only the last multiplies by the softmax
scale, inside the exponent (``sm_scale_log2 = sm_scale * log2e``, ``variants.cuh:54``;
``prefill.cuh:872, 889, 900-907``), and ``run`` folds ``k_scale`` into that ``sm_scale``
(``flashinfer/decode.py:1227-1228``). The padded V rows are zero-filled
(``prefill.cuh:337-338``, ``kFillZero``; loaded at ``:2343``).

A masked slot's logit is then ``-5e4 * sm_scale * k_scale`` nats: for an amax-calibrated
e5m2 cache (``k_scale`` about 8e-5 at ``sm_scale`` 1/sqrt(128)) about -0.5 in log2 units,
so the padded slots take real softmax weight and, their V being zero, shrink the output.
The CUDA-core decode scales first and masks after (``attention/decode.cuh:93-99``: the
mask is -5e4 in log2 units, a weight of ``2^-5e4``): not affected. With
``logits_soft_cap`` the scale in the exponent is ``log2e * cap`` (``variants.cuh:47-49``).

``masked_logit_log2`` is that masked logit in log2 units; ``finite_mask_refusal`` says
why an arm must not run when it is above ``MASKED_LOG2_LIMIT``. Both FlashInfer arms (the
decode suite's ``flashinfer_arm``, tensor cores only, and the engine suite's
``engine_flashinfer``) import it; it imports neither. ``tests/test_fi_finite_mask.py``
models the mechanism on the CPU; ``tests/test_engine_step_gpu.py`` confirmed it on a GPU
with FlashInfer 0.3.1 (S28-R1, an H100: unguarded e5m2 fails the oracle, 128x larger
scales verify).
"""

from __future__ import annotations

import math

#: FlashInfer 0.3.1's "infinity" (``include/flashinfer/math.cuh:32``,
#: ``constexpr float inf = 5e4;``): its tensor-core decode writes ``-FINITE_MASK`` into the
#: raw logit of a masked K position, before the softmax scale
FINITE_MASK = 5e4
#: the highest masked logit (log2 units) taken as masked: a padded slot's weight at most
#: ``2^-30`` of a slot of logit 0
MASKED_LOG2_LIMIT = -30.0


def masked_logit_log2(sm_scale: float, k_scale: float = 1.0,
                      logits_soft_cap: float | None = None) -> float:
    """The logit, in log2 units (what FlashInfer's kernel exponentiates with ``exp2``), of a
    K position FlashInfer 0.3.1's tensor-core decode masks: ``-FINITE_MASK`` times the
    scale applied after the mask (``sm_scale * k_scale``, or the soft cap's ``cap``),
    times ``log2(e)``."""
    scale = logits_soft_cap if logits_soft_cap else sm_scale * k_scale
    return -FINITE_MASK * float(scale) * math.log2(math.e)


def finite_mask_refusal(sm_scale: float, k_scale: float = 1.0,
                        logits_soft_cap: float | None = None, *,
                        version: str = "0.3.1") -> str | None:
    """``None`` when FlashInfer's tensor-core decode masks padded K positions at these
    scales, else why not (the reason, the value, what an engine would do instead)."""
    got = masked_logit_log2(sm_scale, k_scale, logits_soft_cap)
    if got <= MASKED_LOG2_LIMIT:
        return None
    at = (f"soft cap {logits_soft_cap:.3g}" if logits_soft_cap else
          f"k_scale {k_scale:.2g} x sm_scale {sm_scale:.3g}")
    mask = f"{FINITE_MASK:.0e}".replace("e+0", "e")
    return (f"FlashInfer {version} tensor cores mask padded K with a finite -{mask} before "
            f"the scale: at {at} it is {got:.2g} in log2 (> {MASKED_LOG2_LIMIT:g}), "
            f"unmasked; use a larger k_scale (not e5m2 amax/57344)")

__all__ = ["FINITE_MASK", "MASKED_LOG2_LIMIT", "finite_mask_refusal", "masked_logit_log2"]
