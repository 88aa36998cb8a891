"""The decode entry points: one query token per request attends over its pages.

``decode`` validates, plans when no plan is given, allocates outputs and workspaces
through the backend, runs one of four paths and records what it ran (the steps live in
``paged_decode.call``):

- ``"v2"``: the split-KV partial kernel (``[C, Hq, D]`` normalized partials and
  ``[C, Hq]`` base-2 LSEs), then the variable-length merge over ``plan.o_indptr``; when
  every request has one chunk the partial writes the output directly.
- ``"v2tc"``: the same split and merge with the tensor-core partial (CUDA ``mma.sync``,
  Metal ``simdgroup_matrix``; float16 / bfloat16 q, pools in its dtype or fp8;
  ``kernels/decode_v2_tc.py``); ``"auto"`` takes it where the device's measured
  crossover table says it is faster, and over fp8 pools wherever it runs
  (``call.choose_path``).
- ``"v1"``: one CTA per (request, query head), split inside the CTA (comparison arm).
- ``"gather"``: gather visible K/V contiguously, then dense attention (fallback arm).

With ``cascade`` (or ``PAGED_DECODE_CASCADE=1``) a batch whose requests share prefix pages
runs the cascade of ``paged_decode.cascade`` on the v2 kernels instead;
``cascade_decode`` asks for it explicitly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import settings
from .backends import Backend, backend_for
from .call import (
    LAUNCH_PATHS,
    CallArgs,
    Table,
    cascade_call,
    check_call,
    empty_batch,
    flat_call,
    results,
    run_path,
)
from .cascade import CascadeDecodePlan, CascadePlan, run_cascade
from .errors import InvalidArgumentError
from .multitoken_call import counts_key, multitoken_call, refuse_cascade
from .outcome import DecodeOutcome, record
from .plan import DecodePlan
from .prepared import PreparedCascade, PreparedDecode, PreparedMultiToken, decode_cache
from .step_table import StepTable


def decode(q: Any, k_pages: Any, v_pages: Any, table: Table, plan: DecodePlan | None = None,
           *, path: str = "auto", sm_scale: float | None = None, out: Any = None,
           lse: Any = None, return_lse: bool = False, out_dtype: str | None = None,
           backend: str | Backend | None = None, cascade: Any = None, window_left: int = -1,
           logits_soft_cap: float | None = None, sinks: Any = None,
           qo_indptr: Any = None, kv_dtype: str | None = None, k_scale: Any = None,
           v_scale: Any = None) -> Any:
    """Paged decode attention for one query token per request, or 1-8 (multi-token).

    Args:
        q: ``[B, Hq, D]`` queries (float16, bfloat16 or float32); multi-token
            (``docs/multi-token.md``): ``[B, T, Hq, D]`` (``T`` tokens per request,
            ``1 <= T <= 8``) or a flat ``[N, Hq, D]`` with ``qo_indptr``. The table must
            already hold the new tokens (appended before they are decoded, as engines do
            for speculative verification): token ``t`` of ``T`` of a request with ``L``
            visible tokens sees positions ``< L - T + t + 1``; a window ends at each
            token's own position. Outputs are shaped like ``q`` (``lse`` without ``D``).
        k_pages, v_pages: ``[num_pages, P, Hkv, D]`` page pools (same shape and dtype).
        table: the batch's ``PageTable`` (``B`` requests, page size ``P``).
        plan: a ``DecodePlan`` for this table and geometry (made here when ``None``).
        path: ``"auto"``, ``"v2"``, ``"v2tc"`` (the tensor-core v2 partial: CUDA or
            Metal, float16 / bfloat16 q with pools in its dtype or fp8, at most 32 query
            heads per KV head; ``"auto"`` takes it where the device's crossover table has
            it fastest; it runs the window, soft cap and sinks as v2 does), ``"v1"`` or
            ``"gather"``.
        sm_scale: softmax scale in natural units (default ``1 / sqrt(D)``); the kernels
            scale scores by it (times an fp8 pool's ``k_scale``) times log2 e in float32,
            so its magnitude must stay below about 2.36e38.
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
        window_left: sliding window: each request attends to its last
            ``window_left + 1`` visible tokens (``-1``, the default: all); pages wholly
            before the window are neither planned nor read. A given ``plan`` must be made
            with the same ``window_left`` (``plan_decode(..., window_left=W)``).
        logits_soft_cap: ``None`` or ``c > 0``: scores ``s = sm_scale * q.k`` become
            ``c * tanh(s / c)`` before the softmax (the LSE is of the capped scores).
        sinks: ``None`` or a float32 ``[Hq]`` array of the call's backend: a learned logit
            per query head (natural-log units) that joins the softmax denominator with no
            value; the returned LSE includes it, and a request with no visible token gives
            zeros and the sink's LSE (``docs/variants.md``).
        qo_indptr: ``None``, or a host integer ``[B+1]`` array for a flat multi-token
            ``q [N, Hq, D]``: request ``r``'s tokens are rows ``qo_indptr[r]:qo_indptr[r+1]``
            (1 to 8 each, summing to ``N``). A given ``plan`` must be made with
            ``plan_decode(..., query_tokens=T)`` for ``T`` at least the most tokens of a
            request. Multi-token calls run on v2, v2tc (``T x G <= 32``), v1 and gather,
            not on cascade; with a plan and ``out`` they are replayed like one-token calls
            (below; keyed by ``qo_indptr``'s content, not for step tables), eagerly: the
            fold and the merge are array ops, not recorded launches.
        kv_dtype: ``None``, or the fp8 format (``"float8_e4m3fn"``, ``"float8_e5m2"``) of
            pools held as ``uint8`` arrays (CuPy and MLX have no fp8 dtype); pools of an
            fp8 dtype (``ml_dtypes``, torch) name their format themselves.
        k_scale, v_scale: the layer's float32 K and V scales of fp8 pools (required with
            them, refused otherwise): ``read = stored * scale`` (``docs/fp8.md``).

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
                      out_dtype=out_dtype, backend=backend, cascade=cascade,
                      window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks,
                      qo_indptr=qo_indptr, kv_dtype=kv_dtype, k_scale=k_scale,
                      v_scale=v_scale)


