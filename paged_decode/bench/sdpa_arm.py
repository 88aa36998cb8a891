"""Comparison arm: torch SDPA on contiguous K/V, the same bytes without paging.

Each request's visible keys and values are copied once (outside the timed call) into
contiguous ``[B, Hkv, L, D]`` tensors, and the call is
``torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], K, V,
scale=sm_scale, enable_gqa=Hq != Hkv)``. torch picks the backend (``enable_gqa`` is
accepted by the flash and memory-efficient CUDA backends since 2.5, the math backend
expands K/V); the description names the one ``torch._fused_sdp_choice`` reports. torch is
imported on first use only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..page_table import PageTable


def _torch() -> Any:
    import torch
    return torch


# ---------------------------------------------------------------------------- validation
def check_shapes(q_shape: tuple[int, ...], k_shape: tuple[int, ...],
                 v_shape: tuple[int, ...], table: PageTable) -> tuple[int, int, int, int, int]:
    """``(B, Hq, Hkv, D, P)`` of ``q [B, Hq, D]`` and pools ``[N, P, Hkv, D]`` matching
    ``table``; ``ValueError`` naming the mismatch otherwise."""
    q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
    if len(q_shape) != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {list(q_shape)}")
    if len(k_shape) != 4 or k_shape != v_shape:
        raise ValueError(f"k_pages and v_pages must both be [num_pages, P, Hkv, D], got "
                         f"{list(k_shape)} and {list(v_shape)}")
    b, hq, d = q_shape
    n, p, hkv, dk = k_shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) and of the K/V pools ({dk}) differ")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"num_qo_heads {hq} must be a positive multiple of num_kv_heads {hkv}")
    if b != table.batch_size:
        raise ValueError(f"q has batch {b} but the page table has {table.batch_size} requests")
    if p != table.page_size:
        raise ValueError(f"pools have page size {p} but the page table says {table.page_size}")
    if table.max_page_id >= n:
        raise ValueError(f"the page table references page {table.max_page_id} but the pools "
                         f"hold {n} pages")
    return b, hq, hkv, d, p


def equal_visible_length(table: PageTable) -> int:
    """The common visible length ``L >= 1`` of every request; ``ValueError`` otherwise."""
    vis = np.asarray(table.visible_lens)
    if vis.size == 0:
        raise ValueError("contiguous SDPA needs at least one request")
    if (vis != vis[0]).any():
        raise ValueError(f"contiguous SDPA needs equal request lengths, got "
                         f"{sorted(set(vis.tolist()))[:8]}")
    if vis[0] < 1:
        raise ValueError("contiguous SDPA needs >= 1 visible token per request")
    return int(vis[0])


# ---------------------------------------------------------------------------- SDPA
_SDPA_BACKENDS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn",
                  4: "overrideable"}


def sdpa_backend_name(q4: Any, k: Any, v: Any, *, scale: float, enable_gqa: bool) -> str:
    """Which SDPA backend torch's dispatcher picks for these tensors ("flash",
    "efficient", "cudnn", "math"), or ``"unknown"`` when torch does not say."""
    torch = _torch()
    try:
        choice = torch._fused_sdp_choice(q4, k, v, None, 0.0, False, scale=scale,
                                         enable_gqa=enable_gqa)
    except Exception:
        return "unknown"
    return _SDPA_BACKENDS.get(int(choice), f"backend {int(choice)}")


def make_contiguous_sdpa(q: Any, k_pages: Any, v_pages: Any, table: PageTable, *,
                         sm_scale: float) -> tuple[Callable[[], Any], Any, str]:
    """torch SDPA on contiguous K/V: returns ``(call, out, description)``.

    The visible tokens of every request (all of equal length ``L``, else ``ValueError``)
    are copied once, here, into contiguous ``K, V [B, Hkv, L, D]``. ``call()`` returns a
    fresh ``[B, Hq, D]`` view of SDPA's output (no copy into a preallocated buffer: the
    timed bytes are exactly SDPA's K/V reads, q read and output write); ``out`` is the
    result of one warm-up call. The output comes from torch's caching allocator (a
    CUDA-graph capture takes it from the graph's pool), never from a host sync.
    ``first_page_offset`` is honoured (the copy starts there).
    """
    b, hq, hkv, d, _p = check_shapes(tuple(q.shape), tuple(k_pages.shape),
                                     tuple(v_pages.shape), table)
    length = equal_visible_length(table)
    torch = _torch()
    dev = q.device
    on_gpu = bool(getattr(q, "is_cuda", False))
    with torch.cuda.device(dev) if on_gpu else contextlib.nullcontext():
        k_c = torch.empty((b, hkv, length, d), dtype=k_pages.dtype, device=dev)
        v_c = torch.empty((b, hkv, length, d), dtype=v_pages.dtype, device=dev)
        for r in range(b):
            pages = torch.from_numpy(np.array(table.request_pages(r), dtype=np.int64)).to(dev)
            off = int(table.first_page_offset[r])
            for src, dst in ((k_pages, k_c), (v_pages, v_c)):
                rows = src.index_select(0, pages).reshape(-1, hkv, d)[off:off + length]
                dst[r].copy_(rows.permute(1, 0, 2))
        q4 = q.unsqueeze(2)                                   # [B, Hq, 1, D], a view of q
        gqa = hq != hkv
        scale = float(sm_scale)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def call() -> Any:
            return sdpa(q4, k_c, v_c, scale=scale, enable_gqa=gqa).squeeze(2)

        out = call()
        if on_gpu:
            torch.cuda.synchronize(dev)
    backend = sdpa_backend_name(q4, k_c, v_c, scale=scale, enable_gqa=gqa)
    return call, out, (f"torch {torch.__version__} SDPA on contiguous K/V "
                       f"[{b}, {hkv}, {length}, {d}] ({backend})")


__all__ = ["check_shapes", "equal_visible_length", "make_contiguous_sdpa", "sdpa_backend_name"]
