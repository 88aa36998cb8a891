"""The one adapter between a model's attention layers and paged-decode.

A model forward appends the new K/V of every sequence in its batch, layer by layer, then
attends. ``PagedBatch`` turns that into today's public calls on one ``PagePool`` with a
layer axis: ``append_batch(..., layer=0)`` places the step's tokens (pages, copy-on-write
of a shared partial last page) and writes layer 0, ``write_layer`` writes every later
layer into the same slots. A flat decode reads the batch's device-resident step table
(``pool.step_table``: it follows the appends with one small delta copy per step, no host
table rebuilt) under a plan with headroom, replanned only when a sequence outgrows it; a
cascade decode (``cascade=True``) reads the host ``page_table``, built once per step,
whose shared prefix it detects. With ``step_engine=True``, decode steps (one new token
per sequence, every layer decoded) run through a ``DecodeStep`` instead: one ``begin``
per forward, and per layer a copy of the new K/V and q into fixed buffers and two
prepared launches, no validation or planning per call (``docs/engine.md``). The
framework integrations call nothing else of paged-decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..backends import array_kind
from ..call import plan_decode
from ..cascade import CascadePlan, detect_shared_prefix
from ..decode import decode
from ..dtypes import numpy_dtype
from ..engine_step import DecodeStep
from ..errors import InvalidArgumentError, check_bool, check_int, check_int_array, check_number
from ..page_table import MAX_ENTRIES, PageTable
from ..plan import DecodePlan
from ..pool import AppendedBatch, PagePool
from ..step_table import StepTable
from ..variants import PLAIN

#: tokens a flat decode's plan is made to grow by (one replan per 64 decode steps at most)
HEADROOM = 64


class PagedBatch:
    """The K/V of a batch of sequences, ``L`` layers, in one ``PagePool``.

    Args:
        num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, backend: the
            pool (``PagePool(..., num_layers=num_layers)``); pages ``[L, num_pages,
            page_size, Hkv, D]``.
        num_qo_heads: query heads ``Hq`` of the model (a multiple of ``Hkv``).
        cascade: ``True``: every step whose forks share at least one full page decodes
            as a cascade (``detect_shared_prefix(min_shared_pages=1)``), the shared pages
            read once per group, over the host table; ``None`` or ``False``: flat, over
            the device-resident step table.
        step_engine: run decode steps (``begin(None)``) through a ``DecodeStep`` (flat
            decodes only: ``cascade`` must not be ``True``). Such a forward must
            ``decode`` every layer it appends (``gather`` is refused), with backend
            arrays of one kind (e.g. torch tensors) and one ``sm_scale`` throughout.

    A forward is ``begin(counts)``, then ``append(layer, k, v)`` for layers ``0 .. L-1``
    in order, each followed by that layer's ``decode`` or ``gather``.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int,
                 num_kv_heads: int, num_qo_heads: int, head_dim: int, dtype: str,
                 backend: Any = None, cascade: Any = None,
                 step_engine: bool = False) -> None:
        fn = "PagedBatch"
        self.num_layers = check_int(fn, "num_layers", num_layers)
        self.num_qo_heads = check_int(fn, "num_qo_heads", num_qo_heads)
        if self.num_qo_heads % check_int(fn, "num_kv_heads", num_kv_heads):
            raise InvalidArgumentError(f"{fn}: num_qo_heads ({num_qo_heads}) must be a "
                                       f"multiple of num_kv_heads ({num_kv_heads})")
        self.pool = PagePool(num_pages, page_size, num_kv_heads, head_dim, dtype,
                             num_layers=self.num_layers, backend=backend)
        # None / bools only: any other value would silently run flat
        self.cascade = None if cascade is None else check_bool(fn, "cascade", cascade)
        self.step_engine = check_bool(fn, "step_engine", step_engine)
        if self.step_engine and self.cascade is True:
            raise InvalidArgumentError(f"{fn}: step_engine runs flat decodes; it cannot be "
                                       "combined with cascade=True")
        #: the decode steps' engine step, made at the first decode step of a batch
        self._engine: DecodeStep | None = None
        #: its fixed buffers: k, v [B, Hkv, D], q [B, Hq, D], one out [B, Hq, D] per layer
        self._engine_bufs: tuple[Any, Any, Any, list[Any]] | None = None
        self._like: Any = None           # an empty array of the appended arrays' kind
        self.seqs: list[int] = []
        self._counts: np.ndarray | None = None
        self._appended: AppendedBatch | None = None
        self._table: PageTable | None = None
        self._plan: DecodePlan | None = None
        self._step: StepTable | None = None      # the flat decodes' device table
        self._step_plan: DecodePlan | None = None
        self._shared: tuple[PageTable, CascadePlan | None] | None = None
        self._next_layer = 0

    # ------------------------------------------------------------------ sequences
    def start(self, n: int) -> None:
        """``n`` new, empty sequences become the batch (any earlier ones are freed)."""
        self._check_between("PagedBatch.start")
        self._drop()
        self.seqs = [self.pool.new_sequence() for _ in range(check_int(
            "PagedBatch.start", "n", n))]
        self._step, self._engine, self._engine_bufs = None, None, None

    def fork(self, n: int) -> None:
        """The batch of one becomes ``n`` sequences sharing its pages (``PagePool.fork``);
        the original is freed, so the shared pages are held by the forks alone."""
        fn = "PagedBatch.fork"
        self._check_between(fn)
        if len(self.seqs) != 1:
            raise InvalidArgumentError(f"{fn}: the batch must hold one sequence to fork, "
                                       f"it holds {len(self.seqs)}")
        src = self.seqs[0]
        self.seqs = [self.pool.fork(src) for _ in range(check_int(fn, "n", n))]
        self.pool.free(src)
        self._table, self._step, self._engine, self._engine_bufs = None, None, None, None

    def _drop(self) -> None:
        for s in self.seqs:
            self.pool.free(s)
        self.seqs, self._table, self._plan, self._step = [], None, None, None
        self._engine, self._engine_bufs = None, None

    def close(self) -> None:
        """Free every sequence (the pages return to the pool)."""
        self._drop()

    # ------------------------------------------------------------------ one forward
    def begin(self, counts: Sequence[int] | np.ndarray | None) -> None:
        """A forward starts: sequence ``i`` gets ``counts[i]`` new tokens (``None``: one
        each, a decode step)."""
        fn = "PagedBatch.begin"
        self._check_between(fn)
        if counts is not None:
            counts = check_int_array(fn, "counts", counts, len(self.seqs), 0, MAX_ENTRIES)
        self._counts, self._next_layer = counts, 0
        if counts is None and self.step_engine:
            if self._engine is None:
                self._engine = self._make_engine()
            # on the stream of the engine's arrays (made at the first append, e.g. torch
            # tensors: torch's current stream), like its appends and decodes
            self._engine.begin(like=self._buffers()[2])
            self._table = None

    def append(self, layer: int, k: Any, v: Any) -> None:
        """Append layer ``layer``'s new rows ``k, v [N, Hkv, D]`` (the sequences' rows in
        batch order, ``N = sum(counts)``); layers come in order ``0 .. L-1``."""
        fn = "PagedBatch.append"
        if layer != self._next_layer:
            raise InvalidArgumentError(f"{fn}: layer must be {self._next_layer} (layers are "
                                       f"appended in order, once per forward), got {layer!r}")
        if self.step_engine and self._like is None:
            self._like = _exemplar(k)          # the engine's buffers take k's kind
        if self.in_engine_step:
            assert self._engine is not None
            kb, vb, _, _ = self._buffers()
            self._fill(fn, "k", kb, k)
            self._fill(fn, "v", vb, v)
            self._engine.append(layer, kb, vb)
        elif layer == 0:
            self._appended = self.pool.append_batch(self.seqs, k, v, counts=self._counts,
                                                    layer=0)
            self._table = self.pool.page_table(self.seqs)
        else:
            assert self._appended is not None
            self.pool.write_layer(self._appended, k, v, layer=layer)
        self._next_layer += 1

    @property
    def counts(self) -> np.ndarray | None:
        """This forward's new tokens per sequence (int64 ``[B]``), ``None`` in a decode
        step (one each)."""
        return self._counts

    @property
    def table(self) -> PageTable:
        """The batch's page table after this forward's append (built once per forward)."""
        if self._table is None:
            self._table = self.pool.page_table(self.seqs)
        return self._table

    @property
    def lengths(self) -> np.ndarray:
        """Visible tokens per sequence, int32 ``[B]``."""
        if self._engine is not None and self._table is None:
            return self._engine.table.visible_lens.astype(np.int32)
        return self.table.visible_lens

    def decode(self, layer: int, q: Any, sm_scale: float) -> Any:
        """Decode attention of layer ``layer`` (appended this forward): ``q [B, Hq, D]``
        (one query per sequence) over every visible token -> ``[B, Hq, D]`` in ``q``'s
        dtype, the kind ``decode`` returns for the pool's backend."""
        fn = "PagedBatch.decode"
        self._check_appended(fn, layer)
        if self.in_engine_step:
            return self._engine_decode(fn, layer, q, sm_scale)
        k, v = self.pool.layer(layer)
        if self.cascade is not True:            # flat: the device-resident step table
            if self._step is None:
                self._step, self._step_plan = self.pool.step_table(self.seqs), None
            st = self._step
            if self._step_plan is None or not self._step_plan.matches(st):
                self._step_plan = plan_decode(st, self.num_qo_heads, self.pool.num_kv_heads,
                                              self.pool.head_dim, backend=self.pool.backend,
                                              headroom=HEADROOM, kv_dtype=self.pool.dtype)
            return decode(q, k, v, st, self._step_plan, sm_scale=sm_scale, cascade=False,
                          backend=self.pool.backend)
        table = self.table
        if self._plan is None or not self._plan.matches(table):
            self._plan = plan_decode(table, self.num_qo_heads, self.pool.num_kv_heads,
                                     self.pool.head_dim, backend=self.pool.backend,
                                     kv_dtype=self.pool.dtype)
        return decode(q, k, v, table, self._plan, sm_scale=sm_scale,
                      cascade=self._cascade_arg(table), backend=self.pool.backend)

    def _cascade_arg(self, table: PageTable) -> Any:
        if self.cascade is not True:
            return self.cascade
        if self._shared is None or self._shared[0] is not table:   # once per forward
            self._shared = (table, detect_shared_prefix(table, min_shared_pages=1))
        return self._shared[1] if self._shared[1] is not None else True

    def gather(self, layer: int, rows: Sequence[int] | None = None,
               width: int | None = None) -> tuple[Any, Any]:
        """Layer ``layer``'s visible K/V of the sequences ``rows`` (default: all), as
        dense backend arrays ``[len(rows), width, Hkv, D]``: each sequence's tokens in
        order, right-aligned (left padding), ``width`` defaulting to the longest. The
        padding holds some valid slot's data: callers mask it."""
        fn = "PagedBatch.gather"
        self._check_appended(fn, layer)
        if self.in_engine_step:
            raise InvalidArgumentError(f"{fn}: a decode step of a step_engine batch decodes "
                                       "every layer (call decode, not gather)")
        t = self.table
        r = np.arange(len(self.seqs)) if rows is None else \
            check_int_array(fn, "rows", rows, None, 0, len(self.seqs) - 1)
        n = t.visible_lens[r].astype(np.int64)
        w = int(n.max(initial=0)) if width is None else check_int(fn, "width", width, 0)
        if n.size and int(n.max()) > w:
            raise InvalidArgumentError(f"{fn}: width must be >= the longest sequence "
                                       f"({int(n.max())}), got {w}")
        p = self.pool.page_size
        pos = np.arange(w)[None, :] - (w - n)[:, None]          # token index, < 0: padding
        tok = np.maximum(pos, 0) + t.first_page_offset[r].astype(np.int64)[:, None]
        page = t.indices[np.minimum(t.indptr[r].astype(np.int64)[:, None] + tok // p,
                                    max(t.indices.size - 1, 0))] if t.indices.size else \
            np.zeros_like(tok)
        slots = np.where(pos >= 0, page.astype(np.int64) * p + tok % p, 0)
        k, v = self.pool.layer(layer)
        flat = (self.pool.num_pages * p, self.pool.num_kv_heads, self.pool.head_dim)
        with self.pool.backend.launch_context(self.pool.k):      # on the pool's device
            idx = self.pool.backend.asarray(slots.reshape(-1))
        shape = (r.size, w, self.pool.num_kv_heads, self.pool.head_dim)
        return (k.reshape(flat)[idx].reshape(shape), v.reshape(flat)[idx].reshape(shape))

    # ------------------------------------------------------------------ the engine step
    @property
    def in_engine_step(self) -> bool:
        """Whether the forward in progress is a decode step run by the engine step (its
        ``append`` / ``decode`` copy their arrays, of any strides, into fixed buffers)."""
        return self._engine is not None and self._counts is None and self.step_engine

    # ------------------------------------------------------------------ captured forwards
    def graph_state(self) -> tuple[Any, ...]:
        """What a decode forward captured in a CUDA graph depends on: the engine step,
        its plan and its table buffer's layout. When this changes (a replan, a grown
        table, a new batch), a capture made before must not be replayed: capture again."""
        e = self._engine
        return (None,) if e is None else (e, *e.launch_state)

    def begin_capture(self) -> None:
        """Inside a stream capture, right after the eager run of this decode step's
        forward: the forward's layers may run again (the same slots get the same rows),
        and the engine step's table update from its staging buffer is recorded first, so
        each replay applies what the ``begin`` before it sent (``DecodeStep.capture``
        does the same). Needs a decode step on a backend with a staging buffer (CUDA)."""
        fn = "PagedBatch.begin_capture"
        e = self._engine
        if not self.in_engine_step or e is None or not e.table.upload.staged:
            raise InvalidArgumentError(f"{fn}: only a step_engine batch's decode step on the "
                                       "cuda backend can be captured (begin(None) first)")
        if self._next_layer != self.num_layers:
            raise InvalidArgumentError(f"{fn}: run the step's forward once eagerly first "
                                       f"(it appended {self._next_layer} of {self.num_layers} "
                                       "layers)")
        self._next_layer = 0
        e.record_update(like=self._buffers()[2])

    def replayed(self) -> None:
        """A captured decode forward was replayed after this step's ``begin``: its first
        work applied the table update, and every layer was appended and decoded."""
        if self._engine is None or not self.in_engine_step:
            raise InvalidArgumentError("PagedBatch.replayed: no decode step of the engine "
                                       "was begun (begin(None) on a step_engine batch)")
        self._engine.replayed()
        self._next_layer = self.num_layers

    def _make_engine(self) -> DecodeStep:
        """A ``DecodeStep`` over the batch, on the path ``decode``'s automatic rule takes
        for it (``DecodeStep(path="auto")``: the crossover table at the batch; 16-bit
        pools may take the tensor-core partial)."""
        return DecodeStep(self.pool, self.seqs, num_qo_heads=self.num_qo_heads, path="auto",
                          headroom=HEADROOM)

    def _buffers(self) -> tuple[Any, Any, Any, list[Any]]:
        """The engine's fixed buffers for the current batch, made once in the kind of the
        arrays the forwards append (torch tensors on their device, else the backend's)."""
        if self._engine_bufs is None:
            b, hkv, d = len(self.seqs), self.pool.num_kv_heads, self.pool.head_dim
            hq, like, be, dt = self.num_qo_heads, self._like, self.pool.backend, self.pool.dtype
            with be.launch_context(self.pool.k):     # backend arrays on the pool's device
                self._engine_bufs = (_empty_like_kind(like, (b, hkv, d), dt, be),
                                     _empty_like_kind(like, (b, hkv, d), dt, be),
                                     _empty_like_kind(like, (b, hq, d), dt, be),
                                     [_empty_like_kind(like, (b, hq, d), dt, be)
                                      for _ in range(self.num_layers)])
        return self._engine_bufs

    def _fill(self, fn: str, name: str, buf: Any, x: Any) -> None:
        """``buf[...] = x`` (same shape; the forward's rows in batch order)."""
        if tuple(getattr(x, "shape", ())) != tuple(buf.shape):
            raise InvalidArgumentError(f"{fn}: {name} must be {list(buf.shape)} in a decode "
                                       f"step (one row per sequence), got "
                                       f"{list(getattr(x, 'shape', ()))}")
        got = str(getattr(x, "dtype", "")).replace("torch.", "")
        if got != self.pool.dtype:        # a copy would cast it silently
            raise InvalidArgumentError(f"{fn}: {name} must be {self.pool.dtype} (the pool's "
                                       f"dtype), got {got or type(x).__name__}")
        _copy_into(buf, x)

    def _engine_decode(self, fn: str, layer: int, q: Any, sm_scale: float) -> Any:
        """The engine step's decode of ``layer``: ``q [B, Hq, D]`` (the pool's dtype)
        copied into the step's q buffer -> the layer's own output buffer ``[B, Hq, D]``.
        The first call fixes the step's ``sm_scale`` (its prepared launches hold it)."""
        assert self._engine is not None
        scale = PLAIN.checked_score_scale(fn, check_number(fn, "sm_scale", sm_scale))
        if self._engine.sm_scale is None:
            self._engine.sm_scale = scale
        elif scale != self._engine.sm_scale:
            raise InvalidArgumentError(f"{fn}: sm_scale must stay {self._engine.sm_scale} "
                                       f"across a step_engine batch's layers, got {scale}")
        _, _, qb, outs = self._buffers()
        self._fill(fn, "q", qb, q)
        out = outs[layer]
        return self._engine.decode(layer, qb, out=out)

    # ------------------------------------------------------------------ order checks
    def _check_between(self, fn: str) -> None:
        if self._next_layer not in (0, self.num_layers):
            raise InvalidArgumentError(f"{fn}: the forward in progress appended layers 0.."
                                       f"{self._next_layer - 1} of {self.num_layers}; "
                                       "finish it first")

    def _check_appended(self, fn: str, layer: int) -> None:
        if layer != self._next_layer - 1:
            raise InvalidArgumentError(f"{fn}: layer {layer!r} is not the layer appended "
                                       f"last in this forward ({self._next_layer - 1})")


def _exemplar(x: Any) -> Any:
    """What ``_empty_like_kind`` needs of ``x``: an empty tensor on its device for a torch
    tensor (holding none of its memory), else ``None`` (the backend's own arrays)."""
    return x.new_empty((0,)) if array_kind(x) == "torch" else None


def _empty_like_kind(like: Any, shape: tuple[int, ...], dtype: str, backend: Any) -> Any:
    """A NaN-filled array of ``shape`` in ``dtype`` (an output never written shows): a
    torch tensor on ``like``'s device for a torch ``like``, else the backend's own."""
    if array_kind(like) == "torch":
        import torch
        return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device=like.device)
    return backend.asarray(np.full(shape, np.nan, numpy_dtype(dtype)))


def _copy_into(buf: Any, x: Any) -> None:
    """``buf[...] = x`` for torch tensors (``copy_``, any strides) and array kinds with
    item assignment."""
    if hasattr(buf, "copy_"):
        buf.copy_(x)
    else:
        buf[...] = x
