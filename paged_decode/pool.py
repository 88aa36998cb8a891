"""A refcounted page pool: the K/V cache of a batch of sequences, in fixed-size pages.

Layout: ``pool.k`` and ``pool.v`` are arrays on the pool's backend of shape
``[num_pages, page_size, Hkv, D]``, or ``[num_layers, num_pages, page_size, Hkv, D]``
when ``num_layers`` is given (one page allocation serves every layer; ``pool.layer(i)``
returns that layer's 4-D views). Pages are shared between sequences by refcount: ``fork``
shares every page of a sequence, and appending into a shared, partially filled last page
copies it first (copy-on-write). ``trim_front`` retires the oldest tokens of a sliding
window, releasing the pages it empties. Every operation that could run out of pages
checks first and raises ``PoolExhaustedError`` leaving the pool unchanged.

``append_batch`` appends to many sequences at once: its host bookkeeping is a fixed
number of numpy operations on per-sequence arrays (``_Sequences``), whatever the batch
size, and its K/V writes are one launch of the append kernel (``kernels/append.py``).
``append`` is a batch of one.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .append_lookahead import AppendLookahead
from .appended_batch import AppendedBatch, frozen
from .backends import Backend, check_same_device, get_backend
from .dtypes import KV_DTYPES, SUPPORTED, caller_dtype, check_dtype, itemsize
from .errors import (
    InvalidArgumentError,
    PoolExhaustedError,
    as_int64,
    check_int,
    check_shape,
    fail,
    fmt_shape,
    is_int,
    refuse_listed_bools,
)
from .fp8 import check_kv_quant, check_layer_scales, is_fp8
from .kernels.append import AppendWrite
from .page_table import MAX_ENTRIES, PageTable
from .step_table import StepTable


def _host(fn: str, name: str, x: Any) -> np.ndarray:
    """A host (numpy) copy of a small integer argument; device arrays are refused."""
    try:
        return np.asarray(x)
    except TypeError as exc:          # CuPy refuses implicit device-to-host copies
        raise InvalidArgumentError(f"{fn}: {name} must be host integers (a list or a numpy "
                                   f"array), got a {type(x).__name__}") from exc


#: the range of sequence ids (int64): an id outside it names no sequence
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


class _Sequences:
    """Per-sequence state, one row per live sequence (rows of freed sequences are
    reused); every field is an array indexed by row, so a batch is a gather.

    Fields, int64 ``[rows]`` each: ``npages``, ``head`` (a row's page ids are ``pages[row,
    head : head + npages]`` of the int32 ``[rows, width]`` table; ``head`` moves on when
    a trim releases the first pages, and every row moves back to column 0 when one
    would run out of width), ``start`` (entries of the first page retired by trims),
    ``filled`` (entries written, counted from entry 0 of the first page), ``trimmed``
    (tokens trimmed so far). Live ids are kept ascending (ids only grow) in ``ids[:n]``
    (int64), with their rows in ``id_rows``.
    """

    FIELDS = ("npages", "head", "start", "filled", "trimmed", "mark")

    def __init__(self, rows: int = 16, width: int = 8) -> None:
        self.n = 0
        # one more than rows: ids[n] is a sentinel above every id, so that a search
        # result of n compares unequal without clipping
        self.ids = np.full(rows + 1, np.iinfo(np.int64).max, np.int64)
        self.id_rows = np.zeros(rows, np.int64)
        for f in self.FIELDS:
            setattr(self, f, np.zeros(rows, np.int64))
        self.pages = np.full((rows, width), -1, np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))

    # the row fields, for mypy (set in __init__ through FIELDS)
    npages: np.ndarray
    head: np.ndarray
    start: np.ndarray
    filled: np.ndarray
    trimmed: np.ndarray
    mark: np.ndarray         # scratch for the duplicate check of a batch

    def find(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into ``ids``, found) of each id in ``q``."""
        i = np.searchsorted(self.ids[:self.n], q)
        return i, self.ids[i] == q

    def add(self, sid: int) -> int:
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.ids[self.n], self.id_rows[self.n] = sid, row
        self.n += 1
        self.ids[self.n] = np.iinfo(np.int64).max
        for f in ("npages", "head", "start", "filled", "trimmed"):
            getattr(self, f)[row] = 0
        return row

    def remove(self, index: int) -> None:
        row = int(self.id_rows[index])
        self.ids[index:self.n] = self.ids[index + 1:self.n + 1]     # (the sentinel too)
        self.id_rows[index:self.n - 1] = self.id_rows[index + 1:self.n]
        self.n -= 1
        self.npages[row] = self.head[row] = 0     # compaction skips the row
        self.free_rows.append(row)

    def row_pages(self, row: int) -> np.ndarray:
        h = int(self.head[row])
        return self.pages[row, h:h + int(self.npages[row])]

    def reserve(self, ends: np.ndarray, sizes: np.ndarray) -> None:
        """Room for rows about to hold ``sizes`` pages, up to column ``ends`` (head +
        size): when one would overflow, every row moves to column 0 (and the table
        widens if a size needs it)."""
        if ends.size and int(ends.max()) > self.pages.shape[1]:
            self._compact(int(sizes.max()))

    def _compact(self, need: int) -> None:
        """Move every row's pages to column 0; widen to at least ``need`` (doubling)."""
        width = self.pages.shape[1]
        while width < need:
            width *= 2
        n = int(self.npages.max()) if self.npages.size else 0
        cols = self.head[:, None] + np.arange(n)
        keep = np.arange(n) < self.npages[:, None]
        got = np.take_along_axis(self.pages, np.minimum(cols, self.pages.shape[1] - 1), 1)
        new = np.full((self.pages.shape[0], width), -1, np.int32)
        new[:, :n] = np.where(keep, got, -1)
        self.pages = new
        self.head[:] = 0

    def _grow_rows(self) -> None:
        old = self.pages.shape[0]
        self.ids = np.concatenate([self.ids, np.full(old, np.iinfo(np.int64).max)])
        for f in ("id_rows", *self.FIELDS):
            a = getattr(self, f)
            setattr(self, f, np.concatenate([a, np.zeros(old, a.dtype)]))
        self.pages = np.concatenate([self.pages, np.full_like(self.pages, -1)])
        self.free_rows = list(range(2 * old - 1, old - 1, -1))


