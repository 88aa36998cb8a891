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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends import Backend, Problem, backend_for, c_contiguous
from .cascade import CascadeDecodePlan, run_cascade
from .dtypes import check_dtype, expect_dtype
from .errors import (
    UnsupportedProblemError,
    check_bool,
    check_choice,
    check_ndim,
    check_number,
    check_shape,
    check_type,
    fail,
)
from .outcome import DecodeOutcome, record
from .page_table import PageTable
from .plan import DecodePlan, plan_decode

PATHS = ("auto", "v2", "v1", "gather")
#: environment settings that steer the path a call takes (part of the fast-path key)
_PATH_ENVS = ("PAGED_DECODE_CASCADE", "PAGED_DECODE_CROSSOVER", "PAGED_DECODE_STAGES",
              "PAGED_DECODE_V2_ROW_LOADS")


def choose_path(backend: Backend, table: PageTable, plan: DecodePlan) -> tuple[str, str]:
    """The path ``path="auto"`` takes, and why (one place for the policy): the best path
    of the nearest cell of the device's measured crossover table
    (``paged_decode.crossover``), v2 when the device has no table."""
    single = backend.auto_path()  # a backend with one arm (MLX without Metal: gather)
    if single is not None:
        return single
    from .crossover import table_for
    name = backend.device_info().name
    xt = table_for(name)
    if xt is None:
        return "v2", f"auto: v2 (no crossover table for {name!r})"
    ctx = table.total_visible / max(1, table.batch_size)
    best, cell = xt.choose(table.batch_size, ctx, table.page_size,
                           plan.num_qo_heads // plan.num_kv_heads)
    return best, (f"auto: {best} was fastest at the nearest measured cell (B{cell.batch} "
                  f"ctx{cell.context} ps{cell.page_size} G{cell.group}) of "
                  f"{Path(xt.source).name}")


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
        out: optional ``[B, Hq, D]`` output to write (dtype ``out_dtype``). On MLX
            (immutable arrays) ``out`` must be an MLX array; it is rebound to the result
            (``out[...] = result``) rather than written, so it saves no allocation.
        lse: optional ``[B, Hq]`` float32 buffer for the log-sum-exp (same rule).
        return_lse: also return the ``[B, Hq]`` float32 LSE, **base 2** of the scaled
            logits (``log2 sum_t exp2(sm_scale * log2(e) * q.k_t)``); ``-inf`` for a
            request with no visible tokens (whose output is zeros); NaN, with a NaN
            output row, for a head with a non-finite visible score (docs/concepts.md).
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

    With a plan and ``out`` given (and ``lse`` when ``return_lse``), the first v2 or v1
    call prepares the call (``prepare_decode``) and later calls with the *same objects*
    (and settings) replay it without re-validating: an engine's steady state costs a
    dictionary lookup and the launches. Such calls allocate nothing and copy nothing to
    the device after the first one on a stream (the merge workspace is kept per plan and
    stream), so they can be captured in a CUDA graph. The cache
    (``paged_decode.prepared.decode_cache``, 8 entries, least recently used first out)
    keeps the arrays of its entries alive; ``decode_cache.clear()`` releases them.
    """
    return run_decode("decode", q, k_pages, v_pages, table, plan, path=path,
                      sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse,
                      out_dtype=out_dtype, backend=backend, cascade=cascade)


def run_decode(fn: str, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
               plan: DecodePlan | None = None, *, path: str, sm_scale: float | None,
               out: Any, lse: Any, return_lse: bool, out_dtype: str | None,
               backend: str | Backend | None, cascade: Any) -> Any:
    """``decode`` for the public function ``fn`` (``decode``, ``cascade_decode``): its
    errors name ``fn``."""
    be = backend_for(backend, q, fn=fn)
    fast_key = None
    arrays = (q, k_pages, v_pages, out, lse)
    if (out is not None and (lse is not None or not return_lse) and not be.functional_outputs
            and ((plan is not None and (cascade is None or cascade is False))
                 or isinstance(cascade, CascadeDecodePlan))):
        # an engine's steady state (same buffers, table and plan every step): replay the
        # launches prepared on the first such call instead of re-validating and re-packing
        from .prepared import decode_cache
        fast_key = (id(q), id(k_pages), id(v_pages), id(table), id(plan), id(out), id(lse),
                    return_lse, path, sm_scale, out_dtype, cascade, id(be),
                    be.stream_key(q), *(os.environ.get(e) for e in _PATH_ENVS))
        try:
            prepared = decode_cache.get(fast_key, arrays)
        except TypeError:   # an unhashable argument: never cached, the checks below say why
            prepared = fast_key = None
        if prepared is not None:
            return prepared()
    a = check_call(fn, be, q, k_pages, v_pages, table, path=path, sm_scale=sm_scale,
                   out_dtype=out_dtype, return_lse=return_lse)
    single = be.auto_path() if path == "auto" else None  # no automatic cascade there
    run_as = single[0] if single else path
    cc, why_cascade = cascade_call(fn, be, a, cascade, run_as, q, out, lse)
    if cc is not None:
        with be.launch_context(q):
            run_cascade(be, a.q, a.k, a.v, cc.plan, a.scale, cc.out, cc.lse)
        record(cc.outcome)
        if fast_key is not None and cc.tensor_cores and be.merge_gathers:
            from .prepared import PreparedCascade, decode_cache
            decode_cache.put(fast_key, (be, table, cascade), arrays,
                             PreparedCascade(be, a, cc, out, lse, return_lse, q))
        return _results(be, q, out, lse, cc.out, cc.lse, return_lse)
    want_lse = return_lse or lse is not None
    if a.b == 0:
        return _empty_batch(fn, be, a, plan, "v2" if run_as == "auto" else run_as, q, out,
                            lse, want_lse, return_lse)
    plan, chosen, reason, out_a, lse_a = flat_call(fn, be, a, plan, path, q, out, lse,
                                                   want_lse)
    with be.launch_context(q):
        ran = run_path(be, a, plan, chosen, out_a, lse_a)
    if why_cascade:
        reason = f"{reason}; {why_cascade}"
    record(DecodeOutcome(ran, be.name, a.b, table.total_visible,
                         plan.num_chunks if ran.startswith("v2") else a.b, reason))
    if fast_key is not None and chosen in ("v2", "v1"):
        from .prepared import PreparedDecode, decode_cache
        decode_cache.put(fast_key, (be, table, plan), arrays,
                         PreparedDecode(be, a, plan, chosen, reason, out,
                                        lse if want_lse else None, out_a, lse_a,
                                        return_lse, q))
    return _results(be, q, out, lse, out_a, lse_a, return_lse)


@dataclass(frozen=True)
class CallArgs:
    """A validated decode call: backend arrays, geometry, dtypes and the scale."""

    q: Any
    k: Any
    v: Any
    table: PageTable
    b: int
    hq: int
    hkv: int
    d: int
    p: int
    q_dt: str
    kv_dt: str
    o_dt: str
    scale: float


def check_call(fn: str, be: Backend, q: Any, k_pages: Any, v_pages: Any, table: PageTable, *,
               path: str, sm_scale: float | None, out_dtype: str | None,
               return_lse: bool) -> CallArgs:
    """Validate a decode call's arrays, table, path, scale and flags (errors name ``fn``)."""
    qa, ka, va = (be.array_arg(fn, n, x) for n, x in (("q", q), ("k_pages", k_pages),
                                                        ("v_pages", v_pages)))
    check_type(fn, "table", table, PageTable, "a PageTable")
    check_ndim(fn, "q", qa.shape, 3, "[B, Hq, D]", "Hq D")
    check_ndim(fn, "k_pages", ka.shape, 4, "[num_pages, P, Hkv, D]", "P Hkv D")
    b, hq, d = (int(x) for x in qa.shape)
    num_pages, p, hkv, dk = (int(x) for x in ka.shape)
    check_shape(fn, "q", qa.shape, (table.batch_size, hq, dk), "[B, Hq, D]")
    check_shape(fn, "v_pages", va.shape, ka.shape, "[num_pages, P, Hkv, D]")
    if p != table.page_size:
        raise fail(fn, f"k_pages page size (axis 1) must equal table.page_size = "
                       f"{table.page_size}, got {p}")
    if hq % hkv:
        raise fail(fn, f"q's heads must be a multiple of k_pages' KV heads, got Hq = {hq} "
                       f"and Hkv = {hkv}")
    if table.max_page_id >= num_pages:
        raise fail(fn, f"table references page {table.max_page_id}, but k_pages has only "
                       f"{num_pages} pages")
    for name, arr in (("q", qa), ("k_pages", ka), ("v_pages", va)):
        if not c_contiguous(arr):
            raise fail(fn, f"{name} must be C-contiguous (row-major)")
    q_dt = check_dtype(fn, "q", be.dtype_of(qa))
    kv_dt = check_dtype(fn, "k_pages", be.dtype_of(ka))
    if check_dtype(fn, "v_pages", be.dtype_of(va)) != kv_dt:
        raise fail(fn, f"v_pages must have k_pages' dtype {kv_dt}, got {be.dtype_of(va)}")
    o_dt = check_dtype(fn, "out_dtype", q_dt if out_dtype is None else out_dtype)
    check_choice(fn, "path", path, PATHS)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else check_number(fn, "sm_scale", sm_scale)
    check_bool(fn, "return_lse", return_lse)
    return CallArgs(qa, ka, va, table, b, hq, hkv, d, p, q_dt, kv_dt, o_dt, scale)


def resolve_plan(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None,
                 like: Any) -> DecodePlan:
    """``plan`` checked against the call, or a fresh plan for ``like``'s device."""
    if plan is None:
        with be.launch_context(like):  # the device of q, for its SM count
            return plan_decode(a.table, a.hq, a.hkv, a.d, device=be.device_info())
    check_type(fn, "plan", plan, DecodePlan, "a DecodePlan")
    plan.check(fn, a.table, a.hq, a.hkv, a.d)
    return plan


def flat_call(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None, path: str,
              like: Any, out: Any, lse: Any, want_lse: bool
              ) -> tuple[DecodePlan, str, str, Any, Any]:
    """The set-up of a flat (non-cascade) call, shared by ``decode`` and ``prepare_decode``:
    the plan (checked or made), the path and why, the support check, and the output
    buffers ``out [B, Hq, D]`` and ``lse [B, Hq]`` float32 (``None`` when the gather path
    needs no LSE). Returns ``(plan, path, reason, out, lse)``."""
    if a.b == 0:   # decode returns empty arrays (``_empty_batch``); no plan fits no requests
        raise fail(fn, "the table has no requests (B = 0): there is nothing to prepare")
    plan = resolve_plan(fn, be, a, plan, like)
    chosen, reason = choose_path(be, a.table, plan) if path == "auto" else (path, "requested")
    check_support(fn, be, a, chosen)
    with be.launch_context(like):
        out_a = output_buffer(fn, be, "out", out, (a.b, a.hq, a.d), a.o_dt)
        lse_a = output_buffer(fn, be, "lse", lse, (a.b, a.hq), "float32") \
            if want_lse or chosen != "gather" else None
    return plan, chosen, reason, out_a, lse_a


@dataclass(frozen=True)
class CascadeCall:
    """A cascade call set up for running: the ``CascadeDecodePlan``, the output buffers
    ``out [B, Hq, D]`` and ``lse [B, Hq]`` float32 (base 2), whether level 0 runs on the
    tensor-core prefix kernel, and the outcome a run records."""

    plan: Any
    out: Any
    lse: Any
    tensor_cores: bool
    outcome: DecodeOutcome


def cascade_call(fn: str, be: Backend, a: CallArgs, cascade: Any, path: str, like: Any,
                 out: Any, lse: Any) -> tuple[CascadeCall | None, str | None]:
    """The set-up of a cascade call, shared by ``decode`` and ``prepare_decode``: whether
    to run cascade (``cascade_policy.resolve_cascade``), the support check of its level 0,
    the output buffers and the outcome. Returns ``(call or None, reason or None)``; with
    ``None`` the caller runs the flat decode and appends the reason to its own."""
    from .cascade import TC_LEVEL0, V2_LEVEL0, tc_level0_applies
    from .cascade_policy import resolve_cascade

    def device() -> Any:
        with be.launch_context(like):
            return be.device_info()

    cplan, why = resolve_cascade(fn, cascade, path, a.table, a.hq, a.hkv, a.d, device,
                                 (a.q_dt, a.kv_dt))
    if cplan is None:
        return None, why
    sup = be.supports(Problem(a.q_dt, a.kv_dt, a.hq * cplan.prefix.num_members, a.hkv, a.d,
                              a.p, "v2"))
    if not sup:
        raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run the cascade's "
                                      f"level 0: {sup.reason}")
    with be.launch_context(like):
        out_a = output_buffer(fn, be, "out", out, (a.b, a.hq, a.d), a.o_dt)
        lse_a = output_buffer(fn, be, "lse", lse, (a.b, a.hq), "float32")
    tc = tc_level0_applies(be, cplan, a.q_dt, a.kv_dt)
    outcome = DecodeOutcome("cascade", be.name, a.b, a.table.total_visible,
                            cplan.num_partials, f"cascade: {why}",
                            f"{cplan.prefix.describe()}; level 0: "
                            f"{TC_LEVEL0 if tc else V2_LEVEL0}")
    return CascadeCall(cplan, out_a, lse_a, tc, outcome), why


