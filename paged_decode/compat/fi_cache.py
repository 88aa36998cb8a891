"""FlashInfer's paged KV cache argument, NHD layout, as the pools paged-decode reads.

FlashInfer takes the cache as a ``(k_cache, v_cache)`` pair of ``[num_pages, P, Hkv, D]``
arrays, or one ``[num_pages, 2, P, Hkv, D]`` array whose ``[:, 0]`` is K and ``[:, 1]``
is V (with ``P = 1`` the page axis may be left out: ``[num_pages, Hkv, D]`` and
``[num_pages, 2, Hkv, D]``). paged-decode's kernels read C-contiguous
``[num_pages, P, Hkv, D]`` pools through raw pointers, so:

- a pair of C-contiguous arrays is used as it is (zero-copy);
- a C-contiguous combined array is used zero-copy too: viewed as ``2 * num_pages`` pages
  ``[K0, V0, K1, V1, ...]``, K is that view without its last page and V without its first
  (both C-contiguous), and page ``p`` is addressed as page ``2p`` of both, so the page
  table's ids are doubled (``KVPools.interleaved``);
- anything else (a pair of strided views such as ``cache[:, 0]``, a non-contiguous
  combined array) is refused with an error saying so: copying the whole cache on every
  call would hide an O(cache) cost, and the kernels cannot follow other strides.

The append (``fi_page``) writes through views of any strides, so it takes every form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends import Backend, c_contiguous
from ..errors import InvalidArgumentError, fmt_shape
from .fi_arrays import as_backend, shape_of

NAMES = ("k_cache", "v_cache")


@dataclass(frozen=True)
class KVPools:
    """The cache as backend pools: ``k``, ``v`` C-contiguous ``[n, P, Hkv, D]``;
    ``num_pages`` the caller's page count; ``interleaved``: page ``p`` is row ``2p`` of
    both (a combined cache), else row ``p``."""

    k: Any
    v: Any
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    interleaved: bool


def _check_pair(fn: str, k: Any, v: Any) -> None:
    for name, x in zip(NAMES, (k, v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise InvalidArgumentError(f"{fn}: {name} must be an array (a torch tensor, CuPy "
                                       f"or numpy array), got {type(x).__name__}")
        if len(x.shape) not in (3, 4):
            raise InvalidArgumentError(
                f"{fn}: {name} must be 4-D [num_pages, P, Hkv, D] (NHD; 3-D when P = 1), got "
                f"shape {fmt_shape(shape_of(x))}")
    if shape_of(k) != shape_of(v) or str(k.dtype) != str(v.dtype):
        raise InvalidArgumentError(
            f"{fn}: k_cache and v_cache must have one shape and dtype, got "
            f"{fmt_shape(shape_of(k))} {k.dtype} and {fmt_shape(shape_of(v))} {v.dtype}")


def _check_combined(fn: str, kv: Any) -> None:
    shape = shape_of(kv)
    if len(shape) not in (4, 5) or shape[1] != 2:
        raise InvalidArgumentError(
            f"{fn}: paged_kv_cache must be a (k_cache, v_cache) tuple or one "
            f"[num_pages, 2, P, Hkv, D] array (NHD; [num_pages, 2, Hkv, D] when P = 1), "
            f"got shape {fmt_shape(shape)}")


def split_cache(fn: str, cache: Any) -> tuple[Any, Any] | Any:
    """The pair, or the combined array, after the shape checks every form shares."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise InvalidArgumentError(f"{fn}: paged_kv_cache as a tuple must be (k_cache, "
                                       f"v_cache), got {len(cache)} items")
        _check_pair(fn, *cache)
        return tuple(cache)
    if not hasattr(cache, "shape"):
        raise InvalidArgumentError(f"{fn}: paged_kv_cache must be a (k_cache, v_cache) tuple "
                                   f"or one array, got {type(cache).__name__}")
    _check_combined(fn, cache)
    return cache


def first_array(cache: Any) -> Any:
    """The cache argument's first array: ``k_cache`` of a pair, else the combined array
    (what its kind, device and dtype name are read from)."""
    return cache[0] if isinstance(cache, (tuple, list)) else cache


def _pages4(x: Any, combined: bool) -> Any:
    """Insert the page axis of a ``P = 1`` cache left out (FlashInfer allows that)."""
    if len(x.shape) == (4 if combined else 3):    # an indexed view, never a copy
        return x[:, :, None] if combined else x[:, None]
    return x


def decode_pools(fn: str, be: Backend, cache: Any) -> KVPools:
    """The cache as C-contiguous backend pools (see the module docstring)."""
    parts = split_cache(fn, cache)
    if isinstance(parts, tuple):
        k, v = (_pages4(as_backend(fn, n, be, x), False) for n, x in zip(NAMES, parts))
        for name, x in zip(NAMES, (k, v)):
            if not c_contiguous(x):
                raise InvalidArgumentError(
                    f"{fn}: {name} is not C-contiguous (a strided view, e.g. cache[:, 0]); "
                    "the kernels read row-major pools, so pass the combined "
                    "[num_pages, 2, P, Hkv, D] array itself (read zero-copy) or a "
                    "contiguous copy")
        n, p, hkv, d = shape_of(k)
        return KVPools(k, v, n, p, hkv, d, False)
    kv = _pages4(as_backend(fn, "paged_kv_cache", be, parts), True)
    if not c_contiguous(kv):
        raise InvalidArgumentError(
            f"{fn}: paged_kv_cache is not C-contiguous; the kernels read row-major pools "
            "(pass a contiguous array, or the (k_cache, v_cache) pair of contiguous arrays)")
    n, _, p, hkv, d = shape_of(kv)
    if n == 0:
        raise InvalidArgumentError(f"{fn}: paged_kv_cache has no pages")
    flat = kv.reshape(2 * n, p, hkv, d)           # [K0, V0, K1, V1, ...], still a view
    return KVPools(flat[: 2 * n - 1], flat[1:], n, p, hkv, d, True)


def write_views(fn: str, be: Backend, cache: Any) -> tuple[Any, Any]:
    """Writable backend views ``k, v [num_pages, P, Hkv, D]`` of the cache, any strides."""
    parts = split_cache(fn, cache)
    if isinstance(parts, tuple):
        k, v = (_pages4(as_backend(fn, n, be, x), False) for n, x in zip(NAMES, parts))
        return k, v
    kv = _pages4(as_backend(fn, "paged_kv_cache", be, parts), True)
    return kv[:, 0], kv[:, 1]


__all__ = ["KVPools", "decode_pools", "split_cache", "write_views"]
