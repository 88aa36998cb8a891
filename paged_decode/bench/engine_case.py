"""The engine suite's cases and results (``bench/engine.py`` runs them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from ..fp8 import FP8_DTYPES, is_fp8

#: max-rel error of an output against the float64 oracle, per dtype (the bench's bound)
TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-4}
#: what fp8 pools add to that bound: the oracle reads the same stored values, dequantized
#: with the same scales, so only the kernels' two float32 roundings of the scales remain
#: (``k_scale`` folded into the softmax scale, ``v_scale`` times the output; as
#: tests/helpers.py ``fp8_out_tol``). The quantization error itself is not in it: a wrong
#: scale moves the output by its factor and fails.
FP8_SCALE_ROUNDING = 2 * 2.0 ** -24
#: the standard deviation of every arm's V rows (prompt and appended; K's is 1): an fp8
#: pool's V scales are then about half its K scales, so a decode given the K and V caches
#: or scales swapped is about 2x off and fails the oracle
V_SIGMA = 0.5


def tolerance(dtype: str, kv_dtype: str = "") -> float:
    """The bench's max-rel bound for outputs of ``dtype`` (the queries' and outputs') over
    pools of ``kv_dtype`` (``""``: ``dtype`` itself); 0 for a dtype it has none for."""
    return TOLERANCE.get(dtype, 0.0) + (FP8_SCALE_ROUNDING if is_fp8(kv_dtype) else 0.0)


@dataclass(frozen=True)
class EngineCase:
    batch: int
    context: int = 1024            # mean prompt length (ragged: 0.5x to 1.5x)
    layers: int = 32
    steps: int = 32                # the first is a warm-up, left out of the statistics
    page_size: int = 16
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"         # the queries', outputs' and appended rows' dtype
    headroom: int = 64
    model: str = ""                # the models-preset layout of the heads ("": as given)
    #: the pools' dtype when it is not ``dtype``: an fp8 K/V cache (``"float8_e4m3fn"``,
    #: ``"float8_e5m2"``; per-layer scales calibrated on the prompt's K/V, ``docs/fp8.md``)
    kv_dtype: str = ""
    #: the speculative arms: tokens per sequence per step (the token and its drafts)
    spec_tokens: int = 4

    def __post_init__(self) -> None:
        # a typo ("float8_e4m3") would otherwise run 16-bit FlashInfer caches labelled fp8
        if not (isinstance(self.kv_dtype, str) and self.kv_dtype in ("", *FP8_DTYPES)):
            raise InvalidArgumentError(
                f"EngineCase.kv_dtype must be '' (pools of dtype) or one of "
                f"{', '.join(FP8_DTYPES)}, got {self.kv_dtype!r}")

    @property
    def pool_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def label(self) -> str:
        name = f"{self.model} " if self.model else ""
        kv = f" kv {self.kv_dtype}" if self.kv_dtype else ""
        return (f"{name}B{self.batch} ctx{self.context} L{self.layers} x{self.steps} "
                f"{self.num_qo_heads}/{self.num_kv_heads}x{self.head_dim} {self.dtype}{kv}")


@dataclass
class EngineArm:
    arm: str
    ran: bool
    dtype: str = ""
    note: str = ""
    step_us: float = float("nan")         # median wall time of a synchronized step
    mean_us: float = float("nan")         # mean of the same (replans, recaptures included)
    host_us: float = float("nan")         # median host time until the last launch
    gpu_us: float = float("nan")          # median GPU time (cuda only)
    errors: list[float] = field(default_factory=list)   # max-rel error: first, last step
    replans: int = 0
    recaptures: int = 0
    kv_dtype: str = ""                    # the pools' dtype when not ``dtype`` (fp8)
    #: fp8 pools: the per-layer float32 scales the arm quantized with and the oracle read
    #: the pools with (``[L]`` each; empty for 16-bit pools)
    k_scale: list[float] = field(default_factory=list)
    v_scale: list[float] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        """Every checked output within the dtype's tolerance of the float64 oracle."""
        tol = tolerance(self.dtype, self.kv_dtype)
        return bool(self.errors) and all(e <= tol for e in self.errors)


def prompts(case: EngineCase, seed: int = 0) -> list[int]:
    """Ragged prompt lengths; the second half of the batch are forks of request 0."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(case.context // 2, case.context * 3 // 2 + 1, case.batch)
    return [int(x) for x in lens]


def median_us(xs: list[float]) -> float:
    """Median in microseconds of ``xs`` (seconds) past the first step (the warm-up:
    compiles and first allocations), NaNs dropped."""
    arr = np.array([x for x in xs[1:] if x == x], float)
    return float(np.median(arr) * 1e6) if arr.size else float("nan")


def mean_us(xs: list[float]) -> float:
    """Mean in microseconds past the first step (what replans and recaptures cost on
    average is in it)."""
    arr = np.array([x for x in xs[1:] if x == x], float)
    return float(arr.mean() * 1e6) if arr.size else float("nan")


class EventTimer:
    """CUDA events around the block, on the stream current at entry and exit; ``last``
    in seconds. ``new_event`` makes a timing event and ``elapsed_ms(start, stop)`` reads
    it (CuPy's or torch's, as ``bench.timing``'s event loop takes them)."""

    def __init__(self, new_event: Callable[[], Any],
                 elapsed_ms: Callable[[Any, Any], float]) -> None:
        self.start, self.stop = new_event(), new_event()
        self.elapsed_ms = elapsed_ms
        self.last = float("nan")

    def __enter__(self) -> None:
        self.start.record()

    def __exit__(self, *exc: object) -> None:
        self.stop.record()
        self.stop.synchronize()
        self.last = self.elapsed_ms(self.start, self.stop) * 1e-3


class NoTimer:
    """The GPU timer where there is no GPU: ``last`` is NaN."""

    last = float("nan")

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


__all__ = ["FP8_SCALE_ROUNDING", "TOLERANCE", "V_SIGMA", "EngineArm", "EngineCase",
           "EventTimer", "NoTimer", "mean_us", "median_us", "prompts", "tolerance"]
