"""Split-KV decode plan: host-side plain data, cacheable across steps and layers.

A plan cuts every request's page list into chunks of ``pages_per_chunk`` pages; one
partial-kernel CTA runs per (chunk, KV head, query-head group). The chunk count is
non-increasing in ``pages_per_chunk``, so a binary search finds the *largest* chunk
size whose CTA count still reaches the device target (the fewest chunks, least merge
work, among the sizes that fill the device); of that size and the next larger one (whose
count falls short), the plan takes the one whose CTA count is closer to the target by
ratio. Every request gets at least one chunk (an
empty request gets exactly one, which writes zeros and ``-inf``). The total chunk count
never exceeds 65535 (CUDA grid y/z bound). When every request has one chunk the merge is
skipped: the partial is the answer.

The token range of a chunk is *not* stored: the kernels derive it from the table at run
time (``chunk_token_ranges``), so a plan stays valid while requests grow inside their
chunk structure (``matches``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from .device import DeviceInfo
from .errors import InvalidArgumentError, PlanMismatchError, check_int, check_type, fail
from .page_table import PageTable, frozen_int32
from .specs import MAX_HEADS_PER_CTA, heads_per_cta
from .variants import check_window, window_table

MAX_CHUNKS = 65535


def check_geometry(fn: str, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
        check_int(fn, name, val)
    if num_qo_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"{fn}: num_qo_heads must be a multiple of num_kv_heads, got {num_qo_heads} "
            f"and {num_kv_heads}")


def chunk_counts(pages: np.ndarray, pages_per_chunk: int) -> np.ndarray:
    """Chunks per request: ``max(1, ceil(pages / pages_per_chunk))``, ``int64 [B]``."""
    p = pages.astype(np.int64)
    return np.maximum(1, -(-p // pages_per_chunk))


def smallest_chunk_size(pages: np.ndarray, max_chunks: int = MAX_CHUNKS) -> int:
    """The smallest ``pages_per_chunk`` whose total chunk count is ``<= max_chunks``.

    Counts only fall as the size grows, and at the largest request's page count every
    request has one chunk, so a binary search finds it (requires ``B <= max_chunks``).
    """
    lo, hi = 1, max(1, int(pages.max()) if pages.size else 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(chunk_counts(pages, mid).sum()) <= max_chunks:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """A frozen split-KV plan (arrays are host ``int32``, read-only).

    - ``request_indices [C]``: request of chunk ``c`` (ascending).
    - ``kv_tile_indices [C]``: index of chunk ``c`` within its request; its pages are
      ``[tile * pages_per_chunk, min((tile + 1) * pages_per_chunk, pages))``.
    - ``o_indptr [B+1]``: request ``r``'s partials are rows ``o_indptr[r]:o_indptr[r+1]``.
    - ``chunks_per_request [B]``.
    - ``window_left``: the sliding window the plan was made for (``-1``: none); its chunks
      cover only each request's window (``variants.window_table``), and ``matches`` /
      ``check`` apply the window to the table they are given.
    Workspaces: ``v_part [C, Hq, D]`` float32 and ``lse_part [C, Hq]`` float32 (log2),
    needed only when ``needs_merge``.
    """

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_chunk: int
    heads_per_cta: int
    q_groups: int
    target_ctas: int
    forced: bool
    cta_count_per_chunk: int
    chunks_per_request: np.ndarray = field(repr=False)
    request_indices: np.ndarray = field(repr=False)
    kv_tile_indices: np.ndarray = field(repr=False)
    o_indptr: np.ndarray = field(repr=False)
    window_left: int = -1
    #: tables this plan was checked against (weak: tables are dropped with their step)
    _served: weakref.WeakKeyDictionary[PageTable, bool] = field(
        init=False, repr=False, default_factory=weakref.WeakKeyDictionary)

    def __post_init__(self) -> None:
        # A plan built by hand must be one plan_decode could make: the kernels index the
        # table with request_indices / kv_tile_indices and trust them.
        fn = "DecodePlan"
        for name in ("batch_size", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                     "pages_per_chunk", "heads_per_cta", "q_groups", "cta_count_per_chunk"):
            check_int(fn, name, getattr(self, name))
        check_geometry(fn, self.num_qo_heads, self.num_kv_heads, self.head_dim)
        check_int(fn, "window_left", self.window_left, -1)
        g = self.num_qo_heads // self.num_kv_heads
        if self.heads_per_cta * self.q_groups != g or self.heads_per_cta > MAX_HEADS_PER_CTA:
            raise fail(fn, f"heads_per_cta x q_groups must be the GQA group {g} with at most "
                           f"{MAX_HEADS_PER_CTA} heads per CTA, got {self.heads_per_cta} x "
                           f"{self.q_groups}")
        counts = np.asarray(self.chunks_per_request)
        if counts.shape != (self.batch_size,) or (counts.size and counts.min() < 1):
            raise fail(fn, f"chunks_per_request must be [B = {self.batch_size}] positive "
                           f"counts, got shape {list(counts.shape)}")
        o_indptr = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        req = np.repeat(np.arange(self.batch_size, dtype=np.int64), counts)
        tiles = np.arange(req.size, dtype=np.int64) - o_indptr[req]
        for name, want in (("request_indices", req), ("kv_tile_indices", tiles),
                           ("o_indptr", o_indptr)):
            got = np.asarray(getattr(self, name))
            if got.shape != want.shape or not np.array_equal(got, want):
                raise fail(fn, f"{name} does not follow from chunks_per_request (make plans "
                               "with plan_decode)")
            object.__setattr__(self, name, frozen_int32(got))
        object.__setattr__(self, "chunks_per_request", frozen_int32(counts))

    @property
    def num_chunks(self) -> int:
        return int(self.request_indices.size)

    @property
    def ctas_per_chunk(self) -> int:
        """CTAs of the kernel the plan was searched for, per chunk (the v2 partial's
        ``Hkv * q_groups`` unless ``plan_decode(ctas_per_chunk=...)`` said otherwise)."""
        return self.cta_count_per_chunk

    @property
    def num_ctas(self) -> int:
        return self.num_chunks * self.ctas_per_chunk

    @property
    def needs_merge(self) -> bool:
        return self.num_chunks != self.batch_size

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the float32 ``v_part`` + ``lse_part`` workspace (0 without merge)."""
        if not self.needs_merge:
            return 0
        return self.num_chunks * self.num_qo_heads * (self.head_dim + 1) * 4

    def mismatch(self, table: PageTable) -> str | None:
        """Why this plan cannot serve ``table`` (``None`` when it can).

        A plan serves any table with the same batch size and page size whose requests
        keep the same chunk count at this ``pages_per_chunk``.
        """
        check_type("DecodePlan.mismatch", "table", table, PageTable, "a PageTable")
        table = window_table(table, self.window_left)
        if table.batch_size != self.batch_size:
            return f"batch size {table.batch_size} != plan's {self.batch_size}"
        if table.page_size != self.page_size:
            return f"page_size {table.page_size} != plan's {self.page_size}"
        counts = chunk_counts(table.pages_per_request, self.pages_per_chunk)
        diff = np.nonzero(counts != self.chunks_per_request)[0]
        if diff.size:
            r = int(diff[0])
            return (f"request {r} needs {int(counts[r])} chunks of {self.pages_per_chunk} "
                    f"pages, plan has {int(self.chunks_per_request[r])}")
        return None

    def matches(self, table: PageTable) -> bool:
        return self.mismatch(table) is None

    def check(self, fn: str, table: PageTable, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, window_left: int = -1) -> None:
        """Raise ``PlanMismatchError`` unless the plan fits this table, geometry and
        window (``table`` may be the call's table or its window table)."""
        geo = (num_qo_heads, num_kv_heads, head_dim)
        mine = (self.num_qo_heads, self.num_kv_heads, self.head_dim)
        if geo != mine:
            raise PlanMismatchError(f"{fn}: plan was made for (Hq, Hkv, D) = {mine}, "
                                    f"got {geo}")
        if window_left != self.window_left:
            raise PlanMismatchError(f"{fn}: plan was made for window_left = "
                                    f"{self.window_left}, got {window_left} (pass "
                                    "window_left to plan_decode too)")
        if table in self._served:  # both are immutable: one check per (plan, table)
            return
        why = self.mismatch(table)
        if why is None:
            self._served[table] = True
        if why:
            raise PlanMismatchError(f"{fn}: plan does not match the table: {why}; "
                                    "make a new plan with plan_decode")


