"""FP8 K/V caches: the two formats, the scale convention, host conversions and checks.

Formats (one byte per element, the OCP FP8 formats as ``ml_dtypes`` and torch name them):

- ``float8_e4m3fn``: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, NaN
  is ``S.1111.111``; largest finite 448, smallest subnormal 2^-9;
- ``float8_e5m2``: sign, 5 exponent bits (bias 15), 2 mantissa bits (float16's top byte);
  infinities and NaNs as in IEEE; largest finite 57344, smallest subnormal 2^-16.

Scale convention (vLLM's and FlashInfer's): one float32 scale per layer for K and one for
V; ``stored = saturate(round_ne(x / scale))`` (``x / scale`` in float32, rounded to the
nearest fp8 value, ties to even, clamped to the largest finite value; NaN stays NaN) and
``read = stored * scale``. The kernels never dequantize a whole row into memory: they
widen each byte in registers (``kernels/fp8_convert.py``, one routine per dialect), fold
``k_scale`` into the softmax scale (``q . (s k) = s (q . k)``) and multiply the
normalized output by ``v_scale`` (attention is linear in V; a sink has no value), which is
the dequantized attention up to float32 rounding (``docs/fp8.md``).

Backends without an fp8 dtype (CuPy, MLX) hold fp8 pools as ``uint8`` arrays; the format
then comes from the call (``kv_dtype=``) or the pool (``PagePool.dtype``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError, InvalidDtypeError, real_float

#: fp8 format name -> (exponent bits, mantissa bits, largest finite value)
FORMATS = {"float8_e4m3fn": (4, 3, 448.0), "float8_e5m2": (5, 2, 57344.0)}
FP8_DTYPES = tuple(FORMATS)
#: the dtypes fp8 pools take their appended rows and queries in (never fp8)
ROW_DTYPES = ("float16", "bfloat16", "float32")

_NUMPY = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
          "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}


def is_fp8(dtype: str) -> bool:
    return dtype in FORMATS


def numpy_fp8(name: str) -> np.dtype:
    """The ``ml_dtypes`` numpy dtype of an fp8 format."""
    return _NUMPY[name]


def max_finite(name: str) -> float:
    return FORMATS[name][2]


def amax_scales(amax: Any, name: str) -> np.ndarray:
    """The scales an amax calibration gives: float32 ``amax / max_finite(name)`` (same
    shape as ``amax``, e.g. ``[L]``: each layer's largest K or V magnitude), so the
    largest value calibrated on is stored as the format's largest finite value."""
    return (np.asarray(amax, np.float32) / np.float32(max_finite(name))).astype(np.float32)


_LUTS: dict[str, np.ndarray] = {}


def decode_table(name: str) -> np.ndarray:
    """float32 ``[256]``: the value of every code of format ``name`` (``ml_dtypes``' own
    conversion, exact: every fp8 value is a float32). Index it with the codes (``uint8``)
    to dequantize without a scale."""
    lut = _LUTS.get(name)
    if lut is None:
        lut = np.arange(256, dtype=np.uint8).view(_NUMPY[name]).astype(np.float32)
        lut.setflags(write=False)
        _LUTS[name] = lut
    return lut


def codes(x: Any) -> np.ndarray:
    """The bytes of a host fp8 (or ``uint8``) array, as ``uint8`` of the same shape."""
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype.itemsize != 1:
        raise InvalidDtypeError(f"fp8 codes: expected a one-byte dtype, got {a.dtype}")
    return a.view(np.uint8)


def dequantize(x: Any, name: str, scale: float = 1.0) -> np.ndarray:
    """float32 ``stored * scale`` of a host fp8 (or ``uint8``) array in format ``name``."""
    v = decode_table(name)[codes(x)]
    return v if scale == 1.0 else v * np.float32(scale)


def quantize(x: Any, name: str, scale: float = 1.0) -> np.ndarray:
    """``saturate(round_ne(x / scale))`` of a host float array as an ``ml_dtypes`` fp8
    array of format ``name``: ``x / scale`` in float32, clamped to the largest finite
    value (infinities included), rounded to nearest even by ``ml_dtypes``; NaN stays NaN.
    This is the oracle of the append kernels' quantization."""
    lim = np.float32(max_finite(name))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # every float dtype here (ml_dtypes' bfloat16 and fp8 included) widens exactly
        y = np.asarray(x).astype(np.float32) / np.float32(scale)
        y = np.where(np.isnan(y), y, np.clip(y, -lim, lim))
    return y.astype(_NUMPY[name])


def quantize_rows(rows: Any, row_layers: int, layer0: int, name: str,
                  scale: np.ndarray) -> np.ndarray:
    """An append's rows ``[row_layers, N, ...]`` (or ``[N, ...]`` for one layer) quantized
    to ``name``, row layer ``i`` with the scale of pool layer ``layer0 + i`` (``scale``
    float32 ``[L]``): the array-op backends' append. ``row_layers = 0`` (an append that
    only copies, ``reserve_batch``): the rows are not read, quantized with scale 1."""
    r = np.asarray(rows)
    if row_layers == 0:
        return quantize(r, name)
    lay = r.reshape(row_layers, -1)
    out = np.empty(lay.shape, _NUMPY[name])
    for i in range(row_layers):
        out[i] = quantize(lay[i], name, float(scale[layer0 + i]))
    return out.reshape(r.shape)


@dataclass(frozen=True)
class KVQuant:
    """The fp8 K/V of a call: its format and the layer's two scales (float32 values,
    positive and finite)."""

    dtype: str
    k_scale: float
    v_scale: float

    def describe(self) -> str:
        return f"kv {self.dtype} (k_scale={self.k_scale:g}, v_scale={self.v_scale:g})"


def _capturing_device_array(x: Any) -> bool:
    """Whether ``x`` is a CUDA array (a torch CUDA tensor or a CuPy array) while a CUDA
    graph capture is under way on the current stream of torch or CuPy (whichever is
    loaded: a CuPy scale may meet a torch capture), where a host read of ``x`` fails."""
    mod = type(x).__module__.split(".")[0]
    if not ((mod == "torch" and getattr(x, "is_cuda", False)) or mod == "cupy"):
        return False
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    if torch is not None and torch.cuda.is_available() \
            and torch.cuda.is_current_stream_capturing():
        return True
    return cupy is not None and bool(cupy.cuda.get_current_stream().is_capturing())


def check_scale(fn: str, arg: str, value: Any) -> float:
    """A per-layer scale: a real number (or a one-element numpy / torch / CuPy array of a
    real dtype) that is positive and finite as float32; returned as that float32 value.
    A device array is read back (a synchronization); inside a CUDA graph capture it is
    refused, since the read cannot happen there and a replay would keep one value."""
    v = value
    shape = getattr(v, "shape", None)
    if (shape is not None and not isinstance(v, np.generic) and callable(getattr(v, "item", None))
            and math.prod(shape) == 1
            and not any(k in str(v.dtype) for k in ("bool", "complex"))):
        if _capturing_device_array(v):
            raise InvalidArgumentError(
                f"{fn}: {arg} is a device array, read back on the host every call; inside "
                "a CUDA graph capture that read is not allowed (and a replay would keep "
                "the captured value): pass the scale as a Python float")
        v = v.item()    # a one-element array or tensor of any kind (a device one is copied)
    f64 = real_float(v)
    with np.errstate(over="ignore"):     # beyond float32: inf, refused below
        f32 = float(np.float32(f64)) if f64 is not None else math.nan
    if not math.isfinite(f32) or f32 <= 0:
        raise InvalidArgumentError(f"{fn}: {arg} must be a positive finite float32 number, "
                                   f"got {value!r}")
    return f32


def check_layer_scales(fn: str, arg: str, value: Any, num_layers: int) -> np.ndarray:
    """A pool's scales: one number (every layer) or one per layer (``[num_layers]``);
    returned as float32 ``[num_layers]``, each positive and finite."""
    if value is None:
        raise InvalidArgumentError(f"{fn}: an fp8 pool needs {arg} (a positive float32 "
                                   "number, or one per layer)")
    arr = np.asarray(value) if not isinstance(value, (int, float)) else None
    if arr is None or arr.ndim == 0:
        return np.full(num_layers, check_scale(fn, arg, value), np.float32)
    if arr.shape != (num_layers,):
        raise InvalidArgumentError(f"{fn}: {arg} must be one number or one per layer "
                                   f"([{num_layers}]), got shape {list(arr.shape)}")
    return np.array([check_scale(fn, f"{arg}[{i}]", x) for i, x in enumerate(arr)],
                    np.float32)


def check_kv_quant(fn: str, kv_dt: str, k_scale: Any, v_scale: Any) -> KVQuant | None:
    """The fp8 description of a call whose pools are ``kv_dt``: both scales are required
    with fp8 pools (a forgotten scale is a wrong answer, not a default) and refused with
    others (their pools hold the values themselves)."""
    if not is_fp8(kv_dt):
        for arg, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None:
                raise InvalidArgumentError(f"{fn}: {arg} is for fp8 pools "
                                           f"({', '.join(FP8_DTYPES)}); the pools are "
                                           f"{kv_dt}, got {arg}={val!r}")
        return None
    for arg, val in (("k_scale", k_scale), ("v_scale", v_scale)):
        if val is None:
            raise InvalidArgumentError(f"{fn}: {arg} is required with {kv_dt} pools (the "
                                       "layer's float32 scale: read = stored * scale)")
    return KVQuant(kv_dt, check_scale(fn, "k_scale", k_scale),
                   check_scale(fn, "v_scale", v_scale))


def pool_dtype(fn: str, raw_dtype: str, arr_dtype: str, kv_dtype: Any, arg: str) -> str:
    """The element format of a pool argument: ``raw_dtype`` is the caller's array's dtype
    name (before any backend conversion: ``dtypes.caller_dtype``, which gives the backend
    array's where the caller's is not one the package knows), ``arr_dtype`` the backend
    array's. A ``uint8``
    array is fp8 only with ``kv_dtype`` naming the format (CuPy and MLX have no fp8
    dtype); an array of an fp8 dtype must agree with ``kv_dtype`` when it is given."""
    if kv_dtype is None:      # the caller's dtype (a float64 pool MLX took as float32 too)
        return raw_dtype or arr_dtype
    if kv_dtype not in FORMATS:
        raise InvalidArgumentError(f"{fn}: kv_dtype must be None or one of "
                                   f"{', '.join(FP8_DTYPES)}, got {kv_dtype!r}")
    for name in (raw_dtype, arr_dtype):
        if is_fp8(name) and name != kv_dtype:
            raise InvalidArgumentError(f"{fn}: {arg} has dtype {name}, but kv_dtype is "
                                       f"{kv_dtype}")
    if not (is_fp8(raw_dtype) or is_fp8(arr_dtype) or arr_dtype == "uint8"):
        raise InvalidArgumentError(f"{fn}: kv_dtype={kv_dtype!r} needs {arg} of dtype "
                                   f"{kv_dtype} or uint8 (its bytes), got {arr_dtype}")
    return str(kv_dtype)


__all__ = ["FORMATS", "FP8_DTYPES", "KVQuant", "ROW_DTYPES", "amax_scales", "check_kv_quant",
           "check_layer_scales", "check_scale", "codes", "decode_table", "dequantize",
           "is_fp8", "max_finite", "numpy_fp8", "pool_dtype", "quantize", "quantize_rows"]
