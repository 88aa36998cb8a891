"""What one batched append did (``PagePool.append_batch``), per sequence: the result a
page table kept elsewhere follows the append with."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .kernels.append import AppendWrite


def frozen(a: np.ndarray) -> np.ndarray:
    """``a``, made read-only."""
    a.setflags(write=False)
    return a


class AppendedBatch:
    """What one ``PagePool.append_batch`` did, per sequence in the call's order (host
    numpy arrays, read-only, computed on first access): enough for a page table kept
    elsewhere (e.g. on a device) to follow the append without rebuilding.

    - ``seqs`` int64 ``[B]``: the sequence ids; ``counts`` int64 ``[B]``: tokens appended.
    - ``seq_lens`` int64 ``[B]``: visible tokens after the append; ``last_page_len`` int64
      ``[B]``: entries in the last page after (0 without pages); ``num_pages`` int64
      ``[B]``: pages after.
    - ``first_changed`` int64 ``[B]``: position in the sequence's page list of the first
      page id that is new: the last page's when it was copied (copy-on-write), else the
      old page count. The ids from there to the end are ``changed_pages[changed_indptr[i]:
      changed_indptr[i + 1]]`` (int32, CSR with int64 ``changed_indptr [B+1]``).
    - ``copies`` int32 ``[C, 2]``: (shared page, its private copy) of every copy-on-write
      copy, made in every layer.

    ``PagePool.write_layer`` writes another layer's rows to the same slots; ``write`` is
    the launch's description (``kernels/append.py``; its ``desc`` read-only too).
    """

    def __init__(self, pool: Any, write: AppendWrite, seqs: np.ndarray,
                 counts: np.ndarray | None, pages_before: np.ndarray, pages_after: np.ndarray,
                 filled_after: np.ndarray, start: np.ndarray, cow: np.ndarray,
                 last: np.ndarray, taken: np.ndarray, need: np.ndarray) -> None:
        self.pool, self.write, self.version = pool, write, pool._version
        # write_layer launches on write.desc again: a caller's edit would write elsewhere
        frozen(write.desc)
        self.seqs = frozen(seqs)
        self._counts = counts
        self._raw = (pages_before, pages_after, filled_after, start, cow, last, taken, need)

    @property
    def num_rows(self) -> int:
        """N: the new rows per layer (``counts.sum()``)."""
        return self.write.num_rows

    @functools.cached_property
    def counts(self) -> np.ndarray:
        c = self._counts
        return frozen(np.ones(self.seqs.size, np.int64) if c is None else c)

    @functools.cached_property
    def seq_lens(self) -> np.ndarray:
        return frozen(self._raw[2] - self._raw[3])

    @functools.cached_property
    def last_page_len(self) -> np.ndarray:
        n, f = self._raw[1], self._raw[2]
        return frozen(np.where(n > 0, f - (n - 1) * self.pool.page_size, 0))

    @functools.cached_property
    def num_pages(self) -> np.ndarray:
        return frozen(self._raw[1])

    @functools.cached_property
    def first_changed(self) -> np.ndarray:
        return frozen(self._raw[0] - self._raw[4])

    @functools.cached_property
    def changed_pages(self) -> np.ndarray:
        return frozen(self._raw[6])

    @functools.cached_property
    def changed_indptr(self) -> np.ndarray:
        return frozen(np.concatenate([[0], np.cumsum(self._raw[7], dtype=np.int64)]))

    @functools.cached_property
    def copies(self) -> np.ndarray:
        _, _, _, _, cow, last, taken, need = self._raw
        at = (np.cumsum(need) - need)[cow]          # a copy is its sequence's first page
        return frozen(np.stack([last[cow], taken[at]], axis=1).astype(np.int32))


__all__ = ["AppendedBatch", "frozen"]
