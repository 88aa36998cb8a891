"""The element types the package accepts, by one canonical name each.

Names: ``"float16"``, ``"bfloat16"``, ``"float32"`` (queries, outputs, pools) and the
pool-only fp8 formats ``"float8_e4m3fn"``, ``"float8_e5m2"`` (``paged_decode/fp8.py``).
numpy has no native bfloat16 or fp8; the reference backend uses ``ml_dtypes``' types.
Every backend maps these names onto its own array dtypes (``uint8`` for fp8 where the
library has no fp8 dtype); kernels are specialized on the names.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError, InvalidDtypeError
from .fp8 import FP8_DTYPES, decode_table, is_fp8, numpy_fp8

SUPPORTED = ("float16", "bfloat16", "float32")
#: what a pool may hold: the supported dtypes and the fp8 formats
KV_DTYPES = SUPPORTED + FP8_DTYPES

_NUMPY = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


_NAME_CACHE: dict[Any, str] = {}


def dtype_name(dtype: Any) -> str:
    """Canonical name of a numpy / ml_dtypes / cupy / torch / mlx dtype or a name string."""
    try:
        return _NAME_CACHE[dtype]
    except (KeyError, TypeError):
        pass
    name = _dtype_name(dtype)
    try:
        _NAME_CACHE[dtype] = name
    except TypeError:  # an unhashable dtype-like: fine, just not cached
        pass
    return name


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        for prefix in ("torch.", "mlx.core.", "<class 'numpy.", "dtype('"):
            if name.startswith(prefix):
                name = name[len(prefix):]
        name = name.rstrip("')>")
    aliases = {"half": "float16", "f16": "float16", "fp16": "float16", "bf16": "bfloat16",
               "float": "float32", "f32": "float32", "fp32": "float32"}
    name = aliases.get(name, name)
    if name not in KV_DTYPES and name != "float64":
        raise InvalidDtypeError(
            f"dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}"
        )
    return name


_CALLER_CACHE: dict[Any, str | None] = {}


def caller_dtype(given: Any, converted: str) -> str:
    """The dtype a check of the caller's array ``given`` judges and names: the canonical
    name of its own dtype when the package knows it (``dtype_name``: the supported dtypes,
    the fp8 formats, float64), else ``converted``, the backend array's. A backend may hold
    an array in another dtype than the caller's: CuPy and MLX hold an fp8 array as its
    ``uint8`` bytes, MLX a float64 one as float32; neither is what the caller wrote, and a
    float64 argument must be refused as on every other backend. Cached per dtype object
    (checks of the engine step's appends run every layer)."""
    dt = getattr(given, "dtype", None)
    if dt is None:
        return converted
    try:
        name = _CALLER_CACHE[dt]
    except (KeyError, TypeError):
        try:
            name = dtype_name(dt)
        except Exception:     # a spelling the package does not know (another library's)
            name = None
        try:
            _CALLER_CACHE[dt] = name
        except TypeError:     # an unhashable dtype-like: fine, just not cached
            pass
    return name or converted


def _canonical(dtype: Any) -> str:
    """Canonical name of ``dtype``, or its own spelling when the package does not know it."""
    try:
        return dtype_name(dtype)
    except InvalidDtypeError:
        return str(dtype)


def check_dtype(fn: str, arg: str, dtype: Any, allowed: tuple[str, ...] = SUPPORTED) -> str:
    """Canonical name of ``dtype``; raise naming ``fn`` and ``arg`` unless it is allowed."""
    name = _canonical(dtype)
    if name not in allowed:
        shown = repr(dtype) if isinstance(dtype, str) and dtype == "" else dtype   # shows ""
        raise InvalidDtypeError(
            f"{fn}: {arg} must have dtype in ({', '.join(allowed)}), got {shown}"
        )
    return name


def expect_dtype(fn: str, arg: str, dtype: Any, want: str) -> str:
    """``want`` unless ``dtype`` is another one; the message names only ``want`` (never a
    list of dtypes the argument refuses). Another supported dtype is an argument mismatch
    (``InvalidArgumentError``), a dtype the package does not know an ``InvalidDtypeError``."""
    name = _canonical(dtype)
    if name != want:
        cls = InvalidArgumentError if name in SUPPORTED else InvalidDtypeError
        raise cls(f"{fn}: {arg} must have dtype {want}, got {name}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    if name == "float64":
        return np.dtype(np.float64)
    name = dtype_name(name)
    return numpy_fp8(name) if is_fp8(name) else _NUMPY[name]


def itemsize(name: str) -> int:
    name = dtype_name(name)
    return 1 if is_fp8(name) else _ITEMSIZE[name]


def as_float32(arr: np.ndarray) -> np.ndarray:
    """A host array of any supported dtype as float32 (exact for every one of them).

    bfloat16 goes through its bit pattern (the upper half of a float32), which is far
    faster than ml_dtypes' element-wise cast; float16 uses numpy's cast; an fp8 array
    (``ml_dtypes``) is looked up in its format's table of 256 values (no scale).
    """
    a = np.asarray(arr)
    if a.dtype.itemsize == 1 and is_fp8(a.dtype.name):
        return decode_table(a.dtype.name)[np.ascontiguousarray(a).view(np.uint8)]
    if a.dtype == _NUMPY["bfloat16"]:
        bits = np.ascontiguousarray(a).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return a.astype(np.float32)


def as_float64(arr: np.ndarray) -> np.ndarray:
    """A host array of any supported dtype as float64, through float32 (exact; numpy's
    direct float16 -> float64 cast is an order of magnitude slower)."""
    return as_float32(arr).astype(np.float64)