def run_decode(fn: str, q: Any, k_pages: Any, v_pages: Any, table: Table,
               plan: DecodePlan | None = None, *, path: str, sm_scale: float | None,
               out: Any, lse: Any, return_lse: bool, out_dtype: str | None,
               backend: str | Backend | None, cascade: Any, window_left: Any = -1,
               logits_soft_cap: Any = None, sinks: Any = None, qo_indptr: Any = None,
               kv_dtype: Any = None, k_scale: Any = None, v_scale: Any = None) -> Any:
    """``decode`` for the public function ``fn`` (``decode``, ``cascade_decode``): its
    errors name ``fn``."""
    conf = settings.snapshot()     # every PAGED_DECODE_* setting, read once for the call
    with settings.bound(conf):
        be = backend_for(backend, q, fn=fn)
        return _run_decode(fn, be, conf, q, k_pages, v_pages, table, plan, path=path,
                           sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse,
                           out_dtype=out_dtype, cascade=cascade,
                           variants={"window_left": window_left,
                                     "logits_soft_cap": logits_soft_cap, "sinks": sinks,
                                     "kv_dtype": kv_dtype, "k_scale": k_scale,
                                     "v_scale": v_scale},
                           qo_indptr=qo_indptr)


def _run_decode(fn: str, be: Backend, conf: settings.Settings, q: Any, k_pages: Any,
                v_pages: Any, table: Table, plan: DecodePlan | None, *, path: str,
                sm_scale: float | None, out: Any, lse: Any, return_lse: bool,
                out_dtype: str | None, cascade: Any, variants: dict[str, Any],
                qo_indptr: Any = None) -> Any:
    fast_key = None
    sinks = variants["sinks"]
    arrays = (q, k_pages, v_pages, out, lse, sinks)
    one_token = qo_indptr is None and len(getattr(q, "shape", ())) != 4
    # a multi-token call is keyed by its counts' content (a host array may be rewritten
    # in place); it reads a step table's host view, so step tables are not cached for it
    tokens_key = None if one_token else counts_key(qo_indptr)
    # a scale given as an array or tensor can change in place (calibrated scales): its
    # value is read by the checks, so such a call is never replayed from the cache
    number_scales = (isinstance(variants["k_scale"], _NUMBER_SCALE)
                     and isinstance(variants["v_scale"], _NUMBER_SCALE))
    # arrays only: a list accepted for q or sinks has no layout for a hit to compare
    # (and would fail the cache's bookkeeping after the launches wrote `out`)
    if ((one_token or (tokens_key is not None and not isinstance(table, StepTable)))
            and number_scales and out is not None and (lse is not None or not return_lse)
            and all(x is None or hasattr(x, "shape") for x in arrays)
            and not be.functional_outputs
            and ((plan is not None and (cascade is None or cascade is False))
                 or isinstance(cascade, CascadeDecodePlan))):
        # an engine's steady state (same buffers, table and plan every step): replay the
        # launches prepared on the first such call instead of re-validating and re-packing
        if isinstance(table, StepTable) and table.backend is be:
            # the pool changed the batch: the device copy follows, on q's stream; a
            # prepared call stays valid while its buffers do (the layout), or, where the
            # kernels read the host view, while the table does (the version)
            if table.pending:
                with be.launch_context(q):
                    table.update_device()
            # (a cascade plan's level tables are host data of one version)
            table_key: Any = (id(table), table.layout if be.reads_step_tables
                              and not isinstance(cascade, CascadeDecodePlan)
                              else table.version)
        else:
            table_key = id(table)
        # scalars with their types: True == 1 == 1.0 as keys, but the checks refuse a
        # bool or float window_left, a non-bool return_lse, ...
        fast_key = (id(q), id(k_pages), id(v_pages), table_key, id(plan), id(out), id(lse),
                    _typed(return_lse), path, _typed(sm_scale), out_dtype, _typed(cascade),
                    id(be), be.stream_key(q), conf, _typed(variants["window_left"]),
                    _typed(variants["logits_soft_cap"]), id(sinks), variants["kv_dtype"],
                    _typed(variants["k_scale"]), _typed(variants["v_scale"]), tokens_key)
        try:
            prepared = decode_cache.get(fast_key, arrays)
        except TypeError:   # an unhashable argument: never cached, the checks below say why
            prepared = fast_key = None
        if prepared is not None:
            if isinstance(table, StepTable) and isinstance(plan, DecodePlan):
                plan.check(fn, table, plan.num_qo_heads, plan.num_kv_heads, plan.head_dim)
            return prepared()
    want_lse = return_lse or lse is not None
    with be.launch_context(q):        # the device and stream of q, entered once
        a = check_call(fn, be, q, k_pages, v_pages, table, path=path, sm_scale=sm_scale,
                       out_dtype=out_dtype, return_lse=return_lse, qo_indptr=qo_indptr,
                       **variants)
        if a.tokens is not None:
            return _multitoken(fn, be, a, plan, path, cascade, q, out, lse, return_lse,
                               (fast_key, (be, table, plan), arrays))
        single = be.auto_path() if path == "auto" else None  # no automatic cascade there
        run_as = single[0] if single else path
        cc, why_cascade = cascade_call(fn, be, a, cascade, run_as, out, lse)
        if cc is not None:
            run_cascade(be, a.q, a.k, a.v, cc.plan, a.scale, cc.out, cc.lse, a.variant)
        elif a.b == 0:   # B = 0: nothing to window either
            return empty_batch(fn, be, a, plan, "v2" if run_as == "auto" else run_as, q,
                               out, lse, want_lse, return_lse)
        else:
            fplan, chosen, reason, out_a, lse_a = flat_call(fn, be, a, plan, path, out, lse,
                                                            want_lse)
            ran = run_path(be, a, fplan, chosen, out_a, lse_a)
    if cc is not None:
        record(cc.outcome)
        if fast_key is not None and cc.tensor_cores and be.merge_gathers:
            decode_cache.put(fast_key, (be, table, cascade), arrays,
                             PreparedCascade(be, a, cc, out=out, lse=lse,
                                             return_lse=return_lse, like=q))
        return results(be, q, out, lse, cc.out, cc.lse, return_lse)
    if why_cascade:
        reason = f"{reason}; {why_cascade}"
    record(DecodeOutcome(ran, be.name, a.b, a.table.total_visible,
                         fplan.num_chunks if ran.startswith("v2") else a.b, reason,
                         a.variant.describe()))
    if fast_key is not None and chosen in LAUNCH_PATHS:
        decode_cache.put(fast_key, (be, table, fplan), arrays,
                         PreparedDecode(be, a, fplan, path=chosen, reason=reason, out=out,
                                        lse=lse if want_lse else None, out_a=out_a,
                                        lse_a=lse_a, return_lse=return_lse, like=q))
    return results(be, q, out, lse, out_a, lse_a, return_lse)