def check_support(fn: str, be: Backend, a: CallArgs, path: str) -> None:
    sup = be.supports(Problem(a.q_dt, a.kv_dt, a.hq, a.hkv, a.d, a.p, path))
    if not sup:
        raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run path {path!r}: "
                                      f"{sup.reason}")


def run_path(be: Backend, a: CallArgs, plan: DecodePlan, path: str, out_a: Any,
             lse_a: Any) -> str:
    """Launch ``path`` (``"v2"``, ``"v1"`` or ``"gather"``) into ``out_a`` / ``lse_a``
    (inside the backend's launch context); returns the path that ran."""
    if path == "v2":
        if plan.needs_merge:
            v_part, lse_part = be.workspace(plan)
            be.partial(a.q, a.k, a.v, a.table, plan, a.scale, v_part, lse_part)
            be.merge(v_part, lse_part, plan.o_indptr, out_a, lse_a)
            return "v2+merge"
        be.partial(a.q, a.k, a.v, a.table, plan, a.scale, out_a, lse_a)
        return "v2"
    if path == "v1":
        be.decode_v1(a.q, a.k, a.v, a.table, a.scale, out_a, lse_a)
        return "v1"
    be.gather_sdpa(a.q, a.k, a.v, a.table, a.scale, out_a, lse_a)
    return "gather"


