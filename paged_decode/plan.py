"""Split-KV decode plan: host-side plain data, cacheable across steps and layers.

A plan cuts every request's page list into chunks of ``pages_per_chunk`` pages; one
partial-kernel CTA runs per (chunk, KV head, query-head group). The chunk count is
non-increasing in ``pages_per_chunk``, so a binary search finds the *largest* chunk
size whose CTA count still reaches the device target (the fewest chunks, least merge
work, among the sizes that fill the device); of that size and the next larger one (whose
count falls short), the plan takes the one whose CTA count is closer to the target by
ratio. That size then shrinks to the smallest (within ``BALANCE_SLACK``) that keeps
every request's chunk count (``balanced_chunk_size``), so a request's chunks are even
rather than full chunks and a sliver. A plan for the tensor-core partial on a device whose
resident CTAs per SM are known (``slots_per_unit``) takes its size from the wave rule
instead, where that rule's cost model sees a gain (``waves.py``). Every request gets at
least one chunk (an empty request gets exactly one, which writes zeros and ``-inf``). The
total chunk count never exceeds 65535 (CUDA grid y/z bound). When every request has one
chunk the merge is skipped: the partial is the answer.

The token range of a chunk is *not* stored: the kernels derive it from the table at run
time (``chunk_token_ranges``), so a plan stays valid while requests grow inside their
chunk structure (``matches``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .device import DeviceInfo
from .dtypes import KV_DTYPES, check_dtype
from .errors import InvalidArgumentError, PlanMismatchError, check_int, check_type, fail
from .kernels.decode_v2_tc import kv_bytes
from .multitoken import MAX_QUERY_TOKENS, check_query_tokens_arg
from .page_table import MAX_ENTRIES, PageTable, frozen_int32
from .specs import MAX_HEADS_PER_CTA, heads_per_cta
from .step_table import StepTable
from .variants import check_window, window_table
from .waves import wave_chunk_size

MAX_CHUNKS = 65535
#: the most query heads, KV heads or head_dim a plan takes: a CUDA grid dimension's limit
#: (no kernel here launches more heads), and far past any served model's geometry
MAX_GEOMETRY = 65535
#: a batch is ragged when its longest request has this many times the mean's pages
RAGGED_RATIO = 1.25
#: set while make_plan constructs its plan (this thread)
_planning = threading.local()
#: multi-token plans -> their folded view (``DecodePlan.folded``)
_folded_lock = threading.Lock()
_folded: weakref.WeakKeyDictionary[DecodePlan, DecodePlan] = weakref.WeakKeyDictionary()


def check_geometry(fn: str, num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                      ("head_dim", head_dim)):
        check_int(fn, name, val, 1, MAX_GEOMETRY)
    if num_qo_heads % num_kv_heads:
        raise InvalidArgumentError(
            f"{fn}: num_qo_heads must be a multiple of num_kv_heads, got {num_qo_heads} "
            f"and {num_kv_heads}")


def check_headroom(fn: str, headroom: Any) -> int:
    """``headroom`` (tokens a request may still grow by) as an int in ``[0,
    MAX_ENTRIES]``: no request holds more entries, and a larger one would overflow the
    plan's token arithmetic."""
    return check_int(fn, "headroom", headroom, 0, MAX_ENTRIES, note=" tokens")


