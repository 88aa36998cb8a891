"""Random decode problems with realistic page tables, shared by check, bench and tests.

A problem's pool has slack (twice the pages needed) and hands out physical pages in a
shuffled order; requests get randomized partial last pages and, when asked, start
mid-page (a sliding window trimmed inside its first page): the requests r with
(r + seed) odd, so single-request problems start mid-page for odd seeds.

Every pool entry that no request may read (slack pages, the entries of a first page before
``first_page_offset``, the entries of a last page past ``last_page_len``) holds NaN, so a
kernel that reads one produces NaN instead of a plausible wrong number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import numpy_dtype
from .page_table import PageTable


@dataclass(frozen=True)
class ProblemSpec:
    batch: int
    context: int          # nominal visible tokens per request
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: str = "float16"
    kv_dtype: str = "float16"
    seed: int = 0
    jitter: bool = True   # randomize lengths (partial last pages) and mid-page starts
    slack: float = 2.0    # pool pages per needed page

    @property
    def label(self) -> str:
        g = self.num_qo_heads // self.num_kv_heads
        return (f"B{self.batch}-ctx{self.context}-ps{self.page_size}-hq{self.num_qo_heads}"
                f"-hkv{self.num_kv_heads}-g{g}-d{self.head_dim}-{self.kv_dtype}")


@dataclass
class Problem:
    spec: ProblemSpec
    q: np.ndarray         # [B, Hq, D]
    k_pages: np.ndarray   # [num_pages, P, Hkv, D]
    v_pages: np.ndarray
    table: PageTable


def make_table(lengths: list[int], page_size: int, *, offsets: list[int] | None = None,
               slack: float = 2.0, rng: np.random.Generator | None = None,
               ) -> tuple[PageTable, int]:
    """A table for visible ``lengths`` with ``offsets`` (first_page_offset) per request.

    Physical pages come from a pool of ``ceil(slack * needed)`` pages in shuffled order.
    Returns ``(table, num_pages)``.
    """
    rng = rng or np.random.default_rng(0)
    offsets = offsets or [0] * len(lengths)
    p = page_size
    counts = [(-(-(o + n) // p)) if n > 0 else 0 for n, o in zip(lengths, offsets)]
    needed = sum(counts)
    num_pages = max(1, int(np.ceil(slack * needed)))
    order = rng.permutation(num_pages)[:needed]
    lpl = [(o + n) - (c - 1) * p if c else 0 for n, o, c in zip(lengths, offsets, counts)]
    fpo = [o if c else 0 for o, c in zip(offsets, counts)]
    table = PageTable.build(order, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                            lpl, page_size=p, first_page_offset=fpo, num_pages=num_pages)
    return table, num_pages


def in_order(table: PageTable) -> PageTable:
    """``table`` with its pages renumbered in list order: request r's j-th page becomes
    page ``indptr[r] + j``, so each request's K/V is one contiguous run at the start of
    the same pool (``num_pages`` kept), in place of ``make_table``'s shuffled ids. Lengths
    and offsets are unchanged; for measuring what scattered pages cost
    (``bench/device/floor.py``)."""
    return PageTable.build(np.arange(table.total_pages), table.indptr, table.last_page_len,
                           page_size=table.page_size,
                           first_page_offset=table.first_page_offset,
                           num_pages=table.num_pages)


def visible_mask(table: PageTable) -> np.ndarray:
    """``bool [total_pages, P]``: which entries of each listed page are visible."""
    p = table.page_size
    mask = np.ones((table.total_pages, p), bool)
    for r in range(table.batch_size):
        a, b = int(table.indptr[r]), int(table.indptr[r + 1])
        if b == a:
            continue
        mask[a, :int(table.first_page_offset[r])] = False
        mask[b - 1, int(table.last_page_len[r]):] = False
    return mask


def make_problem(spec: ProblemSpec, *, lengths: list[int] | None = None,
                 offsets: list[int] | None = None) -> Problem:
    """Random q and pools (standard normal, scaled) for ``spec`` on the host."""
    rng = np.random.default_rng(spec.seed)
    p = spec.page_size
    if lengths is None:
        if spec.jitter:
            lengths = [max(1, spec.context - int(rng.integers(0, max(1, min(p, spec.context)))))
                       for _ in range(spec.batch)]
        else:
            lengths = [spec.context] * spec.batch
    if offsets is None:
        mid = [spec.jitter and p > 1 and (r + spec.seed) % 2 == 1 for r in range(spec.batch)]
        offsets = [int(rng.integers(1, p)) if m else 0 for m in mid]
    table, num_pages = make_table(lengths, p, offsets=offsets, slack=spec.slack, rng=rng)
    shape = (num_pages, p, spec.num_kv_heads, spec.head_dim)
    kvdt = numpy_dtype(spec.kv_dtype)
    used = table.indices.astype(np.int64)
    visible = visible_mask(table)                                   # [used pages, P]
    k = np.full(shape, np.nan, kvdt)
    v = np.full(shape, np.nan, kvdt)
    for pool in (k, v):
        vals = rng.standard_normal((used.size, *shape[1:]), dtype=np.float32)
        vals[~visible] = np.nan
        pool[used] = vals.astype(kvdt)
    q = (rng.standard_normal((spec.batch, spec.num_qo_heads, spec.head_dim), dtype=np.float32)
         * 1.5).astype(numpy_dtype(spec.q_dtype))
    return Problem(spec, q, k, v, table)


def move(problem: Problem, backend: Any) -> tuple[Any, Any, Any]:
    """``(q, k_pages, v_pages)`` as arrays of ``backend``."""
    return (backend.asarray(problem.q), backend.asarray(problem.k_pages),
            backend.asarray(problem.v_pages))
