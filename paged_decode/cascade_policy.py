"""When ``decode`` runs cascade: the argument, ``PAGED_DECODE_CASCADE``, and a cost rule.

``resolve_cascade`` turns ``decode(..., cascade=None | True | False | plan)`` and the
environment into a ``CascadeDecodePlan`` (or ``None``) and a reason for the outcome.
Detection and planning are memoised per table object, so the layers of one step pay once.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from . import settings
from .cascade import CascadeDecodePlan, CascadePlan, detect_with_reason, plan_cascade
from .device import CHUNK_ENV, RAGGED_ENV, TARGET_ENV
from .dtypes import itemsize
from .errors import InvalidArgumentError, PlanMismatchError, env_switch
from .kernels import prefix_tc
from .page_table import PageTable
from .specs import prefix_kernel_runs

CASCADE_ENV = "PAGED_DECODE_CASCADE"
#: Cost rule of the automatic choice: cascade must remove at least this fraction of the
#: flat page reads and at least this many bytes of K/V reads (saved token reads x 2 x
#: Hkv x D x element size), and level 0 must run on the tensor-core prefix kernel.
#: Measured on an H200 (2026-11-30, bench/results/h200/bench_cascade{,-rule}_run8_2026-11-30
#: .json: shared 128-32K x batch 2-128, Llama-3-8B heads, float16, suffix 256, CUDA-graph
#: replay), cascade against flat v2, by bytes saved and fraction of page reads saved:
#: - tensor-core level 0: every cell below 128 MiB lost (0.38-0.85x) but two (8K x 4, 96
#:   MiB: 1.07x; 2K x 16, 120 MiB: 1.00x); from 192 MiB up every cell with >= 70% saved
#:   won (1.09x at 1K x 64, 252 MiB; 1.26x at 2K x 32; 1.64x at 8K x 8; 3.3x at 8K x 32;
#:   8.4x at 32K x 128); 512 x 128 (254 MiB, 66% saved) broke even (1.00x).
#:   Re-checked with the final kernel (page ids fetched a tile ahead, bench_cascade{,-rule}
#:   _2026-11-30.json): every accepted cell 1.09x-9.1x; 8K x 4 (declined) 1.09x.
#: - v2 level 0 (stacked queries: float32 pools, no tensor-core kernel): 0.38-1.18x, with
#:   losses up to 1 GiB saved (0.90x at 2K x 128), so the automatic choice never takes it.
AUTO_MIN_SAVED_FRACTION = 0.7
AUTO_MIN_SAVED_BYTES = 192 * 2 ** 20


_memo_lock = threading.Lock()
_memo: weakref.WeakKeyDictionary[PageTable, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _memoised(table: PageTable, key: Any, make: Any) -> Any:
    with _memo_lock:
        per = _memo.setdefault(table, {})
        if key in per:
            return per[key]
    val = make()
    with _memo_lock:
        _memo.setdefault(table, {})[key] = val
    return val


def cascade_pays(prefix: CascadePlan, token_bytes: int, tensor_cores: bool
                 ) -> tuple[bool, str]:
    """The automatic cost rule (measured on the H200, see ``AUTO_MIN_SAVED_BYTES``): level
    0 runs on the tensor-core prefix kernel, and the saved page reads are >=
    ``AUTO_MIN_SAVED_FRACTION`` of the flat reads and >= ``AUTO_MIN_SAVED_BYTES`` bytes.
    ``token_bytes``: K and V bytes of one token over all KV heads (``2 * Hkv * D * element
    size``)."""
    saved_tokens = prefix.saved_page_reads * prefix.page_size
    saved = saved_tokens * token_bytes
    frac = prefix.saved_page_reads / max(1, prefix.flat_pages)
    what = (f"saves {frac:.0%} of page reads ({saved_tokens} tokens, {saved / 2 ** 20:.0f} "
            f"MiB)")
    if not tensor_cores:
        return False, (f"{what}, but level 0 would run on the v2 partial (no tensor-core "
                       "prefix kernel for this backend or dtype), measured no faster than "
                       "flat")
    if frac < AUTO_MIN_SAVED_FRACTION or saved < AUTO_MIN_SAVED_BYTES:
        return False, (f"{what}, below the rule ({AUTO_MIN_SAVED_FRACTION:.0%} and "
                       f"{AUTO_MIN_SAVED_BYTES / 2 ** 20:.0f} MiB)")
    return True, what


def env_cascade(fn: str) -> bool | None:
    """``PAGED_DECODE_CASCADE``: ``"1"`` forces cascade on, ``"0"`` off, unset/empty auto."""
    return env_switch(CASCADE_ENV, fn)


def resolve_cascade(fn: str, cascade: Any, path: str, table: PageTable, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, device: Any,
                    dtypes: tuple[str, str] = ("float16", "float16"),
                    tc_allowed: bool = True
                    ) -> tuple[CascadeDecodePlan | None, str | None]:
    """Decide whether ``decode`` runs cascade; returns ``(plan or None, reason or None)``.

    ``cascade``: ``True``/``False`` force (the argument beats the environment), a
    ``CascadePlan``/``CascadeDecodePlan`` forces that grouping, ``None`` follows
    ``PAGED_DECODE_CASCADE`` and otherwise the automatic rule (only for ``path="auto"``).
    ``device`` is a callable returning the ``DeviceInfo`` (called only when the rule or
    the planning needs it); ``dtypes`` = (q, K/V) dtype names, for the rule;
    ``tc_allowed`` False (a logits soft cap: the prefix kernel has none) counts level 0 as
    the v2 partial in the rule.
    """
    geo = (num_qo_heads, num_kv_heads, head_dim)
    if isinstance(cascade, CascadeDecodePlan):
        planned = (cascade.num_qo_heads, cascade.num_kv_heads, cascade.head_dim)
        if planned != geo:
            raise PlanMismatchError(f"{fn}: the cascade plan was made for (Hq, Hkv, D) = "
                                    f"{planned}, the call has {geo}: plan it for the call")
        if not cascade.prefix.matches(table):
            raise PlanMismatchError(f"{fn}: the cascade plan was made for another page table "
                                    "(its CSR arrays or page size differ): plan it for this "
                                    "table")
        forced: bool | None = True
    elif isinstance(cascade, CascadePlan):
        if not cascade.matches(table):
            raise PlanMismatchError(f"{fn}: the cascade plan was made for another page table "
                                    "(its CSR arrays or page size differ): plan it for this "
                                    "table")
        forced = True
    elif cascade is None or isinstance(cascade, bool):
        forced = cascade if cascade is not None else env_cascade(fn)
    else:
        raise InvalidArgumentError(f"{fn}: cascade must be None, a bool or a cascade plan, "
                                   f"got {type(cascade).__name__}")
    if forced is False:
        return None, ("cascade off (argument)" if cascade is False
                      else f"cascade off ({CASCADE_ENV}=0)")
    if forced and path not in ("auto", "v2"):
        raise InvalidArgumentError(f"{fn}: cascade runs on the v2 kernels; it cannot be "
                                   f"combined with path={path!r}")
    if forced is None and path != "auto":
        return None, None
    if isinstance(cascade, CascadeDecodePlan):
        return cascade, "requested plan"
    if isinstance(cascade, CascadePlan):
        return plan_cascade(table, *geo, prefix=cascade, device=device()), "requested plan"
    prefix, none_why = _memoised(table, "detect", lambda: detect_with_reason(table))
    if prefix is None:
        return None, f"cascade: {none_why}"
    if not forced:
        tc = tc_allowed and prefix_kernel_runs(device(), *dtypes)
        pays, why = cascade_pays(prefix, 2 * num_kv_heads * head_dim * itemsize(dtypes[1]), tc)
        if not pays:
            return None, f"cascade declined: {why}"
    else:
        why = "forced " + ("(argument)" if cascade else f"({CASCADE_ENV}=1)")
    dev = device()
    # every setting the plan reads (the prefix kernel's ones size level 0's chunks)
    key = ("plan", geo, dev, settings.get(TARGET_ENV), settings.get(CHUNK_ENV),
           settings.get(RAGGED_ENV), settings.get(prefix_tc.TILE_ENV),
           settings.get(prefix_tc.CTAS_ENV))
    cplan = _memoised(table, key, lambda: plan_cascade(table, *geo, prefix=prefix, device=dev))
    return cplan, why