def chunk_counts(pages: np.ndarray, pages_per_chunk: int) -> np.ndarray:
    """Chunks per request: ``max(1, ceil(pages / pages_per_chunk))``, ``int64 [B]``."""
    p = pages.astype(np.int64)
    return np.maximum(1, -(-p // pages_per_chunk))


#: a balanced chunk may be up to 1 / BALANCE_SLACK longer than the shortest size that
#: keeps every request's chunk count: growth room, so that a plan made with headroom is
#: not outgrown (and replanned) sooner than it must be
BALANCE_SLACK = 16


def balanced_chunk_size(pages: np.ndarray, ppc: int, lower: int = 1) -> int:
    """A chunk size that cuts every request into as many chunks as ``ppc`` does, with
    those chunks as even as possible: at most ``1 / BALANCE_SLACK`` above the smallest
    such size, never below ``lower`` (the chunk floor) nor above ``ppc``.

    The search picks the *largest* size that reaches the CTA target, which can leave a
    request split into one full chunk and a sliver: 20,000 tokens at 1249 pages per
    chunk are 19,984 + 16 tokens, so the request's critical path is barely shorter than
    unsplit. Each request's count ``ceil(n / ppc)`` only falls as the size grows, so the
    smallest size with the same counts, ``max(ceil(n / count))``, has the same chunks,
    CTAs and merge work and the shortest longest chunk (10,000 + 10,000 tokens here).
    ``pages``: the requests' page counts (empty requests left out, they take one chunk
    at any size)."""
    p = np.asarray(pages, np.int64)
    p = p[p > 0]
    if not p.size:
        return ppc
    counts = -(-p // ppc)
    even = int((-(-p // counts)).max())
    return min(ppc, max(lower, even + even // BALANCE_SLACK))


def smallest_chunk_size(pages: np.ndarray, max_chunks: int = MAX_CHUNKS) -> int:
    """The smallest ``pages_per_chunk`` whose total chunk count is ``<= max_chunks``.

    Counts only fall as the size grows, and at the largest request's page count every
    request has one chunk, so a binary search finds it (requires ``B <= max_chunks``).
    """
    if int(chunk_counts(pages, 1).sum()) <= max_chunks:   # the usual case: one op
        return 1
    lo, hi = 2, max(1, int(pages.max()) if pages.size else 1)
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
    - ``query_tokens``: the most query tokens per request the plan serves (1-8,
      ``docs/multi-token.md``): a multi-token call reads each request's common range once
      for all its tokens, their queries folded into the GQA group, so the CTA geometry
      (``heads_per_cta`` x ``q_groups``) is that of ``query_tokens x`` the group. A plan
      serves calls with at most that many tokens per request; a one-token call needs 1.
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
    #: tokens per request the plan was made to grow by (``make_plan(headroom=...)``)
    headroom: int = 0
    #: most query tokens per request (the kernels see a group of ``query_tokens * G``)
    query_tokens: int = 1
    #: resident CTAs per SM the wave rule planned for (``make_plan``); 0: the target rule
    slots_per_unit: int = 0
    #: tables this plan was checked against (weak: tables are dropped with their step)
    _served: weakref.WeakKeyDictionary[Any, int] = field(
        init=False, repr=False, default_factory=weakref.WeakKeyDictionary)

    def __post_init__(self) -> None:
        # A plan built by hand must be one plan_decode could make: the kernels index the
        # table with request_indices / kv_tile_indices and trust them. make_plan's own
        # plans (arrays derived from the counts, frozen) skip the re-derivation: a replan
        # in an engine's loop is host time on the critical path.
        if getattr(_planning, "active", False):
            return
        fn = "DecodePlan"
        for name in ("batch_size", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                     "pages_per_chunk", "heads_per_cta", "q_groups", "cta_count_per_chunk"):
            check_int(fn, name, getattr(self, name))
        check_int(fn, "headroom", self.headroom, 0)
        check_geometry(fn, self.num_qo_heads, self.num_kv_heads, self.head_dim)
        check_int(fn, "window_left", self.window_left, -1)
        check_int(fn, "query_tokens", self.query_tokens, 1, MAX_QUERY_TOKENS)
        check_int(fn, "slots_per_unit", self.slots_per_unit, 0)
        g = self.num_qo_heads // self.num_kv_heads * self.query_tokens
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
        """Chunks over all requests (``C``)."""
        return int(self.request_indices.size)

    @property
    def ctas_per_chunk(self) -> int:
        """CTAs of the kernel the plan was searched for, per chunk (the v2 partial's
        ``Hkv * q_groups`` unless ``plan_decode(ctas_per_chunk=...)`` said otherwise)."""
        return self.cta_count_per_chunk

    @property
    def num_ctas(self) -> int:
        """CTAs the plan was searched for: ``num_chunks * ctas_per_chunk``."""
        return self.num_chunks * self.ctas_per_chunk

    @functools.cached_property
    def uniform_chunks(self) -> int:
        """``K`` when every request has exactly ``K`` chunks, else 0 (cached: the CUDA
        backend asks on every fused call, ``launches.cluster_merge_size``)."""
        counts = self.chunks_per_request
        if counts.size == 0:
            return 0
        k = int(counts[0])
        return k if bool((counts == k).all()) else 0

    @property
    def needs_merge(self) -> bool:
        """Whether some request has more than one chunk (the merge runs, and the
        workspace is needed)."""
        return self.num_chunks != self.batch_size

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the float32 ``v_part`` + ``lse_part`` workspace (0 without merge)."""
        if not self.needs_merge:
            return 0
        return self.num_chunks * self.num_qo_heads * self.query_tokens * (self.head_dim
                                                                           + 1) * 4

    def mismatch(self, table: PageTable | StepTable) -> str | None:
        """Why this plan cannot serve ``table`` (``None`` when it can).

        A plan serves any table with the same batch size and page size whose requests
        need at most the plan's chunk count at this ``pages_per_chunk`` (the kernels
        derive every chunk's token range from the table; a chunk past a request's pages
        is empty and weighs nothing in the merge). A plan made with ``headroom`` has
        chunks for that many more tokens per request.
        """
        check_type("DecodePlan.mismatch", "table", table, (PageTable, StepTable),
                   "a PageTable or StepTable")
        table = window_table(table, self.window_left)
        if table.batch_size != self.batch_size:
            return f"batch size {table.batch_size} != plan's {self.batch_size}"
        if table.page_size != self.page_size:
            return f"page_size {table.page_size} != plan's {self.page_size}"
        counts = chunk_counts(table.pages_per_request, self.pages_per_chunk)
        diff = np.nonzero(counts > self.chunks_per_request)[0]
        if diff.size:
            r = int(diff[0])
            return (f"request {r} needs {int(counts[r])} chunks of {self.pages_per_chunk} "
                    f"pages, plan has {int(self.chunks_per_request[r])}")
        return None

    def tokens_left(self, table: PageTable | StepTable) -> int:
        """How many more tokens every request of ``table`` may gain, one per request at a
        time, with this plan still serving it: ``min`` over requests of the token room
        left in the ``chunks_per_request * pages_per_chunk`` pages the plan covers (0 when
        it does not serve ``table`` now, or has a window, whose table moves otherwise). A
        request outgrows its chunks (``mismatch``) exactly when its room is negative, so
        this is ``mismatch``'s chunk test too, not run again here."""
        check_type("DecodePlan.tokens_left", "table", table, (PageTable, StepTable),
                   "a PageTable or StepTable")
        if (self.window_left >= 0 or table.batch_size != self.batch_size
                or table.page_size != self.page_size):
            return 0
        pages = np.asarray(table.pages_per_request, np.int64)
        if not pages.size:
            return 0
        P = self.page_size
        room = (self.chunks_per_request * self.pages_per_chunk - pages) * P
        room += np.where(pages > 0, P - np.asarray(table.last_page_len, np.int64), 0)
        return max(0, int(room.min()))

    def folded(self) -> DecodePlan:
        """The plan as the kernels of a multi-token call's common pass see it
        (``docs/multi-token.md``): the same chunks, ``query_tokens x Hq`` query heads (each
        token's queries folded into the GQA group), one token and no window (the common
        table is already cut to the tokens' shared range). ``self`` when
        ``query_tokens == 1`` and there is no window; memoised."""
        if self.query_tokens == 1 and self.window_left < 0:
            return self
        with _folded_lock:
            hit = _folded.get(self)
            if hit is None:
                _planning.active = True
                try:
                    hit = _folded[self] = dataclasses.replace(
                        self, num_qo_heads=self.num_qo_heads * self.query_tokens,
                        query_tokens=1, window_left=-1)
                finally:
                    _planning.active = False
        return hit

    def matches(self, table: PageTable | StepTable) -> bool:
        """Whether this plan can serve ``table`` (``mismatch`` gives no reason)."""
        return self.mismatch(table) is None

    def check(self, fn: str, table: PageTable | StepTable, num_qo_heads: int,
              num_kv_heads: int, head_dim: int, window_left: int = -1,
              query_tokens: int | None = None) -> None:
        """Raise ``PlanMismatchError`` unless the plan fits this table, geometry, window
        (``table`` may be the call's table or its window table) and query tokens: a
        multi-token call's most tokens per request (``query_tokens``) must be at most the
        plan's; a one-token call (``None``) needs a plan made for one."""
        geo = (num_qo_heads, num_kv_heads, head_dim)
        mine = (self.num_qo_heads, self.num_kv_heads, self.head_dim)
        if geo != mine:
            raise PlanMismatchError(f"{fn}: plan was made for (Hq, Hkv, D) = {mine}, "
                                    f"got {geo}")
        if window_left != self.window_left:
            raise PlanMismatchError(f"{fn}: plan was made for window_left = "
                                    f"{self.window_left}, got {window_left} (pass "
                                    "window_left to plan_decode too)")
        if (self.query_tokens != 1 if query_tokens is None
                else query_tokens > self.query_tokens):
            got = "a one-token call" if query_tokens is None else \
                f"a call with up to {query_tokens} query tokens per request"
            raise PlanMismatchError(f"{fn}: plan was made for query_tokens = "
                                    f"{self.query_tokens} per request, got {got} (pass "
                                    "query_tokens to plan_decode: a plan serves calls with "
                                    "at most its count)")
        # one check per (plan, table): a PageTable never changes, a StepTable is checked
        # once per version (its flushes)
        token = table.version if isinstance(table, StepTable) else -1
        if self._served.get(table) == token:
            return
        why = self.mismatch(table)
        if why is None:
            self._served[table] = token
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


def make_plan(table: PageTable | StepTable, num_qo_heads: int, num_kv_heads: int,
              head_dim: int, *, device: DeviceInfo, target_ctas: int | None = None,
              pages_per_chunk: int | None = None, min_chunk_tokens: int | None = None,
              max_chunks: int = MAX_CHUNKS, ctas_per_chunk: int | None = None,
              headroom: int = 0, hint: int | None = None, window_left: int = -1,
              ragged_split: float | None = None, query_tokens: int = 1,
              kv_dtype: str | None = None, slots_per_unit: int = 0,
              fn: str = "make_plan") -> DecodePlan:
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
        headroom: tokens every request may still grow by with this plan (a decode loop
            appends one per step): chunks are planned for the lengths plus ``headroom``,
            so the plan keeps matching (``mismatch``) until a request outgrows it.
        hint: a chunk size to try first (the previous plan's ``pages_per_chunk`` when
            replanning): the result is the same, found with fewer evaluations.
        window_left: a sliding window (``-1``: none): the plan covers only the pages of
            each request's last ``W + 1`` visible tokens (``variants.window_table``), so
            pages before a window get no chunk and no CTA.
        ragged_split: the ragged-batch rule (default ``PAGED_DECODE_RAGGED_SPLIT``, else
            ``device.ragged_split``; 0 turns it off): when the target rule leaves every
            request in one chunk although the longest request has ``RAGGED_RATIO`` times
            the mean's pages, the longest requests' CTAs are the critical path of a full
            device; chunks are then cut at ``ragged_split`` times the mean page count
            (never below the chunk floor), so long requests split and the merge evens
            them out.
        query_tokens: the most query tokens per request of the calls (1-8,
            ``docs/multi-token.md``): the CTA geometry is searched for a GQA group of
            ``query_tokens x`` the model's (the tokens share each K/V load); the chunks
            cover the table's pages as for one token (the new tokens are in the table).
        kv_dtype: the pools' dtype name, when known: fp8 pools aim for the device's fp8
            target (``DeviceInfo.fp8_ctas_per_unit``) unless ``target_ctas`` or the
            environment sets one.
        slots_per_unit: CTAs of the partial the plan is for that one SM holds at once
            (``specs.plan_geometry``; 0: unknown). When positive, the chunk size is the
            one ``waves.wave_chunk_size`` models fastest for how those CTAs fill the SMs;
            the target rule's size stays where the model ties it (else the tie's most
            CTAs within the target in one wave, ``waves.pick_tied``), and so does a ragged
            split; ``target_ctas``, ``pages_per_chunk`` or ``PAGED_DECODE_TARGET_CTAS``
            turn the rule off. The plan records it (``DecodePlan.slots_per_unit``; 0 when
            the target rule made it).
    """
    check_type(fn, "table", table, (PageTable, StepTable), "a PageTable or StepTable")
    headroom = check_headroom(fn, headroom)
    check_geometry(fn, num_qo_heads, num_kv_heads, head_dim)
    window_left = check_window(fn, window_left)
    query_tokens = check_query_tokens_arg(fn, query_tokens)
    table = window_table(table, window_left)
    max_chunks = check_int(fn, "max_chunks", max_chunks, 1, MAX_CHUNKS)
    b = table.batch_size
    if b < 1:
        raise InvalidArgumentError(f"{fn}: table must have at least one request, got 0")
    if b > max_chunks:
        raise InvalidArgumentError(f"{fn}: batch size {b} exceeds the grid bound of "
                                   f"{max_chunks} chunks")
    check_type(fn, "device", device, DeviceInfo, "a DeviceInfo or None")
    if kv_dtype is not None:
        check_type(fn, "kv_dtype", kv_dtype, str, "a dtype name or None")
        check_dtype(fn, "kv_dtype", kv_dtype, KV_DTYPES)
    ragged_split = device.ragged_fraction(ragged_split, fn=fn)    # checked whether used or not
    target = device.target_ctas(target_ctas, fn=fn, kv_dtype=kv_dtype)
    slots_per_unit = check_int(fn, "slots_per_unit", slots_per_unit, 0)
    # the wave rule unless a target or a size is asked for
    by_waves = bool(slots_per_unit and pages_per_chunk is None and target_ctas is None
                 and not device.target_from_env())
    qh = heads_per_cta(num_qo_heads * query_tokens, num_kv_heads)
    q_groups = (num_qo_heads * query_tokens // num_kv_heads) // qh
    if ctas_per_chunk is None:
        ctas_per_chunk = num_kv_heads * q_groups
    else:
        ctas_per_chunk = check_int(fn, "ctas_per_chunk", ctas_per_chunk, note=" or None")
    pages = table.pages_per_request
    if headroom:
        p = table.page_size
        have = pages.astype(np.int64)
        filled = np.where(have > 0, (have - 1) * p + table.last_page_len, 0)
        pages = -(-(filled + headroom) // p)
    max_ppc = max(1, int(pages.max()))
    p64 = pages.astype(np.int64)
    nz = p64[p64 > 0]
    empty = b - int(nz.size)
    totals: dict[int, int] = {}

    def total(ppc: int) -> int:     # chunk_counts(pages, ppc).sum(), memoised
        t = totals.get(ppc)
        if t is None:
            t = totals[ppc] = int(((nz + (ppc - 1)) // ppc).sum()) + empty
        return t

    min_ppc = smallest_chunk_size(pages, max_chunks)   # its fast case: one page
    floor_tokens = device.chunk_floor(min_chunk_tokens, fn=fn)
    grid_min_ppc = min_ppc
    min_ppc = min(max(min_ppc, -(-int(floor_tokens) // table.page_size)), max_ppc)

    def reaches(ppc: int) -> bool:
        return total(ppc) * ctas_per_chunk >= target

    def largest_reaching(lo: int, hi: int) -> int:
        """The largest size in [lo, hi] that reaches the target (reaches(lo) holds); a
        hint (the last plan's size) is tried first: the answer moves little per step."""
        if hint is not None:
            for cand in (hint, hint - 1):
                if lo <= cand <= hi and reaches(cand) and (cand == hi or not reaches(cand + 1)):
                    return cand
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if reaches(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    if pages_per_chunk is not None:
        # a chunk's first entry (tile x size x P) is a 32-bit int in the kernels
        ppc = check_int(fn, "pages_per_chunk", pages_per_chunk, 1,
                        MAX_ENTRIES // table.page_size, note=" or None")
        if total(ppc) > max_chunks:
            raise InvalidArgumentError(
                f"{fn}: pages_per_chunk = {ppc} gives {total(ppc)} chunks, above the grid "
                f"bound of {max_chunks}; use at least {grid_min_ppc}")
    elif not reaches(min_ppc):
        ppc = min_ppc
    else:
        lo = largest_reaching(min_ppc, max_ppc)
        ppc = lo
        if lo < max_ppc:
            # one page more per chunk falls short of the target: take it when its CTA
            # count is closer to the target (by ratio), e.g. no split at all for a batch
            # whose requests already give 97% of the target
            over = total(lo) * ctas_per_chunk
            under = total(lo + 1) * ctas_per_chunk
            if target * target < over * under:   # target / under < over / target
                ppc = lo + 1
        searched = ppc
        ppc = _ragged_chunk(fn, device, ragged_split, nz, total, b, ppc, min_ppc)
        # a ragged split stays: the model costs the mean chunk, and on the ragged preset's
        # 128 x 512-4K its one chunk per request took 2.5% longer (S22-R4, R5)
        by_waves = by_waves and ppc == searched
        ppc = balanced_chunk_size(nz, ppc, min_ppc)
    if by_waves and nz.size:    # the target rule's size stays where the model ties it
        token_bytes = 2 * head_dim * kv_bytes(kv_dtype or "float16")   # a K and a V row
        ppc = balanced_chunk_size(nz, wave_chunk_size(
            nz, table.page_size, ctas_per_chunk, num_kv_heads, token_bytes,
            device.compute_units, slots_per_unit, min_ppc, max_ppc, max_chunks - empty,
            prefer=ppc, target=target), min_ppc)
    else:
        slots_per_unit = 0      # the plan says which rule made it
    counts = chunk_counts(pages, ppc)
    req = np.repeat(np.arange(b, dtype=np.int64), counts)
    o_indptr = np.concatenate([[0], np.cumsum(counts)])
    tiles = np.arange(req.size, dtype=np.int64) - o_indptr[req]
    _planning.active = True
    try:
        return DecodePlan(b, int(num_qo_heads), int(num_kv_heads), int(head_dim),
                          table.page_size, ppc, qh, q_groups, target,
                          pages_per_chunk is not None, int(ctas_per_chunk),
                          frozen_int32(counts), frozen_int32(req), frozen_int32(tiles),
                          frozen_int32(o_indptr), headroom=headroom,
                          window_left=window_left, query_tokens=query_tokens,
                          slots_per_unit=slots_per_unit)
    finally:
        _planning.active = False


def _ragged_chunk(fn: str, device: DeviceInfo, ragged_split: float, nz: np.ndarray,
                  total: Any, b: int, ppc: int, min_ppc: int) -> int:
    """``make_plan``'s ragged-batch rule (its ``ragged_split``, the checked fraction)
    applied to the searched ``ppc``; ``nz``: the non-empty requests' page counts,
    ``total(ppc)``: chunk count."""
    if ragged_split == 0 or nz.size < 2 or total(ppc) != b:
        return ppc
    mean = float(nz.mean())
    if float(nz.max()) < RAGGED_RATIO * mean:
        return ppc
    return min(ppc, max(min_ppc, int(np.ceil(mean * ragged_split))))