def _empty_batch(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None, path: str,
                 like: Any, out: Any, lse: Any, want_lse: bool, return_lse: bool) -> Any:
    """A batch without requests: the checks a real call makes (a given plan, the path's
    support, the output buffers), then empty results ``[0, Hq, D]`` and ``[0, Hq]``."""
    if plan is not None:
        resolve_plan(fn, be, a, plan, like)
    check_support(fn, be, a, path)
    with be.launch_context(like):
        out_a = output_buffer(fn, be, "out", out, (0, a.hq, a.d), a.o_dt)
        lse_a = output_buffer(fn, be, "lse", lse, (0, a.hq), "float32") if want_lse else None
    record(DecodeOutcome("empty", be.name, 0, 0, 0, "empty batch (B = 0): nothing to run"))
    return _results(be, like, out, lse, out_a, lse_a, return_lse)


def _results(be: Backend, q: Any, out: Any, lse: Any, out_a: Any, lse_a: Any,
             return_lse: bool) -> Any:
    result = be.wrap_result(out_a, like=q) if out is None else out
    if not return_lse:
        return result
    return result, (be.wrap_result(lse_a, like=q) if lse is None else lse)


def output_buffer(fn: str, be: Backend, name: str, given: Any, shape: tuple[int, ...],
                  dtype: str) -> Any:
    """``given`` checked (shape, dtype, contiguity) as the backend's array, or a fresh one."""
    if given is None:
        return be.empty(shape, dtype)
    if be.functional_outputs and not be.owns(given):  # MLX: the result rebinds `given`
        raise fail(fn, f"{name} must be an array of backend {be.name!r} (it receives the "
                       f"result by rebinding), got {type(given).__module__}."
                       f"{type(given).__name__}")
    arr = be.array_arg(fn, name, given)
    check_shape(fn, name, arr.shape, shape, "[B, Hq, D]" if len(shape) == 3 else "[B, Hq]")
    expect_dtype(fn, name, be.dtype_of(arr), dtype)
    if not c_contiguous(arr):
        raise fail(fn, f"{name} must be C-contiguous")
    if not getattr(getattr(arr, "flags", None), "writeable", True):   # numpy read-only
        raise fail(fn, f"{name} must be writable, got a read-only array")
    return arr


__all__ = ["decode", "run_decode", "choose_path", "PATHS", "CallArgs", "check_call", "resolve_plan",
           "check_support", "flat_call", "run_path", "output_buffer"]
