"""Merging attention states: the closed-form rescale of (V, LSE) partials, base 2.

For partials ``i`` of one group: ``m = max lse_i``, ``w_i = exp2(lse_i - m)``,
``v = sum w_i v_i / sum w_i``, ``lse = m + log2(sum w_i)``. A group of one is the
identity, ``-inf`` partials contribute nothing, an all-empty group gives zeros and
``-inf`` (never NaN); a NaN or ``+inf`` partial LSE poisons its group (NaN output and
LSE; ``docs/concepts.md``, "Non-finite inputs"). The operation is associative and
commutative, so any regrouping of the same partials gives the same answer; cascade
decode depends on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .backends import Backend, Problem, backend_for, c_contiguous
from .dtypes import caller_dtype, check_dtype, expect_dtype
from .errors import (
    InvalidArgumentError,
    UnsupportedProblemError,
    as_int64,
    check_ndim,
    check_shape,
)
from .variants import check_variant


def _check_state(fn: str, be: Backend, names: tuple[str, str], v: Any, lse: Any, dims: str,
                 shape: tuple[int, ...] | None = None) -> tuple[Any, Any, tuple[int, ...]]:
    """Arguments ``names`` = (V, LSE) of ``fn`` as float32 arrays of ``be``: V of shape
    ``dims`` (``shape`` when given, e.g. the other side of ``merge_state``), LSE its first
    two axes. Returns ``(v, lse, v's shape)``."""
    va, la = be.array_arg(fn, names[0], v), be.array_arg(fn, names[1], lse)
    check_ndim(fn, names[0], va.shape, 3, dims, "H D")
    shape = tuple(int(x) for x in va.shape) if shape is None else shape
    check_shape(fn, names[0], va.shape, shape, dims)
    check_shape(fn, names[1], la.shape, shape[:2], dims.rsplit(",", 1)[0] + "]")
    for name, arr, given in zip(names, (va, la), (v, lse)):
        expect_dtype(fn, name, caller_dtype(given, be.dtype_of(arr)), "float32")
    return va, la, shape


def _check_supported(fn: str, be: Backend, h: int, d: int) -> None:
    """Refuse, under ``fn``'s name, a merge of ``h`` heads x ``d`` the backend's merge
    kernel cannot take (a head_dim that is not a multiple of 4, on the kernel backends)."""
    sup = be.supports(Problem("float32", "float32", h, h, d, 1, "merge"))
    if not sup:
        raise UnsupportedProblemError(f"{fn}: {sup.reason} (backend {be.name!r})")


def merge_states(v: Any, lse: Any, indptr: Any, *, out_dtype: str = "float32",
                 backend: str | Backend | None = None, sinks: Any = None) -> tuple[Any, Any]:
    """Variable-length merge of normalized partial states.

    Args:
        v: ``[N, H, D]`` float32 partials, each normalized by its own denominator (D a
            multiple of 4: the merge kernels move float4 slices; others are refused).
        lse: ``[N, H]`` float32 log-sum-exps, **base 2**.
        indptr: host ints ``[M+1]``: output row ``o`` merges rows ``indptr[o]:indptr[o+1]``
            (``indptr[0] == 0``, non-decreasing, ``indptr[-1] == N``).
        out_dtype: dtype of the merged V.
        sinks: ``None`` or float32 ``[H]`` (natural-log units): each group takes one more
            state, LSE ``sinks[h] * log2(e)`` and value 0, once (``docs/variants.md``;
            merge with sinks only where a group is final: merging its result again with
            sinks would count them twice).

    Returns:
        ``(v_out [M, H, D], lse_out [M, H] float32, base 2)``.
    """
    fn = "merge_states"
    be = backend_for(backend, v, fn=fn)
    va, la, (n, h, d) = _check_state(fn, be, ("v", "lse"), v, lse, "[N, H, D]")
    for name, arr in (("v", va), ("lse", la)):
        if not c_contiguous(arr):   # the merge kernels read rows through raw pointers
            raise InvalidArgumentError(f"{fn}: {name} must be C-contiguous (row-major)")
    try:
        ip = np.asarray(indptr)
    except (ValueError, TypeError) as exc:   # ragged nested lists
        raise InvalidArgumentError(f"{fn}: indptr must be a 1-D integer array [M+1], got a "
                                   f"{type(indptr).__name__} that is not one") from exc
    if ip.ndim != 1 or ip.size < 1 or (ip.size and not np.issubdtype(ip.dtype, np.integer)):
        raise InvalidArgumentError(f"{fn}: indptr must be a 1-D integer array [M+1], got "
                                   f"shape {list(ip.shape)} dtype {ip.dtype}")
    ip = as_int64(fn, "indptr", ip)
    if ip[0] != 0 or ip[-1] != n or (np.diff(ip) < 0).any():
        raise InvalidArgumentError(f"{fn}: indptr must start at 0, be non-decreasing and end "
                                   f"at N = {n}, got {ip.tolist()[:16]}")
    m = ip.size - 1
    o_dt = check_dtype(fn, "out_dtype", out_dtype)
    variant = check_variant(fn, be, h, sinks=sinks)
    _check_supported(fn, be, h, d)
    v_out = be.empty((m, h, d), o_dt)
    lse_out = be.empty((m, h), "float32")
    be.merge(va, la, ip.astype(np.int32), v_out, lse_out, **variant.merge_kwargs())
    return be.wrap_result(v_out, like=v), be.wrap_result(lse_out, like=v)


def merge_state(v_a: Any, lse_a: Any, v_b: Any, lse_b: Any, *, out_dtype: str = "float32",
                backend: str | Backend | None = None) -> tuple[Any, Any]:
    """Merge two states row by row: ``v_a, v_b [n, H, D]`` f32 (D a multiple of 4, as for
    ``merge_states``), ``lse_a, lse_b [n, H]`` f32 (base 2) -> ``(v [n, H, D], lse [n, H])``."""
    fn = "merge_state"
    be = backend_for(backend, v_a, fn=fn)
    va, la, shape = _check_state(fn, be, ("v_a", "lse_a"), v_a, lse_a, "[n, H, D]")
    vb, lb, _ = _check_state(fn, be, ("v_b", "lse_b"), v_b, lse_b, "[n, H, D]", shape)
    check_dtype(fn, "out_dtype", out_dtype)
    n, h, d = shape
    _check_supported(fn, be, h, d)
    xp = be.array_module()
    v = xp.stack([va, vb], axis=1).reshape(2 * n, h, d)
    lse = xp.stack([la, lb], axis=1).reshape(2 * n, h)
    return merge_states(v, lse, np.arange(0, 2 * n + 1, 2), out_dtype=out_dtype, backend=be)
