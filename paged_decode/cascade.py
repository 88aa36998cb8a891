"""Cascade (shared-prefix) decode: read a prefix shared by several requests once.

When requests of a batch list the *same physical pages* at the same positions (pages
shared through the pool's refcounts, e.g. after ``PagePool.fork``), the flat decode reads
those pages once per request. Cascade decode splits the work in two levels that run on
the unchanged v2 partial and merge kernels of any backend:

- **level 0**: one request over the shared pages (``last_page_len = page_size``,
  ``first_page_offset = 0``) whose query is the M members' queries stacked on the head
  axis, KV-head major: ``h0 = kv_head * (M * G) + m * G + g``. Its geometry is
  ``Hq0 = M * Hq`` query heads over the same ``Hkv`` KV heads (GQA group ``M * G``), so
  the kernel's ``h0 // (M * G)`` is the right KV head and each prefix K/V element is read
  once for all members. Member-major stacking (``h0 = m * Hq + h``) would run and read
  the wrong KV heads whenever ``Hkv > 1``.
- **level 1**: every request minus its shared pages (non-members keep their whole range).
- **one merge** of all base-2 (V, LSE) partial states of a request: its level-1 chunks
  and, for a member, its level-0 chunks (the merge is associative and commutative).

Level 0 is a matrix product of ``M * G`` stacked rows against the prefix. Where the
backend has it (CUDA on sm_80+, and the CUDA emulator), it runs on the tensor-core prefix
kernel (``kernels/prefix_tc.py``): a CTA holds 64 stacked rows and reads each prefix K/V
element once for all of them, taking the members' rows straight from ``q`` and writing
their states member-major; otherwise (float32 pools, the Metal backend) on the v2 partial
over explicitly stacked queries, which re-reads the prefix once per 8 stacked heads.

Detection and planning are host work on plain data; ``cascade_policy`` decides when
``decode`` uses them (and memoises them per table object, so the layers of one step share
the work); a call only runs three kernels and a few device copies (query stacking, state
un-stacking and one row gather).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .backends import get_backend
from .device import DeviceInfo
from .errors import (
    InvalidArgumentError,
    PagedDecodeError,
    PlanMismatchError,
    check_choice,
    check_int,
    check_int_array,
    check_type,
    fail,
)
from .kernels import prefix_tc
from .page_table import PageTable, frozen_int32
from .plan import DecodePlan, check_geometry, make_plan
from .specs import prefix_kernel_runs
from .variants import PLAIN, Variant

#: Shortest shared span detection considers. Measured on an H200 (2026-11-30,
#: bench/results/h200/bench_cascade-rule{,_run8}_2026-11-30.json, shared 128-2048 x batch 2-128,
#: tensor-core level 0, two runs): no span below 1024 tokens beat flat decode at any
#: batch (512 x 128: 1.00x and 0.995x; 256 x 128: 0.75x and 0.74x); 1024 x 64 won 1.09x,
#: 1024 x 128 1.50x.
DEFAULT_MIN_SHARED_TOKENS = 1024


#: set while this module constructs its own plans (this thread): they skip the checks
_making = threading.local()


def _ro(a: Any) -> np.ndarray:
    return frozen_int32(a)


_Plan = TypeVar("_Plan")


def _made(cls: type[_Plan], *args: Any) -> _Plan:
    """``cls(*args)`` for a plan this module derived (its arrays frozen already)."""
    before, _making.active = getattr(_making, "active", False), True
    try:
        return cls(*args)
    finally:
        _making.active = before


_TABLE_FIELDS = ("indices", "indptr", "last_page_len", "first_page_offset", "rope_positions",
                 "num_pages", "page_size")


def _same_table(a: PageTable, b: PageTable) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in _TABLE_FIELDS)


@dataclass(frozen=True, eq=False)
class CascadePlan:
    """A detected sharing group and the two level tables (geometry-free, host data).

    - ``members``: ``int32 [M]`` request indices (ascending) that share the prefix.
    - ``shared_pages``: ``S``, pages of the prefix (each member keeps >= 1 private page).
    - ``level0``: one request over the ``S`` shared pages (lpl = page_size, fpo = 0).
    - ``level1``: all ``B`` requests; members without their first ``S`` pages.
    - ``saved_page_reads``: ``S * (M - 1)`` page reads removed per KV head.
    """

    members: np.ndarray
    shared_pages: int
    page_size: int
    batch_size: int
    flat_pages: int
    saved_page_reads: int
    level0: PageTable = field(repr=False)
    level1: PageTable = field(repr=False)
    _source: tuple[np.ndarray, ...] = field(repr=False)

    def __post_init__(self) -> None:
        # A plan built by hand (or by dataclasses.replace) must be the one detection makes
        # of its source table: matches() compares only the source, and the kernels then
        # read the level tables' pages and the members' queries. Its arrays become
        # read-only copies, as made plans' are. detect_shared_prefix's plans skip this.
        if getattr(_making, "active", False):
            return
        fn = "CascadePlan"
        check_type(fn, "level0", self.level0, PageTable, "a PageTable")
        check_type(fn, "level1", self.level1, PageTable, "a PageTable")
        src = self._source
        if not (isinstance(src, tuple) and len(src) == 4):
            raise fail(fn, "_source must be the source table's (indices, indptr, "
                           "last_page_len, first_page_offset)")
        page_size = check_int(fn, "page_size", self.page_size)
        span = check_int(fn, "shared_pages", self.shared_pages)
        try:
            base = PageTable.build(src[0], src[1], src[2], page_size=page_size,
                                   first_page_offset=src[3],
                                   rope_positions=self.level1.rope_positions,
                                   num_pages=self.level1.num_pages)
        except PagedDecodeError as exc:
            raise fail(fn, f"_source is not a valid page table ({exc})") from exc
        members = check_int_array(fn, "members", self.members, minimum=0,
                                  maximum=base.batch_size - 1)
        if members.size < 2 or (np.diff(members) <= 0).any():
            raise fail(fn, f"members must be >= 2 ascending distinct request indices, got "
                           f"{members.tolist()[:16]}")
        ip = base.indptr.astype(np.int64)[members]
        ok = _can_share(base)[members] & (base.pages_per_request[members] > span)
        if not ok.all():
            raise fail(fn, f"request {int(members[np.argmin(ok)])} cannot share "
                           f"{span} pages (a member needs first_page_offset 0 and more "
                           "than shared_pages pages)")
        pages = base.indices[ip[:, None] + np.arange(span)[None, :]]
        if (pages != pages[:1]).any():
            raise fail(fn, f"the members do not list the same first {span} pages")
        want = _group_plan(base, members, span)
        for name in ("batch_size", "flat_pages", "saved_page_reads"):
            if getattr(self, name) != getattr(want, name):
                raise fail(fn, f"{name} is {getattr(self, name)!r}, the source table and "
                               f"members give {getattr(want, name)!r}")
        for name in ("level0", "level1"):
            if not _same_table(getattr(self, name), getattr(want, name)):
                raise fail(fn, f"{name} does not follow from the source table, members and "
                               "shared_pages (make plans with detect_shared_prefix)")
        object.__setattr__(self, "members", want.members)
        object.__setattr__(self, "_source", want._source)

    @property
    def num_members(self) -> int:
        """Requests sharing the prefix (``M``)."""
        return int(self.members.size)

    @property
    def shared_tokens(self) -> int:
        """Tokens of the shared prefix (``shared_pages * page_size``)."""
        return self.shared_pages * self.page_size

    def matches(self, table: PageTable) -> bool:
        """Whether this plan was made for ``table`` (same object or equal CSR arrays)."""
        check_type("CascadePlan.matches", "table", table, PageTable, "a PageTable")
        src = (table.indices, table.indptr, table.last_page_len, table.first_page_offset)
        return table.page_size == self.page_size and all(
            a is b or np.array_equal(a, b) for a, b in zip(self._source, src))

    def describe(self) -> str:
        """One line: members, shared pages and tokens, and the page reads saved of
        the flat decode's."""
        return (f"members {self.members.tolist()[:16]}{'...' if self.num_members > 16 else ''}"
                f" (M={self.num_members}), shared pages {self.shared_pages} "
                f"({self.shared_tokens} tokens), saved page reads {self.saved_page_reads} of "
                f"{self.flat_pages}")