#: the scale types a fast-path key may hold: values that cannot change in place
_NUMBER_SCALE = (type(None), int, float, np.generic)


def _typed(x: Any) -> tuple[type, Any]:
    return type(x), x


def _multitoken(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None, path: str,
                cascade: Any, q: Any, out: Any, lse: Any, return_lse: bool,
                cache: tuple[Any, Any, Any]) -> Any:
    """A multi-token call (``multitoken_call``), inside the launch context; with a
    fast-path key in ``cache`` (``(key, refs, arrays)``) it is kept as a prepared call."""
    refuse_cascade(fn, cascade)
    if a.b == 0:
        lead = (0, int(q.shape[1])) if len(q.shape) == 4 else (0,)
        return empty_batch(fn, be, a, None, "v2" if path == "auto" else path, q, out, lse,
                           return_lse or lse is not None, return_lse, lead)
    mt = multitoken_call(fn, be, a, plan, path, out, lse)
    mt.run()
    record(mt.outcome)
    key, refs, arrays = cache
    if key is not None:
        decode_cache.put(key, refs, arrays, PreparedMultiToken(
            be, mt, out=out, lse=lse if (return_lse or lse is not None) else None,
            return_lse=return_lse, like=q))
    return results(be, q, out, lse, mt.out, mt.lse, return_lse)