class PagePool:
    """Fixed-size K/V pages with a free list, refcounts and sequences.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page.
        num_kv_heads, head_dim: K/V row geometry.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``, or an fp8 format
            (``"float8_e4m3fn"``, ``"float8_e5m2"``: one byte per element, ``docs/fp8.md``;
            the arrays are ``ml_dtypes`` fp8 on ``reference`` and the emulators, ``uint8``
            on CuPy and MLX).
        num_layers: when given, the arrays get a leading layer axis.
        backend: where the arrays live (see ``backends.get_backend``).
        k_scale, v_scale: fp8 pools only, and required there: the float32 K and V scales,
            one number for every layer or one per layer (``[num_layers]``); appended rows
            are stored as ``saturate(round_ne(x / scale))`` and read as ``stored *
            scale``. ``decode_args(layer)`` gives a decode call its format and scales.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str = "float16", *, num_layers: int | None = None,
                 backend: str | Backend | None = None, k_scale: Any = None,
                 v_scale: Any = None) -> None:
        fn = "PagePool"
        # page ids are int32 (the tables' and kernels' type)
        check_int(fn, "num_pages", num_pages, 1, int(np.iinfo(np.int32).max))
        check_int(fn, "page_size", page_size, 1, MAX_ENTRIES)
        for name, val in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(fn, name, val)
        if num_layers is not None:
            num_layers = check_int(fn, "num_layers", num_layers, note=" or None")
        self.backend = get_backend(backend, fn=fn)
        self.dtype = check_dtype(fn, "dtype", dtype, KV_DTYPES)
        #: fp8 pools: the layers' scales, float32 ``[num_layers or 1]`` (read-only);
        #: ``None`` otherwise
        self.k_scale: np.ndarray | None = None
        self.v_scale: np.ndarray | None = None
        if is_fp8(self.dtype):
            n = 1 if num_layers is None else int(num_layers)
            self.k_scale, self.v_scale = (frozen(check_layer_scales(fn, name, val, n))
                                          for name, val in (("k_scale", k_scale),
                                                            ("v_scale", v_scale)))
        else:
            check_kv_quant(fn, self.dtype, k_scale, v_scale)   # refuses scales
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.num_layers = num_layers
        lead = () if num_layers is None else (num_layers,)
        shape = (*lead, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        try:
            self.k = self.backend.zeros(shape, self.dtype)
            self.v = self.backend.zeros(shape, self.dtype)
            self._ref = np.zeros(self.num_pages, np.int32)
        except (MemoryError, ValueError) as exc:   # cupy's OutOfMemoryError is a MemoryError
            nbytes = 2 * int(np.prod(shape, dtype=np.float64)) * itemsize(self.dtype)
            raise fail(fn, f"k and v pages of shape {fmt_shape(shape)} ({self.dtype}) need "
                           f"{nbytes / 2 ** 30:.3g} GiB, which backend {self.backend.name!r} "
                           f"could not allocate ({type(exc).__name__})") from exc
        # the scales as the append kernels read them (uploaded once: no copy per append,
        # so appends can be captured in a CUDA graph)
        self._fp8: tuple[str, Any, Any] | None = None
        if self.k_scale is not None and self.v_scale is not None:
            self._fp8 = (self.dtype, self.backend.asarray(self.k_scale.copy()),
                         self.backend.asarray(self.v_scale.copy()))
        # the free list as a stack: _free[:_nfree], handed out from the top (_nfree - 1
        # first), released pages pushed on top; it starts as 0, 1, 2, ... from the top
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int32)
        self._nfree = self.num_pages
        self._seqs = _Sequences()
        self._next_id = 0
        self._version = 0     # counts appends, forks, trims and frees (write_layer)
        #: the DecodeStep whose begin() reserved slots not yet written in every layer;
        #: nothing else may add to or move the sequences until it has (``_no_open_step``)
        self._open_step: Any = None
        #: step tables following this pool's sequences (``step_table``), weakly held (a
        #: list of references: iterated at every append, cheaper than a WeakSet)
        self._table_refs: list[weakref.ReferenceType[StepTable]] = []
        #: the decode loop's fast path (``append_lookahead``): the batch of the last
        #: one-token ``append_batch`` / ``reserve_batch`` (ids, pool rows, the version it
        #: left, the ids' bytes), and the appends of that batch worked out ahead once it
        #: comes again
        self._repeat: tuple[np.ndarray, np.ndarray, int, bytes] | None = None
        self._ahead: AppendLookahead | None = None

    # ------------------------------------------------------------------ inspection
    @property
    def num_free(self) -> int:
        """Pages on the free list (refcount 0)."""
        return self._nfree

    def refcount(self, page: int) -> int:
        """References to physical page ``page`` (0: free)."""
        return int(self._ref[check_int("PagePool.refcount", "page", page, 0,
                                       self.num_pages - 1)])

    def sequences(self) -> list[int]:
        """Ids of the live sequences, ascending."""
        return self._seqs.ids[:self._seqs.n].tolist()  # type: ignore[no-any-return]

    def seq_pages(self, seq: int) -> list[int]:
        """Physical page ids of ``seq``, first to last."""
        return self._seqs.row_pages(self._row("PagePool.seq_pages", seq)).tolist()  # type: ignore[no-any-return]

    def seq_len(self, seq: int) -> int:
        """Visible tokens of ``seq``."""
        r = self._row("PagePool.seq_len", seq)
        return int(self._seqs.filled[r] - self._seqs.start[r])

    def decode_args(self, layer: int | None = None) -> dict[str, Any]:
        """The keyword arguments a decode of this pool's layer ``layer`` needs for its
        element format: ``{}`` for float pools, else ``kv_dtype``, ``k_scale`` and
        ``v_scale`` (``decode(q, *pool.layer(i), table, **pool.decode_args(i))``)."""
        i = 0 if layer is None and self.num_layers is None else layer
        n = self.num_layers or 1
        if not (is_int(i) and 0 <= int(i) < n):    # type: ignore[arg-type]
            raise InvalidArgumentError(f"PagePool.decode_args: layer must be in [0, {n})"
                                       + (" or None (the pool has one layer)"
                                          if self.num_layers is None else "")
                                       + f", got {layer!r}")
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"kv_dtype": self.dtype, "k_scale": float(self.k_scale[int(i)]),  # type: ignore[arg-type]
                "v_scale": float(self.v_scale[int(i)])}  # type: ignore[arg-type]

    def layer(self, i: int) -> tuple[Any, Any]:
        """``(k, v)`` pages of layer ``i``, each ``[num_pages, page_size, Hkv, D]``."""
        if self.num_layers is None:
            if not (is_int(i) and i == 0):
                raise InvalidArgumentError(f"PagePool.layer: the pool has one layer, got {i!r}")
            return self.k, self.v
        if not (is_int(i) and 0 <= i < self.num_layers):
            raise InvalidArgumentError(f"PagePool.layer: i must be in [0, {self.num_layers}), "
                                       f"got {i!r}")
        return self.k[int(i)], self.v[int(i)]

    # ------------------------------------------------------------------ lifecycle
    def new_sequence(self) -> int:
        """A new, empty sequence; returns its id (ids are never reused)."""
        sid = self._next_id
        self._next_id += 1
        self._seqs.add(sid)
        return sid

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (refcounts go up, nothing copied)."""
        self._no_open_step("PagePool.fork")
        src = self._row("PagePool.fork", seq)
        S = self._seqs
        pages = S.row_pages(src).copy()
        sid = self.new_sequence()
        dst = self._row("PagePool.fork", sid)
        S.reserve(np.array([pages.size]), np.array([pages.size]))    # a new row: head 0
        S.pages[dst, :pages.size] = pages
        for f in ("npages", "start", "filled", "trimmed"):
            getattr(S, f)[dst] = getattr(S, f)[src]
        self._ref[pages] += 1
        self._version += 1
        return sid

    def free(self, seq: int) -> None:
        """Drop ``seq``; pages whose refcount reaches zero return to the free list."""
        fn = "PagePool.free"
        i = self._index(fn, seq)
        S = self._seqs
        self._release(S.row_pages(int(S.id_rows[i])))
        S.remove(i)
        step, old = self._open_step, self._version
        self._version += 1
        if step is not None and step._batch is not None and step._batch.version == old \
                and int(seq) not in step._batch.seqs:
            # a sequence outside an open step's batch: its slots and table rows are as
            # they were, so the step goes on (a free of one of its own strands it)
            step._batch.version = self._version
        for table in self._tables():
            table._on_free(int(seq))

    def append(self, seq: int, k: Any, v: Any) -> None:
        """Append ``T >= 0`` tokens: ``k, v [T, Hkv, D]`` (``[L, T, Hkv, D]`` with layers).

        Crosses page boundaries as needed; copies a shared partial last page first. A
        batch of one (``append_batch``).
        """
        fn = "PagePool.append"
        self._no_open_step(fn)
        row = self._row(fn, seq)
        kb, vb = self.backend.array_arg(fn, "k", k), self.backend.array_arg(fn, "v", v)
        kshape = tuple(kb.shape)
        lead = () if self.num_layers is None else (self.num_layers,)
        dims = "[T, Hkv, D]" if not lead else "[L, T, Hkv, D]"
        if len(kshape) != len(lead) + 3:
            raise InvalidArgumentError(f"{fn}: k must be {dims}, got shape {fmt_shape(kshape)}")
        t = int(kshape[len(lead)])
        self._check_rows(fn, kb, vb, (*lead, t, self.num_kv_heads, self.head_dim), dims,
                         (k, v))
        self._append(fn, np.array([seq], np.int64), np.array([row], np.int64),
                     np.array([t], np.int64), kb, vb, 0, self.num_layers or 1)

    def append_batch(self, seqs: Sequence[int] | np.ndarray, k: Any, v: Any, *,
                     counts: Sequence[int] | np.ndarray | None = None,
                     layer: int | None = None) -> AppendedBatch:
        """Append to many sequences at once: one token each, or a ragged run each.

        Args:
            seqs: ``B`` distinct live sequence ids (a list, or an integer array: the
                fastest).
            k, v: the new rows, in sequence order (sequence ``i``'s rows follow those of
                ``i - 1``): ``[B, Hkv, D]`` (one token each) or ``[N, Hkv, D]`` with
                ``counts``; with a leading ``[L, ...]`` axis for every layer of a pool
                with ``num_layers = L``, without it for one layer (``layer=i``) or a pool
                without layers. Any supported float dtype (converted to the pool's;
                passing the pool's dtype avoids the conversion).
            counts: ``[B]`` non-negative integers adding up to ``N``: tokens per sequence
                (``None``: one each).
            layer: on a pool with layers, ``None`` writes every layer and ``i`` layer
                ``i`` only (``None`` or ``0`` without layers).

        Returns:
            ``AppendedBatch``: the new lengths and page ids per sequence, the copies made.

        The tokens take their places (page allocations, copy-on-write of shared partial
        last pages, in every layer) at this call; with ``layer=i`` the other layers' rows
        at the new positions hold stale data until ``write_layer`` writes them. The same
        result as ``append`` for each sequence in order, including which pages are handed
        out. All-or-nothing: if the pool cannot hold every sequence's tokens,
        ``PoolExhaustedError`` says which sequences needed how many pages and nothing
        changes; bad input raises ``InvalidArgumentError`` / ``InvalidDtypeError``, also
        before any change. The writes are one kernel launch on the CUDA, metal and
        emulated backends (array ops on reference and mlx).
        """
        fn = "PagePool.append_batch"
        self._no_open_step(fn)
        ahead = self._lookahead(seqs) if counts is None else None
        ids, rows = (ahead.ids, ahead.pr) if ahead is not None else self._batch_rows(fn, seqs)
        b = ids.size
        layer0, row_layers, lead = self._layer_arg(fn, layer)
        kb, vb = self.backend.array_arg(fn, "k", k), self.backend.array_arg(fn, "v", v)
        kshape = tuple(kb.shape)
        dims = "[L, B, Hkv, D]" if lead else "[B, Hkv, D]"
        if counts is not None:
            dims = dims.replace("B", "N")
        if len(kshape) != len(lead) + 3:
            raise InvalidArgumentError(f"{fn}: k must be {dims}, got shape {fmt_shape(kshape)}"
                                       + self._layer_hint(lead, layer))
        n = b if counts is None else int(kshape[len(lead)])
        self._check_rows(fn, kb, vb, (*lead, n, self.num_kv_heads, self.head_dim), dims,
                         (k, v))
        if ahead is not None:
            return self._append_ahead(ahead, kb, vb, layer0, row_layers)
        t = None if counts is None else self._counts(fn, counts, b, n)
        return self._append(fn, ids, rows, t, kb, vb, layer0, row_layers)

    def reserve_batch(self, seqs: Sequence[int] | np.ndarray, *,
                      counts: Sequence[int] | np.ndarray | None = None) -> AppendedBatch:
        """``append_batch`` without rows: the tokens take their places (pages allocated,
        shared partial last pages copied in every layer, step tables told) and every
        layer's rows are written afterwards with ``write_layer`` (the engine step: the
        model computes layer ``i``'s K/V only when it reaches layer ``i``). Until then the
        new slots hold stale data. Same arguments, result and all-or-nothing rule as
        ``append_batch``; one launch when a page is copied, none otherwise."""
        fn = "PagePool.reserve_batch"
        self._no_open_step(fn)
        ahead = self._lookahead(seqs) if counts is None else None
        if ahead is not None:
            return self._append_ahead(ahead, None, None, 0, 0)
        ids, rows = self._batch_rows(fn, seqs)
        t = None if counts is None else self._counts(fn, counts, ids.size, None)
        return self._append(fn, ids, rows, t, None, None, 0, 0)

    def _lookahead(self, seqs: Any) -> AppendLookahead | None:
        """The worked-out next append when ``seqs`` is the batch of the last one-token
        append and nothing else changed the pool since (``append_lookahead``), else
        ``None`` (the general path then checks ``seqs`` and runs). The comparison is the
        whole check of ``seqs``: that batch passed every check and no sequence was freed
        since (a free moves the version)."""
        rep = self._repeat
        if rep is None or rep[2] != self._version:
            return None
        if isinstance(seqs, np.ndarray):
            q = seqs
        elif isinstance(seqs, (list, tuple)):
            q = np.asarray(seqs)
        else:
            return None
        ids = rep[0]
        if q.dtype == np.int64 and q.ndim == 1:    # (bytes compare: a third of the time)
            if q.tobytes() != rep[3]:
                return None
        elif q.shape != ids.shape or q.dtype.kind not in "iu" or not (q == ids).all():
            return None
        ahead = self._ahead
        if ahead is None or ahead.version != self._version:
            ahead = self._ahead = AppendLookahead.arm(self, rep[1], ids)
        if ahead is None or not ahead.current():
            self._repeat = self._ahead = None       # the general path from here
            return None
        return ahead

    def _append_ahead(self, ahead: AppendLookahead, kb: Any, vb: Any, layer0: int,
                      row_layers: int) -> AppendedBatch:
        """``_append`` of the worked-out next append: the write (none for a
        reservation: no copy-on-write happens), then the commit."""
        write = ahead.write(layer0, row_layers)
        if kb is not None:
            self.k, self.v = self.backend.append_rows(self.k, self.v, kb, vb, write,
                                                      **self._fp8_kw())
        batch = ahead.commit(write, self._table_refs)
        rep = self._repeat
        assert rep is not None                  # what _lookahead found
        self._repeat = (ahead.ids, ahead.pr, self._version, rep[3])
        return batch

    def _follow(self, table: StepTable) -> None:
        """Tell ``table`` about every later change (``step_table`` registers its tables)."""
        self._table_refs.append(weakref.ref(table))

    def _tables(self) -> list[StepTable]:
        """The live step tables following this pool (dead references dropped)."""
        live = [t for t in (r() for r in self._table_refs) if t is not None]
        if len(live) != len(self._table_refs):
            self._table_refs = [weakref.ref(t) for t in live]
        return live

    def _reserve_rows(self, ids: np.ndarray, rows: np.ndarray,
                      fn: str = "PagePool.reserve_batch",
                      counts: np.ndarray | None = None) -> AppendedBatch:
        """``reserve_batch`` of distinct live sequences ``ids`` in pool rows ``rows``,
        already checked (a step table's own sequences; the table follows every free);
        ``counts`` (int64 ``[B]``, checked): tokens each (``None``: one); ``fn`` names
        the caller's call in errors (a full pool)."""
        return self._append(fn, ids, rows, counts, None, None, 0, 0)

    def step_table(self, seqs: Sequence[int] | np.ndarray, *, capacity: int | None = None,
                   page_capacity: int | None = None,
                   fn: str = "PagePool.step_table") -> StepTable:
        """A device-resident page table of ``seqs`` (in order) that follows this pool:
        every later append, trim and free reaches it, and ``decode`` brings its device
        copy up to date with one small copy (``paged_decode.step_table``). ``capacity``:
        rows (``>= len(seqs)``; the rest are empty padding rows); ``page_capacity``: page
        ids the device buffer holds before it grows (default: twice the batch's pages,
        at least 64); ``fn``: the name its errors carry (a caller's own, e.g.
        ``DecodeStep``)."""
        return StepTable(self, seqs, capacity=capacity, page_capacity=page_capacity, fn=fn)

    def write_layer(self, batch: AppendedBatch, k: Any, v: Any, *, layer: int) -> None:
        """Write layer ``layer``'s rows of the tokens ``batch`` appended: ``k, v [N, Hkv,
        D]`` as ``append_batch`` took them, to the same slots (one launch; no
        allocation, no copy). ``batch`` must be this pool's latest change: any append,
        fork, trim or free since makes its slots stale and is refused."""
        fn = "PagePool.write_layer"
        if not isinstance(batch, AppendedBatch) or batch.pool is not self:
            raise InvalidArgumentError(f"{fn}: batch must be what this pool's append_batch "
                                       f"returned, got {type(batch).__name__}")
        if batch.version != self._version:
            raise InvalidArgumentError(
                f"{fn}: batch is stale: the pool changed since that append_batch (an "
                "append, fork, trim_front or free), so its slots may be wrong")
        if self.num_layers is None and (batch.write.row_layers or layer != 0):
            raise InvalidArgumentError(f"{fn}: the pool has no layer axis (append_batch "
                                       "wrote its only layer; after reserve_batch, write "
                                       f"layer=0), got layer={layer!r}")
        if layer is None:
            raise InvalidArgumentError(f"{fn}: layer must be an integer in [0, "
                                       f"{self.num_layers}), got None")
        layer0, _, _ = self._layer_arg(fn, layer)
        kb, vb = self.backend.array_arg(fn, "k", k), self.backend.array_arg(fn, "v", v)
        self._check_rows(fn, kb, vb, (batch.num_rows, self.num_kv_heads, self.head_dim),
                         "[N, Hkv, D]", (k, v))
        w = batch.write
        if w.num_touched:
            self.k, self.v = self.backend.append_rows(
                self.k, self.v, kb, vb, AppendWrite(w.desc, w.num_rows, layer0, 1, False, w.shared),
                **self._fp8_kw())

    def trim_front(self, seq: int, n: int) -> None:
        """Retire the ``n`` oldest visible tokens (a sliding window moving on).

        Pages left holding no visible token are released; a partially filled last page
        always holds the sequence's end, so later appends continue in it.
        """
        fn = "PagePool.trim_front"
        self._no_open_step(fn)
        r = self._row(fn, seq)
        S, p = self._seqs, self.page_size
        vis = int(S.filled[r] - S.start[r])
        n = check_int(fn, "n", n, 0, vis, f" (the visible length of sequence {seq})")
        S.trimmed[r] += int(n)
        start = int(S.start[r]) + int(n)
        gone = start // p                  # leading pages holding no visible token
        pages = S.row_pages(r)
        self._release(pages[:gone])
        S.head[r] += gone
        S.npages[r] -= gone
        S.start[r] = start - gone * p
        S.filled[r] -= gone * p
        self._version += 1
        for table in self._tables():
            table._on_trim(int(seq), gone)

    def trim_back(self, seq: int, n: int) -> None:
        """Retire the ``n`` newest visible tokens of ``seq`` (speculative tokens that
        verification rejected): ``trim_back_batch([seq], [n])``."""
        fn = "PagePool.trim_back"
        row = self._row(fn, seq)
        if not is_int(n):
            raise fail(fn, f"n must be an integer, got {type(n).__name__} {n!r}")
        self._trim_back(fn, np.array([seq], np.int64), np.array([n], np.int64),
                        np.array([row], np.int64))

    def trim_back_batch(self, seqs: Sequence[int] | np.ndarray,
                        counts: Sequence[int] | np.ndarray) -> None:
        """Retire the ``counts[i]`` newest visible tokens of each sequence ``seqs[i]``
        (distinct live ids; ``0 <= counts[i] <=`` its visible length), as speculative
        decoding drops the draft tokens verification rejected. The positions the next
        appends take are the retired ones; pages left holding none of a sequence's tokens
        lose its reference (freed at the last one), and a kept last page shared with a
        fork is copied on the next append into it, as always. Step tables follow.
        All-or-nothing: bad input raises before any change."""
        fn = "PagePool.trim_back_batch"
        ids, rows = self._batch_rows(fn, seqs)
        self._trim_back(fn, ids, self._counts(fn, counts, ids.size, None), rows)

    def _trim_back(self, fn: str, ids: np.ndarray, n: np.ndarray, rows: np.ndarray) -> None:
        """``trim_back_batch`` of the live sequences ``ids`` in pool rows ``rows``."""
        self._no_open_step(fn)
        S, p = self._seqs, self.page_size
        vis = S.filled[rows] - S.start[rows]
        over = n > vis
        if over.any() or (n < 0).any():
            i = int(np.argmax(over | (n < 0)))
            raise InvalidArgumentError(
                f"{fn}: the count for sequence {int(ids[i])} must be in [0, {int(vis[i])}] "
                f"(its visible length), got {int(n[i])}")
        if not n.any():
            return
        filled = S.filled[rows] - n
        empty = filled == S.start[rows]          # nothing visible left: no page kept
        keep = np.where(empty, 0, -(-filled // p))
        npg = S.npages[rows]
        drop = npg - keep
        if drop.any():
            r = np.repeat(rows, drop)
            within = np.arange(int(drop.sum())) - np.repeat(np.cumsum(drop) - drop, drop)
            pages = S.pages[r, S.head[r] + keep[np.repeat(np.arange(rows.size), drop)]
                            + within]
            self._release(pages, distinct=False)     # forks may drop the same page
        S.npages[rows] = keep
        S.filled[rows] = np.where(empty, 0, filled)
        S.start[rows] = np.where(empty, 0, S.start[rows])
        self._version += 1
        for table in self._tables():
            table._on_trim_back(ids)

    # ------------------------------------------------------------------ tables
    def page_table(self, seqs: Sequence[int] | np.ndarray) -> PageTable:
        """The CSR page table of ``seqs``, in order (a sequence may appear twice)."""
        fn = "PagePool.page_table"
        rows = self._lookup(fn, self._ids_array(fn, seqs))
        S, p = self._seqs, self.page_size
        n = S.npages[rows]
        indptr = np.zeros(rows.size + 1, np.int64)
        np.cumsum(n, out=indptr[1:])
        rep = np.repeat(rows, n)
        within = np.arange(int(indptr[-1])) - np.repeat(indptr[:-1], n)
        indices = S.pages[rep, S.head[rep] + within]
        filled, start = S.filled[rows], S.start[rows]
        lpl = np.where(n > 0, filled - (n - 1) * p, 0)
        fpo = np.where(n > 0, start, 0)
        rope = S.trimmed[rows] + filled - start
        return PageTable.build(indices, indptr, lpl, page_size=p, first_page_offset=fpo,
                               rope_positions=rope, num_pages=self.num_pages)

    # ------------------------------------------------------------------ the batched append
    def _append(self, fn: str, ids: np.ndarray, rows: np.ndarray, t: np.ndarray | None,
                kb: Any, vb: Any, layer0: int, row_layers: int) -> AppendedBatch:
        """Append ``t[i]`` tokens (``t`` None: one each, the decode step) to the sequence
        in row ``rows[i]`` (ids ``ids``), all arguments checked; rows of ``kb``/``vb`` in
        sequence order. Plans everything, launches the write, then commits the
        bookkeeping (a failing launch changes no visible entry: it writes only fresh pages
        and slots past every sequence's end)."""
        S, P = self._seqs, self.page_size
        npg, fil = S.npages[rows], S.filled[rows]
        end = S.head[rows] + npg                # one past the last page's column
        room = npg * P - fil                    # in [0, P): a last page is never empty
        width = S.pages.shape[1]
        last = S.pages.reshape(-1)[rows * width + end - 1]  # (garbage where npg == 0)
        if t is None:
            partial = room > 0
            cow = self._copy_on_write(partial, last)
            fresh = ~partial                    # bool; disjoint from cow
            need = fresh | cow
        else:
            partial = (room > 0) & (t > 0)      # the run starts in the last page
            cow = self._copy_on_write(partial, last)
            fresh = np.maximum((t - room + P - 1) // P, 0)
            need = fresh + cow
        total = int(need.sum())
        if total > self._nfree:
            raise self._exhausted(fn, ids, t, need, cow, total)
        # pages in the order append() would pop them: sequence by sequence, the copy first
        taken = self._free[self._nfree - total:self._nfree][::-1].copy()
        if t is None:
            cols = self._one_each(rows, npg, fil, partial, cow, last, taken)
        else:
            cols = self._ragged(rows, npg, fil, t, partial, cow, fresh, need, last, taken)
        desc, col_rows, k, from_taken = cols
        write = AppendWrite(desc, rows.size if t is None else int(t.sum()), layer0,
                            row_layers, True)
        if kb is None:              # reserve_batch: only the copies, in every layer
            if write.copies:
                row_dt = "float16" if self._fp8 is not None else self.dtype
                none = self.backend.zeros((1, self.num_kv_heads, self.head_dim), row_dt)
                self.k, self.v = self.backend.append_rows(self.k, self.v, none, none, write,
                                                          **self._fp8_kw())
        elif desc.shape[1]:
            self.k, self.v = self.backend.append_rows(self.k, self.v, kb, vb, write,
                                                      **self._fp8_kw())
        # commit
        pages_after, filled_after = npg + fresh, fil + (1 if t is None else t)
        S.reserve(end + fresh, pages_after)
        r = col_rows[from_taken]
        S.pages.reshape(-1)[r * S.pages.shape[1] + S.head[r] + k[from_taken]] = \
            desc[0][from_taken]
        if cow.any():
            np.subtract.at(self._ref, last[cow], 1)
        self._ref[taken] = 1
        self._nfree -= total
        S.npages[rows] = pages_after
        S.filled[rows] = filled_after
        self._version += 1
        # a one-token append of the same batch next may take the fast path
        self._repeat = (ids.copy(), rows.copy(), self._version, ids.tobytes()) \
            if t is None else None
        if self._table_refs:
            first_changed = npg - cow
            for table in self._tables():
                table._on_append(ids, first_changed)
        return AppendedBatch(self, write, ids, t, npg, pages_after, filled_after,
                             S.start[rows], cow, last, taken, need)

    def _one_each(self, rows: np.ndarray, npg: np.ndarray, fil: np.ndarray,
                  partial: np.ndarray, cow: np.ndarray, last: np.ndarray,
                  taken: np.ndarray) -> tuple[np.ndarray, ...]:
        """(desc, row of each column, page-list entry of each column, whether the
        column's page is newly taken) for one token per sequence: column i is sequence
        i, writing entry ``fil % P`` of its last page, a fresh page or the copy."""
        P = self.page_size
        from_taken = ~partial | cow
        desc = np.empty((5, rows.size), np.int32)
        desc[0] = last
        desc[0][from_taken] = taken             # one page each, in batch order
        desc[1] = np.where(cow, last, desc[0])
        k = npg - partial
        desc[3] = fil - k * P
        desc[2] = np.arange(rows.size) - desc[3]
        desc[4] = desc[3] + 1
        return desc, rows, k, from_taken

    def _ragged(self, rows: np.ndarray, npg: np.ndarray, fil: np.ndarray, t: np.ndarray,
                partial: np.ndarray, cow: np.ndarray, fresh: np.ndarray, need: np.ndarray,
                last: np.ndarray, taken: np.ndarray) -> tuple[np.ndarray, ...]:
        """``_one_each`` for runs of ``t[i] >= 0`` tokens: one column per touched page;
        the j-th page sequence i touches is its page-list entry ``npg - partial + j``."""
        P = self.page_size
        touched = partial + fresh
        seq_of = np.repeat(np.arange(rows.size), touched)
        j = np.arange(seq_of.size) - np.repeat(np.cumsum(touched) - touched, touched)
        first = partial[seq_of] & (j == 0)      # the old last page, or its copy
        copied = first & cow[seq_of]
        from_taken = ~first | copied
        off = (np.cumsum(need) - need)[seq_of]  # the sequence's first page in taken
        # (-1 where first & ~copied: a valid index, and not used there)
        ti = off + np.where(copied, 0, cow[seq_of] + j - partial[seq_of])
        page = np.where(from_taken, taken[ti], last[seq_of]) if taken.size else last[seq_of]
        k = (npg - partial)[seq_of] + j
        f_s, kp = fil[seq_of], k * P
        desc = np.empty((5, k.size), np.int32)
        desc[0] = page
        desc[1] = np.where(copied, last[seq_of], page)
        desc[2] = (np.cumsum(t) - t)[seq_of] - f_s + kp
        desc[3] = np.maximum(f_s - kp, 0)
        desc[4] = np.minimum(f_s + t[seq_of] - kp, P)
        return desc, rows[seq_of], k, from_taken

    def _copy_on_write(self, partial: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Which sequences copy their shared partial last page: each that appends into a
        page with refcount > 1, except that when every holder of the page appends in
        this batch the last one (in batch order) writes it in place, as ``append`` one
        sequence at a time would (the refcount drops by one with each copy)."""
        shared = partial & (self._ref[last] > 1)
        if not shared.any():
            return shared
        cand = np.flatnonzero(shared)
        cow = np.zeros(partial.size, bool)
        order = cand[np.argsort(last[cand], kind="stable")]
        pg = last[order]
        new = np.r_[True, pg[1:] != pg[:-1]]
        pos = np.arange(pg.size)
        rank = pos - np.maximum.accumulate(np.where(new, pos, 0))
        cow[order[rank < self._ref[pg] - 1]] = True
        return cow

    def _exhausted(self, fn: str, ids: np.ndarray, t: Any, need: np.ndarray,
                   cow: np.ndarray, total: int) -> PoolExhaustedError:
        have = f"the pool has {self._nfree} of {self.num_pages}"
        if fn == "PagePool.append":
            return PoolExhaustedError(f"{fn}: need {total} free pages for {int(t[0])} tokens, "
                                      f"{have}; nothing was changed")
        who = np.flatnonzero(need)
        parts = [f"seq {int(ids[i])}: {int(need[i])}" + (" (1 copy-on-write)" if cow[i] else "")
                 for i in who[:16]]
        more = f", and {who.size - 16} more" if who.size > 16 else ""
        return PoolExhaustedError(
            f"{fn}: need {total} free pages for {who.size} of the {ids.size} sequences "
            f"({', '.join(parts)}{more}), {have} free; nothing was changed")

    def _fp8_kw(self) -> dict[str, Any]:
        """``append_rows``' fp8 argument (format and device scales), empty for float pools."""
        return {} if self._fp8 is None else {"fp8": self._fp8}

    # ------------------------------------------------------------------ argument checks
    def _check_rows(self, fn: str, kb: Any, vb: Any, want: tuple[int, ...], dims: str,
                    given: tuple[Any, Any]) -> None:
        """``kb`` / ``vb``: the backend's arrays of the caller's rows ``given`` (k, v)."""
        check_same_device(fn, self.backend, (("the pool", self.k), ("k", kb), ("v", vb)))
        if tuple(kb.shape) != want or tuple(vb.shape) != want:
            check_shape(fn, "k", tuple(kb.shape), want, dims)
            check_shape(fn, "v", tuple(vb.shape), want, dims)
        # judged by the caller's dtypes (a backend may hold them in another: MLX takes
        # float64 as float32, fp8 as uint8); rows in the pool's own dtype pass as they are
        kd = caller_dtype(given[0], self.backend.dtype_of(kb))
        vd = caller_dtype(given[1], self.backend.dtype_of(vb))
        if kd != self.dtype or vd != self.dtype or self._fp8 is not None:
            # fp8 pools quantize float rows (stored bytes are not taken as rows)
            check_dtype(fn, "k", kd, SUPPORTED)
            check_dtype(fn, "v", vd, SUPPORTED)

    def _layer_arg(self, fn: str, layer: Any) -> tuple[int, int, tuple[int, ...]]:
        """(first layer written, layers written, the rows' leading shape) for ``layer``."""
        if layer is not None and not is_int(layer):
            raise InvalidArgumentError(f"{fn}: layer must be an integer or None, got "
                                       f"{layer!r}")
        if self.num_layers is None:
            if layer not in (None, 0):
                raise InvalidArgumentError(f"{fn}: layer must be None or 0 (the pool has no "
                                           f"layer axis), got {layer}")
            return 0, 1, ()
        if layer is None:
            return 0, self.num_layers, (self.num_layers,)
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"{fn}: layer must be in [0, {self.num_layers}) or "
                                       f"None, got {layer}")
        return int(layer), 1, ()

    def _layer_hint(self, lead: tuple[int, ...], layer: Any) -> str:
        if self.num_layers is None:
            return ""
        return (" (every layer: layer=None)" if lead else f" (one layer: layer={layer})")

    def _counts(self, fn: str, counts: Any, b: int, n: int | None) -> np.ndarray:
        refuse_listed_bools(fn, "counts", counts)
        c = _host(fn, "counts", counts)
        if c.ndim != 1 or c.size != b:
            raise InvalidArgumentError(f"{fn}: counts must have shape [B] = [{b}] (one count "
                                       f"per sequence), got {fmt_shape(c.shape)}")
        if b and (c.dtype.kind not in "iu" or c.dtype == np.bool_):
            raise InvalidArgumentError(f"{fn}: counts must hold integers, got dtype {c.dtype}")
        c = as_int64(fn, "counts", c)
        if b and int(c.min()) < 0:
            i = int(np.argmin(c))
            raise InvalidArgumentError(f"{fn}: counts must be >= 0, got counts[{i}] = "
                                       f"{int(c[i])}")
        most = self.num_pages * self.page_size     # no sequence can hold more: and the page
        if b and int(c.max()) > most:              # arithmetic of a larger one overflows
            i = int(np.argmax(c))
            raise PoolExhaustedError(f"{fn}: counts[{i}] = {int(c[i])} is more tokens than "
                                     f"the pool's {self.num_pages} pages x {self.page_size} "
                                     f"hold ({most}); nothing was changed")
        if n is not None and int(c.sum()) != n:
            raise InvalidArgumentError(f"{fn}: counts must add up to the rows of k and v "
                                       f"(N = {n}), got a sum of {int(c.sum())}")
        return c

    def _ids_array(self, fn: str, seqs: Any) -> np.ndarray:
        """``seqs`` as int64 ``[B]``; bools and non-integers are refused."""
        if isinstance(seqs, (str, bytes)) or not (hasattr(seqs, "__iter__")
                                                  or hasattr(seqs, "__array__")):
            raise fail(fn, f"seqs must be a sequence of sequence ids, got "
                           f"{type(seqs).__name__} {seqs!r}")
        refuse_listed_bools(fn, "seqs", seqs)
        q = _host(fn, "seqs", seqs)
        if q.ndim != 1:
            raise InvalidArgumentError(f"{fn}: seqs must be a 1-D sequence of sequence ids, "
                                       f"got shape {fmt_shape(q.shape)}")
        if q.size and (q.dtype.kind not in "iu" or q.dtype == np.bool_):
            raise InvalidArgumentError(f"{fn}: seqs must hold sequence ids (integers), got "
                                       f"dtype {q.dtype}")
        # a copy: the result's ``seqs`` is made read-only, the caller's array must not be
        return np.array(as_int64(fn, "seqs", q), np.int64)

    def _lookup(self, fn: str, q: np.ndarray) -> np.ndarray:
        """Rows of the live ids ``q`` (int64)."""
        i, found = self._seqs.find(q)
        if not found.all():
            bad = int(np.argmin(found))
            where = f"seqs[{bad}]: " if q.size > 1 else ""
            raise self._unknown(fn, int(q[bad]), where)
        return self._seqs.id_rows[i]  # type: ignore[no-any-return]

    def _batch_rows(self, fn: str, seqs: Any) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of a batch of distinct live sequences."""
        q = self._ids_array(fn, seqs)
        rows = self._lookup(fn, q)
        pos = np.arange(rows.size)
        mark = self._seqs.mark
        mark[rows] = pos                        # the last position of each row wins
        dup = mark[rows] != pos
        if dup.any():
            i = int(np.argmax(dup))
            raise InvalidArgumentError(f"{fn}: seqs must not repeat a sequence, got "
                                       f"{int(q[i])} at seqs[{i}] and seqs[{int(mark[rows[i]])}]")
        return q, rows

    def _no_open_step(self, fn: str) -> None:
        """Raise while a ``DecodeStep``'s ``begin`` has reserved token slots that some
        layer has not written: an append, fork or trim now would leave those slots
        unwritten, and every later decode would attend to them."""
        step = self._open_step
        if step is not None:
            if step._is_stranded:
                raise InvalidArgumentError(
                    f"{fn}: a DecodeStep's begin() reserved token slots that layers "
                    f"{step.unwritten_layers()} can no longer write (one of its sequences "
                    "was freed): free its other sequences that hold one, then call the "
                    "step's set_sequences")
            raise InvalidArgumentError(
                f"{fn}: a DecodeStep's begin() reserved a token slot in its sequences that "
                f"layers {step.unwritten_layers()} have not written yet: append every layer "
                "first (free() is allowed, to drop a sequence)")

    def _index(self, fn: str, seq: Any) -> int:
        """Position of live sequence ``seq`` in the id list."""
        if not is_int(seq):   # True would find sequence 1
            raise fail(fn, f"seq must be a sequence id (an int), got {type(seq).__name__} "
                           f"{seq!r}")
        if not _INT64_MIN <= seq <= _INT64_MAX:    # ids are int64: no such sequence
            raise self._unknown(fn, seq)
        i, found = self._seqs.find(np.array([seq], np.int64))
        if not found[0]:
            raise self._unknown(fn, seq)
        return int(i[0])

    def _row(self, fn: str, seq: Any) -> int:
        return int(self._seqs.id_rows[self._index(fn, seq)])

    def _unknown(self, fn: str, seq: Any, where: str = "") -> InvalidArgumentError:
        return InvalidArgumentError(f"{fn}: {where}unknown sequence {seq!r}; live sequences: "
                                    f"{self.sequences()[:16]}")

    def _release(self, pages: np.ndarray, *, distinct: bool = True) -> None:
        """Drop one reference per entry of ``pages``; pages reaching zero are pushed on the
        free list in order (of first appearance). ``distinct=False``: a page may repeat
        (forks retiring the same shared page in one ``trim_back_batch``), each entry
        dropping one reference."""
        if distinct:
            self._ref[pages] -= 1
        else:
            np.subtract.at(self._ref, pages, 1)
            _, first = np.unique(pages, return_index=True)
            pages = pages[np.sort(first)]
        gone = pages[self._ref[pages] == 0]
        self._free[self._nfree:self._nfree + gone.size] = gone
        self._nfree += gone.size
