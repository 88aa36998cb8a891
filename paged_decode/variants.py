"""Decode variants: sliding window, logits soft cap and attention sinks (issue #14).

One frozen ``Variant`` per call, validated up front (``check_variant``), and the pieces
every path shares (the math is in ``docs/variants.md``):

- **window** ``window_left = W``: token ``j`` of a request with ``L`` visible tokens is
  seen iff ``j >= L - 1 - W`` (``W = -1``: every token). It is a *table* transformation
  (``window_table``): the request's pages wholly before the window are dropped and
  ``first_page_offset`` moves to the window's first token, so the plan, every kernel and
  every array path see exactly the window and nothing outside it is launched or read
  (the cost follows ``W``, not the context). No kernel is specialized for it.
- **soft cap** ``logits_soft_cap = c``: a score ``s = sm_scale * q.k`` becomes
  ``c * tanh(s / c)`` before the softmax (the LSE is of the capped scores). Kernels get a
  ``soft_cap`` specialization (part of the URI) and ``c * log2(e)``, because their scores
  are already in log2 units: ``c log2e * tanh(s log2e / (c log2e))`` is the capped score
  in log2 units.
- **sinks** ``sinks [Hq]`` float32 (natural-log units, as gpt-oss, vLLM and FlashInfer
  define them): a logit per query head that joins the softmax denominator and carries no
  value. It enters exactly once, as one extra merge state ``(v = 0, lse = sink * log2e)``
  in the *final* combine of a request: the merge kernel of a split request (or of
  cascade's levels), the partial's store when it writes the output itself (one chunk),
  v1's store, or ``with_sink`` on the array paths. Partials that are merged never hold it.

- **fp8 K/V** (``kv``, a ``fp8.KVQuant``: the pools' fp8 format and the layer's K and V
  scales; ``docs/fp8.md``): the K scale is folded into the softmax scale by the entry
  points, the format and the V scale travel to every launch that reads K/V
  (``kernel_kwargs``, final or not: attention is linear in V, so merged partials may
  carry the scale).

``PATH_VARIANTS`` is the one place that says which decode path implements which variant;
``check_path`` refuses the others.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import KV_DTYPES, caller_dtype, check_dtype
from .errors import InvalidArgumentError, UnsupportedProblemError, check_int, real_float
from .fp8 import KVQuant, check_kv_quant, pool_dtype
from .page_table import MAX_ENTRIES, PageTable

LOG2E = 1.4426950408889634
F32_MAX = float(np.finfo(np.float32).max)

#: variant -> the decode paths that implement it (window: every path that reads a table)
PATH_VARIANTS = {
    "window_left": ("v2", "v2tc", "v1", "gather", "cascade", "sparse"),
    "logits_soft_cap": ("v2", "v2tc", "v1", "gather", "cascade", "sparse"),
    "sinks": ("v2", "v2tc", "v1", "gather", "cascade", "sparse"),
    "kv_dtype": ("v2", "v2tc", "v1", "gather", "cascade", "sparse"),     # fp8 pools
}


@dataclass(frozen=True, eq=False)
class Variant:
    """The variants of one call. ``window_left`` ``-1`` (off) or ``W >= 0``;
    ``soft_cap`` ``None`` or ``c > 0`` (natural units); ``sinks`` ``None`` or the
    backend's float32 ``[Hq]`` array (natural-log units); ``kv`` ``None`` or the fp8
    pools' format and scales."""

    window_left: int = -1
    soft_cap: float | None = None
    sinks: Any = None
    kv: KVQuant | None = None

    @property
    def plain(self) -> bool:
        return (self.window_left < 0 and self.soft_cap is None and self.sinks is None
                and self.kv is None)

    @property
    def names(self) -> tuple[str, ...]:
        """The public argument names of the variants in use (``kv_dtype`` for fp8 pools)."""
        return tuple(n for n, on in (("window_left", self.window_left >= 0),
                                     ("logits_soft_cap", self.soft_cap is not None),
                                     ("sinks", self.sinks is not None),
                                     ("kv_dtype", self.kv is not None)) if on)

    def score_scale(self, sm_scale: float) -> float:
        """The scale of ``q . k_stored``: ``sm_scale`` times an fp8 pool's K scale
        (``q . (k_scale k) = k_scale (q . k)``), the one place it is folded in."""
        return sm_scale if self.kv is None else sm_scale * self.kv.k_scale

    def checked_score_scale(self, fn: str, sm_scale: float) -> float:
        """``score_scale(sm_scale)``, refused where the kernels' float32 form of it in log2
        units (times log2 e) is not finite: every score would be inf or NaN (even q = 0
        gives 0 * inf)."""
        scale = self.score_scale(sm_scale)
        if not abs(scale) * LOG2E <= F32_MAX:
            what = "sm_scale times k_scale" if self.kv is not None else "sm_scale"
            raise InvalidArgumentError(
                f"{fn}: {what} must be at most {F32_MAX / LOG2E:.4g} in magnitude (the "
                f"kernels scale scores by it times log2 e in float32), got {scale:g}")
        return scale

    @property
    def soft_cap_log2(self) -> float:
        """The cap in the kernels' log2 units (0 when off)."""
        return 0.0 if self.soft_cap is None else self.soft_cap * LOG2E

    def kernel_kwargs(self, final: bool) -> dict[str, Any]:
        """Keyword arguments of ``Backend.partial`` / ``decode_v1`` / ``gather_sdpa`` for
        a launch that writes the output (``final``) or partials to be merged (no sinks:
        the merge adds them once). Empty for a plain call, so backends without variant
        support are called exactly as before."""
        kw: dict[str, Any] = {}
        if self.soft_cap is not None:
            kw["soft_cap"] = self.soft_cap
        if final and self.sinks is not None:
            kw["sinks"] = self.sinks
        if self.kv is not None:      # every launch: a merge of scaled partials is exact
            kw["kv_dtype"] = self.kv.dtype
            kw["v_scale"] = self.kv.v_scale
        return kw

    def merge_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``Backend.merge`` for a final merge (the sinks)."""
        return {} if self.sinks is None else {"sinks": self.sinks}

    def key(self) -> tuple[Any, ...]:
        """What a prepared call's cache key holds of it (the sinks array by identity)."""
        return (self.window_left, self.soft_cap, id(self.sinks), self.kv)

    def describe(self) -> str:
        """The variants for ``DecodeOutcome.detail`` (``""`` when plain)."""
        parts = []
        if self.window_left >= 0:
            parts.append(f"window_left={self.window_left}")
        if self.soft_cap is not None:
            parts.append(f"logits_soft_cap={self.soft_cap:g}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.kv is not None:
            parts.append(self.kv.describe())
        return "variants: " + ", ".join(parts) if parts else ""


PLAIN = Variant()


def check_window(fn: str, window_left: Any) -> int:
    """``window_left``: an integer >= -1 (not a bool). One past ``MAX_ENTRIES`` covers
    every request whole, so a larger one is taken as that (the window's position
    arithmetic stays within int64)."""
    return min(check_int(fn, "window_left", window_left, -1), MAX_ENTRIES)


#: the soft caps the kernels take: the cap in log2 units and its reciprocal stay normal
#: float32 numbers (the CUDA kernels multiply by 1 / cap); a larger cap is no cap (None)
SOFT_CAP_RANGE = (1e-30, 1e30)


def check_soft_cap(fn: str, logits_soft_cap: Any) -> float | None:
    """``logits_soft_cap``: ``None`` or a real number in ``SOFT_CAP_RANGE`` (not a bool)."""
    if logits_soft_cap is None:
        return None
    lo, hi = SOFT_CAP_RANGE
    cap = real_float(logits_soft_cap)
    if cap is None or not lo <= cap <= hi:
        raise InvalidArgumentError(f"{fn}: logits_soft_cap must be None or a finite number "
                                   f"in [{lo:g}, {hi:g}], got {logits_soft_cap!r}")
    return cap


def check_variant(fn: str, be: Any, num_qo_heads: int, *, window_left: Any = -1,
                  logits_soft_cap: Any = None, sinks: Any = None,
                  kv: KVQuant | None = None) -> Variant:
    """Validate the variant arguments of ``fn`` on backend ``be`` for ``Hq`` heads:
    ``sinks`` must be a float32 ``[Hq]`` array of ``be`` (converted zero-copy where the
    kinds allow, as ``q`` is), C-contiguous; ``kv`` comes checked
    (``fp8.check_kv_quant``)."""
    w = check_window(fn, window_left)
    cap = check_soft_cap(fn, logits_soft_cap)
    arr = None
    if sinks is not None:
        arr = be.array_arg(fn, "sinks", sinks)
        if tuple(int(x) for x in arr.shape) != (num_qo_heads,):
            raise InvalidArgumentError(f"{fn}: sinks must have shape [Hq] = [{num_qo_heads}], "
                                       f"got {list(arr.shape)}")
        if (got := caller_dtype(sinks, be.dtype_of(arr))) != "float32":
            raise InvalidArgumentError(f"{fn}: sinks must be float32, got {got}")
        flags = getattr(arr, "flags", None)
        if flags is not None and not (flags["C_CONTIGUOUS"] if not hasattr(flags, "c_contiguous")
                                      else flags.c_contiguous):
            raise InvalidArgumentError(f"{fn}: sinks must be C-contiguous")
    if w < 0 and cap is None and arr is None and kv is None:
        return PLAIN
    return Variant(w, cap, arr, kv)


def check_pools_kv(fn: str, be: Any, given: tuple[Any, Any], arrays: tuple[Any, Any],
                   names: tuple[str, str], *, kv_dtype: Any = None, k_scale: Any = None,
                   v_scale: Any = None) -> tuple[str, KVQuant | None]:
    """The pools' dtype and, for fp8 pools, their ``KVQuant``: ``given`` are the caller's
    K and V arrays (their own dtypes name an fp8 format, e.g. torch's), ``arrays`` the
    backend's (``uint8`` for fp8 where the library has no fp8 dtype: ``kv_dtype`` then
    names the format), ``names`` the arguments' names. Both must have one dtype; scales
    are required with fp8 and refused without (``fp8.check_kv_quant``)."""
    dts = []
    for g, a, n in zip(given, arrays, names):
        held = be.dtype_of(a)
        dts.append(check_dtype(fn, n, pool_dtype(fn, caller_dtype(g, held), held, kv_dtype, n),
                               KV_DTYPES))
    if dts[0] != dts[1]:
        raise InvalidArgumentError(f"{fn}: {names[1]} must have {names[0]}' dtype {dts[0]}, "
                                   f"got {dts[1]}")
    return dts[0], check_kv_quant(fn, dts[0], k_scale, v_scale)


def missing_variants(path: str, variant: Variant) -> list[str]:
    """The variants in use that ``path`` does not implement (the one place for the rule;
    a path not in ``PATH_VARIANTS`` implements none)."""
    return [n for n in variant.names if path not in PATH_VARIANTS[n]]


def check_path(fn: str, backend_name: str, path: str, variant: Variant) -> None:
    """Raise ``UnsupportedProblemError`` when ``path`` does not implement a variant in use
    (``missing_variants``)."""
    missing = missing_variants(path, variant)
    if missing:
        raise UnsupportedProblemError(
            f"{fn}: path {path!r} on backend {backend_name!r} does not implement "
            f"{', '.join(missing)} (implemented on: "
            f"{', '.join(PATH_VARIANTS[missing[0]])})")


# ---------------------------------------------------------------------------- window
def window_starts(visible_lens: np.ndarray, window_left: int) -> np.ndarray:
    """First visible token each request sees, ``int64 [B]``: ``max(0, L - 1 - W)``
    (``0`` for ``W = -1`` and for an empty request)."""
    vis = np.asarray(visible_lens, np.int64)
    if window_left < 0:
        return np.zeros_like(vis)
    return np.maximum(0, vis - 1 - int(window_left))


_windows_lock = threading.Lock()
_windows: weakref.WeakKeyDictionary[PageTable, dict[int, PageTable]] = \
    weakref.WeakKeyDictionary()


def window_table(table: Any, window_left: int, *, fn: str = "window_table") -> Any:
    """``table`` restricted to each request's window (``table`` itself for ``W = -1`` or
    when every window covers its request): pages wholly before the window are dropped and
    ``first_page_offset`` becomes the window start's entry in its page; ``last_page_len``
    is unchanged. Memoised per (table, W) (tables are immutable), so the layers of a step
    share one."""
    if window_left < 0:
        return table
    if not isinstance(table, PageTable):
        raise UnsupportedProblemError(
            f"{fn}: window_left needs a PageTable; a {type(table).__name__} (a pool's "
            "device-resident step table) is not windowed yet: pass its page_table()")
    with _windows_lock:
        hit = _windows.get(table, {}).get(window_left)
    if hit is not None:
        return hit
    made = _window_table(table, int(window_left))
    with _windows_lock:
        _windows.setdefault(table, {})[window_left] = made
    return made


def _window_table(table: PageTable, window_left: int) -> PageTable:
    p = table.page_size
    start = window_starts(table.visible_lens, window_left)
    if not start.any():
        return table
    ip = table.indptr.astype(np.int64)
    has = table.pages_per_request > 0
    entry = table.first_page_offset.astype(np.int64) + start   # the window's first entry
    drop = np.where(has, entry // p, 0)
    req = np.repeat(np.arange(table.batch_size), np.diff(ip))
    keep = np.arange(table.indices.size) - ip[req] >= drop[req]
    counts = np.diff(ip) - drop
    return PageTable.build(table.indices[keep], np.concatenate([[0], np.cumsum(counts)]),
                           table.last_page_len, page_size=p,
                           first_page_offset=np.where(has, entry - drop * p, 0),
                           rope_positions=table.rope_positions, num_pages=table.num_pages)


# ---------------------------------------------------------------------------- array paths
def cap_logits(xp: Any, s: Any, cap: float | None, *, base2: bool) -> Any:
    """Scores ``s`` (log2 units with ``base2``, else natural) soft-capped at ``cap``
    (natural units): ``c * tanh(s / c)`` in the scores' own units; a non-finite score
    stays non-finite (NaN), so it still poisons its row. ``None``: ``s`` unchanged."""
    if cap is None:
        return s
    c = cap * LOG2E if base2 else cap
    return xp.where(xp.isfinite(s), c * xp.tanh(s / c), float("nan"))


def with_sink(xp: Any, o: Any, lse: Any, sinks: Any, heads_axis_shape: tuple[int, ...]
              ) -> tuple[Any, Any]:
    """A final state ``(o [..., H, D], lse [..., H] base 2)`` with the sink of each head
    joined as one more merge state of value 0 and LSE ``sink * log2e`` (the merge rules of
    ``softmax.merge_partials``: an empty state gives zeros and the sink's LSE, a poisoned
    one stays NaN, a ``-inf`` sink changes nothing, a NaN or ``+inf`` sink poisons).
    ``sinks`` ``[H]`` float32 of ``xp``, reshaped to ``heads_axis_shape`` (``lse``'s
    trailing axes) first."""
    from .softmax import merge_partials
    sk = xp.broadcast_to(sinks.astype(xp.float32).reshape(heads_axis_shape) * LOG2E,
                         lse.shape)
    vs = xp.stack([o.astype(xp.float32), xp.zeros(o.shape, xp.float32)])
    ls = xp.stack([lse.astype(xp.float32), sk.astype(xp.float32)])
    return merge_partials(xp, vs, ls)


__all__ = ["LOG2E", "PATH_VARIANTS", "PLAIN", "Variant", "cap_logits", "check_path",
           "check_pools_kv",
           "check_soft_cap", "check_variant", "check_window", "window_starts",
           "window_table", "with_sink"]