def cascade_decode(q: Any, k_pages: Any, v_pages: Any, table: Table, *,
                   sm_scale: float | None = None, out: Any = None, lse: Any = None,
                   return_lse: bool = False, out_dtype: str | None = None,
                   backend: Any = None,
                   cascade_plan: CascadePlan | CascadeDecodePlan | None = None,
                   window_left: int = -1, logits_soft_cap: float | None = None,
                   sinks: Any = None, kv_dtype: str | None = None, k_scale: Any = None,
                   v_scale: Any = None) -> Any:
    """Decode with a shared prefix read once per group (``paged_decode.cascade``).

    Same arrays and results as ``decode`` (``q [B, Hq, D]``, pools ``[num_pages, P, Hkv,
    D]``, ``out [B, Hq, D]``, ``lse [B, Hq]`` float32 **base 2**). ``cascade_plan``: a
    ``detect_shared_prefix`` or ``plan_cascade`` result for this table (detected here when
    ``None``). Without a sharing group it runs flat v2 and records why
    (``last_outcome().reason``). ``window_left``, ``logits_soft_cap`` and ``sinks`` are
    ``decode``'s; with a window the sharing group is detected on the window table (a
    ``cascade_plan`` must be made for it: ``variants.window_table``), a soft cap runs
    level 0 on the v2 partial (the outcome says so) and sinks enter the final merge once.
    fp8 pools (``kv_dtype``, ``k_scale``, ``v_scale`` as for ``decode``) run level 0 on
    the v2 partial too (the tensor-core prefix kernel reads 16-bit pools only).
    """
    fn = "cascade_decode"
    if not (cascade_plan is None or isinstance(cascade_plan, (CascadePlan, CascadeDecodePlan))):
        raise InvalidArgumentError(f"{fn}: cascade_plan must be None, a CascadePlan or a "
                                   f"CascadeDecodePlan, got {type(cascade_plan).__name__}")
    return run_decode(fn, q, k_pages, v_pages, table, path="v2", sm_scale=sm_scale, out=out,
                      lse=lse, return_lse=return_lse, out_dtype=out_dtype, backend=backend,
                      cascade=True if cascade_plan is None else cascade_plan,
                      window_left=window_left, logits_soft_cap=logits_soft_cap, sinks=sinks,
                      kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)


__all__ = ["cascade_decode", "decode", "run_decode"]
