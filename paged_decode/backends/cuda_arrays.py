"""CUDA array interop and streams for the ``cuda`` backend: CuPy views of the caller's
arrays (CuPy, DLPack, ``__cuda_array_interface__``, torch tensors, bfloat16 included),
results in the caller's array kind, and the device and current stream (CuPy's, or
torch's for torch tensors) a call on given arrays launches on."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..dtypes import numpy_dtype
from ..errors import InvalidArgumentError
from ..fp8 import FP8_DTYPES

try:  # imported lazily by the registry; a failure here marks the backend unavailable
    import cupy as cp
except Exception:  # pragma: no cover - exercised only where CuPy is missing
    cp = None


def torch_module() -> Any:
    try:
        import torch
        return torch
    except Exception:
        return None


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def as_cupy(x: Any) -> Any:
    """A CuPy view of ``x`` (no copy for device arrays; host arrays are uploaded, a host fp8
    array as its bytes, ``uint8``: the call reads the format off the caller's array)."""
    if isinstance(x, cp.ndarray):
        return x
    if is_torch(x):
        if not x.is_cuda:
            raise InvalidArgumentError(f"cuda backend: torch tensor on {x.device} is not a "
                                       "CUDA tensor")
        return from_torch(x)
    if hasattr(x, "__cuda_array_interface__"):
        return cp.asarray(x)
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        return cp.from_dlpack(x)
    a = np.asarray(x)
    if a.dtype.name in FP8_DTYPES:   # ml_dtypes fp8: uploaded as its bytes, as from_torch
        a = np.require(a, requirements="C").view(np.uint8)   # (0-d stays 0-d)
    return cp.asarray(a)


def like_caller(x: Any, like: Any) -> Any:
    """``x`` in the array kind of ``like`` (torch tensors through DLPack, else CuPy)."""
    if is_torch(like):
        return torch_module().from_dlpack(x)
    return x


@contextlib.contextmanager
def device_and_stream(like: Any) -> Iterator[None]:
    """Run on ``like``'s device and its framework's current stream."""
    if is_torch(like):
        torch = torch_module()
        dev = like.device.index
        dev = torch.cuda.current_device() if dev is None else dev
        ptr = torch.cuda.current_stream(dev).cuda_stream
        with cp.cuda.Device(dev), external_stream(ptr, dev):
            yield
        return
    dev = like.device.id if isinstance(like, cp.ndarray) else cp.cuda.Device().id
    with cp.cuda.Device(dev):
        yield


def stream_getter(like: Any) -> Callable[[], int]:
    """A function returning the raw current stream for calls on arrays like ``like``:
    torch's current stream on the tensor's device for torch tensors, else CuPy's."""
    if is_torch(like):
        current, dev = torch_module().cuda.current_stream, like.device
        return lambda: int(current(dev).cuda_stream)
    get = cp.cuda.get_current_stream
    return lambda: int(get().ptr)


def external_stream(ptr: int, dev: int) -> Any:
    """A CuPy stream object for a raw CUDA stream owned by another framework."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers from_external
        return cp.cuda.ExternalStream(ptr, dev)


def from_torch(t: Any) -> Any:
    """Zero-copy CuPy view of a CUDA torch tensor (bfloat16 through an int16 view if needed;
    an fp8 tensor as its bytes, ``uint8``: CuPy has no fp8 dtype, and the call reads the
    format off the torch tensor before this view, ``dtypes.caller_dtype``)."""
    torch = torch_module()
    if str(t.dtype).replace("torch.", "") in FP8_DTYPES:
        return cp.from_dlpack(t.view(torch.uint8))
    try:
        return cp.from_dlpack(t)
    except Exception:
        if t.dtype != torch.bfloat16:
            raise
        raw = cp.from_dlpack(t.view(torch.int16))
        return raw.view(numpy_dtype("bfloat16"))


__all__ = ["as_cupy", "device_and_stream", "external_stream", "from_torch", "is_torch",
           "like_caller", "stream_getter", "torch_module"]
