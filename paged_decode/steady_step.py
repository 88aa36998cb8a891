"""The engine's steady-state begin: one new token for every live row of a step table,
when nothing but these begins changed the pool since the last general one.

``DecodeStep.begin`` in general reserves through ``PagePool._append`` (copy-on-write,
any batch) and then brings the table up to date through ``StepTable.update_device``
(trims, moved rows, any change). In an engine's decode loop every begin after the first is
one narrow case. ``SteadyBegin`` works out the next ``LOOKAHEAD`` such begins at once,
in a few dozen array operations, and then each begin only commits its precomputed rows
(about five array operations and the uploads; issue #13's host budget):

- no copy-on-write can happen: after one general begin every live sequence's last page
  is private (a shared partial page is copied by all its holders in the batch but the
  last, which then holds it alone), and fresh pages are private;
- nothing trims, frees or forks (the pool's version moves only with these begins, and
  ``advance`` gives up the moment it moved otherwise);
- every live sequence has a page, so a row takes a fresh page exactly when its last page
  is full, which is known steps ahead; fresh pages come off the free stack in step order,
  then row order, as the general path takes them one begin at a time.

Everything it produces (the pool's bookkeeping, the table's device delta and host mirror,
the ``AppendedBatch``) is what the general path would have produced, element for element:
``tests/test_steady_step.py`` runs both on twin pools and compares them after every step.
The lookahead stops early where the free stack, the width of the pool's page array or
the table's page capacity would run out. Whenever a begin is not covered (those limits,
any change from outside), ``advance`` returns ``None`` before it changes anything, and
the general path runs (and raises its errors).
"""

from __future__ import annotations

import numpy as np

from .kernels.append import AppendWrite, table_row_desc
from .pool import AppendedBatch, PagePool
from .step_table import StepTable

#: page-list entries per row kept free ahead of the steady begins (each takes at most one)
COLUMN_MARGIN = 32
#: begins worked out at once
LOOKAHEAD = 32


