"""The float64 dense oracle that tests, ``check`` and ``bench`` compare against.

Independent of the kernels' arithmetic: it walks each request's page list into one
contiguous run of entries, slices the visible window, and computes softmax attention in
float64 with natural exponentials, converting the log-sum-exp to base 2 at the end.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .dtypes import as_float64
from .fp8 import dequantize, is_fp8
from .page_table import PageTable


def request_kv_f64(pages: Any, table: PageTable, r: int, kv_dtype: str | None = None,
                   scale: float = 1.0) -> np.ndarray:
    """Visible K (or V) rows of request ``r`` as float64 ``[T, Hkv, D]``; fp8 pages are
    dequantized, ``stored * scale`` in float64 (``kv_dtype`` names the format of
    ``uint8`` pages; an ``ml_dtypes`` fp8 array names its own)."""
    p = table.page_size
    ids = [int(x) for x in table.request_pages(r)]
    if not ids:
        return np.zeros((0, *np.asarray(pages).shape[2:]), np.float64)
    host = np.asarray(pages)
    sel = host[np.asarray(ids)]
    fmt = kv_dtype if kv_dtype is not None else sel.dtype.name
    run = (dequantize(sel, fmt).astype(np.float64) if is_fp8(fmt) else as_float64(sel))
    # a scale as decode takes it: a number or a one-element array
    run = (run * float(np.asarray(scale, np.float64).reshape(()))).reshape(-1, *host.shape[2:])
    end = (len(ids) - 1) * p + int(table.last_page_len[r])
    return run[int(table.first_page_offset[r]):end]


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float, *,
                  soft_cap: float | None = None, sinks: Any = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Dense GQA attention of one query token: ``q [Hq, D]``, ``k, v [T, Hkv, D]``.

    The GQA group is a matmul axis (query head ``h`` reads KV head ``h // G``), so no
    per-query-head copy of K/V is made. ``soft_cap`` ``c``: scores ``s`` become
    ``c * tanh(s / c)``; ``sinks`` ``[Hq]`` (natural units): one more logit per head in
    the denominator, with no value. Returns ``out [Hq, D]`` float64 and ``lse [Hq]``
    float64, **base 2** (``-inf`` and zeros when ``T == 0`` and no sink; the sink's LSE
    and zeros when ``T == 0`` with one; NaN for a head with a non-finite score or sink
    other than ``-inf``).
    """
    hq, d = q.shape
    t, hkv, _ = k.shape
    sk = None if sinks is None else as_float64(np.asarray(sinks)).reshape(hq)
    if t == 0:
        if sk is None:
            return np.zeros((hq, d)), np.full(hq, -np.inf)
        with np.errstate(invalid="ignore"):
            bad = np.isnan(sk) | (sk == np.inf)
        return (np.where(bad[:, None], np.nan, 0.0) * np.ones((hq, d)),
                np.where(bad, np.nan, sk / math.log(2.0)))
    g = hq // hkv
    qg = q.astype(np.float64).reshape(hkv, g, d)
    with np.errstate(invalid="ignore", over="ignore"):
        logits = np.matmul(qg, k.transpose(1, 2, 0)) * sm_scale           # [Hkv, G, T]
        # a non-finite score poisons its head (NaN output and LSE; numpy's max keeps NaN)
        logits = np.where(np.isfinite(logits), logits, np.nan)
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        mx = logits.max(axis=-1, keepdims=True)
        if sk is not None:
            s3 = sk.reshape(hkv, g, 1)
            # a NaN or +inf sink poisons; -inf adds nothing (max ignores it)
            mx = np.where(np.isnan(s3) | (s3 == np.inf), np.nan, np.maximum(mx, s3))
        e = np.exp(logits - mx)
        den = e.sum(axis=-1)
        if sk is not None:
            den = den + np.exp(sk.reshape(hkv, g) - mx[..., 0])
        out = np.matmul(e, np.ascontiguousarray(v.transpose(1, 0, 2))) / den[..., None]
    lse = (mx[..., 0] + np.log(den)) / math.log(2.0)
    return out.reshape(hq, d), lse.reshape(hq)


