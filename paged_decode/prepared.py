"""Prepared decode calls: validate, plan and pack once, then launch with minimal host work.

An engine calls decode for every layer of every step with the same buffers and (for the
life of a batch composition) the same page table and plan. ``prepare_decode`` does all
the host work of ``decode`` once (argument checks, plan check, path choice, output and
workspace allocation, table and plan uploads, kernel compilation and argument packing)
and returns a ``PreparedDecode`` whose call only launches the kernels. The arrays are
bound: write the next step's queries into the same ``q`` (and new tokens into the same
pools) before calling again, exactly as a CUDA graph requires. ``cascade=`` prepares a
cascade decode (``PreparedCascade``): three launches when level 0 runs on the
tensor-core prefix kernel and the merge gathers (CUDA), else the host path on every call.

On CUDA the call is one or two ``cuLaunchKernel`` calls on the caller's current stream
(torch's for torch tensors), with no allocation, synchronization or host-to-device copy,
so it can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from . import settings
from .backends import Backend, backend_for
from .call import (
    LAUNCH_PATHS,
    SPLIT_PATHS,
    CallArgs,
    CascadeCall,
    Table,
    cascade_call,
    check_call,
    flat_call,
    returned,
    run_path,
)
from .cascade import run_cascade
from .errors import InvalidArgumentError, PlanMismatchError, check_writable, fail
from .fp8 import check_scale
from .multitoken_call import MultiTokenCall, counts_key, multitoken_call, refuse_cascade
from .outcome import DecodeOutcome, record
from .plan import DecodePlan
from .step_table import StepTable


class _PreparedCall:
    """What every prepared call does when called: launch (inside the backend's launch
    context when the launches are not pre-packed), record the outcome, return ``out``."""

    backend: Backend
    out: Any
    lse: Any
    outcome: DecodeOutcome
    _launch: Any
    _eager: bool
    _like: Any
    _return_lse: bool

    #: set by ``prepare_decode`` over a ``StepTable`` (``_follow_table``); ``None``:
    #: the table never changes, or the caller follows it itself (``DecodeStep``)
    _follow: _TableFollower | None = None
    #: ``(qo_indptr, counts_key(qo_indptr))`` of a multi-token call prepared with one: the
    #: split of the queries was made from those counts, so a call after an edit is refused
    _qo_indptr: tuple[Any, Any] | None = None

    @functools.cached_property
    def _host_outputs(self) -> tuple[tuple[str, Any], ...]:
        """The numpy arrays among ``out`` / ``lse``: the only kind with a writeable flag,
        so a call on a device backend checks none."""
        return tuple((n, x) for n, x in (("out", self.out), ("lse", self.lse))
                     if isinstance(x, np.ndarray))

    def __call__(self) -> Any:
        """Launch the decode; returns ``out`` (or ``(out, lse)`` if prepared with
        ``return_lse``)."""
        for name, x in self._host_outputs:      # numpy's flag can change after preparing
            check_writable(f"{type(self).__name__}()", name, x)
        qo = self._qo_indptr
        if qo is not None and counts_key(qo[0]) != qo[1]:
            raise InvalidArgumentError(
                f"{type(self).__name__}(): qo_indptr changed since prepare_decode, which "
                "split the queries by it once: prepare again (decode reads it per call)")
        f = self._follow
        if f is not None and f.behind():
            f.catch_up(self)
        if self._eager:
            with self.backend.launch_context(self._like):
                self._launch()
        else:
            self._launch()
        record(self.outcome)
        return (self.out, self.lse) if self._return_lse else self.out


class PreparedDecode(_PreparedCall):
    """A decode call with every argument bound; call it to launch (see the module doc).

    Attributes: ``path`` (what runs: ``"v2"``, ``"v2+merge"``, ``"v2tc"``, ``"v2tc+merge"``,
    ``"v1"`` or ``"gather"``),
    ``plan``, ``out`` (``[B, Hq, D]``, the caller's array kind), ``lse`` (``[B, Hq]``
    float32, base 2, or ``None``), ``outcome`` (recorded on every call).
    """

    def __init__(self, be: Backend, args: CallArgs, plan: DecodePlan, *, path: str,
                 reason: str, out: Any, lse: Any, out_a: Any, lse_a: Any,
                 return_lse: bool, like: Any) -> None:
        """``out``/``lse``: what every call returns (the caller's arrays or the allocated
        ones, ``lse`` ``None`` without an LSE); ``out_a``/``lse_a``: the backend arrays
        the launches write; ``like``: the array whose device and stream calls use."""
        self.backend, self.plan, self.args = be, plan, args
        self.out, self.lse = out, lse
        self._return_lse, self._like = return_lse, like

        def run() -> None:
            run_path(be, args, plan, path, out_a, lse_a)

        self._eager = path not in LAUNCH_PATHS       # gather: array ops, not launches
        self._launch = run if self._eager else be.compile_launches(run, like)
        self.path = f"{path}+merge" if path in SPLIT_PATHS and plan.needs_merge else path
        self.outcome = DecodeOutcome(
            self.path, be.name, args.b, args.table.total_visible,
            plan.num_chunks if self.path.startswith("v2") else args.b,
            f"{reason}; prepared call", args.variant.describe())


class PreparedCascade(_PreparedCall):
    """A cascade decode with every argument bound; call it to launch. Same attributes as
    ``PreparedDecode`` (``path`` is ``"cascade"``, ``plan`` the ``CascadeDecodePlan``).
    Three recorded launches (level 1, the tensor-core level 0, the gathering merge) where
    ``compiled``; otherwise every call runs ``run_cascade`` on the host path."""

    def __init__(self, be: Backend, args: CallArgs, call: CascadeCall, *, out: Any,
                 lse: Any, return_lse: bool, like: Any) -> None:
        self.backend, self.plan, self.args = be, call.plan, args
        self.out, self.lse, self.path = out, lse, "cascade"
        self._return_lse, self._like = return_lse, like

        def run() -> None:
            run_cascade(be, args.q, args.k, args.v, call.plan, args.scale, call.out, call.lse,
                        args.variant)

        self.compiled = be.merge_gathers and call.tensor_cores
        self._eager = not self.compiled
        self._launch = be.compile_launches(run, like) if self.compiled else run
        self.outcome = dataclasses.replace(call.outcome,
                                           reason=f"{call.outcome.reason}; prepared call")


class PreparedMultiToken(_PreparedCall):
    """A multi-token decode (``docs/multi-token.md``) with every argument bound: the
    checks, plan, causal split, index uploads and output buffers are done once; each call
    folds the queries, runs the common and pieces passes and the merge
    (``multitoken_call.MultiTokenCall.run``: array ops and launches on the call's stream,
    not recorded, so not capturable in a CUDA graph yet). Same attributes as
    ``PreparedDecode`` (``out`` / ``lse`` shaped like ``q``)."""

    def __init__(self, be: Backend, call: MultiTokenCall, *, out: Any, lse: Any,
                 return_lse: bool, like: Any) -> None:
        self.backend, self.plan, self.args = be, call.plan, call.a
        self.out, self.lse, self.path = out, lse, call.outcome.path
        self._return_lse, self._like = return_lse, like
        self._eager, self._launch = True, call.run
        self.outcome = dataclasses.replace(call.outcome,
                                           reason=f"{call.outcome.reason}; prepared call")


def prepare_decode(q: Any, k_pages: Any, v_pages: Any, table: Table,
                   plan: DecodePlan | None = None, *, path: str = "auto",
                   sm_scale: float | None = None, out: Any = None, lse: Any = None,
                   return_lse: bool = False, out_dtype: str | None = None,
                   backend: str | Backend | None = None,
                   cascade: Any = None, window_left: int = -1,
                   logits_soft_cap: float | None = None, sinks: Any = None,
                   qo_indptr: Any = None, kv_dtype: str | None = None, k_scale: Any = None,
                   v_scale: Any = None
                   ) -> PreparedDecode | PreparedCascade | PreparedMultiToken:
    """Prepare ``decode(q, k_pages, v_pages, table, plan, ...)`` for repeated launches.

    Arguments are ``decode``'s (shapes: ``q [B, Hq, D]``, pools
    ``[num_pages, P, Hkv, D]``, ``out [B, Hq, D]``, ``lse [B, Hq]`` float32 base 2).
    ``cascade``: ``None``/``False`` prepares a flat decode; ``True``, a ``CascadePlan`` or
    a ``CascadeDecodePlan`` a cascade (``PreparedCascade``; with ``True`` and no shared
    prefix, a flat decode). ``out`` and ``lse`` are allocated here when not given and
    returned by every call. The arrays stay bound to the prepared call: update them in
    place (``sinks`` too). ``window_left``, ``logits_soft_cap`` and ``sinks`` are
    ``decode``'s variants, fixed for the prepared call, and so are an fp8 pool's
    ``kv_dtype``, ``k_scale`` and ``v_scale`` (a scale given as a one-element array or
    tensor is read here, once: prepare again after changing it; ``decode`` reads it at
    every call; a step table's re-preparation keeps the value read here). A multi-token
    ``q`` (``[B, T, Hq, D]``, or ``[N, Hq, D]`` with ``qo_indptr``) prepares a
    ``PreparedMultiToken``; its split of the queries is made here from ``qo_indptr``, and a
    call after an in-place edit of ``qo_indptr`` is refused.

    Over a ``StepTable`` each call follows what the pool did to the batch since the last:
    the device table is brought up to date and ``plan`` checked against it (a plan that
    no longer fits raises ``PlanMismatchError``, as ``decode`` does; without a ``plan``
    the call plans again), and whatever the prepared call holds of the table's host view
    (cascade levels, a window table, the array-op backends' table, multi-token pieces) is
    prepared again, into the same ``out`` / ``lse``. On MLX (whose appends replace the
    pool's arrays) such a call raises once the pool has changed the batch: prepare again.
    """
    fn = "prepare_decode"
    kw = {"path": path, "sm_scale": sm_scale, "return_lse": return_lse,
          "out_dtype": out_dtype, "backend": backend, "cascade": cascade,
          "window_left": window_left, "logits_soft_cap": logits_soft_cap, "sinks": sinks,
          "qo_indptr": qo_indptr, "kv_dtype": kv_dtype, "k_scale": k_scale,
          "v_scale": v_scale}
    made = prepare_call(fn, q, k_pages, v_pages, table, plan, out=out, lse=lse, **kw)
    for name in ("k_scale", "v_scale"):
        if kw[name] is not None and not isinstance(kw[name], (int, float)):
            # read once, here (the call checked it): a remake over a changed step table
            # keeps this value, not the array's value of that moment
            kw[name] = check_scale(fn, name, kw[name])
    if qo_indptr is not None:
        made._qo_indptr = (qo_indptr, counts_key(qo_indptr))
    if isinstance(table, StepTable):

        def remake() -> Prepared:   # the same call on the table as it is now, same outputs
            return prepare_call(fn, q, k_pages, v_pages, table, plan, out=made.out,
                                lse=made.lse, **kw)

        made._follow = _TableFollower(fn, table, plan is not None, remake)
    return made


def prepare_call(fn: str, q: Any, k_pages: Any, v_pages: Any, table: Table,
                 plan: DecodePlan | None, *, path: str = "auto",
                 sm_scale: float | None = None, out: Any = None, lse: Any = None,
                 return_lse: bool = False, out_dtype: str | None = None,
                 backend: str | Backend | None = None, cascade: Any = None,
                 window_left: Any = -1, logits_soft_cap: Any = None, sinks: Any = None,
                 qo_indptr: Any = None, kv_dtype: Any = None, k_scale: Any = None,
                 v_scale: Any = None) -> Prepared:
    """``prepare_decode`` without following a step table (``DecodeStep`` follows its own
    table: it keys its prepared calls on the table's version or layout and checks its
    plan within the headroom)."""
    with settings.bound(settings.snapshot()):
        be = backend_for(backend, q, fn=fn)
        with be.launch_context(q):    # the device and stream of q, entered once
            made = _prepare(fn, be, q, k_pages, v_pages, table, plan, path=path,
                            sm_scale=sm_scale, out=out, lse=lse, return_lse=return_lse,
                            out_dtype=out_dtype, cascade=cascade,
                            variants={"window_left": window_left,
                                      "logits_soft_cap": logits_soft_cap, "sinks": sinks,
                                      "kv_dtype": kv_dtype, "k_scale": k_scale,
                                      "v_scale": v_scale},
                            qo_indptr=qo_indptr)
        kind, a, setup, bound = made
        if kind == "cascade":
            return PreparedCascade(be, a, setup, **bound)
        if kind == "multitoken":
            return PreparedMultiToken(be, setup, **bound)
        plan, chosen, reason, out_a, lse_a = setup
        return PreparedDecode(be, a, plan, path=chosen, reason=reason, out_a=out_a,
                              lse_a=lse_a, **bound)


def _prepare(fn: str, be: Backend, q: Any, k_pages: Any, v_pages: Any, table: Table,
             plan: DecodePlan | None, *, path: str, sm_scale: float | None, out: Any,
             lse: Any, return_lse: bool, out_dtype: str | None, cascade: Any,
             variants: dict[str, Any], qo_indptr: Any = None
             ) -> tuple[str, CallArgs, Any, dict[str, Any]]:
    """The host work of ``prepare_decode`` inside the launch context: ``(kind, args,
    set-up, returned arrays)``, ``kind`` ``"cascade"`` (a ``CascadeCall``),
    ``"multitoken"`` (a ``MultiTokenCall``) or ``"flat"`` (``flat_call``'s tuple); the
    prepared call is made outside (it records launches)."""
    a = check_call(fn, be, q, k_pages, v_pages, table, path=path, sm_scale=sm_scale,
                   out_dtype=out_dtype, return_lse=return_lse, qo_indptr=qo_indptr,
                   **variants)
    want_lse = return_lse or lse is not None

    def bound(out_a: Any, lse_a: Any) -> dict[str, Any]:
        """What every call returns: the caller's arrays, or the allocated ones."""
        return {"out": returned(be, q, out, out_a),
                "lse": returned(be, q, lse, lse_a) if want_lse else None,
                "return_lse": return_lse, "like": q}

    if a.tokens is not None:
        refuse_cascade(fn, cascade)
        if a.b == 0:
            raise fail(fn, "the table has no requests (B = 0): there is nothing to prepare")
        mt = multitoken_call(fn, be, a, plan, path, out, lse)
        return "multitoken", a, mt, bound(mt.out, mt.lse)
    if cascade is not None and cascade is not False:
        cc, _ = cascade_call(fn, be, a, cascade, path, out, lse)
        if cc is not None:
            return "cascade", a, cc, bound(cc.out, cc.lse)
    flat = flat_call(fn, be, a, plan, path, out, lse, want_lse)
    if flat[1] == "v2" and flat[0].needs_merge:
        be.workspace(flat[0])   # allocated now, on the caller's current stream
    return "flat", a, flat, bound(flat[3], flat[4])


Prepared = PreparedDecode | PreparedCascade | PreparedMultiToken


class _TableFollower:
    """What keeps a prepared call over a ``StepTable`` right as the pool changes the
    batch. Where the launches read the table's device buffer (``reads_step_tables``) and
    the buffer is the same (``layout``), a flat call only brings the device copy up to
    date and checks its plan (``PlanMismatchError`` when the caller's plan no longer
    fits; a plan the call made itself is made again). Everything else a prepared call
    holds of the table (a cascade's level tables, the host view of the array-op paths, a
    window table, the multi-token split, launches over a reallocated buffer) is prepared
    again, into the same outputs."""

    def __init__(self, fn: str, table: StepTable, given_plan: bool,
                 remake: Any) -> None:
        self.fn, self.table, self.given_plan, self.remake = fn, table, given_plan, remake
        self.version, self.layout = table.version, table.layout

    def behind(self) -> bool:
        t = self.table
        return t.pending or t.version != self.version or t.layout != self.layout

    def catch_up(self, prep: _PreparedCall) -> None:
        t, be = self.table, prep.backend
        if be.functional_outputs:
            # MLX: an append replaces the pool's arrays, and the call holds the old ones
            raise InvalidArgumentError(
                f"{self.fn}: the pool changed the batch since this call was prepared, and "
                f"on the {be.name} backend its appends replace the pool arrays the call "
                "holds: prepare again with the pool's current arrays (or use DecodeStep)")
        # the kernels read this table's device buffer (not a host view or window table)
        if isinstance(prep, PreparedDecode) and prep.args.table is t:
            with settings.bound(settings.snapshot()):
                if t.pending:       # first: the update may grow the buffer (a new layout)
                    with be.launch_context(prep._like):
                        t.update_device()
                if t.layout == self.layout:     # the launches' buffer is still the table's
                    a = prep.args
                    try:
                        prep.plan.check(self.fn, t, a.hq, a.hkv, a.d)
                        self.version, self.layout = t.version, t.layout
                        return
                    except PlanMismatchError:
                        if self.given_plan:
                            raise
        fresh = self.remake()
        # the same object, so the caller's reference stays good; a cascade call may have
        # become flat (no shared prefix any more) or the reverse
        prep.__class__ = type(fresh)
        prep.__dict__.clear()
        prep.__dict__.update(fresh.__dict__)
        prep._follow = self
        self.version, self.layout = t.version, t.layout


def layouts(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a prepared call relies on of each array and that can change on the same
    object (``q.shape = ...``, ``resize``): shape, dtype and strides (``None`` kept), and
    for a torch tensor its data address (``set_``, ``t.data = ...`` and a storage resize
    move a tensor's data; a numpy array the cache holds cannot be resized, and a CuPy
    array's memory is fixed), and numpy's writeable flag (an output made read-only must
    be refused by the checks, not by numpy)."""
    out: list[Any] = []
    for x in arrays:
        if x is None:
            out.append(None)
            continue
        try:
            shape, dtype = tuple(x.shape), x.dtype
        except (AttributeError, TypeError):
            out.append(type(x))   # not an array: the call's checks name it
            continue
        strides = getattr(x, "strides", None)
        ptr = None
        if strides is None and callable(getattr(x, "stride", None)):   # torch
            strides, ptr = x.stride(), x.data_ptr()
        writable = getattr(getattr(x, "flags", None), "writeable", None)   # numpy's
        out.append((shape, dtype, strides, ptr, writable))
    return tuple(out)


class CallCache:
    """The prepared calls behind ``decode``'s fast path: a small LRU keyed by the identity
    of every argument (and the settings that steer path choice). Each entry holds the
    keyed objects themselves, so an ``id`` can never be reused by another object while
    its entry lives; arrays stay alive until the entry is evicted (``MAX`` entries). A hit
    also compares the arrays' ``layouts`` with those the call was prepared for: an array
    reshaped in place drops the entry, and the caller validates afresh."""

    MAX = 8

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...],
                                   tuple[tuple[Any, ...], tuple[Any, ...], Prepared]] \
            = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], arrays: tuple[Any, ...]) -> Prepared | None:
        """The prepared call under ``key`` when ``arrays`` still have its layouts."""
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return None
            if layouts(arrays) != hit[1]:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return hit[2]

    def put(self, key: tuple[Any, ...], refs: tuple[Any, ...], arrays: tuple[Any, ...],
            prep: Prepared) -> None:
        """Keep ``prep`` under ``key`` with ``refs`` and ``arrays`` alive (``arrays``'
        layouts are what a hit compares)."""
        with self._lock:
            self._entries[key] = ((refs, arrays), layouts(arrays), prep)
            self._entries.move_to_end(key)
            while len(self._entries) > self.MAX:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


#: the process-wide cache ``decode`` uses (``decode_cache.clear()`` drops every entry)
decode_cache = CallCache()


__all__ = ["CallCache", "PreparedCascade", "PreparedDecode", "PreparedMultiToken",
           "decode_cache", "layouts", "prepare_decode"]
