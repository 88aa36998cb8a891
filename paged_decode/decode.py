"""The decode entry point: one query token per request attends over its pages.

``decode`` validates, plans when no plan is given, allocates outputs and workspaces
through the backend, runs one of three paths and records what it ran:

- ``"v2"``: the split-KV partial kernel (``[C, Hq, D]`` normalized partials and
  ``[C, Hq]`` base-2 LSEs), then the variable-length merge over ``plan.o_indptr``; when
  every request has one chunk the partial writes the output directly.
- ``"v1"``: one CTA per (request, query head), split inside the CTA (comparison arm).
- ``"gather"``: gather visible K/V contiguously, then dense attention (fallback arm).

With ``cascade`` (or ``PAGED_DECODE_CASCADE=1``) a batch whose requests share prefix pages
runs the cascade of ``paged_decode.cascade`` on the v2 kernels instead.
"""

from __future__ import annotations

import math
from typing import Any

from .backends import Backend, Problem, backend_for
from .dtypes import check_dtype
from .errors import InvalidArgumentError, UnsupportedProblemError, check_ndim, check_shape
from .outcome import DecodeOutcome, record
from .page_table import PageTable
from .plan import DecodePlan, plan_decode

PATHS = ("auto", "v2", "v1", "gather")


def choose_path(backend: Backend, table: PageTable, plan: DecodePlan) -> tuple[str, str]:
    """The path ``path="auto"`` takes, and why (one place for the policy)."""
    return "v2", "auto: v2 is the default path (no crossover table for this device)"


