"""Multi-token decode, the call: fold, two passes of the decode kernels, one merge.

A call with ``T_r`` query tokens per request (``multitoken``; ``docs/multi-token.md``)
runs, inside the call's launch context:

1. the **common pass**: each request's common range (every one of its tokens sees it)
   read once for all its tokens: the queries are folded into the GQA group,
   ``q [N, Hq, D] -> [B, Hkv * Tq * G, D]`` by one gather (query row
   ``kvh * Tq * G + t * G + g`` is head ``kvh * G + g`` of token ``t``; requests with fewer
   than ``Tq`` tokens repeat their last one, and those rows are dropped;
   ``multitoken.fold_rows``), and the chosen path (v2, v2tc, v1, gather) runs a
   plain one-token decode of ``Tq x`` the heads over the common table with the plan's
   folded view (``DecodePlan.folded``): the K/V bytes are those of one token per request;
2. the **pieces pass**: the few positions (at most ``T - 1`` per token) that a token sees
   beyond the common range, one small row per piece, on the same path;
3. the **merge**: each token's states (its common state, unfolded by one gather into a
   token-major stack beside the pieces' states, and its 0-2 pieces) merged by the
   merge of the backend, which adds the sinks once (the partials hold none), into
   ``out [N, Hq, D]`` and ``lse [N, Hq]``.

The passes write float32 states (soft cap applied, no sinks), so the merge is the one
rounding to the output dtype.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends import Backend
from .call import (
    CallArgs,
    call_problem,
    choose_path_at,
    host_table,
    output_buffer,
    run_path,
    runnable_paths,
)
from .cascade import _device_index
from .errors import UnsupportedProblemError, check_type
from .multitoken import TokenSplit, fold_rows, split_tokens
from .outcome import DecodeOutcome
from .page_table import PageTable
from .plan import DecodePlan, make_plan
from .specs import plan_geometry, v2tc_ctas_per_chunk
from .variants import Variant, check_path

_plans_lock = threading.Lock()
#: a pieces table -> its plans, by (path's CTAs per chunk, device name, geometry)
_piece_plans: weakref.WeakKeyDictionary[PageTable, dict[Any, DecodePlan]] = \
    weakref.WeakKeyDictionary()


def _pieces_plan(be: Backend, pieces: PageTable, hq: int, hkv: int, d: int,
                 path: str) -> DecodePlan:
    """The pieces pass's plan: one chunk per piece (a piece holds at most ``T - 1``
    positions: splitting it further would only add a merge); memoised per pieces table,
    so the layers of a step share it."""
    ctas = v2tc_ctas_per_chunk(hq, hkv) if path == "v2tc" else None
    key = (ctas, be.device_info().name, hq, hkv, d)
    with _plans_lock:
        hit = _piece_plans.get(pieces, {}).get(key)
    if hit is None:
        hit = make_plan(pieces, hq, hkv, d, device=be.device_info(), ctas_per_chunk=ctas,
                        pages_per_chunk=max(1, int(pieces.pages_per_request.max())))
        with _plans_lock:
            _piece_plans.setdefault(pieces, {})[key] = hit
    return hit


def counts_key(qo_indptr: Any) -> Any:
    """What a cached or prepared multi-token call keeps of its counts, to notice an
    in-place edit: ``qo_indptr``'s dtype, shape and bytes (the bytes alone match a
    reinterpreting view of a checked array; ``"uniform"`` for a 4-D ``q``, whose layout
    is keyed already), or ``None`` when it is no host integer array (never cached; the
    checks say why)."""
    if qo_indptr is None:
        return "uniform"
    try:
        arr = np.asarray(qo_indptr)
    except (TypeError, ValueError):
        return None
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        return None
    return arr.dtype.str, arr.shape, arr.tobytes()


@dataclass(frozen=True, eq=False)
class MultiTokenCall:
    """A multi-token call set up for running (``run`` launches it; repeatable, for a
    prepared call). ``out`` (``o_dt``) and ``lse`` (float32, base 2) are the backend
    arrays in the call's shape (``[B, T, Hq, D]`` / ``[B, T, Hq]`` for a 4-D ``q``, else
    ``[N, Hq, D]`` / ``[N, Hq]``); ``outcome`` is what a run records."""

    be: Backend
    a: CallArgs
    plan: DecodePlan
    path: str
    split: TokenSplit
    common: CallArgs
    pieces: CallArgs | None
    pieces_plan: DecodePlan | None
    fold_rows: Any           # backend int32 (``multitoken.fold_rows``): the fold's gathers
    unfold_rows: Any
    piece_index: Any         # backend int32 [P]: the q row of each piece
    merge_rows: Any          # backend int32 [N + P] (``TokenSplit.merge_rows``)
    out: Any                 # in the call's shape (returned)
    lse: Any
    out_flat: Any            # [N, Hq, D] and [N, Hq]: what the merge writes (views of
    lse_flat: Any            # out / lse, except on MLX: run hands them back)
    outcome: DecodeOutcome

    def run(self) -> None:
        """Fold the queries, run both passes and the merge (inside the launch context)."""
        be, a, xp = self.be, self.a, self.be.array_module()
        b, n_c, d = a.b, a.b * self.split.fold_tokens, a.d
        hf = self.common.hq
        qf = xp.take(a.q.reshape(-1, d), self.fold_rows, axis=0).reshape(b, hf, d)
        o_c, l_c = be.empty((b, hf, d), "float32"), be.empty((b, hf), "float32")
        run_path(be, dataclasses.replace(self.common, q=qf), self.plan.folded(), self.path,
                 o_c, l_c)
        n_p = 0 if self.pieces is None else self.pieces.b
        # every token's states in one array: the common ones token-major (token t of
        # request b at row t * B + b), then the pieces
        if be.functional_outputs:       # MLX: results rebind, so no writes through views
            v_all, l_all = self._stacked(xp, o_c, l_c)
        else:
            v_all = be.empty((n_c + n_p, a.hq, d), "float32")
            l_all = be.empty((n_c + n_p, a.hq), "float32")
            xp.take(o_c.reshape(-1, d), self.unfold_rows, axis=0,
                    out=v_all[:n_c].reshape(-1, d))
            xp.take(l_c.reshape(-1), self.unfold_rows, axis=0, out=l_all[:n_c].reshape(-1))
            self._pieces(xp, v_all[n_c:], l_all[n_c:])
        sinks = a.variant.merge_kwargs()
        merge: Any = be.merge        # backends with merge_gathers take rows=
        if be.merge_gathers:
            merge(v_all, l_all, self.split.merge_indptr, self.out_flat, self.lse_flat,
                  rows=self.merge_rows, **sinks)
        else:
            merge(xp.take(v_all, self.merge_rows, axis=0),
                  xp.take(l_all, self.merge_rows, axis=0), self.split.merge_indptr,
                  self.out_flat, self.lse_flat, **sinks)
        if be.functional_outputs and self.out_flat is not self.out:
            # MLX rebinds the flat arrays to the results: hand them to the call's arrays
            # (a reshape is a new object even where the shape is the same: a flat q)
            self.out[...] = self.out_flat.reshape(self.out.shape)
            self.lse[...] = self.lse_flat.reshape(self.lse.shape)

    def _pieces(self, xp: Any, v_out: Any, lse_out: Any) -> None:
        """The pieces pass into ``v_out [P, Hq, D]`` / ``lse_out [P, Hq]`` (float32)."""
        if self.pieces is None or self.pieces_plan is None:
            return
        qp = xp.take(self.a.q, self.piece_index, axis=0)
        run_path(self.be, dataclasses.replace(self.pieces, q=qp), self.pieces_plan,
                 self.path, v_out, lse_out)

    def _stacked(self, xp: Any, o_c: Any, l_c: Any) -> tuple[Any, Any]:
        """The states stacked by concatenation (backends whose outputs rebind)."""
        a, n_c = self.a, self.a.b * self.split.fold_tokens
        vs = [xp.take(o_c.reshape(-1, a.d), self.unfold_rows, axis=0).reshape(n_c, a.hq,
                                                                               a.d)]
        ls = [xp.take(l_c.reshape(-1), self.unfold_rows, axis=0).reshape(n_c, a.hq)]
        if self.pieces is not None:
            v_p = self.be.empty((self.pieces.b, a.hq, a.d), "float32")
            l_p = self.be.empty((self.pieces.b, a.hq), "float32")
            self._pieces(xp, v_p, l_p)
            vs.append(v_p)
            ls.append(l_p)
        return xp.concatenate(vs, axis=0), xp.concatenate(ls, axis=0)


#: the paths a multi-token ``auto`` call chooses among (the crossover's, less gather)
AUTO_PATHS = ("v2", "v2tc", "v1")


def refuse_cascade(fn: str, cascade: Any) -> None:
    """Cascade has no multi-token form: ``cascade=True`` or a cascade plan is refused (the
    automatic rule, ``None``, and ``False`` run the multi-token call flat)."""
    if cascade is not None and cascade is not False:
        raise UnsupportedProblemError(
            f"{fn}: cascade decode does not run multi-token calls (q [B, T, Hq, D] or "
            "qo_indptr); pass cascade=None or False for the flat multi-token decode")


def _auto_path(be: Backend, a: CallArgs, table: PageTable, fold: int) -> tuple[str, str]:
    """``path="auto"`` for a multi-token call: the crossover cell of the common pass's
    folded group (``fold`` tokens x G query heads per KV head)."""
    return choose_path_at(be, table, fold * a.hq // a.hkv,
                          runnable_paths(be, a, fold, AUTO_PATHS), a.kv_dt)


def multitoken_call(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None, path: str,
                    out: Any, lse: Any) -> MultiTokenCall:
    """Set up the multi-token call ``a`` (``a.tokens`` not ``None``): the plan (checked, or
    made for the call's most tokens per request), the path and why, the support checks of
    both passes, the split and the output buffers ``out`` / ``lse`` (the caller's, in the
    call's shape: ``[B, T, Hq, D]`` / ``[B, T, Hq]`` for a 4-D ``q``, else ``[N, Hq, D]`` /
    ``[N, Hq]``; the merge writes their flat views)."""
    qt = a.tokens
    assert qt is not None
    table = host_table(a.table)
    w = a.variant.window_left
    if plan is None:
        if path == "auto":   # the path first, then a plan for its CTA geometry
            chosen, reason = _auto_path(be, a, table, qt.max_tokens)
        else:
            chosen, reason = path, "requested"
        device = be.device_info()
        plan = make_plan(table, a.hq, a.hkv, a.d, device=device, window_left=w,
                         query_tokens=qt.max_tokens, kv_dtype=a.kv_dt, fn=fn,
                         **plan_geometry(chosen, a.hq, a.hkv, a.d, a.kv_dt, device,
                                         qt.max_tokens))
    else:
        check_type(fn, "plan", plan, DecodePlan, "a DecodePlan")
        plan.check(fn, table, a.hq, a.hkv, a.d, w, qt.max_tokens)
        chosen, reason = (_auto_path(be, a, table, plan.query_tokens) if path == "auto"
                          else (path, "requested"))
    fold = plan.query_tokens
    _check_support(fn, be, a, chosen, fold)
    check_path(fn, be.name, chosen, a.variant)
    split = split_tokens(table, qt, w, fold)
    # the sinks enter the merge only; the window is in the split; fp8 pools stay fp8
    passes = Variant(-1, a.variant.soft_cap, None, a.variant.kv)
    common = dataclasses.replace(a, table=split.common, hq=a.hq * fold, o_dt="float32",
                                 variant=passes, tokens=None)
    plan.folded().check(fn, split.common, a.hq * fold, a.hkv, a.d)
    pieces = pieces_plan = None
    if split.pieces.batch_size:
        pieces = dataclasses.replace(a, table=split.pieces, b=split.pieces.batch_size,
                                     o_dt="float32", variant=passes, tokens=None)
        pieces_plan = _pieces_plan(be, split.pieces, a.hq, a.hkv, a.d, chosen)
    n = qt.num_tokens
    shape = (a.b, qt.max_tokens) if qt.uniform else (n,)
    names = "B, T, " if qt.uniform else "N, "
    out_a = output_buffer(fn, be, "out", out, (*shape, a.hq, a.d), a.o_dt,
                          f"[{names}Hq, D]")
    lse_a = output_buffer(fn, be, "lse", lse, (*shape, a.hq), "float32", f"[{names}Hq]")
    detail = "; ".join(x for x in (
        f"{qt.describe()}; common pass {fold} tokens x {a.hq // a.hkv} heads per KV head, "
        f"{split.pieces.batch_size} causal pieces", a.variant.describe()) if x)
    outcome = DecodeOutcome(f"{chosen}+merge", be.name, a.b, table.total_visible,
                            plan.num_chunks + (pieces_plan.num_chunks if pieces_plan else 0),
                            reason, detail)
    fold_d, unfold_d = (_device_index(be, x) for x in fold_rows(split, a.hq, a.hkv))
    return MultiTokenCall(be, a, plan, chosen, split, common, pieces, pieces_plan, fold_d,
                          unfold_d, _device_index(be, split.piece_token),
                          _device_index(be, split.merge_rows), out_a, lse_a,
                          out_a.reshape(n, a.hq, a.d), lse_a.reshape(n, a.hq), outcome)


def _check_support(fn: str, be: Backend, a: CallArgs, path: str, fold: int) -> None:
    """Both passes of ``path``: the common pass at ``fold x`` the group, the pieces pass
    at the group."""
    g = a.hq // a.hkv
    for heads, what in ((a.hq * fold, f"the common pass ({fold} query tokens x GQA group "
                                      f"{g} = {fold * g} query rows per KV head)"),
                        (a.hq, "the pieces pass")):
        sup = be.supports(call_problem(a, path, heads))
        if not sup:
            raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run path "
                                          f"{path!r} for {what}: {sup.reason}")


__all__ = ["MultiTokenCall", "multitoken_call", "refuse_cascade"]