class SteadyBegin:
    """The steady begins of one step table (made by ``arm`` right after a general begin).

    Live rows, in table-row order: pool rows ``pr``, table rows ``trow``, sequence ids
    ``ids`` (int64 ``[n]``), and ``base`` (int64 ``[n]``, the flat position of page-list
    entry 0 in the pool's page array). Per precomputed begin ``s`` (row ``s`` of each
    matrix; ``s = 0`` is the state before the first): pages ``npg [K+1, n]``, entries
    written ``fil [K+1, n]``, last page ids ``last [K+1, n]`` (int32), fresh-page rows
    ``full [K, n]`` (bool), the general path's descriptor ``w [K, 5, n]`` and the step's
    ``desc [K, 5, capacity]`` (int32, ``kernels/append.py``), the table's pages per row
    ``tpages [K+1, capacity]`` and deltas ``delta [K, header + max new]`` (int32, the
    first ``header + new[s]`` words of a row), the fresh pages ``taken`` in the order they
    are taken with ``at [K+1]`` (begin ``s`` takes ``taken[at[s]:at[s+1]]``) and their
    flat positions ``pos`` in the pool's page array."""

    def __init__(self, pool: PagePool, table: StepTable, last: np.ndarray,
                 cols_left: int) -> None:
        S = pool._seqs
        self.pool, self.table = pool, table
        self.trow, self.ids, self.pr = table.live_rows()
        self.n = int(self.pr.size)
        self.base = self.pr * S.pages.shape[1] + S.head[self.pr]
        self.start = S.start[self.pr]
        self.no_cow = np.zeros(self.n, bool)
        self.cols_left = cols_left      # page-list entries every row still has room for
        self.version, self.layout = pool._version, table.layout
        # the pool's other tables (weakly: this state must not keep them alive) follow
        # each step through _on_append; a table made later sends begins back to the
        # general path (the list grows)
        self.refs, self.n_refs = pool._table_refs, len(pool._table_refs)
        self.others = [r for r in self.refs if r() is not table]
        self.header = table._steady_header()
        self._lookahead(S.npages[self.pr], S.filled[self.pr], last, table._npages)

    @classmethod
    def arm(cls, pool: PagePool, table: StepTable) -> SteadyBegin | None:
        """The steady state of ``table`` now (right after a general begin and its table
        update), or ``None`` when the next begin is not surely the steady case: a live
        sequence without pages or with a shared last page, an unflushed table, or no
        live row."""
        if table._dirty or not table._simple or table.num_live == 0:
            return None
        S = pool._seqs
        _, _, pr = table.live_rows()
        npg = S.npages[pr]
        if not (npg > 0).all():
            return None
        width = S.pages.shape[1]
        end = S.head[pr] + npg
        if int(end.max()) + COLUMN_MARGIN > width:
            # room for the next pages of every row now (the general path would move or
            # widen the page array at the next page that does not fit, then again)
            S._compact(int(S.npages.max()) + COLUMN_MARGIN)
            width = S.pages.shape[1]
            end = S.head[pr] + npg
        last = S.pages.reshape(-1)[pr * width + end - 1]
        if not (pool._ref[last] == 1).all():
            return None
        return cls(pool, table, last, int((width - end).min()))

    def _lookahead(self, npg: np.ndarray, fil: np.ndarray, last: np.ndarray,
                   tpages: np.ndarray) -> None:
        """Work out the next begins from the state ``npg, fil, last`` (live rows) and the
        table's ``tpages``: as many as ``LOOKAHEAD`` and the limits allow (0 when the
        next one is not covered)."""
        pool, table, P, n = self.pool, self.table, self.pool.page_size, self.n
        cap, h = table.capacity, self.header.size
        k = min(LOOKAHEAD, self.cols_left)
        steps = np.arange(k)[:, None]
        lpl = fil - (npg - 1) * P                       # 1..P before the first begin
        full = (lpl + steps) % P == 0                   # begin s finds the last page full
        new = np.count_nonzero(full, axis=1)
        total = np.cumsum(new)
        # begins whose fresh pages the free stack and the table's capacity hold
        k = int(np.searchsorted(total, min(pool._nfree, table.page_capacity
                                            - table._npages_total), side="right"))
        full, new = full[:k], new[:k]
        self.k, self.s = k, 0
        if not k:
            return
        m = int(total[k - 1])
        taken = pool._free[pool._nfree - m:pool._nfree][::-1].copy()
        gained = np.cumsum(full, axis=0)
        self.npg = np.concatenate([npg[None], npg + gained])
        self.fil = fil + np.arange(k + 1)[:, None]
        # each begin's last page: the latest fresh one taken so far, or the old last page
        ids = np.zeros((k, n), np.int32)
        ids[full] = taken                               # row-major: step, then row order
        latest = np.maximum.accumulate(np.where(full, steps[:k], -1), axis=0)
        self.last = np.concatenate([last[None], np.where(
            latest >= 0, ids[np.maximum(latest, 0), np.arange(n)], last)])
        lo = (lpl + steps[:k]) % P                      # the slot each begin writes
        w = np.empty((k, 5, n), np.int32)
        w[:, 0] = w[:, 1] = self.last[1:]
        w[:, 2] = np.arange(n) - lo
        w[:, 3] = lo
        w[:, 4] = lo + 1
        self.full, self.w, self.desc = full, w, table_row_desc(w, self.trow, cap)
        self.taken, self.at = taken, np.concatenate([[0], total[:k]])
        self.pos = (self.base + self.npg[:k])[full]     # entry npg of the row, per page
        # the table: rows keep their pages and gain their fresh one
        tp = np.repeat(tpages[None], k + 1, axis=0)
        tp[1:, self.trow] = self.npg[1:]
        delta = np.empty((k, h + int(new.max())), np.int32)
        delta[:, :h] = self.header
        np.cumsum(tp[1:], axis=1, out=delta[:, 1:cap + 1])
        delta[:, cap + 1 + self.trow] = lo + 1
        delta[:, 5 * cap + 1:6 * cap + 1] = tp[:-1]
        np.cumsum(tp[1:] - tp[:-1], axis=1, out=delta[:, 6 * cap + 2:7 * cap + 2])
        cols = np.repeat(np.arange(k), new)
        delta[cols, h + np.arange(m) - np.repeat(self.at[:-1], new)] = taken
        self.tpages, self.delta, self.new = tp, delta, new

    def advance(self) -> tuple[AppendedBatch, np.ndarray, np.ndarray, np.ndarray] | None:
        """One token slot for every live row: the pool's bookkeeping committed and
        ``(batch, desc, delta, npages)`` returned (the step's descriptor, int32 ``[5,
        capacity]``; the table's delta and its new pages per row, int64 ``[capacity]``,
        for ``StepTable.send``); or ``None``, with nothing changed, when this is
        not the steady case."""
        pool, table = self.pool, self.table
        if (pool._version != self.version or table.layout != self.layout or table._dirty
                or pool._table_refs is not self.refs or len(self.refs) != self.n_refs):
            return None
        if self.s == self.k:                            # work out the next ones
            k = self.k
            if k:   # each row's page list grew by its fresh pages: the room left
                self.cols_left -= int((self.npg[k] - self.npg[0]).max())
                self._lookahead(self.npg[k], self.fil[k], self.last[k], self.tpages[k])
            if not self.k:
                return None
        s = self.s
        a, b = int(self.at[s]), int(self.at[s + 1])
        taken = self.taken[a:b]
        # commit
        S = pool._seqs
        S.filled[self.pr] = self.fil[s + 1]
        if b > a:
            S.npages[self.pr] = self.npg[s + 1]
            S.pages.reshape(-1)[self.pos[a:b]] = taken
            pool._ref[taken] = 1
            pool._nfree -= b - a
        pool._version += 1
        self.version = pool._version
        for ref in self.others:                         # other tables following the pool
            other = ref()
            if other is not None:
                other._on_append(self.ids, self.npg[s])
        self.s = s + 1
        write = AppendWrite(self.w[s], self.n, 0, 1, True)
        batch = AppendedBatch(pool, write, self.ids, None, self.npg[s], self.npg[s + 1],
                              self.fil[s + 1], self.start, self.no_cow, self.last[s], taken,
                              self.full[s])
        delta = self.delta[s, :self.header.size + b - a]
        return batch, self.desc[s], delta, self.tpages[s + 1]


__all__ = ["SteadyBegin"]