def decode(q: Any, k_pages: Any, v_pages: Any, table: PageTable, plan: DecodePlan | None = None,
           *, path: str = "auto", sm_scale: float | None = None, out: Any = None,
           lse: Any = None, return_lse: bool = False, out_dtype: str | None = None,
           backend: str | Backend | None = None, cascade: Any = None) -> Any:
    """Paged decode attention for one query token per request.

    Args:
        q: ``[B, Hq, D]`` queries (float16, bfloat16 or float32).
        k_pages, v_pages: ``[num_pages, P, Hkv, D]`` page pools (same shape and dtype).
        table: the batch's ``PageTable`` (``B`` requests, page size ``P``).
        plan: a ``DecodePlan`` for this table and geometry (made here when ``None``).
        path: ``"auto"``, ``"v2"``, ``"v1"`` or ``"gather"``.
        sm_scale: softmax scale in natural units (default ``1 / sqrt(D)``).
        out: optional ``[B, Hq, D]`` output to write (dtype ``out_dtype``).
        lse: optional ``[B, Hq]`` float32 buffer for the log-sum-exp.
        return_lse: also return the ``[B, Hq]`` float32 LSE, **base 2** of the scaled
            logits (``log2 sum_t exp2(sm_scale * log2(e) * q.k_t)``); ``-inf`` for a
            request with no visible tokens (whose output is zeros).
        out_dtype: output dtype (default: ``q``'s).
        backend: backend name or instance; by default chosen from ``q``'s array kind.
        cascade: ``None`` (automatic: with ``path="auto"``, cascade when a shared prefix
            is found and the cost rule of ``cascade_policy.cascade_pays`` says it pays; its
            threshold was measured on the H200), ``True``/``False``
            force it on/off (``True`` still runs flat when nothing is shared), or a plan
            from ``detect_shared_prefix``/``plan_cascade``. ``PAGED_DECODE_CASCADE=0/1``
            forces off/on when the argument is ``None``. ``plan`` is unused by a cascade.

    Returns:
        ``out`` (``[B, Hq, D]``), or ``(out, lse)`` with ``return_lse``; arrays of the
        backend's kind (CUDA results come back as the caller's kind, e.g. torch).
    """
    fn = "decode"
    be = backend_for(backend, q)
    qa, ka, va = be.asarray(q), be.asarray(k_pages), be.asarray(v_pages)
    if not isinstance(table, PageTable):
        raise InvalidArgumentError(f"{fn}: table must be a PageTable, got {type(table).__name__}")
    check_ndim(fn, "q", qa.shape, 3, "[B, Hq, D]")
    check_ndim(fn, "k_pages", ka.shape, 4, "[num_pages, P, Hkv, D]")
    b, hq, d = (int(x) for x in qa.shape)
    num_pages, p, hkv, dk = (int(x) for x in ka.shape)
    check_shape(fn, "q", qa.shape, (table.batch_size, hq, dk), "[B, Hq, D]")
    check_shape(fn, "v_pages", va.shape, ka.shape, "[num_pages, P, Hkv, D]")
    if p != table.page_size:
        raise InvalidArgumentError(f"{fn}: k_pages page size (axis 1) must equal "
                                   f"table.page_size = {table.page_size}, got {p}")
    if hq % hkv:
        raise InvalidArgumentError(f"{fn}: q's heads must be a multiple of k_pages' KV heads, "
                                   f"got Hq = {hq} and Hkv = {hkv}")
    if table.max_page_id >= num_pages:
        raise InvalidArgumentError(f"{fn}: table references page {table.max_page_id}, but "
                                   f"k_pages has only {num_pages} pages")
    for name, arr in (("q", qa), ("k_pages", ka), ("v_pages", va)):
        if not _is_contiguous(arr):
            raise InvalidArgumentError(f"{fn}: {name} must be C-contiguous (row-major)")
    q_dt = check_dtype(fn, "q", be.dtype_of(qa))
    kv_dt = check_dtype(fn, "k_pages", be.dtype_of(ka))
    if check_dtype(fn, "v_pages", be.dtype_of(va)) != kv_dt:
        raise InvalidArgumentError(f"{fn}: v_pages must have k_pages' dtype {kv_dt}, "
                                   f"got {be.dtype_of(va)}")
    o_dt = check_dtype(fn, "out_dtype", out_dtype or q_dt)
    if path not in PATHS:
        raise InvalidArgumentError(f"{fn}: path must be one of {', '.join(PATHS)}, got {path!r}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale):
        raise InvalidArgumentError(f"{fn}: sm_scale must be finite, got {sm_scale!r}")
    from .cascade import run_cascade  # cascade imports this module
    from .cascade_policy import resolve_cascade

    def device() -> Any:
        with be.launch_context(q):
            return be.device_info()

    cplan, why_cascade = resolve_cascade(fn, cascade, path, table, hq, hkv, d, device)
    if cplan is not None:
        sup = be.supports(Problem(q_dt, kv_dt, hq * cplan.prefix.num_members, hkv, d, p, "v2"))
        if not sup:
            raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run the cascade's "
                                          f"level 0: {sup.reason}")
        with be.launch_context(q):
            out_a = _buffer(fn, be, "out", out, (b, hq, d), o_dt)
            lse_a = _buffer(fn, be, "lse", lse, (b, hq), "float32")
            run_cascade(be, qa, ka, va, cplan, scale, out_a, lse_a)
        record(DecodeOutcome("cascade", be.name, b, table.total_visible, cplan.num_partials,
                             f"cascade: {why_cascade}", cplan.prefix.describe()))
        return _results(be, q, out, lse, out_a, lse_a, return_lse)
    if plan is None:
        with be.launch_context(q):  # the device of q, for its SM count
            plan = plan_decode(table, hq, hkv, d, device=be.device_info())
    elif not isinstance(plan, DecodePlan):
        raise InvalidArgumentError(f"{fn}: plan must be a DecodePlan, got {type(plan).__name__}")
    else:
        plan.check(fn, table, hq, hkv, d)
    chosen, reason = choose_path(be, table, plan) if path == "auto" else (path, "requested")
    sup = be.supports(Problem(q_dt, kv_dt, hq, hkv, d, p, chosen))
    if not sup:
        raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run path {chosen!r}: "
                                      f"{sup.reason}")
    with be.launch_context(q):
        out_a = _buffer(fn, be, "out", out, (b, hq, d), o_dt)
        want_lse = return_lse or lse is not None
        lse_a = _buffer(fn, be, "lse", lse, (b, hq), "float32") \
            if want_lse or chosen != "gather" else None
        if chosen == "v2":
            if plan.needs_merge:
                v_part = be.empty((plan.num_chunks, hq, d), "float32")
                lse_part = be.empty((plan.num_chunks, hq), "float32")
                be.partial(qa, ka, va, table, plan, scale, v_part, lse_part)
                be.merge(v_part, lse_part, plan.o_indptr, out_a, lse_a)
                ran = "v2+merge"
            else:
                be.partial(qa, ka, va, table, plan, scale, out_a, lse_a)
                ran = "v2"
        elif chosen == "v1":
            be.decode_v1(qa, ka, va, table, scale, out_a, lse_a)
            ran = "v1"
        else:
            be.gather_sdpa(qa, ka, va, table, scale, out_a, lse_a)
            ran = "gather"
    if why_cascade:
        reason = f"{reason}; {why_cascade}"
    record(DecodeOutcome(ran, be.name, b, table.total_visible,
                         plan.num_chunks if ran.startswith("v2") else b, reason))
    return _results(be, q, out, lse, out_a, lse_a, return_lse)


def _results(be: Backend, q: Any, out: Any, lse: Any, out_a: Any, lse_a: Any,
             return_lse: bool) -> Any:
    result = be.wrap_result(out_a, like=q) if out is None else out
    if not return_lse:
        return result
    return result, (be.wrap_result(lse_a, like=q) if lse is None else lse)


def _buffer(fn: str, be: Backend, name: str, given: Any, shape: tuple[int, ...],
            dtype: str) -> Any:
    if given is None:
        return be.empty(shape, dtype)
    arr = be.asarray(given)
    check_shape(fn, name, arr.shape, shape, "[B, Hq, D]" if len(shape) == 3 else "[B, Hq]")
    got = check_dtype(fn, name, be.dtype_of(arr))
    if got != dtype:
        raise InvalidArgumentError(f"{fn}: {name} must have dtype {dtype}, got {got}")
    if not _is_contiguous(arr):
        raise InvalidArgumentError(f"{fn}: {name} must be C-contiguous")
    return arr


def _is_contiguous(arr: Any) -> bool:
    flags = getattr(arr, "flags", None)
    if flags is None:
        return True
    c = flags["C_CONTIGUOUS"] if not hasattr(flags, "c_contiguous") else flags.c_contiguous
    return bool(c)


__all__ = ["decode", "choose_path", "PATHS"]