def oracle_decode(q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                  sm_scale: float | None = None, *, window_left: int = -1,
                  logits_soft_cap: float | None = None, sinks: Any = None,
                  qo_indptr: Any = None, kv_dtype: str | None = None, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """float64 paged decode: ``q [B, Hq, D]`` -> ``out [B, Hq, D]``, ``lse [B, Hq]`` (base 2).

    Multi-token (``docs/multi-token.md``): ``q [B, T, Hq, D]`` -> ``out [B, T, Hq, D]``,
    ``lse [B, T, Hq]``, or a flat ``q [N, Hq, D]`` with ``qo_indptr [B+1]`` -> ``[N, Hq, D]``
    and ``[N, Hq]``. The table holds the new tokens: token ``t`` of ``T`` of a request with
    ``L`` visible tokens sees positions ``< L - T + t + 1`` (causal), and its window ends at
    its own position. Variants (``docs/variants.md``): ``window_left = W >= 0`` keeps the
    last ``W + 1`` tokens a query sees (sliced here from the full run, independently of the
    package's window table), ``logits_soft_cap`` and ``sinks [Hq]`` as in
    ``attention_f64``. fp8 pools (``docs/fp8.md``) are dequantized element by element
    in float64, ``stored * k_scale`` and ``stored * v_scale`` (``kv_dtype``: the format of
    ``uint8`` pools). Inputs may be any array kind with ``__array__`` (read on the host).
    """
    qn = as_float64(np.asarray(q))
    b = table.batch_size
    counts: np.ndarray
    if qn.ndim == 4:
        counts = np.full(b, qn.shape[1], np.int64)
    elif qo_indptr is not None:
        counts = np.diff(np.asarray(qo_indptr).astype(np.int64))
    else:
        counts = np.ones(b, np.int64)
    flat = qn.reshape(-1, *qn.shape[-2:])
    hq, d = flat.shape[1:]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    sk = None if sinks is None else np.asarray(sinks)
    out = np.zeros(flat.shape)
    lse = np.full(flat.shape[:2], -np.inf)
    n = 0
    for r in range(b):
        k_all = request_kv_f64(k_pages, table, r, kv_dtype, k_scale)
        v_all = request_kv_f64(v_pages, table, r, kv_dtype, v_scale)
        big_t = int(counts[r])
        for t in range(big_t):
            end = k_all.shape[0] - big_t + t + 1
            begin = max(0, end - 1 - window_left) if window_left >= 0 else 0
            out[n], lse[n] = attention_f64(flat[n], k_all[begin:end], v_all[begin:end],
                                           scale, soft_cap=logits_soft_cap, sinks=sk)
            n += 1
    return out.reshape(qn.shape), lse.reshape(qn.shape[:-1])


def max_rel_error(got: Any, ref: np.ndarray) -> float:
    """``max |got - ref| / max |ref|`` (NaN anywhere gives ``inf``; an all-zero ``ref``
    compares absolutely)."""
    g = np.asarray(got, dtype=np.float64)
    if not np.isfinite(g).all():
        return math.inf
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    err = float(np.abs(g - ref).max()) if ref.size else 0.0
    return err / scale if scale > 0 else err


def row_rel_error(got: Any, ref: np.ndarray) -> float:
    """``max_rel_error`` per row of the last axis (each request's and head's output
    ``[..., D]`` against its own scale): a long request's output is an average, far
    smaller than a one-token request's, so one scale for the batch would let its error
    hide under another row's size. A row whose reference is all zero (an empty request)
    compares absolutely; NaN anywhere gives ``inf``."""
    g = np.asarray(got, dtype=np.float64)
    if not np.isfinite(g).all():
        return math.inf
    if not ref.size:
        return 0.0
    d = ref.shape[-1] if ref.ndim else 1
    gr, rr = g.reshape(-1, d), np.asarray(ref, np.float64).reshape(-1, d)
    err = np.abs(gr - rr).max(axis=1)
    scale = np.abs(rr).max(axis=1)
    return float(np.where(scale > 0, err / np.where(scale > 0, scale, 1.0), err).max())


def lse_error(got: Any, ref: np.ndarray) -> float:
    """Max absolute LSE error; ``-inf`` must match ``-inf`` exactly (else ``inf``)."""
    g = np.asarray(got, dtype=np.float64)
    empty = np.isneginf(ref)
    if np.isnan(g).any() or (np.isneginf(g) != empty).any():
        return math.inf
    return float(np.abs(g[~empty] - ref[~empty]).max()) if (~empty).any() else 0.0
