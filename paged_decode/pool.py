"""A refcounted page pool: the K/V cache of a batch of sequences, in fixed-size pages.

Layout: ``pool.k`` and ``pool.v`` are arrays on the pool's backend of shape
``[num_pages, page_size, Hkv, D]``, or ``[num_layers, num_pages, page_size, Hkv, D]``
when ``num_layers`` is given (one page allocation serves every layer; ``pool.layer(i)``
returns that layer's 4-D views). Pages are shared between sequences by refcount: ``fork``
shares every page of a sequence, and appending into a shared, partially filled last page
copies it first (copy-on-write). ``trim_front`` retires the oldest tokens of a sliding
window, releasing the pages it empties. Every operation that could run out of pages
checks first and raises ``PoolExhaustedError`` leaving the pool unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends import Backend, get_backend
from .dtypes import check_dtype
from .errors import (
    InvalidArgumentError,
    PoolExhaustedError,
    check_int,
    check_shape,
    fail,
    fmt_shape,
    is_int,
)
from .page_table import PageTable


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    start: int = 0     # entries of pages[0] retired by trims (first_page_offset)
    filled: int = 0    # entries written, counted from entry 0 of pages[0]
    trimmed: int = 0   # absolute tokens trimmed so far (for rope positions)


class PagePool:
    """Fixed-size K/V pages with a free list, refcounts and sequences.

    Args:
        num_pages: pages in the pool.
        page_size: tokens per page.
        num_kv_heads, head_dim: K/V row geometry.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        num_layers: when given, the arrays get a leading layer axis.
        backend: where the arrays live (see ``backends.get_backend``).
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: str = "float16", *, num_layers: int | None = None,
                 backend: str | Backend | None = None) -> None:
        fn = "PagePool"
        for name, val in (("num_pages", num_pages), ("page_size", page_size),
                          ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(fn, name, val)
        if num_layers is not None:
            num_layers = check_int(fn, "num_layers", num_layers, note=" or None")
        self.backend = get_backend(backend, fn=fn)
        self.dtype = check_dtype(fn, "dtype", dtype)
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.num_layers = num_layers
        lead = () if num_layers is None else (num_layers,)
        shape = (*lead, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self.k = self.backend.zeros(shape, self.dtype)
        self.v = self.backend.zeros(shape, self.dtype)
        self._ref = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ inspection
    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        """References to physical page ``page`` (0: free)."""
        return int(self._ref[check_int("PagePool.refcount", "page", page, 0,
                                       self.num_pages - 1)])

    def sequences(self) -> list[int]:
        return list(self._seqs)

    def seq_pages(self, seq: int) -> list[int]:
        return list(self._get("PagePool.seq_pages", seq).pages)

    def seq_len(self, seq: int) -> int:
        """Visible tokens of ``seq``."""
        s = self._get("PagePool.seq_len", seq)
        return s.filled - s.start

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
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq()
        return sid

    def fork(self, seq: int) -> int:
        """A new sequence sharing every page of ``seq`` (refcounts go up, nothing copied)."""
        src = self._get("PagePool.fork", seq)
        sid = self.new_sequence()
        self._seqs[sid] = _Seq(list(src.pages), src.start, src.filled, src.trimmed)
        for p in src.pages:
            self._ref[p] += 1
        return sid

    def free(self, seq: int) -> None:
        """Drop ``seq``; pages whose refcount reaches zero return to the free list."""
        s = self._get("PagePool.free", seq)
        for p in s.pages:
            self._release(p)
        del self._seqs[seq]

    def append(self, seq: int, k: Any, v: Any) -> None:
        """Append ``T >= 0`` tokens: ``k, v [T, Hkv, D]`` (``[L, T, Hkv, D]`` with layers).

        Crosses page boundaries as needed; copies a shared partial last page first.
        """
        fn = "PagePool.append"
        s = self._get(fn, seq)
        kb, vb = self.backend.array_arg(fn, "k", k), self.backend.array_arg(fn, "v", v)
        kshape = tuple(kb.shape)
        lead = () if self.num_layers is None else (self.num_layers,)
        dims = "[T, Hkv, D]" if not lead else "[L, T, Hkv, D]"
        if len(kshape) != len(lead) + 3:
            raise InvalidArgumentError(f"{fn}: k must be {dims}, got shape {fmt_shape(kshape)}")
        t = int(kshape[len(lead)])
        want = (*lead, t, self.num_kv_heads, self.head_dim)
        check_shape(fn, "k", kshape, want, dims)
        check_shape(fn, "v", tuple(vb.shape), want, dims)
        check_dtype(fn, "k", self.backend.dtype_of(kb))
        check_dtype(fn, "v", self.backend.dtype_of(vb))
        if t == 0:
            return
        p = self.page_size
        room = len(s.pages) * p - s.filled
        cow = room > 0 and self._ref[s.pages[-1]] > 1
        need = -(-(t - room) // p) if t > room else 0
        if need + cow > len(self._free):
            raise PoolExhaustedError(
                f"{fn}: need {need + cow} free pages for {t} tokens, the pool has "
                f"{len(self._free)} of {self.num_pages}; nothing was changed")
        if cow:
            old = s.pages[-1]
            new = self._free.pop()
            self._ref[new] = 1
            self.k = self.backend.copy_page(self.k, old, new)
            self.v = self.backend.copy_page(self.v, old, new)
            self._ref[old] -= 1
            s.pages[-1] = new
        for _ in range(need):
            page = self._free.pop()
            self._ref[page] = 1
            s.pages.append(page)
        pos = np.arange(s.filled, s.filled + t, dtype=np.int64)
        ids = np.asarray(s.pages, dtype=np.int64)[pos // p]
        slots = pos % p
        self.k = self.backend.write_tokens(self.k, ids, slots, kb)
        self.v = self.backend.write_tokens(self.v, ids, slots, vb)
        s.filled += t

    def trim_front(self, seq: int, n: int) -> None:
        """Retire the ``n`` oldest visible tokens (a sliding window moving on).

        Pages left holding no visible token are released; a partially filled last page
        always holds the sequence's end, so later appends continue in it.
        """
        fn = "PagePool.trim_front"
        s = self._get(fn, seq)
        vis = s.filled - s.start
        n = check_int(fn, "n", n, 0, vis, f" (the visible length of sequence {seq})")
        s.start += n
        s.trimmed += n
        p = self.page_size
        while s.start >= p:  # the first page holds no visible token
            self._release(s.pages.pop(0))
            s.start -= p
            s.filled -= p

    # ------------------------------------------------------------------ tables
    def page_table(self, seqs: Sequence[int]) -> PageTable:
        """The CSR page table of ``seqs``, in order (a sequence may appear twice)."""
        fn = "PagePool.page_table"
        if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__iter__"):
            raise fail(fn, f"seqs must be a sequence of sequence ids, got "
                           f"{type(seqs).__name__} {seqs!r}")
        rows = [self._get(fn, q) for q in seqs]
        p = self.page_size
        counts = [len(s.pages) for s in rows]
        indices = np.asarray([pg for s in rows for pg in s.pages], dtype=np.int64)
        lpl = [s.filled - (len(s.pages) - 1) * p if s.pages else 0 for s in rows]
        fpo = [s.start if s.pages else 0 for s in rows]
        rope = [s.trimmed + s.filled - s.start for s in rows]
        return PageTable.build(indices, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                               lpl, page_size=p, first_page_offset=fpo, rope_positions=rope,
                               num_pages=self.num_pages)

    # ------------------------------------------------------------------ internals
    def _get(self, fn: str, seq: int) -> _Seq:
        if not is_int(seq):   # True would find sequence 1
            raise fail(fn, f"seq must be a sequence id (an int), got {type(seq).__name__} "
                           f"{seq!r}")
        try:
            return self._seqs[seq]
        except KeyError:
            raise InvalidArgumentError(f"{fn}: unknown sequence {seq!r}; live sequences: "
                                       f"{sorted(self._seqs)[:16]}") from None

    def _release(self, page: int) -> None:
        self._ref[page] -= 1
        if self._ref[page] == 0:
            self._free.append(page)
