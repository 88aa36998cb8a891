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

from .backends import Backend, backend_for
from .dtypes import check_dtype
from .errors import InvalidArgumentError, check_ndim, check_shape


def merge_states(v: Any, lse: Any, indptr: Any, *, out_dtype: str = "float32",
                 backend: str | Backend | None = None) -> tuple[Any, Any]:
    """Variable-length merge of normalized partial states.

    Args:
        v: ``[N, H, D]`` float32 partials, each normalized by its own denominator.
        lse: ``[N, H]`` float32 log-sum-exps, **base 2**.
        indptr: host ints ``[M+1]``: output row ``o`` merges rows ``indptr[o]:indptr[o+1]``
            (``indptr[0] == 0``, non-decreasing, ``indptr[-1] == N``).
        out_dtype: dtype of the merged V.

    Returns:
        ``(v_out [M, H, D], lse_out [M, H] float32, base 2)``.
    """
    fn = "merge_states"
    be = backend_for(backend, v)
    va, la = be.asarray(v), be.asarray(lse)
    check_ndim(fn, "v", va.shape, 3, "[N, H, D]")
    n, h, d = (int(x) for x in va.shape)
    check_shape(fn, "lse", la.shape, (n, h), "[N, H]")
    for name, arr in (("v", va), ("lse", la)):
        if check_dtype(fn, name, be.dtype_of(arr)) != "float32":
            raise InvalidArgumentError(f"{fn}: {name} must be float32, got {be.dtype_of(arr)}")
    ip = np.asarray(indptr)
    if ip.ndim != 1 or ip.size < 1 or (ip.size and not np.issubdtype(ip.dtype, np.integer)):
        raise InvalidArgumentError(f"{fn}: indptr must be a 1-D integer array [M+1], got "
                                   f"shape {list(ip.shape)} dtype {ip.dtype}")
    if ip[0] != 0 or ip[-1] != n or (np.diff(ip) < 0).any():
        raise InvalidArgumentError(f"{fn}: indptr must start at 0, be non-decreasing and end "
                                   f"at N = {n}, got {ip.tolist()[:16]}")
    m = ip.size - 1
    o_dt = check_dtype(fn, "out_dtype", out_dtype)
    v_out = be.empty((m, h, d), o_dt)
    lse_out = be.empty((m, h), "float32")
    be.merge(va, la, ip.astype(np.int32), v_out, lse_out)
    return be.wrap_result(v_out, like=v), be.wrap_result(lse_out, like=v)


def merge_state(v_a: Any, lse_a: Any, v_b: Any, lse_b: Any, *, out_dtype: str = "float32",
                backend: str | Backend | None = None) -> tuple[Any, Any]:
    """Merge two states row by row: ``v_a, v_b [n, H, D]`` f32, ``lse_a, lse_b [n, H]`` f32
    (base 2) -> ``(v [n, H, D], lse [n, H])``."""
    fn = "merge_state"
    be = backend_for(backend, v_a)
    arrays = [be.asarray(x) for x in (v_a, lse_a, v_b, lse_b)]
    check_ndim(fn, "v_a", arrays[0].shape, 3, "[n, H, D]")
    n, h, d = (int(x) for x in arrays[0].shape)
    check_shape(fn, "v_b", arrays[2].shape, (n, h, d), "[n, H, D]")
    check_shape(fn, "lse_a", arrays[1].shape, (n, h), "[n, H]")
    check_shape(fn, "lse_b", arrays[3].shape, (n, h), "[n, H]")
    xp = be.array_module()
    v = xp.stack([arrays[0], arrays[2]], axis=1).reshape(2 * n, h, d)
    lse = xp.stack([arrays[1], arrays[3]], axis=1).reshape(2 * n, h)
    return merge_states(v, lse, np.arange(0, 2 * n + 1, 2), out_dtype=out_dtype, backend=be)
