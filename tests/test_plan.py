"""plan_decode: the maximal chunk size by brute force, invariants, grid bound, reuse."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import table_of

from paged_decode import (
    DecodePlan,
    DeviceInfo,
    InvalidArgumentError,
    PageTable,
    PlanMismatchError,
    plan_decode,
)
from paged_decode.plan import BALANCE_SLACK, MAX_CHUNKS, chunk_token_ranges, heads_per_cta


# ---------------------------------------------------------------------------- helpers
def ref_chunks(pages, ppc: int) -> int:
    """Total chunks at ``ppc`` pages per chunk: at least one per request, by counting."""
    total = 0
    for n in pages:
        chunks, start = 0, 0
        while True:
            chunks += 1
            start += ppc
            if start >= n:
                break
        total += chunks
    return total


def ref_best_ppc(pages, ctas_per_chunk: int, target: int, max_chunks: int = MAX_CHUNKS) -> int:
    """Brute force: the largest chunk size that reaches the target within the grid bound
    (or, when one page more per chunk gives a CTA count closer to the target by ratio,
    that size), else the finest split allowed by the grid bound."""
    top = max(1, max(pages))
    allowed = [ppc for ppc in range(1, top + 1) if ref_chunks(pages, ppc) <= max_chunks]
    reaching = [ppc for ppc in allowed if ref_chunks(pages, ppc) * ctas_per_chunk >= target]
    if not reaching:
        return min(allowed)
    best = max(reaching)
    if best < top:
        over = ref_chunks(pages, best) * ctas_per_chunk
        under = ref_chunks(pages, best + 1) * ctas_per_chunk
        if target / under < over / target:
            return best + 1
    return best


def ref_balanced(pages, ppc: int, lower: int = 1) -> int:
    """Brute force: the smallest chunk size that gives the same total chunk count as
    ``ppc`` (so the same count per request), plus ``BALANCE_SLACK`` slack, within
    ``[lower, ppc]``."""
    total = ref_chunks(pages, ppc)
    even = min(q for q in range(1, ppc + 1) if ref_chunks(pages, q) == total)
    return min(ppc, max(lower, even + even // BALANCE_SLACK))


def ref_grid_min(pages, max_chunks: int = MAX_CHUNKS) -> int:
    """The smallest chunk size within the grid bound."""
    return min(q for q in range(1, max(1, max(pages)) + 1) if ref_chunks(pages, q) <= max_chunks)


def ref_plan_ppc(pages, ctas_per_chunk: int, target: int, max_chunks: int = MAX_CHUNKS) -> int:
    """The chunk size plan_decode picks (chunk floor of one page): the search, balanced."""
    return ref_balanced(pages, ref_best_ppc(pages, ctas_per_chunk, target, max_chunks),
                        ref_grid_min(pages, max_chunks))


def ref_heads_per_cta(hq: int, hkv: int) -> int:
    g = hq // hkv
    return max(d for d in range(1, 9) if g % d == 0)


def ref_token_range(table: PageTable, r: int, tile: int, ppc: int) -> list[int]:
    """Visible tokens of request ``r`` whose page falls in chunk ``tile``, one by one."""
    p, fpo = table.page_size, int(table.first_page_offset[r])
    return [t for t in range(int(table.visible_lens[r]))
            if tile * ppc <= (fpo + t) // p < (tile + 1) * ppc]


def check_structure(plan: DecodePlan, table: PageTable) -> None:
    """The per-chunk arrays describe exactly the chunking at ``plan.pages_per_chunk``."""
    ppc = plan.pages_per_chunk
    req, tiles = [], []
    for r, n in enumerate(table.pages_per_request.tolist()):
        count = ref_chunks([n], ppc)
        req += [r] * count
        tiles += list(range(count))
    assert plan.request_indices.tolist() == req
    assert plan.kv_tile_indices.tolist() == tiles
    counts = np.bincount(req, minlength=table.batch_size)
    assert plan.chunks_per_request.tolist() == counts.tolist()
    assert plan.o_indptr.tolist() == [0, *np.cumsum(counts).tolist()]
    assert (plan.chunks_per_request >= 1).all()
    assert plan.num_chunks == len(req) <= MAX_CHUNKS
    assert plan.num_ctas == plan.num_chunks * plan.num_kv_heads * plan.q_groups
    assert plan.needs_merge == (plan.num_chunks != plan.batch_size)


# ---------------------------------------------------------------------------- search
GEOMETRIES = [(8, 8), (32, 8), (28, 4), (16, 1), (6, 2), (64, 4)]


def test_binary_search_is_maximal_brute_force():
    rng = np.random.default_rng(0)
    reached = unreachable = under = 0
    for _ in range(400):
        b = int(rng.integers(1, 10))
        pages = rng.integers(0, int(rng.choice([3, 12, 50])), b).tolist()
        hq, hkv = GEOMETRIES[int(rng.integers(0, len(GEOMETRIES)))]
        target = int(rng.integers(1, 3000))
        table = table_of(pages, 4)
        plan = plan_decode(table, hq, hkv, 64, target_ctas=target)
        cpc = hkv * (hq // hkv) // ref_heads_per_cta(hq, hkv)
        want = ref_best_ppc(pages, cpc, target)          # the searched size
        assert plan.pages_per_chunk == ref_balanced(pages, want), (pages, hq, hkv, target)
        assert plan.num_chunks == ref_chunks(pages, want)  # balancing keeps the counts
        assert plan.target_ctas == target and not plan.forced
        assert plan.ctas_per_chunk == cpc
        check_structure(plan, table)
        if plan.num_ctas >= target:
            reached += 1
            # one page more per chunk would fall short of the target (or change nothing)
            if want < max(1, max(pages)):
                assert ref_chunks(pages, want + 1) * cpc < target
        elif want > 1 and ref_chunks(pages, want - 1) * cpc >= target:
            under += 1          # the count just below the target was closer to it
            assert target / plan.num_ctas < ref_chunks(pages, want - 1) * cpc / target
        else:
            unreachable += 1
            assert plan.pages_per_chunk == 1
    assert reached > 15 and unreachable > 25 and under > 10   # every branch exercised


def test_balanced_chunks_keep_the_counts_and_shorten_the_longest_chunk():
    """The searched size cut into even chunks: the same chunk count per request (so the
    same CTAs and merge work), a longest chunk no longer and, wherever the searched size
    left a sliver, shorter; brute force over random batches with targets they reach."""
    rng = np.random.default_rng(11)
    shorter = 0
    for _ in range(300):
        pages = rng.integers(0, int(rng.choice([12, 60, 300])), int(rng.integers(1, 20)))
        pages = pages.tolist()
        target = int(rng.integers(8, 8 * max(2, sum(pages) // 3)))
        plan = plan_decode(table_of(pages, 4), 32, 8, 64, target_ctas=target)
        searched = ref_best_ppc(pages, 8, target)
        assert plan.pages_per_chunk == ref_balanced(pages, searched)
        counts = [max(1, -(-n // searched)) for n in pages]
        assert plan.chunks_per_request.tolist() == counts
        longest = max((min(searched, n - t * searched) for n, k in zip(pages, counts)
                       for t in range(k) if n), default=0)
        got = max((min(plan.pages_per_chunk, n - t * plan.pages_per_chunk)
                   for n, k in zip(pages, counts) for t in range(k) if n), default=0)
        assert got <= longest
        shorter += got < longest
    assert shorter > 10


def test_balanced_chunks_of_a_batch_of_17():
    """17 requests of 1250 pages, 8 KV heads, a 264-CTA target: the search takes 1249
    pages per chunk (each request one full chunk and a one-page sliver, 272 CTAs of which
    136 do all the work); balanced, each request is two chunks of 625 pages (plus the
    1 / BALANCE_SLACK growth room: 664)."""
    dev = DeviceInfo("x", "fake", compute_units=132, ctas_per_unit=2)
    plan = plan_decode(table_of([1250] * 17, 16), 32, 8, 128, device=dev)
    assert plan.num_ctas == 272 and plan.chunks_per_request.tolist() == [2] * 17
    assert plan.pages_per_chunk == 625 + 625 // BALANCE_SLACK
    lo, hi = chunk_token_ranges(table_of([1250] * 17, 16), plan)
    assert (hi - lo).max() == 16 * plan.pages_per_chunk and (hi - lo).min() >= 16 * 586


def test_balancing_keeps_the_chunk_floor():
    """Even chunks never go below the floor (min_chunk_tokens): 19 pages of 16 tokens,
    a floor of 8 pages, a target that needs 3 chunks: 8 + 8 + 3 stays at 8 pages (7 would
    be more even)."""
    dev = DeviceInfo("x", "fake", compute_units=1, ctas_per_unit=3, min_chunk_tokens=128)
    plan = plan_decode(table_of([19], 16), 1, 1, 64, device=dev)
    assert plan.pages_per_chunk == 8 and plan.num_chunks == 3
    free = dataclasses.replace(dev, min_chunk_tokens=1)
    assert plan_decode(table_of([19], 16), 1, 1, 64, device=free).pages_per_chunk == 7


@pytest.mark.parametrize("max_chunks", [5, 7, 10, 16, 40])
def test_binary_search_is_maximal_under_a_small_grid_bound(max_chunks):
    rng = np.random.default_rng(max_chunks)
    for _ in range(150):
        b = int(rng.integers(1, min(max_chunks, 6) + 1))
        pages = rng.integers(0, 30, b).tolist()
        target = int(rng.integers(1, 10 * max_chunks))
        plan = plan_decode(table_of(pages, 4), 8, 8, 64, target_ctas=target,
                           max_chunks=max_chunks)
        want = ref_plan_ppc(pages, 8, target, max_chunks)
        assert plan.num_chunks <= max_chunks
        assert plan.pages_per_chunk == want, (pages, target, max_chunks)


def test_grid_bound_finest_split_is_the_smallest_allowed():
    # two requests of 9 pages, at most 10 chunks: 2 pages per chunk gives 5 + 5 = 10
    table = table_of([9, 9], 4)
    plan = plan_decode(table, 1, 1, 8, target_ctas=10, max_chunks=10)
    assert plan.num_chunks == 10 and plan.pages_per_chunk == 2
    forced = plan_decode(table, 1, 1, 8, pages_per_chunk=2, max_chunks=10)
    assert forced.num_chunks == 10
    with pytest.raises(InvalidArgumentError, match=r"use at least 2\b"):
        plan_decode(table, 1, 1, 8, pages_per_chunk=1, max_chunks=10)


def test_chunk_count_non_increasing_in_pages_per_chunk():
    rng = np.random.default_rng(1)
    for _ in range(100):
        pages = rng.integers(0, 40, int(rng.integers(1, 8))).tolist()
        table = table_of(pages, 4)
        counts = [plan_decode(table, 4, 4, 32, pages_per_chunk=ppc).num_chunks
                  for ppc in range(1, max(pages) + 3)]
        assert all(a >= b for a, b in zip(counts, counts[1:]))
        assert counts[-1] == len(pages)          # ppc >= max pages: one chunk each
        assert counts == [ref_chunks(pages, ppc) for ppc in range(1, max(pages) + 3)]


def test_example_lengths_in_pages():
    plan = plan_decode(table_of([10, 3, 0], 4), 8, 8, 64, pages_per_chunk=4)
    assert plan.request_indices.tolist() == [0, 0, 0, 1, 2]
    assert plan.kv_tile_indices.tolist() == [0, 1, 2, 0, 0]
    assert plan.o_indptr.tolist() == [0, 3, 4, 5]
    assert plan.chunks_per_request.tolist() == [3, 1, 1]
    assert plan.forced and plan.needs_merge


def test_every_request_gets_a_chunk_even_empty_ones():
    table = table_of([0, 0, 0], 4)
    for target in (1, 10_000):
        plan = plan_decode(table, 4, 2, 16, target_ctas=target)
        assert plan.chunks_per_request.tolist() == [1, 1, 1]
        assert not plan.needs_merge and plan.workspace_bytes == 0


# ---------------------------------------------------------------------------- matches
def test_matches_same_chunk_structure():
    plan = plan_decode(table_of([8, 8], 4), 8, 8, 64, pages_per_chunk=4)
    assert plan.matches(table_of([8, 8], 4))
    assert plan.matches(table_of([8, 7], 4))
    assert plan.matches(table_of([5, 6], 4))
    assert not plan.matches(table_of([9, 8], 4))
    assert "request 0 needs 3 chunks of 4 pages, plan has 2" in plan.mismatch(
        table_of([9, 8], 4))
    assert not plan.matches(table_of([8, 8, 8], 4))
    assert "batch size 3 != plan's 2" in plan.mismatch(table_of([8, 8, 8], 4))
    assert not plan.matches(table_of([8, 8], 8))
    assert "page_size 8 != plan's 4" in plan.mismatch(table_of([8, 8], 8))


def test_check_raises_plan_mismatch():
    table = table_of([8, 8], 4)
    plan = plan_decode(table, 8, 2, 64, pages_per_chunk=4)
    plan.check("f", table_of([7, 5], 4), 8, 2, 64)
    with pytest.raises(PlanMismatchError, match=r"f: plan was made for \(Hq, Hkv, D\) = "
                                                r"\(8, 2, 64\), got \(8, 4, 64\)"):
        plan.check("f", table, 8, 4, 64)
    with pytest.raises(PlanMismatchError, match=r"f: plan does not match the table: "
                                                r"request 1 needs 3 chunks"):
        plan.check("f", table_of([8, 9], 4), 8, 2, 64)


# ---------------------------------------------------------------------------- grid bound
def test_grid_bound_with_more_than_65535_pages():
    table = table_of([70_000], 1)
    plan = plan_decode(table, 8, 8, 64, target_ctas=10**9)
    assert plan.num_chunks <= MAX_CHUNKS
    assert plan.pages_per_chunk == ref_plan_ppc([70_000], 8, 10**9)   # 2: 35000 chunks
    with pytest.raises(InvalidArgumentError, match=r"pages_per_chunk = 1 gives 70000 chunks, "
                                                   r"above the grid bound of 65535"):
        plan_decode(table, 8, 8, 64, pages_per_chunk=1)


def test_grid_bound_finest_split_many_requests():
    # 30000 requests of 3 pages: 2 pages per chunk gives 60000 <= 65535 chunks
    table = table_of([3] * 30_000, 1)
    plan = plan_decode(table, 8, 8, 64, target_ctas=10**9)
    assert plan.num_chunks <= MAX_CHUNKS
    assert plan.pages_per_chunk == 2 and plan.num_chunks == 60_000


def test_batch_above_grid_bound_is_rejected():
    with pytest.raises(InvalidArgumentError, match=r"batch size 6 exceeds the grid bound of "
                                                   r"5 chunks"):
        plan_decode(table_of([1] * 6, 4), 4, 4, 8, max_chunks=5)


# ---------------------------------------------------------------------------- heads
@pytest.mark.parametrize("hq, hkv", [(8, 8), (32, 8), (56, 8), (14, 2), (16, 1), (24, 2),
                                     (12, 1), (36, 4), (9, 1), (64, 4), (40, 1)])
def test_heads_per_cta_divides_group_and_is_at_most_8(hq, hkv):
    g = hq // hkv
    h = heads_per_cta(hq, hkv)
    assert g % h == 0 and 1 <= h <= 8 and h == ref_heads_per_cta(hq, hkv)
    plan = plan_decode(table_of([3], 4), hq, hkv, 64)
    assert plan.heads_per_cta == h and plan.q_groups * h == g


# ---------------------------------------------------------------------------- target
def test_target_default_argument_and_env(monkeypatch):
    table = table_of([40, 40], 4)
    assert plan_decode(table, 8, 8, 64).target_ctas == 32   # the reference's fixed target
    monkeypatch.setenv("PAGED_DECODE_TARGET_CTAS", "100")
    plan = plan_decode(table, 8, 8, 64)
    assert plan.target_ctas == 100
    assert plan.pages_per_chunk == ref_plan_ppc([40, 40], 8, 100)
    assert plan_decode(table, 8, 8, 64, target_ctas=7).target_ctas == 7   # argument wins
    dev = DeviceInfo("x", "fake", compute_units=3, ctas_per_unit=5)
    assert plan_decode(table, 8, 8, 64, device=dev).target_ctas == 100    # env beats device
    monkeypatch.delenv("PAGED_DECODE_TARGET_CTAS")
    assert plan_decode(table, 8, 8, 64, device=dev).target_ctas == 15


def test_fp8_pools_plan_for_the_devices_fp8_target(monkeypatch):
    """``kv_dtype`` fp8: the device's ``fp8_ctas_per_unit`` sets the default target; a
    16-bit dtype, no dtype, a device without an fp8 figure, the argument and the
    environment keep their rule."""
    table = table_of([40, 40], 4)
    dev = DeviceInfo("x", "fake", compute_units=3, ctas_per_unit=5, fp8_ctas_per_unit=9)
    assert plan_decode(table, 8, 8, 64, device=dev).target_ctas == 15
    assert plan_decode(table, 8, 8, 64, device=dev, kv_dtype="float16").target_ctas == 15
    for fmt in ("float8_e4m3fn", "float8_e5m2"):
        plan = plan_decode(table, 8, 8, 64, device=dev, kv_dtype=fmt)
        assert plan.target_ctas == 27
        assert plan.pages_per_chunk == ref_plan_ppc([40, 40], 8, 27)
        assert plan_decode(table, 8, 8, 64, device=dev, kv_dtype=fmt,
                           target_ctas=7).target_ctas == 7
    plain = DeviceInfo("x", "fake", compute_units=3, ctas_per_unit=5)
    assert plan_decode(table, 8, 8, 64, device=plain, kv_dtype="float8_e4m3fn").target_ctas == 15
    monkeypatch.setenv("PAGED_DECODE_TARGET_CTAS", "100")
    assert plan_decode(table, 8, 8, 64, device=dev, kv_dtype="float8_e5m2").target_ctas == 100


def test_bad_fp8_target_inputs_raise():
    with pytest.raises(InvalidArgumentError, match=r"DeviceInfo: fp8_ctas_per_unit"):
        DeviceInfo("x", "fake", compute_units=3, ctas_per_unit=5, fp8_ctas_per_unit=-1)
    with pytest.raises(InvalidArgumentError, match=r"plan_decode: kv_dtype must be a dtype "
                                                   r"name or None, got int"):
        plan_decode(table_of([4], 4), 8, 8, 64, kv_dtype=8)


@pytest.mark.parametrize("value", ["abc", "0", "-4", "1.5"])
def test_bad_target_env_raises(monkeypatch, value):
    monkeypatch.setenv("PAGED_DECODE_TARGET_CTAS", value)
    with pytest.raises(InvalidArgumentError, match=r"PAGED_DECODE_TARGET_CTAS"):
        plan_decode(table_of([4], 4), 8, 8, 64)


def test_bad_target_argument_raises():
    with pytest.raises(InvalidArgumentError, match=r"target_ctas must be a positive integer"):
        plan_decode(table_of([4], 4), 8, 8, 64, target_ctas=0)


# ---------------------------------------------------------------------------- token ranges
def random_table(rng: np.random.Generator) -> PageTable:
    p = int(rng.choice([1, 2, 4, 16]))
    pages = rng.integers(0, 9, int(rng.integers(1, 6))).tolist()
    lpl, fpo = [], []
    for n in pages:
        last = int(rng.integers(1, p + 1)) if n else 0
        first = 0 if not n else int(rng.integers(0, (min(last, p - 1) if n == 1 else p - 1) + 1))
        lpl.append(last), fpo.append(first)
    return table_of(pages, p, fpo=fpo, lpl=lpl)


def test_chunk_token_ranges_match_ref_and_tile_the_visible_range():
    rng = np.random.default_rng(2)
    for _ in range(300):
        table = random_table(rng)
        ppc = int(rng.integers(1, 5))
        plan = plan_decode(table, 4, 2, 16, pages_per_chunk=ppc)
        t0, t1 = chunk_token_ranges(table, plan)
        covered = {r: [] for r in range(table.batch_size)}
        for c in range(plan.num_chunks):
            r, tile = int(plan.request_indices[c]), int(plan.kv_tile_indices[c])
            assert list(range(int(t0[c]), int(t1[c]))) == ref_token_range(table, r, tile, ppc)
            covered[r] += list(range(int(t0[c]), int(t1[c])))
        for r, toks in covered.items():   # in chunk order: no gap, no overlap
            assert toks == list(range(int(table.visible_lens[r])))


# ---------------------------------------------------------------------------- merge / ws
def test_needs_merge_and_workspace_bytes():
    table = table_of([5, 2, 0], 4)
    single = plan_decode(table, 8, 2, 64, pages_per_chunk=5)
    assert single.chunks_per_request.tolist() == [1, 1, 1]
    assert not single.needs_merge and single.workspace_bytes == 0
    split = plan_decode(table, 8, 2, 64, pages_per_chunk=2)
    assert split.needs_merge and split.num_chunks == 5
    v_part = np.zeros((5, 8, 64), np.float32)
    lse_part = np.zeros((5, 8), np.float32)
    assert split.workspace_bytes == v_part.nbytes + lse_part.nbytes


# ---------------------------------------------------------------------------- plain data
def test_plan_is_frozen_plain_data():
    table = table_of([6, 1], 4)
    plan = plan_decode(table, 8, 2, 64, pages_per_chunk=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.pages_per_chunk = 3
    for arr in (plan.request_indices, plan.kv_tile_indices, plan.o_indptr,
                plan.chunks_per_request):
        assert arr.dtype == np.int32
        with pytest.raises(ValueError):
            arr[0] = 5
    again = plan_decode(table, 8, 2, 64, pages_per_chunk=2)
    assert again.o_indptr.tolist() == plan.o_indptr.tolist()


@pytest.mark.parametrize("args, kwargs, pattern", [
    (("not a table", 8, 8, 64), {},
     r"plan_decode: table must be a PageTable or StepTable, got str"),
    ((None, 6, 4, 64), {}, r"num_qo_heads must be a multiple of num_kv_heads, got 6 and 4"),
    ((None, 0, 4, 64), {}, r"num_qo_heads must be an integer in \[1, 65535\], got 0"),
    ((None, 8, 8, -1), {}, r"head_dim must be an integer in \[1, 65535\], got -1"),
    ((None, 2**62, 2**61, 64), {},
     r"num_qo_heads must be an integer in \[1, 65535\], got 4611686018427387904"),
    ((None, 8, 8, 2**16), {}, r"head_dim must be an integer in \[1, 65535\], got 65536"),
    ((None, 8, 8, 64), {"pages_per_chunk": 0}, r"pages_per_chunk must be an integer in \[1, "),
])
def test_plan_rejects(args, kwargs, pattern):
    if args[0] is None:
        args = (table_of([4], 4), *args[1:])
    with pytest.raises(InvalidArgumentError, match=pattern):
        plan_decode(*args, **kwargs)


def test_plan_rejects_empty_batch():
    with pytest.raises(InvalidArgumentError, match=r"at least one request, got 0"):
        plan_decode(PageTable.build([], [0], [], page_size=4), 8, 8, 64)


# ---------------------------------------------------------------------------- ragged rule
def _ragged_device(split: float) -> DeviceInfo:
    return DeviceInfo("x", "fake", compute_units=4, ctas_per_unit=2, min_chunk_tokens=32,
                      ragged_split=split)


def test_ragged_rule_cuts_long_requests_of_a_full_device_at_the_mean():
    # 16 requests x 8 KV heads >= the target (8 CTAs): no split by the target rule; the
    # longest (60 pages) has 2x the mean (about 30), so the rule cuts at split x mean
    pages = [10, 20, 30, 40, 50, 60, 15, 25, 35, 45, 5, 55, 30, 30, 10, 20]
    table = table_of(pages, 16)
    mean = float(np.mean(pages))
    off = plan_decode(table, 32, 8, 128, device=_ragged_device(0.0))
    assert off.num_chunks == len(pages) and off.pages_per_chunk == max(pages)
    for split in (1.0, 0.5):
        plan = plan_decode(table, 32, 8, 128, device=_ragged_device(split))
        assert plan.pages_per_chunk == int(np.ceil(mean * split))
        assert list(plan.chunks_per_request) == [max(1, -(-p // plan.pages_per_chunk))
                                                 for p in pages]
        lo, hi = chunk_token_ranges(table, plan)     # the chunks still tile every request
        for r, n in enumerate(pages):
            sel = plan.request_indices == r
            assert lo[sel][0] == 0 and hi[sel][-1] == 16 * n
            assert (hi[sel][:-1] == lo[sel][1:]).all()
    # never below the chunk floor (32 tokens = 2 pages), argument beats device
    assert plan_decode(table, 32, 8, 128, device=_ragged_device(0.01)).pages_per_chunk == 2
    assert plan_decode(table, 32, 8, 128, device=_ragged_device(0.5),
                       ragged_split=0).pages_per_chunk == max(pages)


def test_ragged_rule_leaves_even_and_under_filled_batches_alone(monkeypatch):
    dev = _ragged_device(0.5)
    even = table_of([40] * 16, 16)                # not ragged
    assert plan_decode(even, 32, 8, 128, device=dev).num_chunks == 16
    mild = table_of([30, 36] * 8, 16)  # max < 1.25 x mean
    assert plan_decode(mild, 32, 8, 128, device=dev).num_chunks == 16
    # a batch that needs splitting to fill the device keeps the target rule's chunks
    small = table_of([10, 200], 16)
    big = dataclasses.replace(dev, compute_units=40)      # target 80 CTAs: 16 fall short
    want = plan_decode(small, 32, 8, 128, device=dataclasses.replace(big, ragged_split=0.0))
    got = plan_decode(small, 32, 8, 128, device=big)
    assert want.num_chunks > 2 and got.pages_per_chunk == want.pages_per_chunk
    # the environment beats the device
    monkeypatch.setenv("PAGED_DECODE_RAGGED_SPLIT", "0")
    table = table_of([10, 60] * 8, 16)
    assert plan_decode(table, 32, 8, 128, device=dev).num_chunks == 16


@pytest.mark.parametrize("value", ["abc", "-1", "inf", "nan"])
def test_bad_ragged_split_raises(monkeypatch, value):
    monkeypatch.setenv("PAGED_DECODE_RAGGED_SPLIT", value)
    with pytest.raises(InvalidArgumentError, match=r"PAGED_DECODE_RAGGED_SPLIT|ragged_split"):
        plan_decode(table_of([10, 60] * 8, 16), 32, 8, 128,
                    device=_ragged_device(0.5))


@pytest.mark.parametrize("value", [-0.5, float("inf"), float("nan"), "1", True])
def test_device_info_rejects_a_bad_ragged_split(value):
    with pytest.raises(InvalidArgumentError, match="DeviceInfo: ragged_split"):
        _ragged_device(value)


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_ragged_split_plans_decode_like_the_oracle(backend):
    """A plan the ragged rule cut (long requests split, short ones whole) gives the
    float64 oracle's answer through the kernels' split and merge."""
    from helpers import assert_matches_oracle

    import paged_decode as pd
    from paged_decode.backends import availability
    from paged_decode.reference import oracle_decode
    if not availability(backend).ok:
        pytest.skip(availability(backend).reason)
    be = pd.get_backend(backend)
    table = table_of(lengths=[8, 150, 20, 170, 30, 12], page_size=8)  # max > 1.25 x mean
    rng = np.random.default_rng(3)
    num_pages = int(table.indices.max()) + 1
    kp, vp = (rng.standard_normal((num_pages, 8, 2, 64)).astype(np.float32) for _ in "kv")
    q = rng.standard_normal((6, 8, 64)).astype(np.float32)
    dev = DeviceInfo("x", "fake", compute_units=1, ctas_per_unit=2, min_chunk_tokens=16,
                     ragged_split=0.5)
    plan = plan_decode(table, 8, 2, 64, device=dev)
    assert plan.needs_merge and max(plan.chunks_per_request) > 1 \
        and min(plan.chunks_per_request) == 1
    out, lse = pd.decode(be.asarray(q), be.asarray(kp), be.asarray(vp), table, plan,
                         return_lse=True, backend=backend)
    want, want_lse = oracle_decode(q, kp, vp, table)
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), want, want_lse, "float32")
    # the rule off: one chunk each, the same answer
    whole = plan_decode(table, 8, 2, 64, device=dataclasses.replace(dev, ragged_split=0.0))
    assert not whole.needs_merge
