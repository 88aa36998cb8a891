"""MLX-op arms that need no kernel of ours: gather-then-SDPA decode and the merge.

Both run on any MLX device, so MLX users on Linux (MLX's CPU device) get the package
through MLX arrays; on a Mac they run on the GPU.

Gather: every request's visible K/V rows are taken (``mx.take`` on the flat row ids of
``cuda_gather.gather_rows``, padding repeating a visible row) into ``[B, Hkv, Tmax, D]``,
then ``mx.fast.scaled_dot_product_attention`` runs with ``q [B, Hq, 1, D]`` (GQA
natively: K/V are not repeated) and a boolean length mask ``[B, 1, 1, Tmax]``. SDPA
returns no LSE: when asked for, the base-2 LSE comes from a float32 logits pass with MLX
ops. Compute dtype: the inputs' own on the GPU (what an engine without paged kernels
runs; MLX's fused SDPA accumulates in float32), float32 on the CPU device, whose SDPA
rounds the logits to the input dtype (measured: 7.7e-3 relative error in bfloat16, 8e-4
in float16, against 2e-6 in float32), and float32 when q and K/V dtypes differ. A soft
cap (SDPA has no hook on the scores) runs the whole call as the float32 logits pass;
sinks join the final state through ``variants.with_sink`` (exact: one merge state).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..fp8 import decode_table, is_fp8
from ..page_table import PageTable
from ..softmax import RowSoftmax, merge_partials, nonfinite_heads
from ..variants import cap_logits, with_sink
from .cuda_gather import gather_rows

_index_cache: weakref.WeakKeyDictionary[PageTable, tuple[Any, Any, Any]] = \
    weakref.WeakKeyDictionary()


def gather_index(table: PageTable) -> tuple[Any, Any, Any]:
    """``(rows [B, Tmax] int32, valid [B, Tmax] bool, empty [B] bool)`` as MLX arrays,
    memoised per table: ``rows`` index ``pages.reshape(-1, Hkv, D)``."""
    import mlx.core as mx
    got = _index_cache.get(table)
    if got is None:
        rows_h = gather_rows(table)
        rows = np.where(rows_h >= 0, rows_h, -1 - rows_h)
        idt = np.int32 if rows.size == 0 or rows.max() < 2 ** 31 else np.int64
        got = (mx.array(rows.astype(idt)), mx.array(rows_h >= 0),
               mx.array(np.asarray(table.visible_lens) == 0))
        _index_cache[table] = got
    return got


def compute_dtype(q: Any, k_pages: Any) -> Any:
    """The dtype SDPA runs in (see the module docstring)."""
    import mlx.core as mx
    if q.dtype != k_pages.dtype or mx.default_device().type == mx.cpu:
        return mx.float32
    return q.dtype


def gather_attention(q: Any, k_pages: Any, v_pages: Any, table: PageTable, sm_scale: float,
                     want_lse: bool, rows: Any = None, *, soft_cap: float | None = None,
                     sinks: Any = None, kv_dtype: str | None = None,
                     v_scale: float = 1.0) -> tuple[Any, Any]:
    """``q [B, Hq, D]``, pools ``[num_pages, P, Hkv, D]`` (MLX arrays) -> ``(out [B, Hq,
    D]`` in the compute dtype, ``lse [B, Hq]`` float32 base 2 or ``None``). An empty
    request gives zeros and ``-inf`` (the sink's LSE with ``sinks [Hq]`` float32).
    ``soft_cap``: natural units. ``rows``: the gather index (a test hook). fp8 pools
    (``uint8``, format ``kv_dtype``): the gathered bytes are widened through the format's
    table of values, V times ``v_scale``."""
    import mlx.core as mx
    b, hq, d = (int(x) for x in q.shape)
    hkv = int(k_pages.shape[2])
    idx, valid, empty = gather_index(table)
    idx = idx if rows is None else rows
    kf = mx.take(k_pages.reshape(-1, hkv, d), idx, axis=0).transpose(0, 2, 1, 3)
    vf = mx.take(v_pages.reshape(-1, hkv, d), idx, axis=0).transpose(0, 2, 1, 3)
    if kv_dtype is not None and is_fp8(kv_dtype):
        lut = mx.array(decode_table(kv_dtype))
        kf = mx.take(lut, kf.astype(mx.int32))
        vf = mx.take(lut, vf.astype(mx.int32)) * v_scale
    ct = compute_dtype(q, kf)
    mask = valid[:, None, None, :]                                    # [B, 1, 1, Tmax]
    g = hq // hkv
    if soft_cap is not None:     # the scores themselves change: the float32 logits pass
        qf = q.astype(mx.float32).reshape(b, hkv, g, d)
        s = mx.matmul(qf, kf.astype(mx.float32).transpose(0, 1, 3, 2)) * float(sm_scale)
        sm = RowSoftmax(mx, cap_logits(mx, s, soft_cap, base2=False), mask, base2=False)
        o32 = sm.normalize(mx.matmul(sm.p, vf.astype(mx.float32))).reshape(b, hq, d)
        lse2 = sm.lse2.reshape(b, hq)
        if sinks is not None:
            o32, lse2 = with_sink(mx, o32, lse2, sinks, (hq,))
        return o32, (lse2.astype(mx.float32) if want_lse else None)
    o = mx.fast.scaled_dot_product_attention(
        q.astype(ct)[:, :, None, :], kf.astype(ct), vf.astype(ct), scale=float(sm_scale),
        mask=mask)[:, :, 0, :]
    out = mx.where(empty[:, None, None], mx.zeros((), o.dtype), o)
    if not want_lse and sinks is None:
        bad = nonfinite_heads(mx, q, kf, valid, empty, g)                  # [B, Hq]
        return mx.where(bad[..., None], mx.array(float("nan"), o.dtype), out), None
    qf = q.astype(mx.float32).reshape(b, hkv, g, d)
    s = mx.matmul(qf, kf.astype(mx.float32).transpose(0, 1, 3, 2)) * float(sm_scale)
    sm = RowSoftmax(mx, s, mask, base2=False)                         # [B, Hkv, G, Tmax]
    # the output keeps SDPA's values; its poisoned heads follow the logits pass
    out = mx.where(sm.poisoned.reshape(b, hq)[..., None], mx.array(float("nan"), o.dtype), out)
    lse2 = sm.lse2.reshape(b, hq).astype(mx.float32)
    if sinks is not None:
        out, lse2 = with_sink(mx, out, lse2, sinks, (hq,))
    return out, (lse2.astype(mx.float32) if want_lse else None)


def merge_ops(v: Any, lse: Any, o_indptr: Any, *, sinks: Any = None) -> tuple[Any, Any]:
    """The merge contract with MLX ops: ``v [N, H, D]`` f32, ``lse [N, H]`` f32 (base 2),
    host ``o_indptr [M+1]`` -> ``(v_out [M, H, D]`` f32, ``lse_out [M, H]`` f32); a
    ``-inf`` partial carries no weight, a NaN or +inf one poisons its group (NaN), an
    all-empty group gives zeros and -inf (``paged_decode.softmax.merge_partials``); with
    ``sinks [H]`` float32 each group takes the head's sink as one more state."""
    import mlx.core as mx
    ip = np.asarray(o_indptr, dtype=np.int64)
    m = ip.size - 1
    n, h, d = (int(x) for x in v.shape)
    counts = np.diff(ip)
    width = int(counts.max()) if m and counts.size else 0
    if m == 0 or width == 0 or n == 0:
        out, lse_out = mx.zeros((m, h, d), mx.float32), mx.full((m, h), -mx.inf, mx.float32)
    else:
        slot = np.arange(width)[None, :]
        live = slot < counts[:, None]                                 # [M, W]
        idx = mx.array(np.where(live, ip[:-1, None] + slot, 0).astype(np.int32))
        ls = mx.take(lse, idx, axis=0)                                # [M, W, H]
        vs = mx.take(v, idx, axis=0)                                  # [M, W, H, D]
        out, lse_out = merge_partials(mx, vs, ls, mx.array(live)[..., None], axis=1)
    if sinks is not None:        # one more state per group: the head's sink
        out, lse_out = with_sink(mx, out, lse_out, sinks, (h,))
    return out.astype(mx.float32), lse_out.astype(mx.float32)


__all__ = ["compute_dtype", "gather_attention", "gather_index", "merge_ops"]
