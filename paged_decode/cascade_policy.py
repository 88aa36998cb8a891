"""When ``decode`` runs cascade: the argument, ``PAGED_DECODE_CASCADE``, and a cost rule.

``resolve_cascade`` turns ``decode(..., cascade=None | True | False | plan)`` and the
environment into a ``CascadeDecodePlan`` (or ``None``) and a reason for the outcome.
Detection and planning are memoised per table object, so the layers of one step pay once.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from .cascade import CascadeDecodePlan, CascadePlan, detect_shared_prefix, plan_cascade
from .device import CHUNK_ENV, TARGET_ENV
from .errors import InvalidArgumentError
from .page_table import PageTable

CASCADE_ENV = "PAGED_DECODE_CASCADE"
#: Cost rule of the automatic choice: cascade must remove at least this fraction of the
#: flat page reads and at least this many token reads. Measured on an H200 (2026-11-29,
#: bench/results/h200/bench_cascade_2026-11-29.json, Llama-3-8B heads, suffix 256): with
#: the current kernels cascade beat flat v2 only where it saved ~1M token reads or more
#: (8K x 128: 1.04x, 32K x 32: 1.11x, 32K x 128: 1.12x) and lost everywhere below
#: (8K x 32, 254K saved: 0.98x; 2K x 4: 0.11x).
AUTO_MIN_SAVED_FRACTION = 0.25
AUTO_MIN_SAVED_TOKENS = 1_000_000


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


def cascade_pays(prefix: CascadePlan) -> tuple[bool, str]:
    """The automatic cost rule (measured on the H200, see ``AUTO_MIN_SAVED_TOKENS``): the
    saved page reads must be >= ``AUTO_MIN_SAVED_FRACTION`` of the flat reads and >=
    ``AUTO_MIN_SAVED_TOKENS`` tokens."""
    saved_tokens = prefix.saved_page_reads * prefix.page_size
    frac = prefix.saved_page_reads / max(1, prefix.flat_pages)
    if frac < AUTO_MIN_SAVED_FRACTION or saved_tokens < AUTO_MIN_SAVED_TOKENS:
        return False, (f"saves {frac:.0%} of page reads ({saved_tokens} tokens), below the "
                       f"rule ({AUTO_MIN_SAVED_FRACTION:.0%} and {AUTO_MIN_SAVED_TOKENS})")
    return True, f"saves {frac:.0%} of page reads ({saved_tokens} tokens)"


def env_cascade(fn: str) -> bool | None:
    """``PAGED_DECODE_CASCADE``: ``"1"`` forces cascade on, ``"0"`` off, unset/empty auto."""
    val = os.environ.get(CASCADE_ENV, "").strip()
    if val == "":
        return None
    if val not in ("0", "1"):
        raise InvalidArgumentError(f"{fn}: {CASCADE_ENV} must be 0 or 1, got {val!r}")
    return val == "1"


def resolve_cascade(fn: str, cascade: Any, path: str, table: PageTable, num_qo_heads: int,
                    num_kv_heads: int, head_dim: int, device: Any
                    ) -> tuple[CascadeDecodePlan | None, str | None]:
    """Decide whether ``decode`` runs cascade; returns ``(plan or None, reason or None)``.

    ``cascade``: ``True``/``False`` force (the argument beats the environment), a
    ``CascadePlan``/``CascadeDecodePlan`` forces that grouping, ``None`` follows
    ``PAGED_DECODE_CASCADE`` and otherwise the automatic rule (only for ``path="auto"``).
    ``device`` is a callable returning the ``DeviceInfo`` (called only when planning).
    """
    geo = (num_qo_heads, num_kv_heads, head_dim)
    if isinstance(cascade, CascadeDecodePlan):
        if (cascade.num_qo_heads, cascade.num_kv_heads, cascade.head_dim) != geo \
                or not cascade.prefix.matches(table):
            raise InvalidArgumentError(f"{fn}: cascade plan was made for another table or "
                                       f"geometry (Hq, Hkv, D) = {geo}")
        forced: bool | None = True
    elif isinstance(cascade, CascadePlan):
        if not cascade.matches(table):
            raise InvalidArgumentError(f"{fn}: cascade plan was made for another table")
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
    prefix = _memoised(table, "detect", lambda: detect_shared_prefix(table))
    if prefix is None:
        return None, "cascade: no shared prefix"
    if not forced:
        pays, why = cascade_pays(prefix)
        if not pays:
            return None, f"cascade declined: {why}"
    else:
        why = "forced " + ("(argument)" if cascade else f"({CASCADE_ENV}=1)")
    dev = device()
    key = ("plan", geo, dev, os.environ.get(TARGET_ENV), os.environ.get(CHUNK_ENV))
    cplan = _memoised(table, key, lambda: plan_cascade(table, *geo, prefix=prefix, device=dev))
    return cplan, why
