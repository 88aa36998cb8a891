"""The next one-token appends of a fixed batch, worked out ahead (the decode loop's case).

In a decode loop the same batch of live sequences gains one token each at every step.
When nothing else changes the pool between two such appends, the next ones are known in
advance:

- no copy-on-write can happen: after one general append every sequence of the batch has
  a private last page (a shared partial page is copied by all its holders in the batch
  but the last, which then holds it alone), and fresh pages are private;
- nothing trims, frees or forks (the pool's version moves only with these appends, and
  ``AppendLookahead`` gives up the moment it moved otherwise);
- every sequence has a page, so a row takes a fresh page exactly when its last page is
  full, which is known steps ahead; fresh pages come off the free stack in step order,
  then row order, as the general path takes them one append at a time.

``AppendLookahead`` works out the next ``LOOKAHEAD`` appends in a few dozen array
operations; each append then only commits its precomputed rows (about five array
operations). What it commits and returns is what ``PagePool``'s general path would have,
element for element (``tests/test_steady_step.py`` and ``tests/test_append_batch.py``
run both on twin pools). Its users: ``PagePool.append_batch`` / ``reserve_batch`` called
again with the same batch, and ``DecodeStep``'s steady begin (``steady_step.py``), which
adds the step table's side.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .appended_batch import AppendedBatch
from .kernels.append import AppendWrite

#: page-list entries per row kept free ahead of the lookahead (each append takes at most
#: one per row)
COLUMN_MARGIN = 32
#: appends worked out at once
LOOKAHEAD = 32


class AppendLookahead:
    """The next one-token appends of pool rows ``pr`` (sequence ids ``ids``, int64
    ``[n]``, distinct and live), made by ``arm`` right after a general append.

    ``base`` (int64 ``[n]``): the flat position of page-list entry 0 of each row in the
    pool's page array. Per worked-out append ``s`` (row ``s`` of each matrix; ``s = 0`` is
    the state before the first): pages ``npg [K+1, n]``, entries written ``fil [K+1,
    n]``, last page ids ``last [K+1, n]`` (int32); fresh-page rows ``full [K, n]`` (bool),
    fresh pages per append ``new [K]``, the slot each row writes ``lo [K, n]`` and the
    general path's descriptor ``w [K, 5, n]`` (int32, read-only, ``kernels/append.py``);
    the fresh pages ``taken`` in the order they are taken with ``at [K+1]`` (append ``s`` takes
    ``taken[at[s]:at[s+1]]``) and their flat positions ``pos`` in the page array. ``s``
    is the next append, ``k`` how many are worked out."""

    def __init__(self, pool: Any, pr: np.ndarray, ids: np.ndarray, last: np.ndarray,
                 cols_left: int) -> None:
        S = pool._seqs
        self.pool, self.pr, self.ids = pool, pr, ids
        # the rows' index in the pool's per-row arrays: a slice where they are consecutive
        # (sequences made in order: a slice assignment costs a third of a fancy one)
        self.n = n = int(pr.size)
        self.at_rows: slice | np.ndarray = pr
        if n and bool((np.diff(pr) == 1).all()):
            self.at_rows = slice(int(pr[0]), int(pr[0]) + n)
        self.base = pr * S.pages.shape[1] + S.head[pr]
        self.start = S.start[pr]
        self.no_cow = np.zeros(self.n, bool)
        self.cols_left = cols_left      # page-list entries every row still has room for
        self.version = pool._version
        self.k = self.s = 0
        self.npg, self.fil, self.last = S.npages[pr][None], S.filled[pr][None], last[None]

    @classmethod
    def arm(cls, pool: Any, pr: np.ndarray, ids: np.ndarray) -> AppendLookahead | None:
        """The lookahead of rows ``pr`` now, or ``None`` when their next append is not
        surely the steady case: a row without pages or with a shared last page, or no
        row. Nothing is worked out yet (``plan``)."""
        if pr.size == 0:
            return None
        S = pool._seqs
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
        return cls(pool, pr, ids, last, int((width - end).min()))

    def plan(self, limit: int) -> int:
        """Work out the appends after the last one worked out (after the armed state at
        first), as many as ``LOOKAHEAD``, the width of the page array and the free stack
        allow, taking at most ``limit`` fresh pages in all. Returns how many (``k``; 0
        when the next one is not covered)."""
        pool, P, n = self.pool, self.pool.page_size, self.n
        k0 = self.k
        if k0:          # each row's page list grew by its fresh pages: the room left
            self.cols_left -= int((self.npg[k0] - self.npg[0]).max())
        npg, fil, last = self.npg[k0], self.fil[k0], self.last[k0]
        k = min(LOOKAHEAD, self.cols_left)
        steps = np.arange(k)[:, None]
        lpl = fil - (npg - 1) * P                       # 1..P before the first append
        full = (lpl + steps) % P == 0                   # append s finds the last page full
        new = np.count_nonzero(full, axis=1)
        total = np.cumsum(new)
        # appends whose fresh pages the free stack (and the caller's limit) hold
        k = int(np.searchsorted(total, min(pool._nfree, limit), side="right"))
        self.k, self.s = k, 0
        if not k:
            self.version = -1           # spent: a later plan would start from stale rows
            return 0
        full, new = full[:k], new[:k]
        m = int(total[k - 1])
        taken = pool._free[pool._nfree - m:pool._nfree][::-1].copy()
        gained = np.cumsum(full, axis=0)
        self.npg = np.concatenate([npg[None], npg + gained])
        self.fil = fil + np.arange(k + 1)[:, None]
        # each append's last page: the latest fresh one taken so far, or the old last page
        got = np.zeros((k, n), np.int32)
        got[full] = taken                               # row-major: step, then row order
        latest = np.maximum.accumulate(np.where(full, steps[:k], -1), axis=0)
        self.last = np.concatenate([last[None], np.where(
            latest >= 0, got[np.maximum(latest, 0), np.arange(n)], last)])
        lo = (lpl + steps[:k]) % P                      # the slot each append writes
        w = np.empty((k, 5, n), np.int32)
        w[:, 0] = w[:, 1] = self.last[1:]
        w[:, 2] = np.arange(n) - lo
        w[:, 3] = lo
        w[:, 4] = lo + 1
        w.setflags(write=False)         # AppendWrite.shared: uploaded once where kept
        self.full, self.new, self.lo, self.w = full, new, lo, w
        self.taken, self.at = taken, np.concatenate([[0], total[:k]])
        self.pos = (self.base + self.npg[:k])[full]     # entry npg of the row, per page
        return k

    def current(self) -> bool:
        """Whether the next append is worked out and nothing changed the pool since the
        last one (``plan`` first when the worked-out ones are used up)."""
        return self.pool._version == self.version and (self.s < self.k
                                                       or self.plan(self.pool._nfree) > 0)

    def write(self, layer0: int = 0, row_layers: int = 1) -> AppendWrite:
        """The next append's launch description (rows in layers ``layer0`` to ``layer0 +
        row_layers``)."""
        return AppendWrite(self.w[self.s], self.n, layer0, row_layers, True, (self.w, self.s))

    def commit(self, write: AppendWrite, tables: list[Any]) -> AppendedBatch:
        """Commit the next append into the pool's bookkeeping and tell ``tables`` (weak
        references to step tables following the pool) about it. Returns the append's
        ``AppendedBatch``, whose launch description is ``write``."""
        pool, s = self.pool, self.s
        a, b = int(self.at[s]), int(self.at[s + 1])
        taken = self.taken[a:b]
        S = pool._seqs
        S.filled[self.at_rows] = self.fil[s + 1]
        if b > a:
            S.npages[self.at_rows] = self.npg[s + 1]
            S.pages.reshape(-1)[self.pos[a:b]] = taken
            pool._ref[taken] = 1
            pool._nfree -= b - a
        pool._version += 1
        self.version = pool._version
        for ref in tables:
            table = ref()
            if table is not None:
                table._on_append(self.ids, self.npg[s])
        self.s = s + 1
        return AppendedBatch(pool, write, self.ids, None, self.npg[s], self.npg[s + 1],
                             self.fil[s + 1], self.start, self.no_cow, self.last[s], taken,
                             self.full[s])


__all__ = ["COLUMN_MARGIN", "LOOKAHEAD", "AppendLookahead"]
