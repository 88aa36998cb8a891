"""The CUDA dialect's soft-capped logit (``kernels/common.py``: ``logit<true>`` on
``tanh_fast``) against ``c * tanh(x / c)`` in float64, over scores from 1e-30 to far past
the cap, both signs, caps across ``variants.SOFT_CAP_RANGE``: on the CPU emulator here
(IEEE exp2 and division), on the GPU's exp2 and reciprocal approximations in
``tests/test_variants_gpu.py`` (the same check)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.emulator import Buffer, launch
from paged_decode.kernels.common import CUDA_COMMON
from paged_decode.variants import SOFT_CAP_RANGE

LOGIT_TEST = CUDA_COMMON + r"""
__global__ void pd_logit_test(const float* __restrict__ x, float* __restrict__ out, float cap,
                              int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = pd::logit<true>(x[i], cap);
}
"""
#: relative to |c tanh(x / c)|: the series below |x / c| = 1/8 is exact to float32 rounding,
#: above it the tanh's absolute error is a few 1e-7 on a result of at least 0.124
REL_TOL = 4e-6
CAPS = [SOFT_CAP_RANGE[0], 1e-3, 0.7, 30.0 * 1.4426950408889634, 50.0, 1e9, SOFT_CAP_RANGE[1]]


def scores(cap: float) -> np.ndarray:
    """float32 scores: a log-spaced sweep around the cap (1e-8 to 1e3 of it, and tiny ones
    to 1e-30), both signs, zeros, the series' switch point on either side."""
    mag = np.concatenate([np.geomspace(1e-8, 1e3, 3001) * cap, np.geomspace(1e-30, 1e-8, 50),
                          [0.125 * cap * (1 - 1e-7), 0.125 * cap, 0.125 * cap * (1 + 1e-7)]])
    mag = mag[np.isfinite(mag.astype(np.float32))]
    return np.concatenate([mag, -mag, [0.0]]).astype(np.float32)


def check_logits(cap: float, x: np.ndarray, got: np.ndarray) -> None:
    c = np.float64(np.float32(cap))
    want = c * np.tanh(x.astype(np.float64) / c)
    err = np.abs(got.astype(np.float64) - want)
    # plus the underflow of x * (1 / c) below float32's normal numbers (x < c * 2^-126),
    # and results below them, which the GPU returned as 0 (H200, S7-R4: c = 1e-30, x about
    # 1e-38): logits far below anything the softmax resolves
    bound = REL_TOL * np.abs(want) + (c + 1.0) * 2.0 ** -126
    bad = np.flatnonzero(err > bound)
    assert bad.size == 0, [(float(x[i]), float(got[i]), float(want[i])) for i in bad[:6]]
    big = np.abs(want) > (c + 1.0) * 2.0 ** -126
    assert (np.signbit(got) == np.signbit(want))[big].all()


def run_emulated(cap: float, x: np.ndarray) -> np.ndarray:
    out = np.full(x.size, np.nan, np.float32)
    launch(LOGIT_TEST, "pd_logit_test", (1, 1, 1), 128,
           [Buffer("x", x), Buffer("out", out, True), np.float32(cap), np.int32(x.size)],
           check_races=False)
    return out


@pytest.mark.parametrize("cap", CAPS, ids=[f"{c:g}" for c in CAPS])
def test_soft_capped_logit_matches_float64_tanh(cap):
    x = scores(cap)
    check_logits(cap, x, run_emulated(cap, x))


def test_non_finite_scores_stay_poison():
    x = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    got = run_emulated(30.0, x)
    assert np.isnan(got[:3]).all() and np.isfinite(got[3])
