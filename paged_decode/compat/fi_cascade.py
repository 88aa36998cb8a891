"""FlashInfer's state merges (``flashinfer/cascade.py`` of 0.3.1) on ``paged_decode.merge``.

A state is ``(v, s)``: ``v`` the attention output normalized by its own softmax
denominator, ``s`` its log-sum-exp, **base 2** in FlashInfer and in paged-decode alike.
``v`` may be float16, bfloat16 or float32 (merged in float32, returned in ``v``'s dtype);
``s`` is converted to float32 first, as FlashInfer does. Arrays: torch (CPU or CUDA),
CuPy or numpy; results of the same kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import merge as pd_merge
from ..backends import Backend, backend_for
from ..dtypes import check_dtype
from ..errors import InvalidArgumentError, check_ndim, check_shape, check_writable
from .fi_arrays import as_backend, in_kind, shape_of


def _state(fn: str, be: Backend, names: tuple[str, str], v: Any, s: Any) -> tuple[Any, Any, str]:
    """``(v as float32, s as float32, v's dtype)`` as C-contiguous backend arrays, after
    the checks under the caller's names: ``s`` has ``v``'s leading axes (float64 ``s`` is
    taken too: FlashInfer converts ``s`` to float32 first)."""
    va, sa = as_backend(fn, names[0], be, v), as_backend(fn, names[1], be, s)
    v_dt = check_dtype(fn, names[0], be.dtype_of(va))
    if be.dtype_of(sa) != "float64":
        check_dtype(fn, names[1], be.dtype_of(sa))
    lead = shape_of(va)[:-1]
    check_shape(fn, names[1], shape_of(sa), lead, "[n, H]" if len(lead) == 2 else "[n, S, H]")
    xp = be.array_module()
    return (xp.ascontiguousarray(va.astype(np.float32)),
            xp.ascontiguousarray(sa.astype(np.float32)), v_dt)


def merge_state(v_a: Any, s_a: Any, v_b: Any, s_b: Any, *, backend: str | Backend | None = None
                ) -> tuple[Any, Any]:
    """Merge two states row by row: ``v_a, v_b [n, H, D]``, ``s_a, s_b [n, H]`` (base 2)
    -> ``(v [n, H, D] in v_a's dtype, s [n, H] float32)``, the attention over both KV
    segments. ``backend`` (not FlashInfer's) picks a paged-decode backend."""
    fn = "merge_state"
    be = backend_for(backend, v_a, fn=fn)
    with be.launch_context(v_a):      # conversions and launches on v_a's device and stream
        va, sa, dt = _state(fn, be, ("v_a", "s_a"), v_a, s_a)
        vb, sb, _ = _state(fn, be, ("v_b", "s_b"), v_b, s_b)
        v, s = pd_merge.merge_state(va, sa, vb, sb, out_dtype=dt, backend=be)
        return in_kind(be, v, v_a), in_kind(be, s, v_a)


def merge_state_in_place(v: Any, s: Any, v_other: Any, s_other: Any, mask: Any = None, *,
                         backend: str | Backend | None = None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place, for rows where ``mask``
    (bool or integer ``[n]``, nonzero: merge; default all) is set; ``s`` must be float32
    (it is written). The mask is read where the arrays live (no copy to the host), so a
    captured call follows the mask's values at replay, as FlashInfer's does."""
    fn = "merge_state_in_place"
    be = backend_for(backend, v, fn=fn)
    with be.launch_context(v):
        _merge_in_place(fn, be, v, s, v_other, s_other, mask)


def _merge_in_place(fn: str, be: Backend, v: Any, s: Any, v_other: Any, s_other: Any,
                    mask: Any) -> None:
    vt, st = as_backend(fn, "v", be, v), as_backend(fn, "s", be, s)
    for name, x in (("v", v), ("s", s)):
        check_writable(fn, name, x, " (the merge writes it in place)")
    if check_dtype(fn, "s", be.dtype_of(st)) != "float32":
        raise InvalidArgumentError(f"{fn}: s must be float32 (it receives the merged LSE), "
                                   f"got {be.dtype_of(st)}")
    mv, ms = merge_state(v, s, v_other, s_other, backend=be)
    mv, ms = as_backend(fn, "v", be, mv), as_backend(fn, "s", be, ms)
    if mask is None:
        vt[...], st[...] = mv, ms
        return
    m = _mask(fn, be, mask, int(vt.shape[0]))
    xp = be.array_module()
    # on the device, without a host copy of the mask: FlashInfer's mask exists for CUDA
    # graphs, whose replays read its current values
    vt[...] = xp.where(m[:, None, None], mv, vt)
    st[...] = xp.where(m[:, None], ms, st)


def _mask(fn: str, be: Backend, mask: Any, n: int) -> Any:
    """``mask`` as ``be``'s boolean ``[n]`` array (nonzero: set): bool or any integer
    dtype, FlashInfer's bool / uint8 included, of any array kind the shim takes."""
    ma = as_backend(fn, "mask", be, mask)
    dt = str(ma.dtype)
    if dt != "bool" and not np.issubdtype(np.dtype(dt), np.integer):
        raise InvalidArgumentError(f"{fn}: mask must be a bool or integer array, got dtype "
                                   f"{dt}")
    check_shape(fn, "mask", shape_of(ma), (n,), "[n]")
    return ma != 0


def merge_states(v: Any, s: Any, *, backend: str | Backend | None = None) -> tuple[Any, Any]:
    """Merge ``S`` states per row: ``v [n, S, H, D]``, ``s [n, S, H]`` (base 2) ->
    ``(v [n, H, D] in v's dtype, s [n, H] float32)``; ``S = 0`` gives zeros and
    ``-inf``."""
    fn = "merge_states"
    be = backend_for(backend, v, fn=fn)
    with be.launch_context(v):
        return _merge_states(fn, be, v, s)


def _merge_states(fn: str, be: Backend, v: Any, s: Any) -> tuple[Any, Any]:
    va, sa, dt = _state(fn, be, ("v", "s"), v, s)
    check_ndim(fn, "v", shape_of(va), 4, "[n, S, H, D]", "H D")
    n, k, h, d = shape_of(va)
    check_shape(fn, "s", shape_of(sa), (n, k, h), "[n, S, H]")
    merged = pd_merge.merge_states(va.reshape(n * k, h, d), sa.reshape(n * k, h),
                                   np.arange(0, n * k + 1, max(k, 1)) if k else
                                   np.zeros(n + 1, np.int64), out_dtype=dt, backend=be)
    return in_kind(be, merged[0], v), in_kind(be, merged[1], v)


__all__ = ["merge_state", "merge_state_in_place", "merge_states"]
