"""Array kinds for the FlashInfer shim: torch tensors (CPU or CUDA), CuPy arrays, numpy.

FlashInfer takes torch tensors only; the shim takes those and also CuPy and numpy arrays,
and gives results in the kind it got. What a backend computes on: numpy for CPU kinds
(torch CPU tensors are viewed zero-copy, bfloat16 through an ``int16`` view, since numpy
has no bfloat16 of its own: ``ml_dtypes.bfloat16``), CuPy on the ``cuda`` backend (its
``asarray`` views torch CUDA tensors zero-copy). Everything here is glue; none of it
computes attention.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import Backend, array_kind
from ..backends.base import poison_enabled
from ..backends.reference import torch_cpu_view
from ..dtypes import numpy_dtype
from ..errors import InvalidArgumentError, as_int64, check_writable, refuse_listed_bools

#: int32's range: FlashInfer's index arrays hold int32
I32 = np.iinfo(np.int32)


def torch_module() -> Any:
    import torch  # only reached for torch inputs, so torch stays an optional dependency
    return torch


def is_torch(x: Any) -> bool:
    return array_kind(x) == "torch"


def is_cuda_tensor(x: Any) -> bool:
    return is_torch(x) and bool(x.is_cuda)


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


def as_backend(fn: str, name: str, be: Backend, x: Any) -> Any:
    """Argument ``name`` of ``fn`` as ``be``'s array, zero-copy where the kinds allow (CPU
    torch tensors become numpy views on the CPU backends); errors name both."""
    _known_device(fn, name, x)
    if is_torch(x) and not x.is_cuda:
        if be.name == "cuda":
            raise InvalidArgumentError(f"{fn}: {name} is a CPU torch tensor, but the call runs "
                                       "on the cuda backend (pass CUDA tensors)")
        x = torch_cpu_view(x)
    elif is_cuda_tensor(x) and be.name != "cuda":
        raise InvalidArgumentError(f"{fn}: {name} is a CUDA torch tensor, but the call runs on "
                                   f"backend {be.name!r} (use backend='auto' or 'cuda')")
    return be.array_arg(fn, name, x)


def _known_device(fn: str, name: str, x: Any) -> None:
    """Raise for a torch tensor on a device other than the CPU and CUDA (``meta``,
    ``mps``, ...): no backend here reads it, and converting it fails inside torch."""
    if is_torch(x) and x.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{fn}: {name} is a torch tensor on device "
                                   f"{x.device.type!r}; paged-decode takes CPU or CUDA tensors "
                                   "(or CuPy / numpy arrays)")


def host_ints(fn: str, name: str, x: Any) -> np.ndarray:
    """A host numpy copy of an integer index array of any kind (a device array is copied
    to the host: the plan runs there, as FlashInfer's does)."""
    _known_device(fn, name, x)
    if is_torch(x):
        x = x.detach().cpu().numpy()
    elif array_kind(x) == "cupy":
        x = x.get()
    refuse_listed_bools(fn, name, x)
    try:
        arr = np.array(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{fn}: {name} must be a 1-D integer array, got "
                                   f"{type(x).__name__}") from exc
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgumentError(f"{fn}: {name} must be a 1-D integer array, got shape "
                                   f"{list(arr.shape)} dtype {arr.dtype}")
    # FlashInfer's index arrays are int32; past that, its arithmetic here would wrap (an
    # array of 32 bits or fewer cannot hold such values: no scan)
    wide = arr.dtype.itemsize > 4 or arr.dtype == np.uint32
    arr = as_int64(fn, name, arr)
    if wide and arr.size and (int(arr.min()) < I32.min or int(arr.max()) > I32.max):
        i = int(np.argmax((arr < I32.min) | (arr > I32.max)))
        raise InvalidArgumentError(f"{fn}: {name}[{i}] = {int(arr[i])} is outside int32 "
                                   "(FlashInfer's index arrays are int32)")
    return arr


def checked_table(fn: str, indptr: np.ndarray, indices: np.ndarray | None,
                  last_page_len: np.ndarray, page_size: int, prefix: str = "") -> np.ndarray:
    """FlashInfer's CSR invariants over host int64 arrays (``host_ints``), or an error
    naming ``fn`` and the argument (``prefix`` + ``indptr`` / ``indices`` /
    ``last_page_len``): ``indptr [B+1]`` from 0, non-decreasing (B = len(last_page_len));
    ``indices`` at least ``indptr[-1]`` long (a longer buffer is fine; ``None``: not
    checked); ``1 <= last_page_len <= page_size`` for a request with pages. A request
    without pages is empty whatever its ``last_page_len`` (as CUDA-graph padding rows
    are): returns ``last_page_len`` with those set to 0, paged-decode's spelling of an
    empty request."""
    b = last_page_len.size
    if indptr.size != b + 1:
        raise InvalidArgumentError(f"{fn}: {prefix}indptr must have batch_size + 1 = {b + 1} "
                                   f"entries (batch_size = len({prefix}last_page_len)), got "
                                   f"{indptr.size}")
    pages = np.diff(indptr)
    if indptr[0] != 0 or (pages < 0).any():
        raise InvalidArgumentError(f"{fn}: {prefix}indptr must start at 0 and be "
                                   f"non-decreasing, got {indptr.tolist()[:16]}")
    if indices is not None and indices.size < indptr[-1]:
        raise InvalidArgumentError(f"{fn}: {prefix}indices has {indices.size} entries, "
                                   f"{prefix}indptr[-1] = {int(indptr[-1])} needs that many")
    lpl = np.where(pages > 0, last_page_len, 0)
    bad = np.flatnonzero((pages > 0) & ((lpl < 1) | (lpl > page_size)))
    if bad.size:
        r = int(bad[0])
        raise InvalidArgumentError(f"{fn}: {prefix}last_page_len must be in [1, page_size = "
                                   f"{page_size}], got {int(lpl[r])} for request {r}")
    return lpl


def int32_buffer(fn: str, name: str, x: Any, size: int | None = None) -> None:
    """Raise unless ``x`` is a writable 1-D int32 array of a kind the shim knows (a
    caller-owned index buffer), with ``size`` entries when given."""
    if array_kind(x) not in ("torch", "cupy", "numpy"):
        raise InvalidArgumentError(f"{fn}: {name} must be a torch tensor, CuPy or numpy "
                                   f"array, got {type(x).__name__}")
    if len(x.shape) != 1 or "int32" not in str(x.dtype):
        raise InvalidArgumentError(f"{fn}: {name} must be a 1-D int32 array, got shape "
                                   f"{list(shape_of(x))} dtype {x.dtype}")
    if size is not None and int(x.shape[0]) != size:
        raise InvalidArgumentError(f"{fn}: {name} must have {size} entries, got "
                                   f"{int(x.shape[0])}")
    check_writable(fn, name, x, " (plan copies into it)")


def copy_into(buf: Any, values: np.ndarray) -> None:
    """``buf[:len(values)] = values`` in place, whatever the kind of ``buf`` (host values;
    a device buffer gets one host-to-device copy on its current stream)."""
    n = int(values.size)
    vals = values.astype(np.int32)
    kind = array_kind(buf)
    if kind == "torch":
        torch = torch_module()
        buf[:n].copy_(torch.from_numpy(vals))
    elif kind == "cupy":
        import cupy as cp
        buf[:n] = cp.asarray(vals)
    else:
        buf[:n] = vals


def empty_like_kind(be: Backend, like: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """A fresh output in the caller's kind (``like``'s): torch tensors through torch's
    allocator (graph-aware under capture, as FlashInfer's outputs are), else the
    backend's; NaN-filled when ``PAGED_DECODE_POISON`` is set."""
    if is_torch(like):
        torch = torch_module()
        out = torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
        if poison_enabled():
            out.fill_(float("nan"))
        return out
    return be.empty(shape, dtype)


def in_kind(be: Backend, x: Any, like: Any) -> Any:
    """Backend array ``x`` in the caller's kind (``like``'s)."""
    if is_torch(like) and not like.is_cuda:
        torch = torch_module()
        arr = np.asarray(x)
        if arr.dtype == numpy_dtype("bfloat16"):
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    return be.wrap_result(x, like=like)


__all__ = ["I32", "as_backend", "checked_table", "copy_into", "empty_like_kind", "host_ints",
           "in_kind", "ints_like", "int32_buffer", "is_cuda_tensor", "is_torch", "shape_of",
           "torch_module"]


def ints_like(values: np.ndarray, like: Any) -> Any:
    """Host int32 ``values`` as an array of ``like``'s kind and device."""
    vals = np.ascontiguousarray(values, dtype=np.int32)
    kind = array_kind(like)
    if kind == "torch":
        return torch_module().from_numpy(vals).to(like.device)
    if kind == "cupy":
        import cupy as cp
        return cp.asarray(vals)
    return vals
