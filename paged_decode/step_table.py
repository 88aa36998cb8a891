"""A decode batch's page table that lives on the device and follows its pool in place.

``PagePool.step_table(seqs)`` makes one. The pool tells the table about every change to
its sequences (appends, front trims, frees); the table accumulates what changed. Bringing
the device copy up to date takes two parts:

- ``send`` (host): the delta (the new per-row header and the changed page ids only) is
  built and sent with **one** small host-to-device copy (``step_upload.py``; an engine
  step's append descriptor travels in the same copy); the device update is then
  *pending*;
- ``apply_pending`` (device): the table-update launch (``kernels/table_update.py``;
  on the CUDA dialect after a device-to-device copy of the buffer into a scratch one).

``flush`` (which ``decode`` calls) does both. ``DecodeStep.begin`` does only the first:
the update runs as the step's first device work, inside the captured graph on replay
(``record_update``), or eagerly before the first reader of the device table
(``device_arrays``, ``page_table``, ``flush``, a decode, the step's append / decode).
Nothing is rebuilt or re-validated per step: the pool produced every entry.
``page_table()`` builds the immutable, validated host ``PageTable`` on request (for
inspection, cascade detection and the array-op paths).

Rows: ``capacity`` rows; row ``i`` is ``sequences[i]`` (``-1``: an empty padding row that
decodes to zeros and a ``-inf`` LSE). A decode through a step table takes ``q
[capacity, Hq, D]``, so a CUDA graph captured for a capacity stays valid while sequences
come and go (``set_sequences``). Page capacity: the device buffer holds up to
``page_capacity`` page ids; a batch that outgrows it (or its rows) reallocates, which
bumps ``layout`` (captured graphs and prepared calls over the old buffer are then stale:
``decode`` notices, a captured step says so).

Device buffer layout (int32, ``kernels/table_update.TABLE_SECTIONS``): ``indptr
[cap+1]``, ``last_page_len [cap]``, ``first_page_offset [cap]``, ``indices [page_cap]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, check_int
from .kernels.table_update import delta_header_words, table_views, table_words
from .page_table import MAX_ENTRIES, PageTable
from .step_upload import StepUpload

_CLEAN = np.iinfo(np.int64).max // 4       # "no page changed" in _dirty_from


class StepTable:
    """The device-resident CSR table of a batch of a ``PagePool``'s sequences.

    Attributes (host, read-only views, current after ``flush``): ``batch_size`` (=
    ``capacity``), ``page_size``, ``sequences`` (int64 ``[capacity]``, ``-1`` padding),
    ``pages_per_request`` / ``visible_lens`` (int64 ``[capacity]``), ``last_page_len`` /
    ``first_page_offset`` (int32 ``[capacity]``), ``total_visible``,
    ``version`` (counts flushes that changed the device copy), ``layout`` (counts
    reallocations of the device buffer), ``batches`` (counts ``set_sequences`` calls).
    """
    # host state (int64 [capacity] each unless noted), set in _alloc / _set_rows / flush
    _ids: np.ndarray             # sequence of each row, -1 padding
    _pool_rows: np.ndarray       # the pool's row of each sequence
    _src: np.ndarray             # pending: the old row each row keeps pages of, -1 none
    _front: np.ndarray           # pending: pages trimmed from the front since the flush
    _dirty_from: np.ndarray      # pending: first page position that may have changed
    _npages: np.ndarray          # pages per row in the device copy
    _npages_total: int           # their sum
    _mirror_src: np.ndarray      # the last delta sent (its header is the device header)
    _mirror: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    _buf: Any                    # the device buffer (int32, TABLE_SECTIONS)
    _scratch: Any                # the old table during a CUDA-dialect update
    upload: StepUpload           # the one-copy staging of the delta (and a step's desc)
    _device_pending: bool        # a delta was sent and not yet applied on the device
    _pending_delta: Any          # what the update reads: the staged view or a host delta
    _staged_idem: bool           # applying the staged delta again changes nothing
    _view: tuple[int, PageTable] | None
    _live: np.ndarray            # bool: rows holding a sequence
    _pr: np.ndarray              # pool row of each table row (0 for padding)
    _rows: np.ndarray            # arange(capacity)
    _all_live: bool
    _simple: bool                # pending changes are appends only, rows in place

    # ``pool`` is the PagePool that made the table (not imported: the pool imports this
    # module, and only the pool constructs a StepTable)
    def __init__(self, pool: Any, seqs: Sequence[int] | np.ndarray, *,
                 capacity: int | None = None, page_capacity: int | None = None,
                 fn: str = "PagePool.step_table") -> None:
        self.pool, self.backend = pool, pool.backend
        self.page_size = pool.page_size
        ids, rows = pool._batch_rows(fn, seqs)
        b = int(ids.size)
        cap = b if capacity is None else check_int(fn, "capacity", capacity, 1, MAX_ENTRIES,
                                                    note=f" (at least the {b} sequences)")
        if cap < b:
            raise InvalidArgumentError(f"{fn}: capacity must be at least the number of "
                                       f"sequences ({b}), got {cap}")
        if cap < 1:
            raise InvalidArgumentError(f"{fn}: seqs must name at least one sequence when no "
                                       "capacity is given")
        need = int(pool._seqs.npages[rows].sum())
        # default: room to double (a reallocation re-uploads every page and makes
        # captured graphs stale)
        pcap = max(64, 2 * need) if page_capacity is None else check_int(
            fn, "page_capacity", page_capacity, 1, MAX_ENTRIES, note=" or None")
        if pcap < need:
            raise InvalidArgumentError(f"{fn}: page_capacity must hold the batch's {need} "
                                       f"pages, got {pcap}")
        # a row never holds a page twice: more ids than rows x pool pages is never used
        most = max(64, 2 * need, cap * int(pool.num_pages))
        if pcap > most:
            raise InvalidArgumentError(
                f"{fn}: page_capacity must be at most {most} (the largest of 64, twice the "
                f"batch's {need} pages and {cap} rows x {pool.num_pages} pool pages: a row "
                f"never holds a page twice), got {pcap}")
        self.version = 0
        self.layout = 0
        self.batches = 0
        #: the layout a graph's table update was recorded for (``record_update``)
        self._recorded: int | None = None
        def too_big(exc: Exception) -> InvalidArgumentError:
            return InvalidArgumentError(
                f"{fn}: a table of {cap} rows and {pcap} pages needs "
                f"{4 * table_words(cap, pcap) / 2 ** 30:.3g} GiB twice over, which backend "
                f"{self.backend.name!r} could not allocate ({type(exc).__name__})")
        try:
            self._alloc(cap, pcap)
        except (MemoryError, ValueError) as exc:   # CuPy's OutOfMemoryError is a MemoryError
            raise too_big(exc) from exc
        try:                                        # the host rows of `cap` sequences
            self._set_rows(np.concatenate([ids, np.full(cap - b, -1, np.int64)]),
                           np.concatenate([rows, np.full(cap - b, -1, np.int64)]),
                           np.full(cap, -1, np.int64))
        except MemoryError as exc:
            raise too_big(exc) from exc
        pool._follow(self)
        self.flush()

    # ------------------------------------------------------------------ inspection
    @property
    def capacity(self) -> int:
        """Rows of the table, padding rows included."""
        return self._cap

    @property
    def batch_size(self) -> int:
        """Rows of the table (``capacity``): the ``B`` of a decode through it."""
        return self._cap

    @property
    def page_capacity(self) -> int:
        """Page ids the device buffer holds before it grows (``layout`` changes)."""
        return self._pcap

    @property
    def sequences(self) -> np.ndarray:
        """Sequence id of each row, int64 ``[capacity]`` (``-1``: padding); a
        read-only copy."""
        out = self._ids.copy()
        out.flags.writeable = False
        return out

    @property
    def num_live(self) -> int:
        """Rows holding a sequence (not padding)."""
        return self._n_live

    def live_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(table rows, sequence ids, pool rows)`` of the live rows, int64 (read-only:
        cached until the batch changes)."""
        return self._live_rows

    @property
    def pages_per_request(self) -> np.ndarray:
        """Pages of each row, int64 ``[capacity]`` (read-only;
        pending changes are flushed first)."""
        return self._mirrors()[0]

    @property
    def visible_lens(self) -> np.ndarray:
        """Visible tokens of each row, int64 ``[capacity]`` (read-only;
        pending changes are flushed first)."""
        return self._mirrors()[1]

    @property
    def last_page_len(self) -> np.ndarray:
        """Entries used in each row's last page, int32 ``[capacity]`` (0 without
        pages; read-only; pending changes are flushed first)."""
        return self._mirrors()[2]

    @property
    def first_page_offset(self) -> np.ndarray:
        """Entries of each row's first page retired by front trims, int32
        ``[capacity]`` (read-only; pending changes are flushed first)."""
        return self._mirrors()[3]

    @property
    def total_visible(self) -> int:
        """Visible tokens over all rows."""
        return int(self.visible_lens.sum(dtype=np.int64))

    @property
    def total_pages(self) -> int:
        """Pages over all rows."""
        return int(self.pages_per_request.sum(dtype=np.int64))

    @property
    def max_page_id(self) -> int:
        """An upper bound of every page id in the table (the pool's last page)."""
        return self.pool.num_pages - 1

    @property
    def pending(self) -> bool:
        """Whether the device copy is behind: the pool changed the batch since the last
        ``send`` (``changed``), or a sent delta waits for its device update."""
        return self._dirty or self._device_pending

    @property
    def changed(self) -> bool:
        """Whether the pool changed the batch since the last ``send`` (or ``flush``)."""
        return self._dirty

    @property
    def buffer(self) -> Any:
        """The device buffer (int32, ``kernels/table_update.TABLE_SECTIONS``), current
        after ``flush`` (the address, for checks, at any time)."""
        return self._buf

    def device_arrays(self) -> tuple[Any, Any, Any, Any]:
        """``indices, indptr, last_page_len, first_page_offset`` as views of the device
        buffer (``launches.TABLE_FIELDS`` order), current after ``flush``."""
        self._require_flushed()
        return self._views

    def page_table(self) -> PageTable:
        """The immutable, validated host ``PageTable`` of the batch (``capacity`` rows,
        padding rows empty), built from the pool's state (cached until the next change)."""
        self._require_flushed()
        if self._view is None or self._view[0] != self.version:
            self._view = (self.version, self._build_view())
        return self._view[1]

    # ------------------------------------------------------------------ membership
    def set_sequences(self, seqs: Sequence[int] | np.ndarray) -> None:
        """Make ``seqs`` the batch, in this order (padding rows after them). Sequences
        already in the table keep their device pages (only new ones are uploaded); more
        sequences than ``capacity`` reallocate (``layout`` changes)."""
        fn = "StepTable.set_sequences"
        step = self.pool._open_step
        if step is not None and step.table is self:
            raise InvalidArgumentError(
                f"{fn}: a DecodeStep over this table has begun a step whose new slots "
                f"have not been written in layers {step.unwritten_layers()} (its rows are "
                "this batch's): append those layers first (or free the sequences holding "
                "them), and change a step's batch with DecodeStep.set_sequences")
        ids, rows = self.pool._batch_rows(fn, seqs)
        self.batches += 1
        b = int(ids.size)
        grew = b > self._cap
        if grew:   # a new buffer: every row is rebuilt from the pool at the flush
            self._grow(fn, b, self._pcap)
        pad = self._cap - b
        pos, found = self._find(ids)                 # rows of the current (host) batch
        at = np.where(found & (not grew), pos, -1)
        # `_src` maps host rows to the device rows they keep pages of; a batch set since
        # the last flush is not on the device yet, so compose through it (a row of the
        # current batch that is not on the device itself stays -1: sent whole)
        old_src, old_front, old_dirty = self._src, self._front, self._dirty_from
        src = np.where(at >= 0, old_src[np.maximum(at, 0)], -1)
        self._set_rows(np.concatenate([ids, np.full(pad, -1, np.int64)]),
                       np.concatenate([rows, np.full(pad, -1, np.int64)]),
                       np.concatenate([src, np.full(pad, -1, np.int64)]))
        kept = np.flatnonzero(self._src >= 0)        # the pending trims and appends
        self._front[kept] = old_front[at[kept]]      # travel with their sequence's row
        self._dirty_from[kept] = old_dirty[at[kept]]
        self._simple = self._simple and not self._front.any()
        self._dirty = True

    # ------------------------------------------------------------------ the pool's events
    def _on_append(self, ids: np.ndarray, first_changed: np.ndarray) -> None:
        """Sequences ``ids`` appended; their page ids from ``first_changed`` on are new."""
        if ids is self._live_rows[1]:               # the engine's case: every live row
            t, fc = self._live_rows[0], first_changed   # (a freed row leaves a hole)
        elif ids.size == self._n_live and np.array_equal(ids, self._ids[:ids.size]):
            t, fc = np.arange(ids.size), first_changed  # the first rows, in order
        else:
            pos, found = self._find(ids)
            if not found.any():
                return
            t, fc = pos[found], first_changed[found]
        self._dirty_from[t] = np.minimum(self._dirty_from[t], fc)   # ids are distinct
        self._dirty = True

    def _on_trim(self, seq: int, gone: int) -> None:
        pos, found = self._find(np.array([seq], np.int64))
        if not found[0]:
            return
        t = int(pos[0])
        if gone:
            self._simple = False
        self._front[t] += gone
        self._dirty_from[t] = max(0, int(self._dirty_from[t]) - gone)
        self._dirty = True

    def _on_trim_back(self, ids: np.ndarray) -> None:
        """Sequences ``ids`` lost their newest tokens: each keeps the first of its page
        ids (the delta takes the fewer pages and the new lengths from the pool)."""
        if self._find(ids)[1].any():
            self._dirty = True

    def _on_free(self, seq: int) -> None:
        """A freed sequence leaves its row empty (a padding row)."""
        pos, found = self._find(np.array([seq], np.int64))
        if not found[0]:
            return
        t = int(pos[0])
        ids, rows, src = self._ids.copy(), self._pool_rows.copy(), self._src.copy()
        ids[t] = rows[t] = src[t] = -1
        front, dirty = self._front, self._dirty_from
        self._set_rows(ids, rows, src)
        self._front, self._dirty_from = front, dirty
        self._simple = self._simple and not front.any()
        self._dirty = True

    # ------------------------------------------------------------------ the device update
    def flush(self) -> bool:
        """Bring the device copy up to date, on the device of the table's buffer and the
        current stream there: the delta's one host-to-device copy and the table-update
        launch (or what of them is still pending; nothing when the pool changed nothing).
        Returns whether it updated. ``decode`` calls it on its own stream
        (``update_device``)."""
        if not self.pending:
            return False
        with self.backend.launch_context(self._buf):
            return self.update_device()

    def update_device(self) -> bool:
        """``flush`` inside the launch context the caller entered (the stream a decode
        runs on, so the update is ordered before its kernels)."""
        if self._dirty:
            self._send()
        return self.apply_pending()

    def send(self, desc: np.ndarray | None = None,
             steady: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """The host part of an update, on the current stream: the delta of what the pool
        changed (or ``steady``'s precomputed ``(delta, npages)``, ``steady_step.py``) and
        ``desc`` (an engine step's append descriptor, int32 ``[5, capacity]``, into
        ``upload.desc``) in one copy; the device update is then pending
        (``apply_pending``, or a captured step's ``record_update``). A delta sent before
        and not yet applied is applied first (its staging is about to be overwritten)."""
        if desc is not None and not (isinstance(desc, np.ndarray) and desc.dtype == np.int32
                                     and desc.shape == (5, self._cap)
                                     and desc.flags.c_contiguous):
            raise InvalidArgumentError(
                f"StepTable.send: desc must be None or a C-contiguous int32 numpy array of "
                f"shape [5, {self._cap}], got {getattr(desc, 'dtype', type(desc).__name__)} "
                f"{list(getattr(desc, 'shape', ()))}")
        self._send(desc, steady)

    def _send(self, desc: np.ndarray | None = None,
              steady: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """``send`` without its check of ``desc``, for callers that build it themselves
        (``update_device``; ``DecodeStep.begin``, once per step)."""
        if self._device_pending:
            self.apply_pending()
        delta = npages = None
        idem = True
        if steady is not None:                  # rows in place, nothing trimmed
            delta, npages = steady
        elif self._dirty:
            idem = self._simple
            delta, npages = self._general_delta()
        elif desc is not None and not self._staged_idem:
            # a graph re-applies the staged delta on replay: make it a no-op first
            delta = self._identity_delta()
        target = self.upload.send(desc, delta)
        if delta is None:
            return
        self._staged_idem = idem
        if npages is None:                      # the identity: nothing to apply
            return
        self._pending_delta = target
        self._device_pending = True
        self._npages = npages
        self._npages_total = int(delta[self._cap])
        self._mirror_src = delta
        self._mirror = None
        self._dirty = False
        self.version += 1

    def apply_pending(self) -> bool:
        """The device part of an update: the table-update launch over the sent delta, on
        the current stream (returns whether there was one). After it, the staged delta
        is one a replayed graph may apply again harmlessly (``record_update``)."""
        if not self._device_pending:
            return False
        buf = self._buf
        self._buf = self.backend.update_table(buf, self._pending_delta, self._cap,
                                              self._pcap, scratch=self._scratch)
        self._device_pending = False
        if self._buf is not buf:                # a new buffer (Metal): new views
            self._views = self._make_views()
        if not self._staged_idem and self.upload.staged:
            # rows moved or trimmed: applied twice it would move them twice
            self.upload.send(None, self._identity_delta())
            self._staged_idem = True
        return True

    def record_update(self) -> None:
        """The device update from the staging buffer, made unconditionally: the first
        work a captured step records (``DecodeStep.capture``), so that each replay
        applies the delta its ``begin`` sent. Only with a staging buffer."""
        self.backend.update_table(self._buf, self.upload.delta, self._cap, self._pcap,
                                  scratch=self._scratch)
        self._recorded = self.layout

    def replayed(self, fn: str = "StepTable.replayed") -> None:
        """A captured step applied the staged delta on the device (``CapturedStep``).
        Refused (``fn`` named) unless a graph recorded the update for this buffer: the
        pending update would be dropped, and the device table stay behind the pool."""
        if self._recorded is None or self._recorded != self.layout:
            why = ("record_update was never called" if self._recorded is None
                   else "its buffer grew since the capture")
            raise InvalidArgumentError(
                f"{fn}: no graph recorded this table's update ({why}): a replay without it "
                "would leave the device table behind the pool")
        self._device_pending = False

    def _general_delta(self) -> tuple[np.ndarray, np.ndarray]:
        """The delta of everything the pool changed since the last send (int32,
        ``DELTA_SECTIONS``) and the new pages per row (int64 ``[capacity]``); the table's
        pending bookkeeping is reset (it grows first when the pages outgrow it)."""
        S, P, cap = self.pool._seqs, self.page_size, self._cap
        pr = self._pr
        npages = S.npages[pr]
        if not self._all_live:
            npages[~self._live] = 0
        total = int(npages.sum())
        if total > self._pcap:
            self._grow("StepTable.flush", cap, max(total, 2 * self._pcap))
        # the page positions each row keeps: the engine's case (rows continue their own
        # rows, no trims) needs no gather of the old counts
        if self._simple:
            keep = np.minimum(self._dirty_from, npages)
        else:
            src = self._src
            old = np.where(src >= 0, self._npages[np.maximum(src, 0)], 0)
            keep = np.minimum(np.minimum(self._dirty_from, old - self._front), npages)
            keep = np.maximum(np.where(src >= 0, keep, 0), 0)
        changed = npages - keep
        m = int(changed.sum())
        h = delta_header_words(cap)
        delta = np.empty(h + m, np.int32)
        delta[0] = 0
        np.cumsum(npages, out=delta[1:cap + 1])
        filled, start = S.filled[pr], S.start[pr]
        empty = npages == 0
        lpl = delta[cap + 1:2 * cap + 1]
        np.subtract(filled, (npages - 1) * P, out=lpl, casting="unsafe")
        fpo = delta[2 * cap + 1:3 * cap + 1]
        fpo[:] = start
        if empty.any():
            lpl[empty] = 0
            fpo[empty] = 0
        delta[3 * cap + 1:4 * cap + 1] = self._src
        delta[4 * cap + 1:5 * cap + 1] = self._front
        delta[5 * cap + 1:6 * cap + 1] = keep
        cind = delta[6 * cap + 1:7 * cap + 2]
        cind[0] = 0
        np.cumsum(changed, out=cind[1:])
        if m:
            rows = np.flatnonzero(changed)
            if m == rows.size:                  # one new page id per changed row
                delta[h:] = S.pages[pr[rows], S.head[pr[rows]] + keep[rows]]
            else:
                rep = np.repeat(rows, changed[rows])
                within = np.arange(m) - np.repeat(cind[rows].astype(np.int64), changed[rows])
                delta[h:] = S.pages[pr[rep], S.head[pr[rep]] + keep[rep] + within]
        if not self._simple:
            self._src = np.where(self._live, self._rows, -1)
            self._front = np.zeros(cap, np.int64)
            self._simple = True
        self._dirty_from = np.full(cap, _CLEAN, np.int64)
        return delta, npages

    def _identity_delta(self) -> np.ndarray:
        """A delta that leaves the device table as it is (every row keeps its pages in
        place): what the staging holds once a delta that moves rows was applied."""
        cap = self._cap
        d = np.zeros(delta_header_words(cap), np.int32)
        d[:3 * cap + 1] = self._mirror_src[:3 * cap + 1]
        d[3 * cap + 1:4 * cap + 1] = np.where(self._npages > 0, self._rows, -1)
        d[5 * cap + 1:6 * cap + 1] = self._npages
        return d

    def _mirrors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The host views (pages per row, visible lengths, last-page lengths, first-page
        offsets; read-only, int64 / int32), built from the last delta on first use (host
        state: a sent delta's device update may still be pending)."""
        if self._dirty:
            self.flush()
        if self._mirror is None:
            cap, P = self._cap, self.page_size
            npages = self._npages.copy()
            host = self._mirror_src[cap + 1:3 * cap + 1].copy()
            lpl, fpo = host[:cap], host[cap:]
            vis = np.where(npages > 0, (npages - 1) * P + lpl - fpo, 0)
            for a in (npages, vis, lpl, fpo):   # views of ``host`` keep their own flag
                a.flags.writeable = False
            self._mirror = (npages, vis, lpl, fpo)
        return self._mirror

    def _steady_header(self) -> np.ndarray:
        """A delta header (int32) with the sections a steady begin keeps: no row moves
        or skips pages, first-page offsets stay; the rest it overwrites (padding rows'
        last-page lengths stay 0)."""
        cap = self._cap
        h = np.zeros(delta_header_words(cap), np.int32)
        h[2 * cap + 1:3 * cap + 1] = self._mirror_src[2 * cap + 1:3 * cap + 1]
        h[3 * cap + 1:4 * cap + 1] = self._src
        return h

    # ------------------------------------------------------------------ internals
    def _alloc(self, cap: int, pcap: int) -> None:
        self._cap, self._pcap = int(cap), int(pcap)
        host = np.full(table_words(self._cap, self._pcap), -1, np.int32)
        host[:self._cap + 1] = 0
        with self.backend.launch_context(self.pool.k):   # on the pool's device
            self._buf = self.backend.table_buffer(host)
            self._scratch = self.backend.table_buffer(host)
            self.upload = StepUpload(self.backend, self._cap, self._pcap)
        self._device_pending, self._pending_delta, self._staged_idem = False, None, True
        self._npages = np.zeros(self._cap, np.int64)
        self._npages_total = 0
        self._views = self._make_views()
        self._view = None

    def _grow(self, fn: str, cap: int, pcap: int) -> None:
        """A bigger device buffer holding the current table (every row rebuilt from the
        pool at the next flush); ``layout`` changes."""
        old_cap = self._cap
        ids = np.concatenate([self._ids, np.full(cap - old_cap, -1, np.int64)])
        rows = np.concatenate([self._pool_rows, np.full(cap - old_cap, -1, np.int64)])
        self._alloc(cap, pcap)
        self._set_rows(ids, rows, np.full(cap, -1, np.int64))
        self.layout += 1
        self._dirty = True

    def _set_rows(self, ids: np.ndarray, pool_rows: np.ndarray, src: np.ndarray) -> None:
        cap = self._cap
        self._ids = ids.astype(np.int64)
        self._pool_rows = pool_rows.astype(np.int64)
        self._src = src.astype(np.int64)
        self._front = np.zeros(cap, np.int64)
        self._dirty_from = np.full(cap, _CLEAN, np.int64)
        live = self._ids >= 0
        self._live, self._all_live = live, bool(live.all())
        self._pr = np.where(live, self._pool_rows, 0)
        self._rows = np.arange(cap, dtype=np.int64)
        # rows continue their own rows with nothing trimmed (update_device's fast case)
        self._simple = bool(np.array_equal(self._src, np.where(live, self._rows, -1)))
        self._n_live = int(live.sum())
        at = np.flatnonzero(live)
        self._live_rows = (at, self._ids[at], self._pool_rows[at])
        for a in self._live_rows:
            a.flags.writeable = False
        order = np.argsort(np.where(live, self._ids, np.iinfo(np.int64).max), kind="stable")
        self._sorted_ids = self._ids[order][:self._n_live]
        self._sorted_rows = order[:self._n_live]
        self._dirty = True

    def _find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table row or -1, found) of each sequence id."""
        if not self._n_live:
            return np.full(ids.size, -1, np.int64), np.zeros(ids.size, bool)
        i = np.minimum(np.searchsorted(self._sorted_ids, ids), self._n_live - 1)
        found = self._sorted_ids[i] == ids
        return np.where(found, self._sorted_rows[i], -1), found

    def _make_views(self) -> tuple[Any, Any, Any, Any]:
        v = table_views(self._buf, self._cap)
        return (v["indices"], v["indptr"], v["last_page_len"], v["first_page_offset"])

    def _require_flushed(self) -> None:
        """Before reading the device table (or its view): nothing pending."""
        if self.pending:
            self.flush()

    def _build_view(self) -> PageTable:
        live = self._ids >= 0
        if live.all():
            return self.pool.page_table(self._ids)  # type: ignore[arg-type]
        # padding rows (and freed rows) are empty requests
        host = self.pool.page_table(self._ids[live]) if live.any() else None  # type: ignore[arg-type]
        counts = np.zeros(self._cap, np.int64)
        lpl = np.zeros(self._cap, np.int64)
        fpo = np.zeros(self._cap, np.int64)
        rope = np.zeros(self._cap, np.int64)
        indices = np.zeros(0, np.int32)
        if host is not None:
            counts[live] = host.pages_per_request
            lpl[live] = host.last_page_len
            fpo[live] = host.first_page_offset
            rope[live] = host.rope_positions
            indices = host.indices
        indptr = np.concatenate([[0], np.cumsum(counts)])
        return PageTable.build(indices, indptr, lpl, page_size=self.page_size,
                               first_page_offset=fpo, rope_positions=rope,
                               num_pages=self.pool.num_pages)


__all__ = ["StepTable"]