@dataclass(frozen=True, eq=False)
class CascadeDecodePlan:
    """A ``CascadePlan`` planned for one geometry and device: everything a call needs.

    - ``plan0``: ``DecodePlan`` of ``level0`` for ``(M * Hq, Hkv, D)``, ``C0`` chunks.
    - ``plan1``: ``DecodePlan`` of ``level1`` for ``(Hq, Hkv, D)``, ``C1`` chunks.
    - ``merge_rows``: ``int32 [C1 + M * C0]``: row ``i`` of the merge input is row
      ``merge_rows[i]`` of the stacked states ``[level-1 chunks; member 0's level-0 chunks;
      member 1's; ...]``, so each request's partials are contiguous (the CUDA merge reads
      through it; other backends gather first).
    - ``o_indptr``: ``int32 [B + 1]``, the merge groups (one output row per request).
    - ``prefix_row_tiles``: row tiles per KV head of the tensor-core level 0
      (``ceil(M * G / DeviceInfo.prefix_tile_rows)``; ``plan0`` was searched for its
      ``Hkv * prefix_row_tiles`` CTAs per chunk), 0 when level 0 runs on the v2 partial.
    """

    prefix: CascadePlan
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    prefix_row_tiles: int
    plan0: DecodePlan = field(repr=False)
    plan1: DecodePlan = field(repr=False)
    merge_rows: np.ndarray = field(repr=False)
    o_indptr: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        # A plan built by hand must be one plan_cascade could make: the merge gathers
        # through merge_rows and each level's kernel trusts its plan. Its arrays become
        # read-only copies. plan_cascade's plans skip this.
        if getattr(_making, "active", False):
            return
        fn = "CascadeDecodePlan"
        check_type(fn, "prefix", self.prefix, CascadePlan, "a CascadePlan")
        check_type(fn, "plan0", self.plan0, DecodePlan, "a DecodePlan")
        check_type(fn, "plan1", self.plan1, DecodePlan, "a DecodePlan")
        check_geometry(fn, self.num_qo_heads, self.num_kv_heads, self.head_dim)
        check_int(fn, "prefix_row_tiles", self.prefix_row_tiles, 0)
        pre = self.prefix
        for name, plan, table, hq in (("plan0", self.plan0, pre.level0,
                                       pre.num_members * self.num_qo_heads),
                                      ("plan1", self.plan1, pre.level1, self.num_qo_heads)):
            geo = (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.query_tokens,
                   plan.window_left)
            if geo != (hq, self.num_kv_heads, self.head_dim, 1, -1):
                raise fail(fn, f"{name} must be planned for (Hq, Hkv, D) = "
                               f"{(hq, self.num_kv_heads, self.head_dim)}, one query token and "
                               f"no window, got {geo[:3]}, {geo[3]} token(s), window "
                               f"{geo[4]}")
            why = plan.mismatch(table)
            if why is not None:
                raise fail(fn, f"{name} does not serve the prefix's level table: {why}")
        rows, start = _merge_order(pre, self.plan0, self.plan1)
        for name, want in (("merge_rows", rows), ("o_indptr", start)):
            got = np.asarray(getattr(self, name))
            if got.shape != want.shape or not np.array_equal(got, want):
                raise fail(fn, f"{name} does not follow from the level plans (make plans "
                               "with plan_cascade)")
            object.__setattr__(self, name, _ro(want))

    @property
    def num_partials(self) -> int:
        """Partial-state rows the merge reads (``C1 + M * C0``)."""
        return int(self.merge_rows.size)


