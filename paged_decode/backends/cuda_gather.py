"""The gather-then-SDPA arm on CUDA: gather every request's visible K/V rows into a
contiguous, zero-padded ``[B, Hkv, Tmax, D]`` copy, then dense attention.

Dense attention is torch's ``scaled_dot_product_attention`` when torch is importable
(the baseline an engine without paged kernels would use), otherwise a CuPy float32
implementation; the LSE (base 2), when asked for, comes from the CuPy implementation, and
so does every call with a soft cap (SDPA has no hook on the scores) or sinks (joined to
the state with ``variants.with_sink``, which needs the LSE).
Row indices are built on the host once per table and memoised with the table's arrays.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..fp8 import decode_table, is_fp8
from ..page_table import PageTable
from ..softmax import RowSoftmax, nonfinite_heads
from ..variants import cap_logits, with_sink

_rows_cache: weakref.WeakKeyDictionary[PageTable, np.ndarray] = weakref.WeakKeyDictionary()


def gather_rows(table: PageTable) -> np.ndarray:
    """``int64 [B, Tmax]`` flat row ids into ``pages.reshape(-1, Hkv, D)``; padding is
    negative: ``-1 - row`` for a visible row of the same request to read instead (the
    attention masks it, but it is never an entry that may hold garbage), ``-1`` for an
    empty request.

    Read-only and memoised per table.
    """
    got = _rows_cache.get(table)
    if got is not None:
        return got
    p = table.page_size
    vis = table.visible_lens.astype(np.int64)
    tmax = max(1, int(vis.max()) if vis.size else 1)
    rows = np.full((table.batch_size, tmax), -1, np.int64)
    for r in range(table.batch_size):
        n = int(vis[r])
        if n == 0:
            continue
        a = int(table.first_page_offset[r]) + np.arange(n, dtype=np.int64)
        pages = table.indices[table.indptr[r] + a // p].astype(np.int64)
        rows[r, :n] = pages * p + a % p
        # padding repeats a visible row of the same request (masked out, but finite)
        rows[r, n:] = -1 - rows[r, 0]
    rows.setflags(write=False)
    _rows_cache[table] = rows
    return rows


def gather_attention(be: Any, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                     sm_scale: float, out: Any, lse_out: Any, *,
                     soft_cap: float | None = None, sinks: Any = None,
                     kv_dtype: str | None = None, v_scale: float = 1.0) -> None:
    """``q [B, Hq, D]``, pools ``[num_pages, P, Hkv, D]`` (CuPy) -> ``out [B, Hq, D]``,
    ``lse_out [B, Hq]`` float32 base 2 (or ``None``); ``soft_cap``, ``sinks [Hq]``
    float32, ``kv_dtype`` and ``v_scale`` (fp8 pools: the gathered bytes are widened
    through the format's table of values, V times its scale) as in
    ``Backend.gather_sdpa``."""
    import cupy as cp
    b, hq, d = (int(x) for x in q.shape)
    hkv = int(k_pages.shape[2])
    g = hq // hkv
    rows_h = gather_rows(table)
    rows = be.upload(np.where(rows_h >= 0, rows_h, -1 - rows_h))
    valid = be.upload(rows_h >= 0)                                # [B, Tmax]
    kf = k_pages.reshape(-1, hkv, d)[rows].transpose(0, 2, 1, 3)  # [B, Hkv, Tmax, D]
    vf = v_pages.reshape(-1, hkv, d)[rows].transpose(0, 2, 1, 3)
    if kv_dtype is not None and is_fp8(kv_dtype):
        lut = cp.asarray(decode_table(kv_dtype))
        kf, vf = lut[kf], lut[vf] * np.float32(v_scale)
    empty = cp.asarray(table.visible_lens == 0)
    torch = _torch_cuda()
    if torch is not None and lse_out is None and soft_cap is None and sinks is None:
        tq = torch.from_dlpack(q).unsqueeze(2)                     # [B, Hq, 1, D]
        tk, tv = torch.from_dlpack(kf), torch.from_dlpack(vf)
        # the host rows say whether any slot is padding (a device read would synchronize)
        mask = None if bool((rows_h >= 0).all()) else torch.from_dlpack(valid)[:, None, None, :]
        o = torch.nn.functional.scaled_dot_product_attention(
            tq, tk.to(tq.dtype), tv.to(tq.dtype), attn_mask=mask, scale=sm_scale,
            enable_gqa=g > 1)
        res = cp.from_dlpack(o.squeeze(2).contiguous())
        res = cp.where(empty[:, None, None], 0, res)
        bad = nonfinite_heads(cp, q, kf, valid, empty, g)                  # [B, Hq]
        out[...] = cp.where(bad[..., None], cp.nan, res).astype(out.dtype)
        return
    qf = q.astype(cp.float32).reshape(b, hkv, g, d)
    s = cp.matmul(qf, kf.astype(cp.float32).transpose(0, 1, 3, 2)) * np.float32(sm_scale)
    s = cap_logits(cp, s, soft_cap, base2=False)
    sm = RowSoftmax(cp, s, valid[:, None, None, :], base2=False)  # [B, Hkv, G, Tmax]
    o = sm.normalize(cp.matmul(sm.p, vf.astype(cp.float32))).reshape(b, hq, d)
    lse2 = sm.lse2.reshape(b, hq)
    if sinks is not None:
        o, lse2 = with_sink(cp, o, lse2, sinks, (hq,))
    out[...] = o.astype(out.dtype)
    if lse_out is not None:
        lse_out[...] = lse2.astype(cp.float32)


def _torch_cuda() -> Any:
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None
