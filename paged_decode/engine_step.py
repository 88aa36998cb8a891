"""The engine step: one decode step of a whole batch, every layer, at serving speed.

An engine's decode loop, per step: every live sequence gains one token in every layer,
and every layer attends over the batch. ``DecodeStep`` holds what stays the same from
step to step, so the loop pays only for what changes::

    step = DecodeStep(pool, seqs, num_qo_heads=32, capacity=128, headroom=64)
    while serving:
        step.begin()                       # host: one slot per sequence, table delta
        for layer in range(num_layers):
            step.append(layer, k, v)       # k, v [capacity, Hkv, D]: one launch
            step.decode(layer, q, out=o)   # q, o [capacity, Hq, D]
    # or capture every layer once (CUDA graph) and replay it after each begin():
    graph = step.capture(body)             # body(step) makes the calls above
    step.begin(); graph.replay()

What each piece costs: ``begin`` is ``PagePool.reserve_batch`` (vectorized bookkeeping;
a launch only for copy-on-write copies), **one** small host-to-device copy of the step
table's delta (the changed page ids) and the append descriptor into the table's fixed
staging buffer (``paged_decode.step_upload``), and a replan only when a sequence
outgrows the plan's ``headroom`` (``replans`` counts them; a replan makes a captured
graph stale, and ``stale`` says so). The table-update launch is left pending: a captured
graph starts with it, an eager step runs it before its first append or decode.
``append`` and ``decode`` launch kernels on fixed buffers, so a CUDA graph can hold them.

Rows: row ``i`` of ``q``, ``k``, ``v`` and ``out`` is the table's row ``i``
(``table.sequences[i]``; ``-1``: a padding row, whose rows are ignored and whose output
is zeros). ``set_sequences`` changes the batch between steps.

Speculative decoding and multi-token heads (``docs/multi-token.md``): ``begin(tokens=T)``
gives every live sequence ``T`` slots (the token and its drafts), ``append`` takes ``k, v
[capacity, T, Hkv, D]``, ``decode`` ``q [capacity, T, Hq, D]`` (token ``t`` sees the
context and the new tokens ``<= t``), and ``trim_back(counts)`` retires the drafts
verification rejected. Such steps run eagerly (the multi-token call's fold, split and
merge are host-planned per step), and are not captured.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .backends import c_contiguous
from .call import LAUNCH_PATHS, choose_path_at, output_buffer, pool_paths
from .compile_ahead import AheadReport, compile_ahead
from .decode import run_decode
from .dtypes import caller_dtype, check_dtype
from .errors import (
    InvalidArgumentError,
    PagedDecodeError,
    UnsupportedProblemError,
    check_int,
    check_number,
)
from .fp8 import is_fp8
from .kernels.append import AppendWrite, table_row_desc
from .multitoken import MAX_QUERY_TOKENS
from .page_table import PageTable
from .plan import DecodePlan, check_headroom, make_plan
from .pool import AppendedBatch, PagePool
from .prepared import layouts, prepare_call
from .specs import plan_geometry
from .steady_step import SteadyBegin
from .variants import PLAIN, check_soft_cap

#: the paths a step takes: "auto" (the crossover table's choice) or a launch path
STEP_PATHS = ("auto", *LAUNCH_PATHS)


class StaleStepError(PagedDecodeError, RuntimeError):
    """A captured step replayed after the batch outgrew it (a replan or a new table
    buffer), or without ``begin``."""


class DecodeStep:
    """One decode step of a batch of a ``PagePool``'s sequences, every layer.

    Args:
        pool: the K/V pool (with a layer axis, or one layer).
        seqs: the batch's live sequences, in row order.
        num_qo_heads: query heads (a multiple of the pool's KV heads).
        capacity: rows (``>= len(seqs)``; padding rows after the sequences): the batch
            size a captured graph is made for.
        page_capacity: page ids the device table holds before it grows (default: twice
            the batch's pages, at least 64; ``PagePool.step_table``). Growing makes a new
            buffer, which a captured step must be captured again for (``stale``), so an
            engine sizes it for the contexts it serves.
        headroom: tokens each sequence may grow by before a replan (default 64: one
            replan per 64 steps at most).
        logits_soft_cap, sinks: decode variants for every layer (``docs/variants.md``;
            ``sinks`` ``[Hq]`` float32 on the pool's backend). A sliding window needs a
            host table, so ``window_left`` is not a step's argument.
            An fp8 pool's format and per-layer scales come from the pool
            (``PagePool.decode_args``).
        sm_scale, path, out_dtype: as ``decode``'s. ``path`` is ``"auto"`` (default: the
            fastest path the backend runs for the step's pools at the nearest cell of the
            device's crossover table, as ``decode``'s automatic rule; chosen again at
            each replan, and named by ``path`` and ``path_reason``), ``"v2"``, ``"v2tc"``
            or ``"v1"``; a backend with a single arm runs that one.
    """

    def __init__(self, pool: PagePool, seqs: Sequence[int] | np.ndarray, *,
                 num_qo_heads: int, capacity: int | None = None,
                 page_capacity: int | None = None, headroom: int = 64,
                 sm_scale: float | None = None, path: str = "auto",
                 out_dtype: str | None = None, logits_soft_cap: float | None = None,
                 sinks: Any = None) -> None:
        fn = "DecodeStep"
        if not isinstance(pool, PagePool):
            raise InvalidArgumentError(f"{fn}: pool must be a PagePool, got "
                                       f"{type(pool).__name__}")
        self.pool, self.backend = pool, pool.backend
        single = self.backend.auto_path()       # mlx without Metal: the gather arm only
        if path not in STEP_PATHS and not (single and path == single[0]):
            raise InvalidArgumentError(f"{fn}: path must be one of {', '.join(STEP_PATHS)}, "
                                       f"got {path!r}")
        if single and path in STEP_PATHS:
            path = single[0]
        self.num_qo_heads = check_int(fn, "num_qo_heads", num_qo_heads)
        self.headroom = check_headroom(fn, headroom)
        #: the path asked for ("auto" or a path) and the one the step runs (``_plan``)
        self.requested_path = path
        self._auto_allowed: tuple[str, ...] | None = None
        self.path = path if path != "auto" else "v2"
        self.path_reason = f"path {path!r} asked for"
        # checked here so that a bad value names DecodeStep, not its first decode
        if sm_scale is not None:
            PLAIN.checked_score_scale(fn, check_number(fn, "sm_scale", sm_scale))
        if out_dtype is not None:
            check_dtype(fn, "out_dtype", out_dtype)
        check_soft_cap(fn, logits_soft_cap)
        self.sm_scale, self.out_dtype = sm_scale, out_dtype
        #: decode's variant keywords (sinks, an array of the backend, are checked by the
        #: first decode; the same for each layer)
        self.variants = {"logits_soft_cap": logits_soft_cap, "sinks": sinks}
        self.num_layers = pool.num_layers or 1
        self.table = pool.step_table(seqs, capacity=capacity, page_capacity=page_capacity,
                                     fn=fn)
        self.plan = self._plan()
        #: begins the plan surely serves without a check (``DecodePlan.tokens_left``: a
        #: begin adds one token per row); any other change to the pool or the batch (seen
        #: through the pool's version) sets it to 0
        self._unchecked_begins = self.plan.tokens_left(self.table)
        self._pool_version = pool._version
        self._table_batches = self.table.batches      # set_sequences calls followed
        self.replans = 0
        self.steps = 0
        #: the steady begins' state (``steady_step.py``), armed by each general begin
        self._steady: SteadyBegin | None = None
        self._batch: AppendedBatch | None = None
        #: layers appended since the last begin: while some are missing, that begin's
        #: slots hold no K/V there (``pool._open_step`` is this step)
        self._appended: set[int] = set()
        #: inside CapturedStep's capture on a backend whose graphs repeat device work only
        self._capturing = False
        #: tokens per sequence of the last begin; for a multi-token one, the live rows'
        #: host table of this step (made at its first decode) and the multi-token plan
        #: and path (kept while they serve, as ``plan`` is)
        self._tokens = 1
        self._mt_table: PageTable | None = None
        self._mt_plan: DecodePlan | None = None
        self._mt_path = ""
        #: the CUDA-dialect append reads its descriptor from the table's staging buffer
        #: (``step_upload.py``: fixed address, which a captured graph keeps; it travels
        #: with the table delta in one copy); the others take the host array per call
        self._device_desc = self.table.upload.staged
        self._desc: Any = (self.table.upload.desc if self._device_desc
                           else np.zeros((5, self.capacity), np.int32))
        #: prepared appends and decodes by (layer, buffers, table), least recently used
        #: first; bounded: an engine that passes new arrays every step must not pin them all
        self._prepared: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] = \
            OrderedDict()
        self._layers = [pool.layer(i) for i in range(self.num_layers)]

    # ------------------------------------------------------------------ inspection
    @property
    def capacity(self) -> int:
        """Rows of the step's table (``StepTable.capacity``), padding rows included."""
        return self.table.capacity

    @property
    def sequences(self) -> np.ndarray:
        """Sequence id of each row, int64 ``[capacity]`` (``-1``: padding); a
        read-only copy."""
        return self.table.sequences

    def compile_ahead(self, q_dtype: str | None = None,
                      query_tokens: int = 1) -> AheadReport:
        """Compile every kernel this step can launch at any batch and contexts: its
        decode on its path (with ``path="auto"``, on each path the backend runs for its
        pools), every specialization a plan may pick, its appends and table updates
        (``compile_ahead.kernel_specs``), so that no later step compiles one (nor raises
        under ``PAGED_DECODE_ASSERT_NO_COMPILE``). ``q_dtype``: the queries' dtype
        (default the pools' own; fp8 pools need it named). ``query_tokens``: the most
        tokens per sequence of the step's ``begin(tokens=T)`` calls (1: one-token steps
        only). Call it before serving; on a backend that compiles at first use (Metal) it
        compiles nothing and its report's ``note`` says so."""
        pool = self.pool
        return compile_ahead(
            self.backend, num_qo_heads=self.num_qo_heads, num_kv_heads=pool.num_kv_heads,
            head_dim=pool.head_dim, page_size=pool.page_size, kv_dtype=pool.dtype,
            q_dtype=q_dtype, out_dtype=self.out_dtype,
            paths=None if self.requested_path == "auto" else (self.path,),
            logits_soft_cap=self.variants["logits_soft_cap"] is not None,
            sinks=self.variants["sinks"] is not None, query_tokens=query_tokens,
            fn="DecodeStep.compile_ahead")

    # ------------------------------------------------------------------ the step
    def set_sequences(self, seqs: Sequence[int] | np.ndarray) -> None:
        """The batch of the next steps (at most ``capacity`` sequences keep a captured
        graph valid unless a replan is needed). Refused while the last ``begin``'s slots
        are not written in every layer, unless each sequence holding one was freed."""
        fn = "DecodeStep.set_sequences"
        if self.pool._open_step is self:
            live = set(self.pool.sequences())
            held = [int(s) for s in self._batch.seqs if int(s) in live] \
                if self._batch is not None else []
            if held:
                stranded = self._is_stranded
                raise InvalidArgumentError(
                    f"{fn}: sequences {held[:16]} hold the token slot the last begin() "
                    f"reserved, which layers {self.unwritten_layers()} have not written: "
                    + ("free those sequences (a sequence of the step was freed, so it "
                       "cannot write them any more)" if stranded else
                       "append those layers first, or free those sequences"))
            self.pool._open_step = None
        self.table.set_sequences(seqs)
        self._follow_batch()

    def _follow_batch(self) -> None:
        """Take the table's batch as set by ``set_sequences`` (the step's or, between
        steps, the table's own): the next begin replans if the plan no longer fits, and
        re-arms its steady path."""
        self._table_batches = self.table.batches
        self._batch = None
        self._unchecked_begins = 0
        self._steady = None

    def begin(self, like: Any = None, *, tokens: int = 1) -> AppendedBatch:
        """Start a step: one new token slot per live sequence (``reserve_batch``), the
        table delta and the append descriptor sent in one copy (the table's device
        update is left pending: a replayed graph starts with it, an eager step's first
        append or decode runs it), a replan if a sequence outgrew the plan. Device work
        runs on the stream of ``like`` (an engine array; default: the pool's ``k``).
        ``tokens`` (1-8): slots per live sequence; above 1 a multi-token step (the module
        docstring), whose ``append`` and ``decode`` take ``[capacity, tokens, ...]``
        rows. Returns the reservation."""
        fn = "DecodeStep.begin"
        tokens = check_int(fn, "tokens", tokens, 1, MAX_QUERY_TOKENS)
        self._no_open_step(fn)
        if tokens > 1:
            return self._begin_tokens(fn, like, tokens)
        if self.table.batches != self._table_batches:   # step.table.set_sequences
            self._follow_batch()
        if self.pool._version != self._pool_version:   # changed outside this step
            self._unchecked_begins = 0                  # (advance sees it too)
        steady = self._steady.advance() if self._steady is not None else None
        if steady is not None:
            batch, desc = steady[0], steady[1]
        else:
            rows, ids, pool_rows = self.table.live_rows()
            batch = self.pool._reserve_rows(ids, pool_rows, fn)
            desc = table_row_desc(batch.write.desc, rows, self.capacity)
        self._pool_version = self.pool._version
        # the host part only: one upload of the table delta and the descriptor; the
        # device update is pending until the step's first device work (in the graph on
        # replay, else before the first append or decode, or another reader's)
        with self.backend.launch_context(self.pool.k if like is None else like):
            self.table._send(desc if self._device_desc else None,
                             (steady[2], steady[3]) if steady is not None else None)
        # the staging buffer's view (a new one only with a new table buffer); array ops
        # and the Metal dialect read the host descriptor
        self._desc = self.table.upload.desc if self._device_desc else desc
        if steady is None:                       # the next begins may be steady ones
            self._steady = SteadyBegin.arm(self.pool, self.table)
        if self._unchecked_begins > 0:
            self._unchecked_begins -= 1
        else:
            self._replan_if_needed()
        return self._opened(batch, 1)

    def _opened(self, batch: AppendedBatch, tokens: int) -> AppendedBatch:
        """The step ``batch`` reserved, open until every layer writes its slots."""
        self._batch, self._tokens, self._mt_table = batch, tokens, None
        self._appended = set()
        if batch.write.num_touched:         # until every layer writes the new slots
            self.pool._open_step = self
        self.steps += 1
        return batch

    def _begin_tokens(self, fn: str, like: Any, tokens: int) -> AppendedBatch:
        """``begin(tokens=T)``, T > 1: T slots per live sequence (a ragged reservation
        with its host descriptor, which ``append`` hands to the pool's write) and the
        table delta; the steady begins rearm at the next one-token begin."""
        if self.table.batches != self._table_batches:
            self._follow_batch()
        _, ids, pool_rows = self.table.live_rows()
        batch = self.pool._reserve_rows(ids, pool_rows, fn,
                                        np.full(ids.size, tokens, np.int64))
        self._pool_version = self.pool._version
        with self.backend.launch_context(self.pool.k if like is None else like):
            self.table._send(None, None)
        self._steady = None
        self._unchecked_begins = 0          # the next one-token begin checks its plan
        return self._opened(batch, tokens)

    def trim_back(self, counts: Any) -> None:
        """Retire the newest ``counts[i]`` tokens of table row ``i``'s sequence (int
        ``[capacity]``; padding rows 0): the drafts verification rejected, after every
        layer was appended (``PagePool.trim_back_batch``). The next begin takes the
        positions back."""
        fn = "DecodeStep.trim_back"
        self._no_open_step(fn)
        if self.table.batches != self._table_batches:
            self._follow_batch()
        c = self.pool._counts(fn, counts, self.capacity, None)
        rows, ids, _ = self.table.live_rows()
        pad = np.ones(self.capacity, bool)
        pad[rows] = False
        if (c[pad] != 0).any():
            i = int(np.flatnonzero(pad & (c != 0))[0])
            raise InvalidArgumentError(f"{fn}: counts[{i}] must be 0 (row {i} is a padding "
                                       f"row), got {int(c[i])}")
        self.pool.trim_back_batch(ids, c[rows])

    def append(self, layer: int, k: Any, v: Any) -> None:
        """Write layer ``layer``'s new rows: ``k, v [capacity, Hkv, D]`` (row ``i`` for
        table row ``i``; padding rows are not read). One launch; with the same ``k`` /
        ``v`` buffers (in the pool's dtype) every step, the launch is recorded once and
        replayed (``Backend.compile_launches``)."""
        fn = "DecodeStep.append"
        batch = self._current(fn)
        layer = check_int(fn, "layer", layer, 0, self.num_layers - 1)
        # (a graph capture runs the step's appends a second time: CapturedStep and
        # record_update clear the set before it)
        if layer in self._appended:
            raise InvalidArgumentError(f"{fn}: layer {layer} was appended already since "
                                       "begin() (its slot would be written twice): call "
                                       "begin() for the next token")
        if self._tokens > 1:
            self._append_tokens(fn, batch, layer, k, v)
        else:
            self._append_rows(fn, batch, layer, k, v)
        self._wrote((layer,))

    def _eager_only(self, fn: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{fn}: a multi-token step (begin(tokens={self._tokens})) runs eagerly: its "
            "split and merge are planned on the host each step, which a captured graph "
            "would not repeat; capture one-token steps only")

    def _one_slot_only(self, fn: str) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{fn}: the last begin() gave each sequence {self._tokens} slots, and a captured "
            "step writes one: run a multi-token step eagerly (append and decode), and "
            "replay after a one-token begin()")

    def _refuse_capture(self, fn: str) -> None:
        if self._capturing or self.backend.capturing():
            raise self._eager_only(fn)

    def _live_gather(self, x: Any) -> Any:
        """Rows of ``x`` (leading axis: the table's rows) of the live sequences, in table
        order: ``x`` itself where every row is live (no copy)."""
        rows = self.table.live_rows()[0]
        if rows.size == self.capacity:
            return x
        xp = self.backend.array_module()
        return xp.take(x, self.backend.asarray(rows.astype(np.int32)), axis=0)

    def _append_tokens(self, fn: str, batch: AppendedBatch, layer: int, k: Any,
                       v: Any) -> None:
        """``append`` of a multi-token step: ``k, v [capacity, T, Hkv, D]``, the live
        rows' tokens written in one launch (``PagePool.write_layer``)."""
        self._refuse_capture(fn)
        pool, t = self.pool, self._tokens
        kb, vb = self.backend.array_arg(fn, "k", k), self.backend.array_arg(fn, "v", v)
        pool._check_rows(fn, kb, vb, (self.capacity, t, pool.num_kv_heads, pool.head_dim),
                         f"[capacity, T = {t}, Hkv, D]", (k, v))
        if batch.write.num_touched == 0:
            return
        self._apply_pending(k)
        n = batch.num_rows
        shape = (n, pool.num_kv_heads, pool.head_dim)
        with self.backend.launch_context(k):
            pool.write_layer(batch, self._live_gather(kb).reshape(shape),
                             self._live_gather(vb).reshape(shape),
                             layer=layer if pool.num_layers else 0)
        if self.backend.functional_outputs:      # MLX: the pool arrays were rebound
            self._layers = [pool.layer(i) for i in range(self.num_layers)]

    def _append_rows(self, fn: str, batch: AppendedBatch, layer: int, k: Any, v: Any) -> None:
        """``append``'s write, arguments checked but the rows'."""
        if batch.write.num_touched == 0:
            if self._capturing or self.backend.capturing():
                # nothing to launch now, so nothing would be recorded, and every replay
                # would leave its begin's slots unwritten (read as stale K/V)
                raise InvalidArgumentError(
                    f"{fn}: the batch has no live sequence, so a graph captured now would "
                    "write no rows when replayed over a later batch: capture after "
                    "set_sequences gives the step a sequence")
            return
        self._apply_pending(k)
        key = ("append", layer, id(k), id(v), self.table.layout)
        hit = self._cached(key)
        if hit is not None and hit[0][0] is k and hit[0][1] is v \
                and layouts((k, v)) == hit[0][2]:
            hit[1]()
            return
        pool = self.pool
        kb, vb = self.backend.array_arg(fn, "k", k), self.backend.array_arg(fn, "v", v)
        pool._check_rows(fn, kb, vb, (self.capacity, pool.num_kv_heads, pool.head_dim),
                         "[capacity, Hkv, D]", (k, v))
        target = layer if pool.num_layers else 0

        def run() -> None:
            write = AppendWrite(self._desc, self.capacity, target, 1, False)
            pool.k, pool.v = self.backend.append_rows(pool.k, pool.v, kb, vb, write,
                                                      **pool._fp8_kw())

        # a recorded launch holds the rows' addresses: only rows the kernel reads as they
        # are (the pool's dtype, or one float dtype for an fp8 pool's quantizing append;
        # C-contiguous) are recorded, others are converted per call
        as_is = kb.dtype == vb.dtype and (kb.dtype == pool.k.dtype or bool(pool._fp8_kw()))
        recordable = bool(self._device_desc) and as_is and c_contiguous(kb) and \
            c_contiguous(vb)
        if not recordable and (self._capturing or self.backend.capturing()):
            # a graph would repeat the launch on the rows converted at capture
            raise InvalidArgumentError(
                f"{fn}: rows of dtype {kb.dtype} / {vb.dtype}"
                f"{'' if c_contiguous(kb) and c_contiguous(vb) else ', not C-contiguous,'} "
                "are converted on the host at every call, which a captured graph does not "
                f"repeat: capture with C-contiguous rows in the pool's dtype ({pool.dtype}"
                f"{'' if not pool._fp8_kw() else ', or one float dtype for both'})")
        if recordable:
            # like=k, the caller's array: replays go to its framework's current stream
            # (torch's for torch tensors, so a torch graph captures them), not to the
            # stream of kb, the backend's view
            replay = self.backend.compile_launches(run, like=k)
            self._keep(key, ((k, v, layouts((k, v))), replay))
            replay()
            return
        with self.backend.launch_context(k):    # the caller's stream, as replays use
            run()
        if self.backend.functional_outputs:      # MLX: the pool arrays were rebound
            self._layers = [pool.layer(i) for i in range(self.num_layers)]

    def decode(self, layer: int, q: Any, *, out: Any = None, lse: Any = None,
               return_lse: bool = False) -> Any:
        """Decode layer ``layer``: ``q [capacity, Hq, D]`` -> ``out [capacity, Hq, D]``
        (and ``lse [capacity, Hq]`` float32, base 2). With the same ``q`` / ``out``
        buffers every step, the launches are prepared once and replayed."""
        fn = "DecodeStep.decode"
        layer = check_int(fn, "layer", layer, 0, self.num_layers - 1)
        if self.pool._open_step is self:
            if layer not in self._appended:
                raise InvalidArgumentError(f"{fn}: layer {layer} has not been appended since "
                                           "begin(): the token slot begin() reserved holds no "
                                           "K/V there yet (append it first)")
        else:
            self.pool._no_open_step(fn)        # another step's slots, not written yet
        if self._batch is not None and self.table.batches != self._table_batches:
            self._current(fn)                  # the table took another batch mid-step
        if self._tokens > 1:
            return self._decode_tokens(fn, layer, q, out, lse, return_lse)
        if len(getattr(q, "shape", ())) == 4:
            raise UnsupportedProblemError(
                f"{fn}: q [B, T, Hq, D] is a multi-token query, and this step's begin() "
                "gave each sequence one slot: begin(tokens=T) first (docs/multi-token.md)")
        if self.table.changed:     # the pool changed outside begin(): follow it here
            with self.backend.launch_context(q):
                self.table.update_device()
            self._replan_if_needed()
        else:
            self._apply_pending(q)
        k, v = self._layers[layer]
        if out is None or (return_lse and lse is None) or self.backend.functional_outputs:
            self._check_auto_query(fn, q)
            return run_decode(fn, q, k, v, self.table, self.plan, path=self.path,
                              sm_scale=self.sm_scale, out=out, lse=lse,
                              return_lse=return_lse, out_dtype=self.out_dtype,
                              backend=self.backend, cascade=None, **self.variants,
                              **self.pool.decode_args(layer))
        # prepared launches read the table's device buffers (valid while its layout
        # holds), or on array-op backends its host view (valid for one version)
        t = self.table
        key = (layer, id(q), id(out), id(lse), return_lse,
               t.layout if self.backend.reads_step_tables else t.version)
        hit = self._cached(key)
        lay = layouts((q, out, lse))
        if hit is None or hit[0][0] is not q or hit[0][1] is not out \
                or lay != hit[0][2]:                 # reshaped, or a tensor's data moved
            self._check_auto_query(fn, q)
            prep = prepare_call("DecodeStep.decode", q, k, v, self.table, self.plan,
                                path=self.path, sm_scale=self.sm_scale, out=out, lse=lse,
                                return_lse=return_lse, out_dtype=self.out_dtype,
                                backend=self.backend, cascade=None, qo_indptr=None,
                                **self.variants, **self.pool.decode_args(layer))
            hit = ((q, out, lay, lse), prep)
            if not self.backend.reads_step_tables:
                self._prepared = OrderedDict((k, h) for k, h in self._prepared.items()
                                             if k[-1] == key[-1])
            self._keep(key, hit)
        return hit[1]()

    def _decode_tokens(self, fn: str, layer: int, q: Any, out: Any, lse: Any,
                       return_lse: bool) -> Any:
        """``decode`` of a multi-token step: ``q [capacity, T, Hq, D]`` -> ``out
        [capacity, T, Hq, D]`` (``lse [capacity, T, Hq]``; padding rows: zeros and
        ``-inf``). The live rows run as one multi-token call over their host table, with
        a plan kept while it serves (replanned like ``plan``, counted in ``replans``)."""
        self._refuse_capture(fn)
        be, t, hq = self.backend, self._tokens, self.num_qo_heads
        pool = self.pool
        qb = be.array_arg(fn, "q", q)
        want = (self.capacity, t, hq, pool.head_dim)
        if tuple(qb.shape) != want:
            raise InvalidArgumentError(f"{fn}: q must be [capacity, T, Hq, D] = "
                                       f"{list(want)} (begin(tokens={t})), got "
                                       f"{list(qb.shape)}")
        rows = self.table.live_rows()[0]
        whole = rows.size == self.capacity
        o_dt = self.out_dtype or caller_dtype(q, be.dtype_of(qb))
        if not whole:       # checked here: the call below writes other arrays
            with be.launch_context(q):
                if out is not None:
                    out = output_buffer(fn, be, "out", out, want, o_dt,
                                        "[capacity, T, Hq, D]")
                if lse is not None:
                    lse = output_buffer(fn, be, "lse", lse, want[:3], "float32",
                                        "[capacity, T, Hq]")
        if self.table.changed:
            with be.launch_context(q):
                self.table.update_device()
        else:
            self._apply_pending(q)
        k, v = self._layers[layer]
        if whole:
            plan, path = self._tokens_plan(t)
            return run_decode(fn, q, k, v, self._tokens_table(), plan, path=path,
                              sm_scale=self.sm_scale, out=out, lse=lse,
                              return_lse=return_lse, out_dtype=self.out_dtype, backend=be,
                              cascade=None, **self.variants, **pool.decode_args(layer))
        if rows.size:
            plan, path = self._tokens_plan(t)
            o, lo = run_decode(fn, self._live_gather(qb), k, v, self._tokens_table(), plan,
                               path=path, sm_scale=self.sm_scale, out=None, lse=None,
                               return_lse=True,
                               out_dtype=self.out_dtype, backend=be, cascade=None,
                               **self.variants, **pool.decode_args(layer))
        else:               # padding rows only: nothing to run
            o, lo = be.empty((0, *want[1:]), o_dt), be.empty((0, *want[1:3]), "float32")
        o, lo = self._scatter_rows(o, out, 0.0), self._scatter_rows(lo, lse, -np.inf)
        o, lo = be.wrap_result(o, like=q), be.wrap_result(lo, like=q)
        return (o, lo) if return_lse else o

    def _scatter_rows(self, x: Any, dest: Any, fill: float) -> Any:
        """The live rows' ``x`` ([n, ...]) spread over the table's rows, ``fill`` in
        padding rows: into ``dest`` when given (not on MLX, whose results rebind)."""
        be, xp = self.backend, self.backend.array_module()
        rows = self.table.live_rows()[0]
        where = np.full(self.capacity, rows.size, np.int32)     # padding: the fill row
        where[rows] = np.arange(rows.size, dtype=np.int32)
        pad = xp.full((1, *x.shape[1:]), fill, dtype=x.dtype)
        full = xp.take(xp.concatenate([x, pad], axis=0), be.asarray(where), axis=0)
        if dest is None or be.functional_outputs:
            return full
        dest[...] = full
        return dest

    def _tokens_table(self) -> PageTable:
        """The live rows' host page table of this step (one per begin)."""
        if self._mt_table is None:
            self._mt_table = self.pool.page_table(self.table.live_rows()[1])
        return self._mt_table

    def _tokens_plan(self, tokens: int) -> tuple[DecodePlan, str]:
        """The multi-token plan and path for this step's live rows (``tokens`` per
        request): the kept one while it serves, else a new one (its path: the step's, or
        with ``path="auto"`` decode's rule at the folded group, among the paths that run
        it)."""
        table = self._tokens_table()
        p = self._mt_plan
        if p is not None and p.query_tokens >= tokens and p.batch_size == table.batch_size \
                and p.mismatch(table) is None:
            return p, self._mt_path
        pool, device = self.pool, self.backend.device_info()
        hq, hkv = self.num_qo_heads, pool.num_kv_heads
        if self.requested_path == "auto":
            fold = pool_paths(self.backend, hq * tokens, hkv, pool.head_dim, pool.page_size,
                              pool.dtype, pool.num_pages)
            if self._auto_allowed is None:
                self._auto_path()
            allowed = tuple(x for x in fold if x in (self._auto_allowed or ())) or ("v2",)
            path = choose_path_at(self.backend, table, tokens * hq // hkv, allowed,
                                  pool.dtype)[0]
        else:
            path = self.path
        plan = make_plan(table, hq, hkv, pool.head_dim, device=device,
                         headroom=self.headroom, query_tokens=tokens,
                         hint=p.pages_per_chunk if p is not None else None,
                         kv_dtype=pool.dtype, fn="DecodeStep",
                         **plan_geometry(path, hq, hkv, pool.head_dim, pool.dtype, device,
                                         tokens))
        if p is not None:
            self.replans += 1
        self._mt_plan, self._mt_path = plan, path
        return plan, path

    def capture(self, body: Callable[[DecodeStep], Any]) -> CapturedStep:
        """Record ``body(self)`` (``append`` and ``decode`` calls on fixed buffers, after a
        ``begin``) for replay after every later ``begin``: a CUDA graph on the ``cuda``
        backend (``body`` runs once eagerly first, to compile and allocate, then under
        capture); elsewhere replays run ``body`` again."""
        self._current("DecodeStep.capture")
        if self._tokens > 1:
            raise self._eager_only("DecodeStep.capture")
        try:
            inspect.signature(body).bind(self)     # a callable of one positional argument
        except TypeError as exc:                   # not callable, or another signature
            raise InvalidArgumentError(
                f"DecodeStep.capture: body must be a callable taking the step as its one "
                f"argument, got {type(body).__name__} {body!r}") from exc
        except ValueError:                         # no signature to read (some builtins):
            pass                                   # the eager run will tell
        return CapturedStep(self, body)

    # ------------------------------------------------------------ the caller's own graph
    @property
    def launch_state(self) -> tuple[Any, int]:
        """What captured launches of this step depend on: ``(plan, table layout)``. A
        graph captured under one value must not be replayed under another (a replan, a
        grown table): capture again."""
        return self.plan, self.table.layout

    def record_update(self, like: Any = None) -> None:
        """For a step captured in the caller's own CUDA graph (e.g. ``torch.cuda.graph``
        around a model forward that calls ``append`` and ``decode``): call it inside the
        capture, before the first ``append``, after one eager run of the same calls on
        the capture stream (it compiles and allocates there). It records the table
        update each ``begin`` leaves pending, from the staging buffer that ``begin``
        writes, on the current stream of ``like`` (default: the pool's ``k``). After each
        later ``begin``, replay the graph and call ``replayed``. Only on the ``cuda``
        backend (a staging buffer)."""
        fn = "DecodeStep.record_update"
        self._current(fn)
        if self._tokens > 1:
            raise self._eager_only(fn)
        if not self.table.upload.staged:
            raise InvalidArgumentError(f"{fn}: the {self.backend.name!r} backend has no "
                                       "staging buffer for a graph to read (cuda only)")
        with self.backend.launch_context(self.pool.k if like is None else like):
            self.table.record_update()
        self._appended = set()      # the captured calls write this step's slots again

    def replayed(self) -> None:
        """The caller's graph (``record_update``) replayed this step's update and calls
        (every layer's append among them)."""
        fn = "DecodeStep.replayed"
        self._current(fn)
        if self._tokens > 1:
            raise self._one_slot_only(fn)
        self.table.replayed(fn)
        self._wrote(range(self.num_layers))

    def unwritten_layers(self) -> list[int]:
        """The layers not appended since the last ``begin`` (all of them written: ``[]``)."""
        return [i for i in range(self.num_layers) if i not in self._appended]

    # ------------------------------------------------------------------ internals
    def _check_auto_query(self, fn: str, q: Any) -> None:
        """``path="auto"`` plans before any query is seen, taking 16-bit queries over fp8
        pools (``_auto_path``): a float32 query, which v2 would take, is refused here,
        saying so, rather than by the chosen path's checks, which would blame a path the
        caller never named."""
        if self.requested_path != "auto" or self.path != "v2tc" or not is_fp8(self.pool.dtype):
            return
        got = self.backend.dtype_of(q)
        if got == "float32":        # other dtypes: no path takes them (decode's check)
            raise InvalidArgumentError(
                f"{fn}: path='auto' chose v2tc for this step's {self.pool.dtype} pools, "
                f"assuming float16 or bfloat16 queries; got q {got}: pass 16-bit queries, "
                "or make the step with path='v2' (float32 queries too)")

    def _auto_path(self) -> tuple[str, str]:
        """``path="auto"``: ``decode``'s rule (``call.choose_path_at``) at the step table's
        batch and contexts, among the paths the backend supports for the pools (queries
        taken in the pools' dtype; float16 for an fp8 pool, whose queries are 16-bit;
        worked out once: the pools do not change)."""
        pool = self.pool
        if self._auto_allowed is None:
            self._auto_allowed = pool_paths(self.backend, self.num_qo_heads,
                                            pool.num_kv_heads, pool.head_dim,
                                            pool.page_size, pool.dtype, pool.num_pages)
        return choose_path_at(self.backend, self.table, self.num_qo_heads // pool.num_kv_heads,
                              self._auto_allowed, pool.dtype)

    def _plan(self, hint: int | None = None) -> DecodePlan:
        if self.requested_path == "auto":
            self.path, self.path_reason = self._auto_path()
        pool, device = self.pool, self.backend.device_info()
        return make_plan(self.table, self.num_qo_heads, pool.num_kv_heads, pool.head_dim,
                         device=device, headroom=self.headroom, hint=hint,
                         kv_dtype=pool.dtype, fn="DecodeStep",
                         **plan_geometry(self.path, self.num_qo_heads, pool.num_kv_heads,
                                         pool.head_dim, pool.dtype, device))

    def _apply_pending(self, like: Any) -> None:
        """The table update ``begin`` left pending, on ``like``'s stream before the
        step's first launch (eager steps; a replayed graph makes it itself)."""
        if self.table.pending:
            with self.backend.launch_context(like):
                self.table.apply_pending()

    def _replan_if_needed(self) -> None:
        left = self.plan.tokens_left(self.table)
        if left == 0 and self.plan.mismatch(self.table) is not None:
            self.plan = self._plan(hint=self.plan.pages_per_chunk)
            self.replans += 1
            self._prepared.clear()      # launches of the old plan
            left = self.plan.tokens_left(self.table)
        self._unchecked_begins = left

    #: prepared calls kept per layer (appends and decodes together): two buffer sets of
    #: each, as an engine that alternates two does
    PREPARED_PER_LAYER = 4

    def _cached(self, key: tuple[Any, ...]) -> Any:
        """The prepared call under ``key`` (now the most recently used), or ``None``."""
        hit = self._prepared.get(key)
        if hit is not None:
            self._prepared.move_to_end(key)
        return hit

    def _keep(self, key: tuple[Any, ...], hit: Any) -> None:
        """Keep a prepared call, dropping the least recently used past the bound."""
        self._prepared[key] = hit
        while len(self._prepared) > self.PREPARED_PER_LAYER * self.num_layers:
            self._prepared.popitem(last=False)

    def _wrote(self, layers: Any) -> None:
        """Layers ``layers`` wrote the slots of the last begin; with every layer written
        the pool is free for other changes again."""
        self._appended.update(layers)
        if self.pool._open_step is self and len(self._appended) >= self.num_layers:
            self.pool._open_step = None

    def _no_open_step(self, fn: str) -> None:
        """Raise while a begin's slots (this step's or another's over the pool) are not
        written in every layer."""
        if self.pool._open_step is not self:
            self.pool._no_open_step(fn)          # another step's, or none
            return
        if self._is_stranded:
            raise self._stranded(fn)
        raise InvalidArgumentError(
            f"{fn}: the last begin() reserved a token slot per sequence that layers "
            f"{self.unwritten_layers()} have not written: append them before the next "
            "begin() (an unwritten slot would be attended to)")

    @property
    def _is_stranded(self) -> bool:
        """Whether the pool changed since this step's begin (while a step is open, only a
        free of one of its own sequences does that): its slots cannot be written."""
        return self._batch is not None and self._batch.version != self.pool._version

    def _stranded(self, fn: str) -> InvalidArgumentError:
        """The error of a step whose sequence was freed before every layer was appended
        (only a free can change the pool while a step is open)."""
        return InvalidArgumentError(
            f"{fn}: a sequence was freed since the last begin(), before layers "
            f"{self.unwritten_layers()} were appended: that step cannot write its slots any "
            "more; free its other sequences and call set_sequences()")

    def _current(self, fn: str) -> AppendedBatch:
        b = self._batch
        if b is None:
            raise InvalidArgumentError(f"{fn}: call begin() first (once per step, after any "
                                       "change to the batch)")
        if b.version != self.pool._version:
            if self.pool._open_step is self:
                raise self._stranded(fn)
            if not b.write.num_touched:
                # a begin over padding rows only reserved nothing and left the pool open:
                # no change to it can strand this step's (empty) writes
                b.version = self.pool._version
                return b
            raise InvalidArgumentError(
                f"{fn}: the pool changed since this step's begin() (an append, fork, trim "
                "or free): call begin() again")
        if self.table.batches != self._table_batches:
            raise InvalidArgumentError(
                f"{fn}: the step's table took another batch (step.table.set_sequences) "
                "since this step's begin(): its reserved slots belong to the old batch; "
                "change the batch between steps, with DecodeStep.set_sequences")
        return b


class CapturedStep:
    """A recorded step (``DecodeStep.capture``); ``replay()`` after each ``begin()``."""

    def __init__(self, step: DecodeStep, body: Callable[[DecodeStep], Any]) -> None:
        self.step, self.body = step, body
        self._state = step.launch_state
        self._last = step.steps
        # the capture stream is kept with the graph: the step's workspaces were first
        # allocated on it (CUDA keeps them per stream while their plan lives). The graph
        # starts with the table update (from the staging buffer each begin writes), so a
        # replay applies its begin's delta; the eager run applies the pending one itself
        table = step.table

        def run() -> None:
            step._appended = set()     # each run writes the step's slots afresh
            body(step)
        step._capturing = step.backend.records_graphs
        try:
            self.graph, self._stream = step.backend.capture_graph(
                run, table.record_update if table.upload.staged else None)
        finally:
            step._capturing = False
        #: the layers the body appends (a replayed graph writes them)
        self._layers = frozenset(step._appended)

    @property
    def stale(self) -> bool:
        """Whether the step's launches changed since capture (a replan, a new table
        buffer): replay would be wrong."""
        return self.step.launch_state != self._state     # plans compare by identity

    def replay(self, like: Any = None) -> None:
        """Replay the step on the current stream of ``like`` (an engine array; default:
        the pool's ``k``), ordered after the ``begin()`` that ran there."""
        fn = "CapturedStep.replay"
        s = self.step
        if self.stale:
            raise StaleStepError(f"{fn}: the step was replanned or its table buffer grew "
                                 "since capture (a sequence outgrew the headroom, or the "
                                 "batch changed): capture again")
        s._current(fn)
        if s._tokens > 1:
            raise s._one_slot_only(fn)
        if s.steps == self._last:
            raise StaleStepError(f"{fn}: call step.begin() before each replay (the same "
                                 "slots would be written twice)")
        if s._appended & self._layers:
            # the graph writes those layers' slots again (or, re-run, refuses half-way)
            raise InvalidArgumentError(
                f"{fn}: layers {sorted(s._appended & self._layers)} were appended since "
                "begin(), and the replay appends them again: replay a step whole, or "
                "write it eagerly")
        self._last = s.steps
        if self.graph is None:
            self.body(s)           # its first append or decode applies the table update
        else:
            s.backend.replay_graph(self.graph, s.pool.k if like is None else like)
            s.table.replayed()     # the graph's first work was the update
            s._wrote(self._layers)


__all__ = ["STEP_PATHS", "CapturedStep", "DecodeStep", "StaleStepError"]
