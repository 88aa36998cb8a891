"""The engine's steady-state begin: one new token for every live row of a step table,
when nothing but these begins changed the pool since the last general one.

``DecodeStep.begin`` in general reserves through ``PagePool._append`` (copy-on-write,
any batch) and then brings the table up to date through ``StepTable.update_device``
(trims, moved rows, any change). In an engine's decode loop every begin after the first is
one narrow case: the same batch gains one token each, which ``append_lookahead`` works out
for the pool ``LOOKAHEAD`` begins ahead. ``SteadyBegin`` adds the step table's side (the
device delta, the table's pages per row, the step's descriptor) for the same begins, so
each begin only commits its precomputed rows (about five array operations and the
uploads; issue #13's host budget). The lookahead also stops where the table's page
capacity would run out.

Everything it produces (the pool's bookkeeping, the table's device delta and host mirror,
the ``AppendedBatch``) is what the general path would have produced, element for element:
``tests/test_steady_step.py`` runs both on twin pools and compares them after every step.
Whenever a begin is not covered (the limits, any change from outside), ``advance``
returns ``None`` before it changes anything, and the general path runs (and raises its
errors).
"""

from __future__ import annotations

import numpy as np

from .append_lookahead import AppendLookahead
from .kernels.append import table_row_desc
from .pool import AppendedBatch, PagePool
from .step_table import StepTable


class SteadyBegin:
    """The steady begins of one step table (made by ``arm`` right after a general begin).

    ``ahead``: the pool's side (``AppendLookahead`` of the table's live rows, in
    table-row order); ``trow`` (int64 ``[n]``): their table rows. Per worked-out begin
    ``s``: the step's descriptor ``desc [K, 5, capacity]`` (int32, ``kernels/append.py``),
    the table's pages per row ``tpages [K+1, capacity]`` and deltas ``delta [K, header +
    max new]`` (int32, the first ``header + new[s]`` words of a row)."""

    def __init__(self, pool: PagePool, table: StepTable, trow: np.ndarray,
                 ahead: AppendLookahead) -> None:
        self.pool, self.table, self.trow, self.ahead = pool, table, trow, ahead
        self.layout = table.layout
        # the pool's other tables (weakly: this state must not keep them alive) follow
        # each step through _on_append; a table made later sends begins back to the
        # general path (the list grows)
        self.refs, self.n_refs = pool._table_refs, len(pool._table_refs)
        self.others = [r for r in self.refs if r() is not table]
        self.header = table._steady_header()
        self._lookahead(table._npages)

    @classmethod
    def arm(cls, pool: PagePool, table: StepTable) -> SteadyBegin | None:
        """The steady state of ``table`` now (right after a general begin and its table
        update), or ``None`` when the next begin is not surely the steady case: a live
        sequence without pages or with a shared last page, an unflushed table, or no
        live row."""
        if table._dirty or not table._simple or table.num_live == 0:
            return None
        trow, ids, pr = table.live_rows()
        ahead = AppendLookahead.arm(pool, pr, ids)
        return None if ahead is None else cls(pool, table, trow, ahead)

    def _lookahead(self, tpages: np.ndarray) -> None:
        """Work out the next begins from the table's ``tpages`` and the pool's state
        after the last worked-out begin: as many as the pool's lookahead and the table's
        page capacity allow (none when the next one is not covered)."""
        table, ahead = self.table, self.ahead
        cap, h = table.capacity, self.header.size
        k = ahead.plan(table.page_capacity - table._npages_total)
        if not k:
            return
        new, at, taken = ahead.new, ahead.at, ahead.taken
        m = int(at[k])
        self.desc = table_row_desc(ahead.w, self.trow, cap)
        # the table: rows keep their pages and gain their fresh one
        tp = np.repeat(tpages[None], k + 1, axis=0)
        tp[1:, self.trow] = ahead.npg[1:]
        delta = np.empty((k, h + int(new.max())), np.int32)
        delta[:, :h] = self.header
        np.cumsum(tp[1:], axis=1, out=delta[:, 1:cap + 1])
        delta[:, cap + 1 + self.trow] = ahead.lo + 1
        delta[:, 5 * cap + 1:6 * cap + 1] = tp[:-1]
        np.cumsum(tp[1:] - tp[:-1], axis=1, out=delta[:, 6 * cap + 2:7 * cap + 2])
        cols = np.repeat(np.arange(k), new)
        delta[cols, h + np.arange(m) - np.repeat(at[:-1], new)] = taken
        self.tpages, self.delta = tp, delta

    def advance(self) -> tuple[AppendedBatch, np.ndarray, np.ndarray, np.ndarray] | None:
        """One token slot for every live row: the pool's bookkeeping committed and
        ``(batch, desc, delta, npages)`` returned (the step's descriptor, int32 ``[5,
        capacity]``; the table's delta and its new pages per row, int64 ``[capacity]``,
        for ``StepTable.send``); or ``None``, with nothing changed, when this is
        not the steady case."""
        pool, table, ahead = self.pool, self.table, self.ahead
        if (pool._version != ahead.version or table.layout != self.layout or table._dirty
                or pool._table_refs is not self.refs or len(self.refs) != self.n_refs):
            return None
        if ahead.s == ahead.k:                          # work out the next ones
            if ahead.k:
                self._lookahead(self.tpages[ahead.k])
            if not ahead.k:
                return None
        s = ahead.s
        batch = ahead.commit(ahead.write(), self.others)
        delta = self.delta[s, :self.header.size + int(ahead.new[s])]
        return batch, self.desc[s], delta, self.tpages[s + 1]


__all__ = ["SteadyBegin"]