# ---------------------------------------------------------------------------- detection
def detect_shared_prefix(table: PageTable, *, min_shared_pages: int | None = None,
                         min_members: int = 2) -> CascadePlan | None:
    """Find the sharing group whose cascade removes the most page reads, or ``None``.

    Requests are compared page id by page id from their first page (equal ids at equal
    positions are the same refcounted page). Eligible requests have visible tokens,
    ``first_page_offset == 0`` (a window starting mid-page is excluded) and >= 2 pages.
    A group's span is capped so every member keeps its last page private (the shared
    pages are full pages). Among all (group, span) candidates with span >=
    ``min_shared_pages`` and >= ``min_members`` members, the one with the largest
    ``span * (members - 1)`` wins (ties: longer span, then lower request indices).

    Args:
        table: the flat batch's page table.
        min_shared_pages: shortest span worth a cascade (default:
            ``ceil(DEFAULT_MIN_SHARED_TOKENS / page_size)``, measured).
        min_members: smallest group (>= 2; the automatic rule's byte floor decides
            whether a small group pays).
    """
    return detect_with_reason(table, min_shared_pages=min_shared_pages,
                              min_members=min_members)[0]


def detect_with_reason(table: PageTable, *, min_shared_pages: int | None = None,
                       min_members: int = 2, fn: str = "detect_shared_prefix"
                       ) -> tuple[CascadePlan | None, str]:
    """``detect_shared_prefix`` and why it found no group (``""`` when it found one): no
    shared prefix at all, or one shorter than the minimum span (a fork that shares every
    page of a short sequence), which the outcome of an automatic call reports."""
    check_type(fn, "table", table, PageTable, "a PageTable")
    p = table.page_size
    if min_shared_pages is None:
        msp = -(-DEFAULT_MIN_SHARED_TOKENS // p)
        floor = (f"the minimum span of {msp} pages ({DEFAULT_MIN_SHARED_TOKENS} tokens, "
                 "DEFAULT_MIN_SHARED_TOKENS)")
    else:
        msp = check_int(fn, "min_shared_pages", min_shared_pages, note=" or None")
        floor = f"min_shared_pages = {msp}"
    min_members = check_int(fn, "min_members", min_members, 2)
    none = "no shared prefix"
    pages = table.pages_per_request.astype(np.int64)
    cand = np.nonzero(_can_share(table))[0]
    if cand.size < min_members:
        return None, none
    first = table.indices[table.indptr[cand]]
    _, inv, cnt = np.unique(first, return_inverse=True, return_counts=True)
    cand = cand[cnt[inv.reshape(-1)] >= 2]         # cheap exit when nothing is shared
    if cand.size < min_members:
        return None, none
    caps = pages[cand] - 1
    group, span = _best_group(table, cand, caps, msp, min_members)
    if group is not None:
        return _group_plan(table, group, span), ""
    group, span = _best_group(table, cand, caps, 1, min_members)
    if group is None:
        return None, none
    return None, (f"requests {group.tolist()[:8]}{'...' if group.size > 8 else ''} share "
                  f"{span} full pages ({span * p} tokens; each keeps its last page), below "
                  f"{floor}")


def _can_share(table: PageTable) -> np.ndarray:
    """bool ``[B]``: requests that may join a sharing group (visible tokens,
    ``first_page_offset == 0``, >= 2 pages so one stays private)."""
    return ((table.visible_lens > 0) & (table.first_page_offset == 0)
            & (table.pages_per_request >= 2))


def _best_group(table: PageTable, cand: np.ndarray, caps: np.ndarray, min_span: int,
                min_members: int) -> tuple[np.ndarray | None, int]:
    """Sort candidates by their capped page lists; adjacent common-prefix lengths form a
    histogram whose largest rectangle (width = members - 1) is the best group."""
    n = cand.size
    width = int(caps.max())
    col = np.arange(width + 1, dtype=np.int64)
    starts = table.indptr[cand].astype(np.int64)
    pos = np.minimum(starts[:, None] + col[None, :], table.indices.size - 1)
    rows = table.indices[pos].astype(np.int64)
    pad = -(np.arange(n, dtype=np.int64) + 1)       # unique per row: stops every prefix at
    rows = np.where(col[None, :] < caps[:, None], rows, pad[:, None])  # the row's own cap
    as_lists = rows.tolist()
    order = np.asarray(sorted(range(n), key=as_lists.__getitem__), dtype=np.int64)
    srt = rows[order]
    lcp = np.argmax(srt[1:] != srt[:-1], axis=1)    # <= min of the two caps (pads differ)
    h = np.where(lcp >= min_span, lcp, 0).tolist()
    best: tuple[int, int, int] | None = None        # (saved, span, -first member)
    best_range = (0, 0)
    stack: list[int] = []
    left = [0] * len(h)
    for k, hk in enumerate(h):                      # left extent of each bar
        while stack and h[stack[-1]] >= hk:
            stack.pop()
        left[k] = stack[-1] + 1 if stack else 0
        stack.append(k)
    stack.clear()
    for k in range(len(h) - 1, -1, -1):             # right extent, then score
        hk = h[k]
        while stack and h[stack[-1]] >= hk:
            stack.pop()
        right = stack[-1] - 1 if stack else len(h) - 1
        stack.append(k)
        members = right - left[k] + 2
        if hk == 0 or members < min_members:
            continue
        lo, hi = left[k], right + 1
        key = (hk * (members - 1), hk, -int(cand[order[lo:hi + 1]].min()))
        if best is None or key > best:
            best, best_range = key, (lo, hi)
    if best is None:
        return None, 0
    lo, hi = best_range
    return np.sort(cand[order[lo:hi + 1]]), best[1]


def _group_plan(table: PageTable, members: np.ndarray, span: int) -> CascadePlan:
    p, b = table.page_size, table.batch_size
    ip = table.indptr.astype(np.int64)
    shared = table.indices[ip[members[0]]:ip[members[0]] + span]
    level0 = PageTable.build(shared, [0, span], [p], page_size=p, first_page_offset=[0],
                             rope_positions=[span * p], num_pages=table.num_pages)
    drop = np.zeros(b, np.int64)
    drop[members] = span
    keep = np.ones(table.indices.size, bool)
    offs = (ip[members][:, None] + np.arange(span)[None, :]).reshape(-1)
    keep[offs] = False
    counts = np.diff(ip) - drop
    level1 = PageTable.build(table.indices[keep], np.concatenate([[0], np.cumsum(counts)]),
                             table.last_page_len, page_size=p,
                             first_page_offset=table.first_page_offset,
                             rope_positions=table.rope_positions, num_pages=table.num_pages)
    src = (table.indices, table.indptr, table.last_page_len, table.first_page_offset)
    return _made(CascadePlan, _ro(members), int(span), p, b, table.total_pages,
                 int(span * (members.size - 1)), level0, level1, src)


# ---------------------------------------------------------------------------- planning
def plan_cascade(table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
                 prefix: CascadePlan | None = None, device: DeviceInfo | None = None,
                 backend: str | None = None, min_shared_pages: int | None = None,
                 min_members: int = 2, level0: str = "auto") -> CascadeDecodePlan | None:
    """Detect (unless ``prefix`` is given) and plan both levels; ``None`` when no group.

    The level plans use ``plan_decode``'s search on ``device`` (default: the backend's).
    ``level0``: ``"auto"`` (the tensor-core prefix kernel where ``device`` has one, else
    the v2 partial), ``"tc"`` (require it) or ``"v2"`` (the v2 partial on stacked queries,
    a comparison arm). A call whose dtypes the prefix kernel does not take (float32)
    runs level 0 on the v2 partial with the same chunks.
    """
    fn = "plan_cascade"
    check_type(fn, "table", table, PageTable, "a PageTable")
    check_geometry(fn, num_qo_heads, num_kv_heads, head_dim)
    check_choice(fn, "level0", level0, ("auto", "tc", "v2"))
    if prefix is None:
        prefix = detect_with_reason(table, min_shared_pages=min_shared_pages,
                                    min_members=min_members, fn=fn)[0]
        if prefix is None:
            return None
    elif not isinstance(prefix, CascadePlan):
        raise InvalidArgumentError(f"{fn}: prefix must be a CascadePlan (detect_shared_prefix) "
                                   f"or None, got {type(prefix).__name__}")
    elif not prefix.matches(table):
        raise PlanMismatchError(f"{fn}: prefix is a CascadePlan made for another page table "
                                "(its CSR arrays or page size differ)")
    if device is None:
        device = get_backend(backend, fn=fn).device_info()
    check_type(fn, "device", device, DeviceInfo, "a DeviceInfo or None")
    m = prefix.num_members
    tile_rows = device.prefix_tile_rows if level0 != "v2" else 0
    if level0 == "tc" and not tile_rows:
        raise InvalidArgumentError(f"{fn}: level0='tc' needs a backend with the tensor-core "
                                   f"prefix kernel; device {device.name!r} "
                                   f"({device.backend}) has none")
    row_tiles = -(-m * (num_qo_heads // num_kv_heads) // tile_rows) if tile_rows else 0
    if row_tiles:
        plan0 = make_plan(prefix.level0, m * num_qo_heads, num_kv_heads, head_dim,
                            device=device, ctas_per_chunk=num_kv_heads * row_tiles,
                            pages_per_chunk=_prefix_pages_per_chunk(
                                prefix, device, head_dim, num_kv_heads * row_tiles))
    else:
        plan0 = make_plan(prefix.level0, m * num_qo_heads, num_kv_heads, head_dim,
                            device=device)
    plan1 = make_plan(prefix.level1, num_qo_heads, num_kv_heads, head_dim, device=device)
    rows, start = _merge_order(prefix, plan0, plan1)
    return _made(CascadeDecodePlan, prefix, int(num_qo_heads), int(num_kv_heads),
                 int(head_dim), row_tiles, plan0, plan1, _ro(rows), _ro(start))


def _merge_order(prefix: CascadePlan, plan0: DecodePlan, plan1: DecodePlan
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``(merge_rows, o_indptr)`` of ``CascadeDecodePlan`` (int64): each request's level-1
    chunks, then a member's level-0 chunks, contiguous."""
    m, b = prefix.num_members, prefix.batch_size
    c0, c1 = plan0.num_chunks, plan1.num_chunks
    chunks1 = plan1.chunks_per_request.astype(np.int64)
    slot = np.full(b, -1, np.int64)
    slot[prefix.members] = np.arange(m)
    counts = chunks1 + np.where(slot >= 0, c0, 0)
    start = np.concatenate([[0], np.cumsum(counts)])
    rows = np.empty(int(start[-1]), np.int64)
    req1 = plan1.request_indices.astype(np.int64)
    rows[start[req1] + plan1.kv_tile_indices] = np.arange(c1)
    mem = prefix.members.astype(np.int64)
    dst = (start[mem] + chunks1[mem])[:, None] + np.arange(c0)[None, :]
    rows[dst.reshape(-1)] = c1 + np.arange(m * c0)
    return rows, start


def _prefix_pages_per_chunk(prefix: CascadePlan, device: DeviceInfo, head_dim: int,
                            ctas_per_chunk: int) -> int:
    """Level-0 chunk size for the tensor-core prefix kernel: as many chunks as fit in one
    wave of resident CTAs (``ctas_per_sm`` by shared memory, 2 when unknown; a CTA
    more would start a second wave that doubles the kernel's time), no chunk shorter
    than the device's chunk floor."""
    per_sm = (prefix_tc.ctas_per_sm(head_dim, device.shared_mem_per_unit)
              if device.shared_mem_per_unit else 2)
    wave = max(1, device.compute_units * per_sm)
    chunks = max(1, wave // ctas_per_chunk)
    s = prefix.shared_pages
    floor_pages = -(-device.chunk_floor() // prefix.page_size)
    return max(1, min(s, max(-(-s // chunks), floor_pages)))


# ---------------------------------------------------------------------------- running
def stack_member_queries(xp: Any, q: Any, members: Any, num_kv_heads: int) -> Any:
    """``q [B, Hq, D]`` -> level-0 query ``[1, Hkv * M * G, D]``, KV-head major
    (``h0 = kv_head * (M * G) + m * G + g``); ``members`` is a device index array."""
    _, hq, d = q.shape
    qm = xp.take(q, members, axis=0)                               # [M, Hq, D]
    m = qm.shape[0]
    g = hq // num_kv_heads
    qm = qm.reshape(m, num_kv_heads, g, d).transpose(1, 0, 2, 3)
    return xp.ascontiguousarray(qm).reshape(1, num_kv_heads * m * g, d)


def unstack_member_states(xp: Any, v0: Any, lse0: Any, num_members: int,
                          num_kv_heads: int) -> tuple[Any, Any]:
    """Level-0 states ``v0 [C0, Hkv*M*G, D]``, ``lse0 [C0, Hkv*M*G]`` -> per-member rows
    ``[M * C0, Hq, D]`` and ``[M * C0, Hq]`` (member-major, each member's chunks together)."""
    c0, h0, d = v0.shape
    m, hkv = num_members, num_kv_heads
    g = h0 // (m * hkv)
    v = v0.reshape(c0, hkv, m, g, d).transpose(2, 0, 1, 3, 4)
    lse = lse0.reshape(c0, hkv, m, g).transpose(2, 0, 1, 3)
    return (xp.ascontiguousarray(v).reshape(m * c0, hkv * g, d),
            xp.ascontiguousarray(lse).reshape(m * c0, hkv * g))


def _device_index(be: Any, arr: np.ndarray) -> Any:
    up = getattr(be, "upload", None)                # CUDA: memoised per read-only array
    return up(arr) if up is not None else be.array_module().asarray(arr)


TC_LEVEL0 = "tensor-core prefix"
V2_LEVEL0 = "v2 on stacked queries"


def tc_level0_applies(be: Any, cplan: CascadeDecodePlan, q_dtype: str, kv_dtype: str,
                      variant: Variant = PLAIN) -> bool:
    """Whether ``run_cascade`` runs level 0 on the tensor-core prefix kernel: the plan was
    made for it, the backend has it, the dtypes fit (16-bit pools, ``q`` alike) and no
    logits soft cap is asked for (the prefix kernel has none; sinks enter only the final
    merge, so they do not matter here)."""
    return (bool(cplan.prefix_row_tiles) and variant.soft_cap is None
            and prefix_kernel_runs(be.device_info(), q_dtype, kv_dtype))


def run_cascade(be: Any, q: Any, k_pages: Any, v_pages: Any, cplan: CascadeDecodePlan,
                sm_scale: float, out: Any, lse_out: Any, variant: Variant = PLAIN) -> None:
    """Run both levels and the merge on validated backend arrays. Level 0 runs on the
    tensor-core prefix kernel when ``tc_level0_applies`` (outcomes name it ``TC_LEVEL0``),
    else on the v2 partial over stacked queries (``V2_LEVEL0``). On the tensor-core path
    with a gathering merge it makes three kernel launches and nothing else
    (``prepare_decode`` records them).

    ``q [B, Hq, D]``; pools ``[num_pages, P, Hkv, D]``; ``out [B, Hq, D]`` (any output
    dtype); ``lse_out [B, Hq]`` float32 (base 2). Workspaces are float32 ``scratch`` of
    ``cplan`` (kept per plan and stream on CUDA: a call allocates nothing after its first).
    ``variant``: a soft cap applies to both levels' partials (and keeps level 0 off the
    tensor-core kernel); sinks enter the one final merge, once per request and head. A
    window was applied to the table the plan was made from.
    """
    xp = be.array_module()
    _, hq, d = q.shape
    hkv, pre = cplan.num_kv_heads, cplan.prefix
    p0, p1, m = cplan.plan0, cplan.plan1, pre.num_members
    c0, c1 = p0.num_chunks, p1.num_chunks
    n = c1 + m * c0
    ws_v = be.scratch(cplan, "states_v", (n, hq, d), "float32")
    ws_l = be.scratch(cplan, "states_lse", (n, hq), "float32")
    v1, l1 = ws_v[:c1], ws_l[:c1]       # views on numpy/CuPy: the kernel fills ws_v, ws_l
    kw = variant.kernel_kwargs(final=False)
    be.partial(q, k_pages, v_pages, pre.level1, p1, sm_scale, v1, l1, **kw)
    if be.functional_outputs:           # MLX rebinds v1, l1 instead (see backends.base)
        ws_v[:c1], ws_l[:c1] = v1, l1
    members = _device_index(be, pre.members)
    if not (cplan.prefix_row_tiles and variant.soft_cap is None and be.prefix_partial(
            q, k_pages, v_pages, pre.level0, p0, members, cplan.prefix_row_tiles, sm_scale,
            ws_v[c1:], ws_l[c1:])):
        q0 = stack_member_queries(xp, q, members, hkv)
        v0 = be.scratch(cplan, "level0_v", (c0, m * hq, d), "float32")
        l0 = be.scratch(cplan, "level0_lse", (c0, m * hq), "float32")
        be.partial(q0, k_pages, v_pages, pre.level0, p0, sm_scale, v0, l0, **kw)
        ws_v[c1:], ws_l[c1:] = unstack_member_states(xp, v0, l0, m, hkv)
    rows = _device_index(be, cplan.merge_rows)
    if be.merge_gathers:                # the merge reads the states through `rows`
        be.merge(ws_v, ws_l, cplan.o_indptr, out, lse_out, rows=rows, **variant.merge_kwargs())
    else:
        be.merge(xp.take(ws_v, rows, axis=0), xp.take(ws_l, rows, axis=0), cplan.o_indptr,
                 out, lse_out, **variant.merge_kwargs())


__all__ = ["TC_LEVEL0", "V2_LEVEL0", "CascadePlan", "CascadeDecodePlan",
           "detect_shared_prefix", "detect_with_reason", "plan_cascade", "tc_level0_applies",
           "run_cascade", "DEFAULT_MIN_SHARED_TOKENS"]
