"""FlashInfer's page helpers (``flashinfer/page.py`` of 0.3.1): the append of new K/V rows
into a paged cache, and the index arithmetic around it.

``append_paged_kv_cache`` writes row ``i`` of ``append_key`` / ``append_value`` to
position ``positions[i]`` of request ``batch_indices[i]``: page
``kv_indices[kv_indptr[b] + pos // P]``, entry ``pos % P``, the page table already
counting the new rows (FlashInfer's contract). It is one vectorized scatter per K and V on
the backend's arrays (numpy, or CuPy on the GPU), writing through views of any strides,
not the project's append kernel: that kernel takes, per page, one run of consecutive new
rows (``kernels/append.py``), while FlashInfer's rows may go anywhere. Unlike FlashInfer,
the arguments are checked first on the host (a device array costs one copy there): a row
outside its request's pages, a request id out of range or two rows for one slot raise
instead of writing out of bounds or racing. Those host copies make the append (and the
helpers ``get_seq_lens`` / ``get_batch_indices_positions``, which compute on the host too)
unfit for a CUDA graph capture: inside one the append is refused by name. Capture the
decode ``run`` (graph mode) and append outside the graph, or use the page pool's appends.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends import backend_for
from ..dtypes import KV_DTYPES, caller_dtype, check_dtype
from ..errors import InvalidArgumentError, check_int, check_ndim, check_shape, check_writable
from ..fp8 import is_fp8
from .fi_arrays import I32, as_backend, checked_table, host_ints, ints_like, shape_of
from .fi_cache import first_array, write_views
from .fi_unsupported import check_layout


def seq_lens_of(indptr: np.ndarray, last_page_len: np.ndarray, page_size: int) -> np.ndarray:
    """``max(pages - 1, 0) * P + last_page_len`` per request, int64 (FlashInfer's rule)."""
    return np.maximum(np.diff(indptr) - 1, 0) * page_size + last_page_len


def get_seq_lens(kv_indptr: Any, kv_last_page_len: Any, page_size: int) -> Any:
    """Tokens per request of a page table: ``kv_indptr [B+1]``, ``kv_last_page_len [B]`` ->
    int32 ``[B]``, in ``kv_indptr``'s kind."""
    fn = "get_seq_lens"
    p = check_int(fn, "page_size", page_size, 1, int(I32.max))
    ip, lpl = host_ints(fn, "kv_indptr", kv_indptr), host_ints(fn, "kv_last_page_len",
                                                                kv_last_page_len)
    checked_table(fn, ip, None, lpl, p, "kv_")   # (FlashInfer's rule keeps an empty
    lens = seq_lens_of(ip, lpl, p)               # request's last_page_len: not zeroed)
    if lens.size and int(lens.max()) > np.iinfo(np.int32).max:
        raise InvalidArgumentError(f"{fn}: a request of {int(lens.max())} tokens does not "
                                   "fit the int32 lengths returned")
    return ints_like(lens, kv_indptr)


def get_batch_indices_positions(append_indptr: Any, seq_lens: Any, nnz: int) -> tuple[Any, Any]:
    """Row ``j`` of a ragged append (``append_indptr [B+1]``, ``nnz`` rows) belongs to
    request ``b`` with ``append_indptr[b] <= j < append_indptr[b+1]`` and goes to position
    ``j + seq_lens[b] - append_indptr[b+1]`` (the new rows are each request's last ones;
    ``seq_lens [B]`` counts them). Returns int32 ``(batch_indices [nnz], positions
    [nnz])`` in ``append_indptr``'s kind."""
    fn = "get_batch_indices_positions"
    ip, sl = host_ints(fn, "append_indptr", append_indptr), host_ints(fn, "seq_lens", seq_lens)
    n = check_int(fn, "nnz", nnz, 0, int(I32.max))
    check_shape(fn, "append_indptr", ip.shape, (sl.size + 1,), "[B+1]")
    counts = np.diff(ip)
    if ip[0] != 0 or (counts < 0).any() or ip[-1] != n:
        raise InvalidArgumentError(f"{fn}: append_indptr must start at 0, be non-decreasing "
                                   f"and end at nnz = {n}, got {ip.tolist()[:16]}")
    short = np.flatnonzero(sl < counts)
    if short.size:
        b = int(short[0])
        raise InvalidArgumentError(f"{fn}: seq_lens[{b}] = {int(sl[b])} is less than the "
                                   f"{int(counts[b])} rows appended to request {b} (seq_lens "
                                   "must count them)")
    batch = np.repeat(np.arange(sl.size), counts)
    pos = np.arange(n) + (sl - ip[1:])[batch]
    return ints_like(batch, append_indptr), ints_like(pos, append_indptr)


def append_destinations(fn: str, batch: np.ndarray, pos: np.ndarray, indices: np.ndarray,
                        indptr: np.ndarray, last_page_len: np.ndarray, page_size: int,
                        num_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """``(page ids, entries)`` of each appended row, int64, after the checks (the table's
    are ``checked_table``'s: a ``last_page_len`` past the page size would send a row into
    the next request's page)."""
    last_page_len = checked_table(fn, indptr, indices, last_page_len, page_size, "kv_")
    b = last_page_len.size
    pages = np.diff(indptr)
    if batch.size and (batch.min() < 0 or batch.max() >= b):
        raise InvalidArgumentError(f"{fn}: batch_indices must be in [0, {b}), got "
                                   f"{int(batch.min())}..{int(batch.max())}")
    lens = seq_lens_of(indptr, last_page_len, page_size)
    bad = np.flatnonzero((pos < 0) | (pos >= lens[batch]) | (pages[batch] < 1))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgumentError(
            f"{fn}: row {i} goes to position {int(pos[i])} of request {int(batch[i])}, "
            f"outside its {int(lens[batch[i]])} tokens (the page table must already count "
            "the appended rows)")
    page = indices[indptr[batch] + pos // page_size]
    out = np.flatnonzero((page < 0) | (page >= num_pages))
    if out.size:
        i = int(out[0])
        raise InvalidArgumentError(f"{fn}: kv_indices names page {int(page[i])} for row {i}, "
                                   f"outside the cache's {num_pages} pages")
    entry = pos % page_size
    slot = page * page_size + entry
    if np.unique(slot).size != slot.size:
        raise InvalidArgumentError(f"{fn}: two rows go to the same (page, entry); the write "
                                   "order would decide which one stays")
    return page, entry


def append_paged_kv_cache(append_key: Any, append_value: Any, batch_indices: Any,
                          positions: Any, paged_kv_cache: Any, kv_indices: Any,
                          kv_indptr: Any, kv_last_page_len: Any, kv_layout: str = "NHD",
                          *, backend: Any = None) -> None:
    """Write new K/V rows into a paged cache, in place (see the module docstring).

    Args (FlashInfer's, in its order):
        append_key, append_value: ``[nnz, Hkv, D]`` in the cache's dtype (an fp8 cache
            takes rows already in its format, as FlashInfer's does: they are copied).
        batch_indices, positions: int ``[nnz]``: request and position of each row
            (``get_batch_indices_positions`` makes them).
        paged_kv_cache: ``(k_cache, v_cache)`` ``[num_pages, P, Hkv, D]`` or one
            ``[num_pages, 2, P, Hkv, D]`` array (NHD), any strides; written in place.
        kv_indices, kv_indptr, kv_last_page_len: the page table, new rows included.
        kv_layout: ``"NHD"`` (``"HND"`` is refused).
        backend: not FlashInfer's; a paged-decode backend (default: from the cache's kind).
    """
    fn = "append_paged_kv_cache"
    check_layout(fn, kv_layout)
    first = first_array(paged_kv_cache)
    be = backend_for(backend, first, fn=fn)
    with be.launch_context(first):   # views and writes on the cache's device and stream
        _append(fn, be, append_key, append_value, batch_indices, positions, paged_kv_cache,
                kv_indices, kv_indptr, kv_last_page_len)


def _element(fn: str, name: str, be: Any, arr: Any, given: Any) -> str:
    """The element type of argument ``name`` (``arr``, the backend view of ``given``): a
    decode dtype, an fp8 format (a torch fp8 tensor is a ``uint8`` view on ``cuda``), or
    ``uint8``, the bytes of an fp8 cache in an array kind without fp8 (CuPy): the append
    copies elements, so the rows need only the cache's element type."""
    # the caller's own dtype where the package knows it (a torch fp8 tensor's format; MLX
    # holds float64 rows as float32), else the backend array's
    got = caller_dtype(given, be.dtype_of(arr))
    return got if is_fp8(got) or got == "uint8" else check_dtype(fn, name, got, KV_DTYPES)


def _append(fn: str, be: Any, append_key: Any, append_value: Any, batch_indices: Any,
            positions: Any, paged_kv_cache: Any, kv_indices: Any, kv_indptr: Any,
            kv_last_page_len: Any) -> None:
    """``append_paged_kv_cache`` on backend ``be``, inside the cache's launch context."""
    if be.capturing():
        raise InvalidArgumentError(
            f"{fn}: called inside a CUDA graph capture: it checks and maps its index arrays "
            "on the host (a device-to-host copy each, which a capture does not allow); "
            "append outside the graph, or write the rows with PagePool.append_batch or "
            "DecodeStep.append, which capture")
    k, v = write_views(fn, be, paged_kv_cache)
    for name, x in (("k_cache", k), ("v_cache", v)):     # before any write: all or nothing
        check_writable(fn, name, x, " (the rows are written into it)")
    num_pages, p, hkv, d = shape_of(k)
    dt = _element(fn, "paged_kv_cache", be, k, first_array(paged_kv_cache))
    rows = []
    for name, x in (("append_key", append_key), ("append_value", append_value)):
        a = as_backend(fn, name, be, x)
        check_ndim(fn, name, shape_of(a), 3, "[nnz, Hkv, D]")
        got = _element(fn, name, be, a, x)
        if got != dt:
            raise InvalidArgumentError(f"{fn}: {name} must have the cache's dtype {dt}, got "
                                       f"{got}")
        rows.append(a)
    nnz = int(rows[0].shape[0])
    for name, a in zip(("append_key", "append_value"), rows):
        check_shape(fn, name, shape_of(a), (nnz, hkv, d), "[nnz, Hkv, D]")
    batch, pos = host_ints(fn, "batch_indices", batch_indices), host_ints(fn, "positions",
                                                                          positions)
    check_shape(fn, "batch_indices", batch.shape, (nnz,), "[nnz]")
    check_shape(fn, "positions", pos.shape, (nnz,), "[nnz]")
    page, entry = append_destinations(
        fn, batch, pos, host_ints(fn, "kv_indices", kv_indices),
        host_ints(fn, "kv_indptr", kv_indptr), host_ints(fn, "kv_last_page_len",
                                                         kv_last_page_len), p, num_pages)
    if nnz == 0:
        return
    xp = be.array_module()
    pg, en = xp.asarray(page), xp.asarray(entry)
    k[pg, en] = rows[0]
    v[pg, en] = rows[1]


__all__ = ["append_destinations", "append_paged_kv_cache", "get_batch_indices_positions",
           "get_seq_lens", "seq_lens_of"]
