"""PageTable: layout, derived lengths, the token -> (page, entry) map, every rejection."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import table_of

from paged_decode import PagePool, PageTable, PageTableError
from paged_decode.backends.reference import visible_kv
from paged_decode.reference import request_kv_f64


# ---------------------------------------------------------------------------- slow refs
def ref_visible_len(pages: int, page_size: int, last_page_len: int, fpo: int) -> int:
    """Visible tokens by counting the occupied entries one by one."""
    end = (pages - 1) * page_size + last_page_len if pages else 0
    return sum(1 for pos in range(pages * page_size) if fpo <= pos < end)


def ref_token_slots(page_ids: list[int], page_size: int, last_page_len: int,
                    fpo: int) -> list[tuple[int, int]]:
    """(physical page, entry) of every visible token, oldest first, by walking the pages."""
    slots = []
    for j, page in enumerate(page_ids):
        used = last_page_len if j == len(page_ids) - 1 else page_size
        first = fpo if j == 0 else 0
        slots.extend((page, e) for e in range(first, used))
    return slots


def ref_is_valid(indptr, indices, lpl, fpo, rope, page_size, num_pages) -> bool:
    """Every invariant of the table, spelled out independently of ``validate``."""
    b = len(indptr) - 1
    if indptr[0] != 0 or any(indptr[i + 1] < indptr[i] for i in range(b)):
        return False
    if len(indices) != indptr[-1] or len(lpl) != b or len(fpo) != b or len(rope) != b:
        return False
    if any(not 0 <= p < num_pages for p in indices):
        return False
    for r in range(b):
        n = indptr[r + 1] - indptr[r]
        if n == 0:
            if lpl[r] != 0 or fpo[r] != 0 or rope[r] < 0:
                return False
            continue
        if not (1 <= lpl[r] <= page_size and 0 <= fpo[r] < page_size):
            return False
        vis = ref_visible_len(n, page_size, lpl[r], fpo[r])
        if (n - 1) * page_size + lpl[r] - fpo[r] < 0 or rope[r] < vis:
            return False
    return True


def id_pages(num_pages: int, page_size: int) -> np.ndarray:
    """Pages whose every entry holds its own (page, entry) code: ``page * P + entry``."""
    codes = np.arange(num_pages * page_size, dtype=np.float64).reshape(num_pages, page_size)
    return codes[:, :, None, None]  # [num_pages, P, Hkv=1, D=1]


def decoded_slots(values: np.ndarray, page_size: int) -> list[tuple[int, int]]:
    return [(int(c) // page_size, int(c) % page_size) for c in np.asarray(values).ravel()]


def assert_geometry(table: PageTable, r: int, *, pages, visible, lpl, fpo, rope) -> None:
    assert table.request_pages(r).tolist() == pages
    assert int(table.visible_lens[r]) == visible
    assert int(table.last_page_len[r]) == lpl
    assert int(table.first_page_offset[r]) == fpo
    assert int(table.rope_positions[r]) == rope
    assert int(table.pages_per_request[r]) == len(pages)


# ---------------------------------------------------------------------------- layouts
def test_full_and_partial_last_pages():
    # request 0: 8 tokens in 2 full pages; request 1: 10 tokens, last page holds 2
    t = table_of([[5, 2], [0, 7, 3]], 4, lpl=[4, 2], num_pages=8)
    assert_geometry(t, 0, pages=[5, 2], visible=8, lpl=4, fpo=0, rope=8)
    assert_geometry(t, 1, pages=[0, 7, 3], visible=10, lpl=2, fpo=0, rope=10)
    assert t.batch_size == 2 and t.total_pages == 5 and t.total_visible == 18
    assert t.max_page_id == 7


def test_exactly_full_last_page_via_pool():
    pool = PagePool(8, 4, 1, 2, "float32")
    s = pool.new_sequence()
    pool.append(s, np.ones((8, 1, 2), np.float32), np.ones((8, 1, 2), np.float32))
    t = pool.page_table([s])
    # a full last page is last_page_len == page_size, never 0
    assert_geometry(t, 0, pages=[0, 1], visible=8, lpl=4, fpo=0, rope=8)


def test_front_trimmed_window():
    # a length-13 sequence, P = 4: tokens 0-3 | 4-7 | 8-11 | 12. Keep the window [11, 13):
    # pages 0 and 1 are retired, page 2 keeps entry 3 (token 11) -> fpo 3, lpl 1.
    t = table_of([[2, 3]], 4, lpl=[1], fpo=[3], rope=[13])
    assert_geometry(t, 0, pages=[2, 3], visible=2, lpl=1, fpo=3, rope=13)
    # and the pool produces the same geometry from the same history
    pool = PagePool(8, 4, 1, 1, "float32")
    s = pool.new_sequence()
    vals = np.arange(13, dtype=np.float32).reshape(13, 1, 1)
    pool.append(s, vals, vals)
    pool.trim_front(s, 10)  # window = tokens [10, 11, 12]
    t10 = pool.page_table([s])
    assert_geometry(t10, 0, pages=[2, 3], visible=3, lpl=1, fpo=2, rope=13)
    assert request_kv_f64(pool.k, t10, 0).ravel().tolist() == [10, 11, 12]
    pool.trim_front(s, 1)   # window = tokens [11, 12]
    t11 = pool.page_table([s])
    assert_geometry(t11, 0, pages=[2, 3], visible=2, lpl=1, fpo=3, rope=13)
    assert request_kv_f64(pool.k, t11, 0).ravel().tolist() == [11, 12]
    assert pool.num_free == 6 and pool.refcount(0) == 0 and pool.refcount(1) == 0


def test_front_trim_landing_on_page_boundary():
    # fpo + visible ending exactly at a page end: lpl == P with fpo > 0
    t = table_of([[4, 1, 6]], 4, lpl=[4], fpo=[1], rope=[20])
    assert_geometry(t, 0, pages=[4, 1, 6], visible=11, lpl=4, fpo=1, rope=20)


def test_shared_pages_through_pool_with_refcounts():
    pool = PagePool(8, 4, 1, 1, "float32")
    a = pool.new_sequence()
    vals = np.arange(10, dtype=np.float32).reshape(10, 1, 1)
    pool.append(a, vals, vals)                     # pages 0, 1, 2 (page 2 holds 2)
    b = pool.fork(a)
    assert [pool.refcount(p) for p in range(4)] == [2, 2, 2, 0]
    t = pool.page_table([a, b, a])                 # a sequence may appear twice
    assert t.indices.tolist() == [0, 1, 2] * 3
    for r in range(3):
        assert_geometry(t, r, pages=[0, 1, 2], visible=10, lpl=2, fpo=0, rope=10)
    one = np.full((1, 1, 1), 99, np.float32)
    pool.append(b, one, one)                       # copy-on-write of page 2 -> page 3
    t = pool.page_table([a, b])
    assert_geometry(t, 0, pages=[0, 1, 2], visible=10, lpl=2, fpo=0, rope=10)
    assert_geometry(t, 1, pages=[0, 1, 3], visible=11, lpl=3, fpo=0, rope=11)
    assert [pool.refcount(p) for p in range(4)] == [2, 2, 1, 1]
    assert request_kv_f64(pool.k, t, 0).ravel().tolist() == list(range(10))
    assert request_kv_f64(pool.k, t, 1).ravel().tolist() == list(range(10)) + [99]


def test_empty_requests():
    t = table_of([[], [1], []], 4, lpl=[0, 3, 0], num_pages=4)
    assert_geometry(t, 0, pages=[], visible=0, lpl=0, fpo=0, rope=0)
    assert_geometry(t, 1, pages=[1], visible=3, lpl=3, fpo=0, rope=3)
    assert_geometry(t, 2, pages=[], visible=0, lpl=0, fpo=0, rope=0)
    all_empty = table_of([[], []], 4, lpl=[0, 0])
    assert all_empty.total_visible == 0 and all_empty.max_page_id == -1
    assert all_empty.indices.size == 0


def test_fully_trimmed_requests():
    pool = PagePool(8, 4, 1, 1, "float32")
    vals = np.zeros((10, 1, 1), np.float32)
    partial, full = pool.new_sequence(), pool.new_sequence()
    pool.append(partial, vals, vals)         # pages 0, 1, 2
    pool.append(full, vals[:8], vals[:8])    # pages 3, 4
    pool.trim_front(partial, 10)
    pool.trim_front(full, 8)
    t = pool.page_table([partial, full])
    # the partial last page stays (later appends continue in it); nothing is visible
    assert_geometry(t, 0, pages=[2], visible=0, lpl=2, fpo=2, rope=10)
    # a fully trimmed sequence of full pages holds no page at all
    assert_geometry(t, 1, pages=[], visible=0, lpl=0, fpo=0, rope=8)
    assert pool.num_free == 7


def test_rope_positions_exceed_visible_after_trim():
    t = table_of([[0, 1], [2]], 4, lpl=[3, 4], fpo=[2, 1], rope=[105, 3])
    assert t.visible_lens.tolist() == [5, 3]
    assert t.rope_positions.tolist() == [105, 3]
    # default rope positions are the visible lengths
    assert table_of([[0, 1], [2]], 4, lpl=[3, 4], fpo=[2, 1]).rope_positions.tolist() \
        == [5, 3]


def test_table_is_an_immutable_copy():
    idx = np.array([0, 1, 2], np.int64)
    t = PageTable.build(idx, [0, 2, 3], [4, 1], page_size=4)
    idx[0] = 7                                     # the caller's array is not aliased
    assert t.indices.tolist() == [0, 1, 2]
    assert t.indices.dtype == np.int32
    for arr in (t.indices, t.indptr, t.last_page_len, t.first_page_offset,
                t.rope_positions, t.visible_lens, t.pages_per_request):
        with pytest.raises(ValueError):
            arr[0] = 1


def test_subset_keeps_rows_in_order():
    t = table_of([[0, 1], [], [2, 3, 4]], 4, lpl=[3, 0, 1], fpo=[1, 0, 2],
                 rope=[9, 0, 20], num_pages=5)
    s = t.subset([2, 0])
    assert_geometry(s, 0, pages=[2, 3, 4], visible=7, lpl=1, fpo=2, rope=20)
    assert_geometry(s, 1, pages=[0, 1], visible=6, lpl=3, fpo=1, rope=9)
    assert s.num_pages == 5


# ---------------------------------------------------------------------------- rejections
REJECTIONS = {
    # name: (build kwargs, message regex)
    "indptr0": (dict(indices=[0], indptr=[1, 1], last_page_len=[0]),
                r"indptr\[0\] must be 0, got 1"),
    "indptr-decreasing": (dict(indices=[0, 1], indptr=[0, 2, 1, 2], last_page_len=[4, 0, 4]),
                          r"request 1 has indptr\[1\] = 2 > indptr\[2\] = 1"),
    "indices-length": (dict(indices=[0, 1, 2], indptr=[0, 1, 2], last_page_len=[4, 4]),
                       r"len\(indices\) must equal indptr\[-1\] = 2, got 3"),
    "page-negative": (dict(indices=[0, -1], indptr=[0, 1, 2], last_page_len=[4, 4]),
                      r"request 1: indices\[1\] = -1 is not a page id"),
    "page-too-large": (dict(indices=[0, 1, 8], indptr=[0, 1, 3], last_page_len=[4, 4],
                            num_pages=8),
                       r"request 1: indices\[2\] = 8 is not a page id in \[0, 8\)"),
    "lpl-zero": (dict(indices=[0, 1], indptr=[0, 1, 2], last_page_len=[4, 0]),
                 r"request 1: last_page_len must be in \[1, page_size = 4\], got 0"),
    "lpl-too-large": (dict(indices=[0, 1], indptr=[0, 1, 2], last_page_len=[5, 4]),
                      r"request 0: last_page_len must be in \[1, page_size = 4\], got 5"),
    "fpo-negative": (dict(indices=[0, 1], indptr=[0, 1, 2], last_page_len=[4, 4],
                          first_page_offset=[0, -1]),
                     r"request 1: first_page_offset must be in \[0, page_size = 4\), got -1"),
    "fpo-page-size": (dict(indices=[0, 1, 2], indptr=[0, 1, 3], last_page_len=[4, 4],
                           first_page_offset=[0, 4]),
                      r"request 1: first_page_offset must be in \[0, page_size = 4\), got 4"),
    "no-pages-lpl": (dict(indices=[0], indptr=[0, 1, 1], last_page_len=[4, 2]),
                     r"request 1: has no pages, so last_page_len and first_page_offset "
                     r"must be 0, got 2 and 0"),
    "no-pages-fpo": (dict(indices=[], indptr=[0, 0], last_page_len=[0],
                          first_page_offset=[1]),
                     r"request 0: has no pages, .* got 0 and 1"),
    "negative-geometry": (dict(indices=[0, 1], indptr=[0, 1, 2], last_page_len=[4, 2],
                               first_page_offset=[0, 3]),
                          r"request 1: geometry gives a negative visible length .*: -1"),
    "rope-below-visible": (dict(indices=[0, 1, 2], indptr=[0, 1, 3], last_page_len=[4, 2],
                                rope_positions=[4, 5]),
                           r"request 1: rope_positions must be >= the visible length 6, "
                           r"got 5"),
    "rope-negative-empty": (dict(indices=[], indptr=[0, 0], last_page_len=[0],
                                 rope_positions=[-1]),
                            r"request 0: rope_positions must be >= the visible length 0"),
    "indices-float": (dict(indices=[0.0, 1.0], indptr=[0, 1, 2], last_page_len=[4, 4]),
                      r"indices must hold integers, got dtype float64"),
    "lpl-float": (dict(indices=[0, 1], indptr=[0, 1, 2], last_page_len=[4.0, 4.0]),
                  r"last_page_len must hold integers"),
    "indptr-float": (dict(indices=[0, 1], indptr=[0.0, 1.0, 2.0], last_page_len=[4, 4]),
                     r"indptr must hold integers"),
    "indptr-2d": (dict(indices=[0, 1], indptr=[[0, 1, 2]], last_page_len=[4, 4]),
                  r"indptr must be 1-D, got shape \[1, 3\]"),
    "indptr-empty": (dict(indices=[], indptr=np.zeros(0, np.int32), last_page_len=[]),
                     r"indptr must have B\+1 >= 1 entries, got 0"),
    "int32-overflow": (dict(indices=[2**31], indptr=[0, 1], last_page_len=[4]),
                       r"indices has values outside int32"),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_build_rejects(name):
    kwargs, pattern = REJECTIONS[name]
    kwargs = {"page_size": 4, **kwargs}
    with pytest.raises(PageTableError, match=pattern):
        PageTable.build(**kwargs)


@pytest.mark.parametrize("page_size", [0, -3, 2.0, "4"])
def test_build_rejects_bad_page_size(page_size):
    with pytest.raises(PageTableError, match=r"page_size must be an integer in \[1, 2147483647\]"):
        PageTable.build([0], [0, 1], [1], page_size=page_size)


# B = 3; lengths 2 and 4 differ from B for every per-request field.
@pytest.mark.parametrize("field", ["last_page_len", "first_page_offset", "rope_positions"])
@pytest.mark.parametrize("length", [2, 4])
def test_build_rejects_wrong_array_lengths(field, length):
    kwargs = dict(last_page_len=[4, 4, 4], first_page_offset=[0, 0, 0],
                  rope_positions=[4, 4, 4])
    kwargs[field] = [kwargs[field][0]] * length
    with pytest.raises(PageTableError, match=rf"{field} must have B = 3 entries, got {length}"):
        PageTable.build([0, 1, 2], [0, 1, 2, 3], page_size=4, **kwargs)


def test_validate_checks_pool_bound_given_later():
    t = PageTable.build([0, 9], [0, 1, 2], [4, 4], page_size=4)  # bound unknown: fine
    t.validate(num_pages=10)
    with pytest.raises(PageTableError, match=r"request 1: indices\[1\] = 9 is not a page id "
                                             r"in \[0, 9\)"):
        t.validate(num_pages=9)


# ---------------------------------------------------------------------------- random sweep
def random_table_arrays(rng: np.random.Generator):
    """Arrays of a random, valid table (shared pages allowed)."""
    p = int(rng.choice([1, 2, 3, 4, 8, 16]))
    b = int(rng.integers(1, 7))
    num_pages = int(rng.integers(1, 40))
    counts = [int(rng.integers(0, 6)) for _ in range(b)]
    page_lists = [rng.integers(0, num_pages, n).tolist() for n in counts]
    lpl, fpo, rope = [], [], []
    for n in counts:
        if n == 0:
            lpl.append(0), fpo.append(0), rope.append(int(rng.integers(0, 50)))
            continue
        last = int(rng.integers(1, p + 1))
        first = int(rng.integers(0, p))
        if n == 1:
            first = int(rng.integers(0, min(last, p - 1) + 1))  # visible >= 0
        lpl.append(last), fpo.append(first)
        rope.append((n - 1) * p + last - first + int(rng.integers(0, 30)))
    return page_lists, lpl, fpo, rope, p, num_pages


def test_random_sweep_lengths_and_token_map():
    rng = np.random.default_rng(7)
    for _ in range(300):
        page_lists, lpl, fpo, rope, p, num_pages = random_table_arrays(rng)
        t = table_of(page_lists, p, lpl=lpl, fpo=fpo, rope=rope, num_pages=num_pages)
        pages = id_pages(num_pages, p)
        for r, ids in enumerate(page_lists):
            want = ref_token_slots(ids, p, lpl[r], fpo[r])
            n = ref_visible_len(len(ids), p, lpl[r], fpo[r])
            assert len(want) == n
            assert int(t.visible_lens[r]) == n
            assert decoded_slots(request_kv_f64(pages, t, r), p) == want
            assert decoded_slots(visible_kv(pages, t, r, 0, n), p) == want
            if n:  # an arbitrary sub-range, the way kernels read a chunk
                t0 = int(rng.integers(0, n))
                t1 = int(rng.integers(t0, n + 1))
                assert decoded_slots(visible_kv(pages, t, r, t0, t1), p) == want[t0:t1]
        assert t.total_visible == sum(int(x) for x in t.visible_lens)


def test_random_sweep_accepts_exactly_the_valid_tables():
    rng = np.random.default_rng(11)
    seen = {True: 0, False: 0}
    for _ in range(400):
        page_lists, lpl, fpo, rope, p, num_pages = random_table_arrays(rng)
        # corrupt one per-request field now and then
        r = int(rng.integers(0, len(lpl)))
        which = int(rng.integers(0, 5))
        if which == 0:
            lpl[r] = int(rng.integers(-1, p + 2))
        elif which == 1:
            fpo[r] = int(rng.integers(-1, p + 1))
        elif which == 2:
            rope[r] = int(rng.integers(-2, 40))
        elif which == 3 and page_lists[r]:
            page_lists[r][0] = int(rng.choice([-1, num_pages, num_pages + 3]))
        counts = [len(x) for x in page_lists]
        indptr = [0, *np.cumsum(counts).tolist()]
        valid = ref_is_valid(indptr, [x for pl in page_lists for x in pl], lpl, fpo, rope,
                             p, num_pages)
        seen[valid] += 1
        if valid:
            table_of(page_lists, p, lpl=lpl, fpo=fpo, rope=rope, num_pages=num_pages)
        else:
            with pytest.raises(PageTableError, match=r"request \d+: "):
                table_of(page_lists, p, lpl=lpl, fpo=fpo, rope=rope, num_pages=num_pages)
    assert seen[True] > 50 and seen[False] > 50  # both sides were exercised


def test_a_request_past_the_kernels_32_bit_entry_index_is_refused():
    """The CUDA kernels index a request's entries (first-page offset + token) with 32-bit
    ints; a table beyond that (reachable with repeated page ids, or rope_positions that
    hid a wrapped visible length) is refused, one entry below it is accepted."""
    p, pages = 256, 2**23 + 1
    ind = np.zeros(pages, np.int32)               # one page, repeated: 32 MiB of ids
    ok = PageTable.build(ind[:-1], np.array([0, pages - 1]), np.array([p - 1]), page_size=p,
                         first_page_offset=np.array([1]))
    assert int(ok.visible_lens[0]) == 2**31 - 2      # its last entry is 2^31 - 2
    with pytest.raises(PageTableError, match="request 0: its pages hold 2147483649 entries "
                       "up to its last token; the kernels index a request's entries in 32 "
                       r"bits \(at most 2147483647\)"):
        PageTable.build(ind, np.array([0, pages]), np.array([1]), page_size=p,
                        first_page_offset=np.array([2]))
    big = np.zeros(2**24, np.int32)
    with pytest.raises(PageTableError, match="its pages hold 4294967296 entries"):
        PageTable.build(big, np.array([0, 2**24]), np.array([p]), page_size=p,
                        rope_positions=np.array([0]))
