"""The CSR page table: which physical pages hold each request's visible K/V tokens.

Layout (all host ``int32`` numpy arrays, row-major, read-only once built):

- ``indices [indptr[-1]]``: physical page ids, the requests' page lists concatenated.
- ``indptr [B+1]``: request ``r`` owns ``indices[indptr[r]:indptr[r+1]]``.
- ``last_page_len [B]``: entries used in the request's last page, in ``[1, page_size]``;
  ``0`` for a request with no pages.
- ``first_page_offset [B]``: entries of the first page already retired by a front trim
  (a sliding window that starts mid-page), in ``[0, page_size)``; ``0`` without pages.
- ``rope_positions [B]``: absolute position of the *next* token of each request (what a
  RoPE embedding of the new query uses). Equals the visible length unless the front was
  trimmed, in which case it is larger.

Token ``t`` (0-based among the visible ones) of request ``r`` lives at page
``indices[indptr[r] + (first_page_offset[r] + t) // page_size]``, entry
``(first_page_offset[r] + t) % page_size``. The geometry identity:
``visible_len = (pages - 1) * page_size + last_page_len - first_page_offset``
(``0`` for a request without pages). A request may have zero visible tokens (no pages,
or a fully trimmed window that still holds its partial last page); it decodes to zeros
with a ``-inf`` log-sum-exp.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import PageTableError, check_int, refuse_listed_bools

#: most entries (first-page offset plus visible tokens) of one request: the CUDA kernels
#: index a request's entries with 32-bit ints (2^31 tokens, beyond any pool of one GPU
#: unless page ids repeat)
MAX_ENTRIES = 2**31 - 1
_TABLE_ARRAYS = ("indices", "indptr", "last_page_len", "first_page_offset", "rope_positions")
#: the public function constructing a table on this thread (its errors name it)
_constructing = threading.local()


def frozen_int32(value: Any) -> np.ndarray:
    """A read-only ``int32`` copy of ``value`` whose data a ``bytes`` object owns, so that
    ``setflags(write=True)`` raises: tables and plans are validated once and their device
    copies memoised by identity, so an edit after validation would be an out-of-bounds
    read on a GPU. An array already held that way is returned as it is."""
    if isinstance(value, np.ndarray) and value.dtype == np.int32:
        root = value
        while isinstance(root, np.ndarray) and root.base is not None:
            root = root.base
        if isinstance(root, bytes):
            return value
    arr = np.ascontiguousarray(value, dtype=np.int32)
    return np.frombuffer(arr.tobytes(), np.int32).reshape(arr.shape)


def _as_i32(fn: str, name: str, value: Any, ndim: int = 1) -> np.ndarray:
    refuse_listed_bools(fn, name, value, PageTableError)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:   # ragged nested lists
        raise PageTableError(f"{fn}: {name} must be a {ndim}-D integer array, got "
                             f"{type(value).__name__}") from exc
    if arr.ndim != ndim:
        raise PageTableError(f"{fn}: {name} must be {ndim}-D, got shape {list(arr.shape)}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PageTableError(f"{fn}: {name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise PageTableError(f"{fn}: {name} has values outside int32")
    return frozen_int32(arr)


@dataclass(frozen=True, eq=False)
class PageTable:
    """CSR page table of a decode batch (see the module docstring for the layout).

    Build it with ``PageTable.build(...)`` (validates) or from a ``PagePool``. The arrays
    are immutable, so a table can be cached and its device copies memoised by identity.
    """

    indices: np.ndarray
    indptr: np.ndarray
    last_page_len: np.ndarray
    first_page_offset: np.ndarray
    rope_positions: np.ndarray
    page_size: int
    num_pages: int | None = None
    #: derived: visible tokens per request, ``int32 [B]``
    visible_lens: np.ndarray = field(init=False, repr=False)
    #: derived: pages per request, ``int32 [B]``
    pages_per_request: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        fn = getattr(_constructing, "fn", "PageTable")
        check_int(fn, "page_size", self.page_size, 1, MAX_ENTRIES, error=PageTableError)
        if self.num_pages is not None:
            check_int(fn, "num_pages", self.num_pages, 0, note=" or None", error=PageTableError)
        for name in _TABLE_ARRAYS:   # a table built directly owns read-only copies too
            object.__setattr__(self, name, _as_i32(fn, name, getattr(self, name)))
        b = max(self.indptr.size - 1, 0)
        pages = np.diff(self.indptr.astype(np.int64)) if self.indptr.size else \
            np.zeros(0, np.int64)
        if self.last_page_len.size == b and self.first_page_offset.size == b:
            vis = np.where(pages > 0, (pages - 1) * self.page_size + self.last_page_len
                           - self.first_page_offset, 0)
        else:  # malformed lengths: validate() reports them by name
            vis = np.zeros(b, np.int64)
        for name, arr in (("visible_lens", vis), ("pages_per_request", pages)):
            object.__setattr__(self, name, frozen_int32(arr))
        # a table built directly is validated too (kernels trust every table they get)
        self._validate(fn, None)

    def __reduce__(self) -> tuple[Any, ...]:
        # copies and pickles are rebuilt (validated, read-only), never restored writable
        return (_rebuild, (*(getattr(self, n) for n in _TABLE_ARRAYS), self.page_size,
                           self.num_pages))

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, indices: Any, indptr: Any, last_page_len: Any, *, page_size: int,
              first_page_offset: Any = None, rope_positions: Any = None,
              num_pages: int | None = None) -> PageTable:
        """Copy the arrays into an immutable, validated table.

        ``first_page_offset`` defaults to zeros, ``rope_positions`` to the visible
        lengths; ``num_pages`` (the pool size) enables the page-id range check.
        """
        fn = "PageTable.build"
        check_int(fn, "page_size", page_size, 1, MAX_ENTRIES, error=PageTableError)
        if num_pages is not None:
            check_int(fn, "num_pages", num_pages, 0, note=" or None", error=PageTableError)
        ip = _as_i32(fn, "indptr", indptr)
        if ip.size == 0:
            raise PageTableError(f"{fn}: indptr must have B+1 >= 1 entries, got 0")
        b = ip.size - 1
        lpl = _as_i32(fn, "last_page_len", last_page_len)
        fpo = _as_i32(fn, "first_page_offset",
                      np.zeros(b, np.int32) if first_page_offset is None else first_page_offset)
        idx = _as_i32(fn, "indices", indices)
        if rope_positions is None:
            pages = ip[1:].astype(np.int64) - ip[:-1]
            rope = np.where(pages > 0, (pages - 1) * page_size + lpl[:b] - fpo[:b], 0) \
                if lpl.size == b and fpo.size == b else np.zeros(b, np.int64)
        else:
            rope = rope_positions
        _constructing.fn = fn                     # errors name build, not PageTable
        try:
            return cls(idx, ip, lpl, fpo, _as_i32(fn, "rope_positions", rope), int(page_size),
                       None if num_pages is None else int(num_pages))
        finally:
            del _constructing.fn

    # ------------------------------------------------------------------ queries
    @property
    def batch_size(self) -> int:
        """Requests in the batch (``B``)."""
        return int(self.indptr.size - 1)

    @property
    def total_pages(self) -> int:
        """Page-list entries over all requests (``indptr[-1]``, ``len(indices)``)."""
        return int(self.indptr[-1])

    @functools.cached_property
    def max_page_id(self) -> int:
        """Largest physical page id referenced (``-1`` when there are none)."""
        return int(self.indices.max()) if self.indices.size else -1

    @functools.cached_property
    def total_visible(self) -> int:
        """Visible tokens over all requests."""
        return int(self.visible_lens.astype(np.int64).sum())

    def request_pages(self, r: int) -> np.ndarray:
        """Physical page ids of request ``r``."""
        r = check_int("PageTable.request_pages", "r", r, 0, self.batch_size - 1,
                      error=PageTableError)
        return self.indices[self.indptr[r]:self.indptr[r + 1]]

    def subset(self, requests: Sequence[int]) -> PageTable:
        """A new table with only ``requests`` (in the given order)."""
        fn = "PageTable.subset"
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
            raise PageTableError(f"{fn}: requests must be a sequence of request indices, "
                                 f"got {type(requests).__name__}")
        reqs = [check_int(fn, "requests[i]", r, 0, self.batch_size - 1, error=PageTableError)
                for r in requests]
        parts = [self.request_pages(r) for r in reqs]
        counts = [len(p) for p in parts]
        return PageTable.build(
            np.concatenate(parts) if parts else np.zeros(0, np.int32),
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            self.last_page_len[reqs], page_size=self.page_size,
            first_page_offset=self.first_page_offset[reqs],
            rope_positions=self.rope_positions[reqs], num_pages=self.num_pages)

    # ------------------------------------------------------------------ invariants
    def validate(self, num_pages: int | None = None) -> None:
        """Check every invariant; raise ``PageTableError`` naming the request and field.

        Invariants: ``indptr[0] == 0``, ``indptr`` non-decreasing,
        ``len(indices) == indptr[-1]``, page ids in ``[0, num_pages)`` (when known),
        ``last_page_len`` in ``[1, page_size]`` for a request with pages and ``0``
        without, ``first_page_offset`` in ``[0, page_size)`` (``0`` without pages), the
        geometry identity giving ``visible_len >= 0``, at most ``MAX_ENTRIES`` entries
        up to a request's last token, and ``rope_positions >= visible_len``.
        """
        self._validate("PageTable.validate", num_pages)

    def _validate(self, fn: str, num_pages: int | None) -> None:
        """``validate`` for the public function ``fn`` (``build`` names itself)."""
        if num_pages is not None:
            check_int(fn, "num_pages", num_pages, 0, note=" or None", error=PageTableError)
        p = check_int(fn, "page_size", self.page_size, 1, MAX_ENTRIES, error=PageTableError)
        ip, lpl, fpo = self.indptr, self.last_page_len, self.first_page_offset
        if ip.size == 0:
            raise PageTableError(f"{fn}: indptr must have B+1 >= 1 entries, got 0")
        b = ip.size - 1
        if ip[0] != 0:
            raise PageTableError(f"{fn}: indptr[0] must be 0, got {int(ip[0])}")
        steps = np.diff(ip.astype(np.int64))
        if (steps < 0).any():
            r = int(np.argmax(steps < 0))
            raise PageTableError(f"{fn}: indptr must be non-decreasing, but request {r} has "
                                 f"indptr[{r}] = {int(ip[r])} > indptr[{r + 1}] = {int(ip[r + 1])}")
        if self.indices.size != int(ip[-1]):
            raise PageTableError(f"{fn}: len(indices) must equal indptr[-1] = {int(ip[-1])}, "
                                 f"got {self.indices.size}")
        for name, arr in (("last_page_len", lpl), ("first_page_offset", fpo),
                          ("rope_positions", self.rope_positions)):
            if arr.size != b:
                raise PageTableError(f"{fn}: {name} must have B = {b} entries, got {arr.size}")
        bound = self.num_pages if num_pages is None else int(num_pages)
        if self.indices.size:
            bad = self.indices < 0
            if bound is not None:
                bad |= self.indices >= bound
            if bad.any():
                j = int(np.argmax(bad))
                r = int(np.searchsorted(ip, j, side="right") - 1)
                rng = "[0, num_pages)" if bound is None else f"[0, {bound})"
                raise PageTableError(f"{fn}: request {r}: indices[{j}] = {int(self.indices[j])} "
                                     f"is not a page id in {rng}")
        # vectorized (an engine builds a table every step); the first bad request is named
        has = steps > 0
        vis = (steps - 1) * p + lpl.astype(np.int64) - fpo
        ends = vis + fpo                           # first-page offset + visible tokens
        checks = (
            (has & ~((lpl > 0) & (lpl <= p)), lambda r: (
                f"last_page_len must be in [1, page_size = {p}], got {int(lpl[r])}")),
            (has & ~((fpo >= 0) & (fpo < p)), lambda r: (
                f"first_page_offset must be in [0, page_size = {p}), got {int(fpo[r])}")),
            (has & (vis < 0), lambda r: (
                f"geometry gives a negative visible length (pages {int(steps[r])}, "
                f"last_page_len {int(lpl[r])}, first_page_offset {int(fpo[r])}): "
                f"{int(vis[r])}")),
            (~has & ((lpl != 0) | (fpo != 0)), lambda r: (
                f"has no pages, so last_page_len and first_page_offset must be 0, got "
                f"{int(lpl[r])} and {int(fpo[r])}")),
            (has & (ends > MAX_ENTRIES), lambda r: (
                f"its pages hold {int(ends[r])} entries up to its last token; the kernels "
                f"index a request's entries in 32 bits (at most {MAX_ENTRIES})")),
            (self.rope_positions < self.visible_lens, lambda r: (
                f"rope_positions must be >= the visible length "
                f"{int(self.visible_lens[r])}, got {int(self.rope_positions[r])}")),
        )
        first = [(int(np.argmax(bad)), msg) for bad, msg in checks if bad.any()]
        if first:
            r, msg = min(first, key=lambda x: x[0])   # the loop's order: request, then rule
            raise PageTableError(f"{fn}: request {r}: {msg(r)}")

    def __repr__(self) -> str:
        return (f"PageTable(B={self.batch_size}, page_size={self.page_size}, "
                f"pages={self.total_pages}, visible={self.visible_lens.tolist()[:8]}"
                f"{'...' if self.batch_size > 8 else ''})")


def _rebuild(indices: Any, indptr: Any, last_page_len: Any, first_page_offset: Any,
             rope_positions: Any, page_size: int, num_pages: int | None) -> PageTable:
    return PageTable.build(indices, indptr, last_page_len, page_size=page_size,
                           first_page_offset=first_page_offset,
                           rope_positions=rope_positions, num_pages=num_pages)