def chunk_token_ranges(table: PageTable, plan: DecodePlan) -> tuple[np.ndarray, np.ndarray]:
    """Visible-token range ``[t_begin, t_end)`` of every chunk, ``int64 [C]`` each.

    The kernels compute the same thing in-kernel from the table:
    ``page_begin = tile * ppc``, ``page_end = min(page_begin + ppc, pages)``,
    ``t_begin = max(0, page_begin * P - fpo)``, ``t_end = visible_len`` when the chunk
    reaches the last page, else ``max(0, page_end * P - fpo)``; both clamped to
    ``visible_len``.
    """
    r = plan.request_indices.astype(np.int64)
    npages = table.pages_per_request.astype(np.int64)[r]
    seq = table.visible_lens.astype(np.int64)[r]
    fpo = table.first_page_offset.astype(np.int64)[r]
    p, ppc = table.page_size, plan.pages_per_chunk
    page_begin = plan.kv_tile_indices.astype(np.int64) * ppc
    page_end = np.minimum(page_begin + ppc, npages)
    t_begin = np.maximum(0, page_begin * p - fpo)
    t_end = np.where(page_end >= npages, seq, np.maximum(0, page_end * p - fpo))
    return np.minimum(t_begin, seq), np.minimum(t_end, seq)


def make_plan(table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
              device: DeviceInfo, target_ctas: int | None = None,
              pages_per_chunk: int | None = None, min_chunk_tokens: int | None = None,
              max_chunks: int = MAX_CHUNKS, ctas_per_chunk: int | None = None,
              window_left: int = -1, fn: str = "make_plan") -> DecodePlan:
    """Plan a split-KV decode of ``table`` on ``device`` (``paged_decode.plan_decode``
    finds the device of a backend first; errors name ``fn``).

    Args:
        table: the batch's page table.
        num_qo_heads, num_kv_heads, head_dim: attention geometry (``Hq % Hkv == 0``).
        device: the device to fill (a ``DeviceInfo``: facts as data, no backend lookup).
        target_ctas: CTA count to reach (overrides env and device default).
        pages_per_chunk: force a chunk size instead of searching (e.g. 1 to force the
            finest split and exercise the merge).
        min_chunk_tokens: the searched chunk size is at least this many tokens (default:
            ``device.min_chunk_tokens``); ignored when ``pages_per_chunk`` is given.
        max_chunks: grid bound on the total chunk count (65535).
        ctas_per_chunk: CTAs one chunk launches, for a kernel whose CTA geometry is not
            the v2 partial's ``Hkv * q_groups`` (cascade's tensor-core level 0); the search
            fills the device with that kernel's CTAs.
        window_left: a sliding window (``-1``: none): the plan covers only the pages of
            each request's last ``W + 1`` visible tokens (``variants.window_table``), so
            pages before a window get no chunk and no CTA.
    """
    check_type(fn, "table", table, PageTable, "a PageTable")
    check_geometry(fn, num_qo_heads, num_kv_heads, head_dim)
    window_left = check_window(fn, window_left)
    table = window_table(table, window_left)
    max_chunks = check_int(fn, "max_chunks", max_chunks, 1, MAX_CHUNKS)
    b = table.batch_size
    if b < 1:
        raise InvalidArgumentError(f"{fn}: table must have at least one request, got 0")
    if b > max_chunks:
        raise InvalidArgumentError(f"{fn}: batch size {b} exceeds the grid bound of "
                                   f"{max_chunks} chunks")
    check_type(fn, "device", device, DeviceInfo, "a DeviceInfo or None")
    target = device.target_ctas(target_ctas, fn=fn)
    qh = heads_per_cta(num_qo_heads, num_kv_heads)
    q_groups = (num_qo_heads // num_kv_heads) // qh
    if ctas_per_chunk is None:
        ctas_per_chunk = num_kv_heads * q_groups
    else:
        ctas_per_chunk = check_int(fn, "ctas_per_chunk", ctas_per_chunk, note=" or None")
    pages = table.pages_per_request
    max_ppc = max(1, int(pages.max()))
    min_ppc = smallest_chunk_size(pages, max_chunks)
    floor_tokens = device.chunk_floor(min_chunk_tokens, fn=fn)
    grid_min_ppc = min_ppc
    min_ppc = min(max(min_ppc, -(-int(floor_tokens) // table.page_size)), max_ppc)

    def reaches(ppc: int) -> bool:
        return int(chunk_counts(pages, ppc).sum()) * ctas_per_chunk >= target

    if pages_per_chunk is not None:
        ppc = check_int(fn, "pages_per_chunk", pages_per_chunk, note=" or None")
        if int(chunk_counts(pages, ppc).sum()) > max_chunks:
            raise InvalidArgumentError(
                f"{fn}: pages_per_chunk = {ppc} gives "
                f"{int(chunk_counts(pages, ppc).sum())} chunks, above the grid bound of "
                f"{max_chunks}; use at least {grid_min_ppc}")
    elif not reaches(min_ppc):
        ppc = min_ppc
    else:
        lo, hi = min_ppc, max_ppc  # invariant: reaches(lo)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if reaches(mid):
                lo = mid
            else:
                hi = mid - 1
        ppc = lo
        if lo < max_ppc:
            # one page more per chunk falls short of the target: take it when its CTA
            # count is closer to the target (by ratio), e.g. no split at all for a batch
            # whose requests already give 97% of the target
            over = int(chunk_counts(pages, lo).sum()) * ctas_per_chunk
            under = int(chunk_counts(pages, lo + 1).sum()) * ctas_per_chunk
            if target * target < over * under:   # target / under < over / target
                ppc = lo + 1
    counts = chunk_counts(pages, ppc)
    req = np.repeat(np.arange(b, dtype=np.int64), counts)
    o_indptr = np.concatenate([[0], np.cumsum(counts)])
    tiles = np.arange(req.size, dtype=np.int64) - o_indptr[req]
    return DecodePlan(b, int(num_qo_heads), int(num_kv_heads), int(head_dim),
                      table.page_size, ppc, qh, q_groups, target,
                      pages_per_chunk is not None, int(ctas_per_chunk), frozen_int32(counts),
                      frozen_int32(req), frozen_int32(tiles), frozen_int32(o_indptr),
                      window_left=window_left)
