"""Device memory between bench cases and arms: whether an exception is a device
allocation failure, and handing the CUDA allocators' cached free blocks back."""

from __future__ import annotations

import sys

from ..backends import Backend
from ..errors import PagedDecodeError


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device allocation failure: CuPy's ``OutOfMemoryError`` is a
    ``MemoryError``; torch's (``torch.OutOfMemoryError``) is a ``RuntimeError`` of that
    name. This package's own errors are not (``PoolExhaustedError`` is a ``MemoryError``
    too, but a full page pool is a bug to report, not a card too small)."""
    if isinstance(exc, PagedDecodeError):
        return False
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def release_memory(be: Backend) -> None:
    """Hand the CUDA allocators' cached free blocks back to the device (CuPy's pool, and
    torch's when an arm has loaded it), so that the next case's pools of many GB are not
    refused beside blocks nothing uses any more. Nothing on other backends."""
    if be.name != "cuda":
        return
    import gc

    import cupy as cp
    gc.collect()            # arrays kept alive only by reference cycles (captured graphs)
    cp.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
