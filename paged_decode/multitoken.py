"""Multi-token decode, the host math: query-token counts and the causal split of a request.

A multi-token call gives ``T_r`` (1-8) query tokens to request ``r``: ``q [B, T, Hq, D]``
(every request ``T``) or a flat ``q [N, Hq, D]`` with ``qo_indptr [B+1]`` (request ``r``'s
tokens are rows ``qo_indptr[r]:qo_indptr[r+1]``). The K/V of the table already holds the
new tokens (an engine appends, then verifies): with ``L`` the request's visible length,
token ``t`` (0-based) sits at position ``L - T + t`` and sees positions
``[start_t, L - T + t + 1)``, ``start_t = max(0, L - T + t - W)`` under a window
``W >= 0`` (each token's window ends at its own position), else 0.

Every token of a request sees one common range, ``[S0, E0)`` with ``S0 = start_{T-1}``
and ``E0 = L - T + 1`` (token 0's end), and at most ``T - 1`` positions of its own on
either side: ``[start_t, S0)`` (window only) and ``[E0, L - T + t + 1)``. ``split_tokens``
returns that decomposition: the common range is read once for all ``T`` tokens (their
queries folded into the GQA group, ``docs/multi-token.md``), the small per-token pieces
separately, and each token's states are merged (the merge algebra is exact). When the
window is shorter than ``T - 1`` tokens the common range is empty and each token's whole
range is one piece.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidArgumentError, fail, is_int, refuse_listed_bools
from .page_table import PageTable, frozen_int32

#: most query tokens of one request (speculative verification and MTP heads)
MAX_QUERY_TOKENS = 8


@dataclass(frozen=True, eq=False)
class QueryTokens:
    """The query tokens of a multi-token call: ``counts int32 [B]`` (each 1-8),
    ``qo_indptr int32 [B+1]`` (host, read-only), ``uniform`` (``q`` came as
    ``[B, T, Hq, D]``)."""

    counts: np.ndarray
    qo_indptr: np.ndarray
    uniform: bool

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def max_tokens(self) -> int:
        return int(self.counts.max()) if self.counts.size else 1

    def describe(self) -> str:
        """For ``DecodeOutcome.detail``."""
        lo = int(self.counts.min()) if self.counts.size else 0
        span = f"{lo}" if lo == self.max_tokens else f"{lo}-{self.max_tokens}"
        return f"query tokens: {self.num_tokens} ({span} per request)"


def query_tokens(fn: str, q_shape: tuple[int, ...], qo_indptr: Any, batch_size: int,
                 visible_lens: np.ndarray) -> QueryTokens | None:
    """The query tokens of a call from ``q``'s shape and ``qo_indptr`` (``None``: one token
    per request, ``q [B, Hq, D]`` without ``qo_indptr``). Checks: a 4-D ``q`` has ``B``
    rows and ``1 <= T <= 8`` and takes no ``qo_indptr``; ``qo_indptr`` is an integer
    ``[B+1]`` array starting at 0 whose counts are 1-8 and sum to ``q``'s ``N`` rows; every
    request holds at least its query tokens (``L >= T``: they were appended)."""
    if len(q_shape) == 4:
        if qo_indptr is not None:
            raise fail(fn, "qo_indptr is for a flat q [N, Hq, D]; q [B, T, Hq, D] has the "
                           "same T for every request, got both")
        b, t = int(q_shape[0]), int(q_shape[1])
        if b != batch_size:
            raise fail(fn, f"q must have shape [B, T, Hq, D] with B = {batch_size} (the "
                           f"table's requests), got {list(q_shape)}")
        if not 1 <= t <= MAX_QUERY_TOKENS:
            raise fail(fn, f"q [B, T, Hq, D] must have 1 <= T <= {MAX_QUERY_TOKENS} query "
                           f"tokens per request, got T = {t}")
        counts = np.full(b, t, np.int64)
        uniform = True
    elif qo_indptr is None:
        return None
    else:
        counts = _counts(fn, qo_indptr, batch_size, int(q_shape[0]) if q_shape else 0)
        uniform = False
    short = np.nonzero(np.asarray(visible_lens, np.int64) < counts)[0]
    if short.size:
        r = int(short[0])
        raise fail(fn, f"request {r} has {int(visible_lens[r])} visible tokens but "
                       f"{int(counts[r])} query tokens: the table must already hold the new "
                       "tokens (append them before decoding them), so L >= T")
    indptr = np.concatenate([[0], np.cumsum(counts)])
    return QueryTokens(frozen_int32(counts), frozen_int32(indptr), uniform)


def _counts(fn: str, qo_indptr: Any, batch_size: int, rows: int) -> np.ndarray:
    """Per-request counts of a host ``qo_indptr`` (int64 ``[B]``), checked."""
    refuse_listed_bools(fn, "qo_indptr", qo_indptr)
    try:
        arr = np.asarray(qo_indptr)
    except (TypeError, ValueError) as exc:   # a device array, ragged lists
        raise fail(fn, f"qo_indptr must be a host integer array [B+1], got "
                       f"{type(qo_indptr).__name__}") from exc
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise fail(fn, f"qo_indptr must hold integers, got dtype {arr.dtype}")
    if arr.shape != (batch_size + 1,):
        raise fail(fn, f"qo_indptr must have shape [B+1] = [{batch_size + 1}], got "
                       f"{list(arr.shape)}")
    ip = arr.astype(np.int64)
    if ip[0] != 0:
        raise fail(fn, f"qo_indptr[0] must be 0, got {int(ip[0])}")
    counts = np.diff(ip)
    bad = np.nonzero((counts < 1) | (counts > MAX_QUERY_TOKENS))[0]
    if bad.size:
        r = int(bad[0])
        raise fail(fn, f"qo_indptr gives request {r} {int(counts[r])} query tokens; each "
                       f"request takes 1 to {MAX_QUERY_TOKENS}")
    if int(ip[-1]) != rows:
        raise fail(fn, f"qo_indptr[-1] = {int(ip[-1])} query tokens, but q [N, Hq, D] has "
                       f"N = {rows} rows")
    return counts


def check_query_tokens_arg(fn: str, query_tokens: Any) -> int:
    """``query_tokens`` of ``plan_decode``: an integer in 1-8."""
    if not is_int(query_tokens) or not 1 <= int(query_tokens) <= MAX_QUERY_TOKENS:
        raise InvalidArgumentError(f"{fn}: query_tokens must be an integer in 1 to "
                                   f"{MAX_QUERY_TOKENS}, got {query_tokens!r}")
    return int(query_tokens)


# ---------------------------------------------------------------------------- the split
@dataclass(frozen=True, eq=False)
class TokenSplit:
    """The causal decomposition of a multi-token call (see the module docstring).

    - ``common``: a ``PageTable`` of ``B`` rows, request ``r``'s range ``[S0, E0)`` (empty
      when the window is shorter than ``T - 1``): read once for all its tokens.
    - ``pieces``: a ``PageTable`` of ``P`` rows, each a range that one token sees beyond
      ``common`` (at most ``T - 1`` positions); ``piece_token int32 [P]`` is its token
      (a row of the flat ``q``), in token order.
    - ``merge_indptr int32 [N+1]``: token ``n``'s states are rows
      ``merge_indptr[n]:merge_indptr[n+1]`` of the stacked (common, pieces) states;
      ``merge_rows int32 [N + P]`` gives, for each of them, its row in
      ``concat(common states, piece states)``: the common states unfolded token-major
      (token ``t`` of request ``b`` at row ``t * B + b``, ``t < Tq``, ``Tq`` the padded
      token count ``fold_tokens``), then the ``P`` piece states.
    - ``fold_index int32 [B * Tq]``, request-major: the flat ``q`` row of folded token
      ``(b, t)`` (a request's last token for ``t >= T_b``: rows computed and dropped).
    """

    common: PageTable
    pieces: PageTable
    piece_token: np.ndarray
    merge_indptr: np.ndarray
    merge_rows: np.ndarray
    fold_tokens: int
    fold_index: np.ndarray


_splits_lock = threading.Lock()
_splits: weakref.WeakKeyDictionary[PageTable, dict[Any, TokenSplit]] = \
    weakref.WeakKeyDictionary()


def split_tokens(table: PageTable, qt: QueryTokens, window_left: int,
                 fold_tokens: int) -> TokenSplit:
    """The ``TokenSplit`` of ``table`` for these query tokens and window (``-1``: none),
    with the common pass's queries padded to ``fold_tokens >= qt.max_tokens`` per
    request. Memoised per (table, counts, window, fold) (tables are immutable), so the
    layers of a step share one."""
    key = (qt.counts.tobytes(), int(window_left), int(fold_tokens))
    with _splits_lock:
        hit = _splits.get(table, {}).get(key)
    if hit is not None:
        return hit
    made = _split(table, qt, int(window_left), int(fold_tokens))
    with _splits_lock:
        _splits.setdefault(table, {})[key] = made
    return made


def _split(table: PageTable, qt: QueryTokens, w: int, fold: int) -> TokenSplit:
    b = table.batch_size
    n = qt.num_tokens
    lens = table.visible_lens.astype(np.int64)
    cnt = qt.counts.astype(np.int64)
    req = np.repeat(np.arange(b, dtype=np.int64), cnt)           # request of token n
    t = np.arange(n, dtype=np.int64) - qt.qo_indptr[:-1].astype(np.int64)[req]
    end = lens[req] - cnt[req] + t + 1                            # token n sees [start, end)
    start = np.maximum(0, end - 1 - w) if w >= 0 else np.zeros(n, np.int64)
    s0 = np.maximum(0, lens - 1 - w) if w >= 0 else np.zeros(b, np.int64)
    e0 = lens - cnt + 1
    has_common = s0 < e0
    c_begin = np.where(has_common, s0, 0)
    c_end = np.where(has_common, e0, 0)
    # beyond the common range: [start, S0) and [E0, end), or the whole range without one
    hc = has_common[req]
    head_b, head_e = start, np.where(hc, s0[req], end)
    tail_b, tail_e = np.where(hc, e0[req], end), end
    pb = np.stack([head_b, tail_b], 1).reshape(-1)                # token order, head first
    pe = np.stack([head_e, tail_e], 1).reshape(-1)
    ptok = np.repeat(np.arange(n, dtype=np.int64), 2)
    live = pe > pb
    pb, pe, ptok = pb[live], pe[live], ptok[live]
    per_token = np.bincount(ptok, minlength=n) + 1                # the common state too
    merge_indptr = np.concatenate([[0], np.cumsum(per_token)])
    # each token's states: its common row (t * B + b), then its pieces in order
    rows = np.empty(int(merge_indptr[-1]), np.int64)
    rows[merge_indptr[:-1]] = t * b + req
    piece_slot = np.arange(ptok.size) - np.concatenate([[0], np.cumsum(per_token - 1)])[ptok]
    rows[merge_indptr[ptok] + 1 + piece_slot] = b * fold + np.arange(ptok.size)
    return TokenSplit(range_table(table, np.arange(b), c_begin, c_end),
                      range_table(table, req[ptok], pb, pe), frozen_int32(ptok),
                      frozen_int32(merge_indptr), frozen_int32(rows), fold,
                      frozen_int32(qt.qo_indptr[:-1, None].astype(np.int64)
                                   + np.minimum(np.arange(fold)[None, :], cnt[:, None] - 1)
                                   ).reshape(-1))


_rows_lock = threading.Lock()
_rows: weakref.WeakKeyDictionary[TokenSplit, dict[Any, tuple[np.ndarray, np.ndarray]]] = \
    weakref.WeakKeyDictionary()


def fold_rows(split: TokenSplit, num_qo_heads: int, num_kv_heads: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """The fold at the level of ``[D]`` rows (read-only int32, memoised per split and
    geometry), so that folding and unfolding are one gather each:

    - ``fold [B * Hkv * Tq * G]``: for folded query row ``(b, kvh, t, g)`` (the common
      pass's ``q [B, Hkv * Tq * G, D]``), its row of ``q.reshape(N * Hq, D)``: head
      ``kvh * G + g`` of token ``t`` of request ``b`` (``fold_index``);
    - ``unfold [Tq * B * Hq]``: for state row ``(t, b, h)`` (token-major, as
      ``merge_rows`` expects them), its row of the common states
      ``reshape(B * Hkv * Tq * G, D)``.
    """
    key = (int(num_qo_heads), int(num_kv_heads))
    with _rows_lock:
        hit = _rows.get(split, {}).get(key)
    if hit is not None:
        return hit
    b, tq = split.common.batch_size, split.fold_tokens
    hq, hkv = key
    g = hq // hkv
    tok = split.fold_index.astype(np.int64).reshape(b, 1, tq, 1)
    kvh = np.arange(hkv, dtype=np.int64).reshape(1, hkv, 1, 1)
    gg = np.arange(g, dtype=np.int64).reshape(1, 1, 1, g)
    fold = tok * hq + kvh * g + gg                                     # [B, Hkv, Tq, G]
    t = np.arange(tq, dtype=np.int64).reshape(tq, 1, 1, 1)
    r = np.arange(b, dtype=np.int64).reshape(1, b, 1, 1)
    unfold = r * (hkv * tq * g) + kvh.reshape(1, 1, hkv, 1) * (tq * g) + t * g + gg
    made = (frozen_int32(fold.reshape(-1)), frozen_int32(unfold.reshape(-1)))
    with _rows_lock:
        _rows.setdefault(split, {})[key] = made
    return made


def range_table(table: PageTable, req: np.ndarray, begin: np.ndarray,
                end: np.ndarray) -> PageTable:
    """A table of ``len(req)`` rows: row ``i`` is visible positions ``[begin[i], end[i])``
    of request ``req[i]`` of ``table`` (``0 <= begin <= end <= L``; an empty range is a
    row without pages), its pages those of the range and ``first_page_offset`` /
    ``last_page_len`` its first and last entries."""
    p = table.page_size
    req = np.asarray(req, np.int64)
    begin, end = np.asarray(begin, np.int64), np.asarray(end, np.int64)
    ip = table.indptr.astype(np.int64)
    fpo = table.first_page_offset.astype(np.int64)[req]
    live = end > begin
    e0, e1 = fpo + begin, fpo + end                               # entries [e0, e1)
    p0 = np.where(live, e0 // p, 0)
    p1 = np.where(live, (e1 - 1) // p + 1, 0)
    counts = p1 - p0
    indptr = np.concatenate([[0], np.cumsum(counts)])
    rows = np.repeat(np.arange(req.size), counts)
    flat = ip[req][rows] + p0[rows] + (np.arange(int(indptr[-1])) - indptr[:-1][rows])
    return PageTable.build(table.indices[flat] if flat.size else np.zeros(0, np.int32),
                           indptr, np.where(live, e1 - (p1 - 1) * p, 0), page_size=p,
                           first_page_offset=np.where(live, e0 - p0 * p, 0),
                           num_pages=table.num_pages)


__all__ = ["MAX_QUERY_TOKENS", "QueryTokens", "TokenSplit", "check_query_tokens_arg",
           "fold_rows", "query_tokens", "range_table", "split_tokens"]
