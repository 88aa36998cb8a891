"""The tensor-core partial's wave rule (``paged_decode/waves.py``): its picks against the
H200 sweeps it was fitted to, where ``make_plan`` uses it, and where it must not."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_matches_oracle

from paged_decode import decode, plan_decode
from paged_decode.backends import get_backend
from paged_decode.device import DeviceInfo
from paged_decode.errors import InvalidArgumentError
from paged_decode.page_table import PageTable
from paged_decode.plan import DecodePlan, make_plan
from paged_decode.reference import oracle_decode
from paged_decode.specs import plan_geometry, v2tc_slots_per_unit
from paged_decode.waves import TIE, grid_cost, pick_tied, wave_chunk_size

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "h200"
SWEEPS = (RESULTS / "2026-12-05-s22" / "r1" / "out" / "tune_chunks.json",   # S22-R1
          RESULTS / "2026-12-05-s21" / "r3" / "out" / "tune_chunks.json")   # S21-R3
#: the H200 as the CUDA backend describes it (132 SMs, 228 KB of shared memory per SM)
H200 = DeviceInfo("cuda", "NVIDIA H200", 132, 2, min_chunk_tokens=128, ragged_split=0.5,
                  shared_mem_per_unit=233472)


def uniform(batch: int, context: int, page: int = 16) -> PageTable:
    n = -(-context // page)
    last = context - (n - 1) * page
    return PageTable.build(np.arange(batch * n, dtype=np.int32),
                           np.arange(batch + 1, dtype=np.int64) * n,
                           np.full(batch, last), page_size=page)


def sweep_cells() -> dict[str, list[dict]]:
    """v2tc rows of the measured sweeps by cell: even chunkings of uniform batches."""
    cells: dict[str, list[dict]] = {}
    for path in SWEEPS:
        for r in json.loads(path.read_text()):
            if r["arm"] == "v2tc" and r["plan"].endswith("chunks") and r["part"] in (
                    "sweep", "waves"):
                cells.setdefault(r["cell"], []).append(r)
    return cells


def geometry(cell: str) -> tuple[int, int, int, int, int]:
    """(Hq, Hkv, head_dim, batch, context) of a sweep cell label."""
    heads, batch, context = cell.split()[:3]
    hq, hkv = map(int, heads.split("x")[0].split("/"))
    return hq, hkv, int(heads.split("x")[1]), int(batch[1:]), int(context[3:])


def test_the_model_picks_near_the_fastest_measured_chunking():
    """Over the 18 measured cells the model's choice among the timed chunkings is within
    5% of the fastest everywhere and 1% on average; the CTA-target rule's plans were 7%
    slower on average there (the fit this rule's constants come from)."""
    cells = sweep_cells()
    assert len(cells) == 18
    regrets = []
    for cell, rows in cells.items():
        hq, hkv, d, b, ctx = geometry(cell)
        pages = np.full(b, ctx // 16, np.int64)
        ppcs = np.array(sorted({r["pages_per_chunk"] for r in rows}))
        counts = -(-pages[None, :] // ppcs[:, None])
        chunks = counts.sum(axis=1)
        geo = plan_geometry("v2tc", hq, hkv, d, "float16", H200)
        cost = grid_cost(chunks, b * ctx / chunks, (pages[None, :] * 16 / counts).max(axis=1),
                         geo["ctas_per_chunk"], b * ctx * 4 * d * hkv, 4 * d, 132,
                         geo["slots_per_unit"])
        pick = pick_tied(ppcs, chunks * geo["ctas_per_chunk"], cost <= cost.min() * (1 + TIE),
                         min(H200.target_ctas(None), 132 * geo["slots_per_unit"]))
        us = {r["pages_per_chunk"]: r["gpu_us"] for r in rows}
        regrets.append(us[pick] / min(us.values()) - 1)
    assert max(regrets) < 0.05, regrets
    assert float(np.mean(regrets)) < 0.01, regrets


@pytest.mark.parametrize("batch,context,want_ctas", [
    (12, 16384, 384),   # S22-R1: 207.0 us at 384 CTAs, 221.3 at the target rule's 288
    (5, 16384, 240),    # 99.6 at 240, 104.8 at 280
    (64, 4096, 1024),   # S21-R3: 284.3 at 1024, 323.6 at the target rule's 512
    (32, 16384, 256),   # one full wave already: the target rule's plan stays
])
def test_plan_decode_for_v2tc_fills_the_waves(batch, context, want_ctas):
    table = uniform(batch, context)
    plan = plan_decode(table, 32, 8, 128, device=H200, path="v2tc")
    assert plan.slots_per_unit == 3
    assert plan.num_ctas == want_ctas
    assert plan.matches(table)
    # the v2 partial keeps the CTA-target rule
    v2 = plan_decode(table, 32, 8, 128, device=H200, path="v2")
    assert v2.slots_per_unit == 0


@pytest.mark.parametrize("hq,hkv,batch,context,page", [
    (32, 8, 1, 4096, 16), (32, 8, 4, 1024, 16), (8, 1, 8, 2048, 16), (32, 2, 8, 2048, 16),
    (32, 2, 6, 3000, 64)])
def test_ties_keep_the_target_rules_plan(hq, hkv, batch, context, page):
    """Small batches: every one-wave size costs the same in the model, and the target
    rule's 128-token chunks (two 64-token stages) beat 144 (three) on the H200 (S22-R4).
    At 6 x 3000 in 64-token pages the target rule's 288 CTAs exceed the target (264): the
    most CTAs within it (192) would be 192-token chunks, so its size stays there too."""
    table = uniform(batch, context, page)
    geo = plan_geometry("v2tc", hq, hkv, 128, None, H200)
    waves = make_plan(table, hq, hkv, 128, device=H200, **geo)
    target = make_plan(table, hq, hkv, 128, device=H200, ctas_per_chunk=geo["ctas_per_chunk"])
    assert waves.slots_per_unit == 3 and target.slots_per_unit == 0
    assert waves.pages_per_chunk == target.pages_per_chunk


#: the H100 as the CUDA backend describes it (132 SMs, as the H200)
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 132, 2, min_chunk_tokens=128,
                  ragged_split=0.5, shared_mem_per_unit=233472)


@pytest.mark.parametrize("model,batch,context,old,want", [
    # S37-R6 (H100) v2tc: 35.2 us at the old 224 CTAs, 33.5 at 256; S36-R1 34.1 at 256
    ("32/2", 8, 8192, 224, 256),
    ("32/2", 8, 32768, 224, 256),       # S37-R6: 99.2 at 224, 97.5 at 256
    ("32/8", 1, 16384, 224, 256),       # S37-R6: 32.9 at 224, 31.3 at 256
    ("32/8", 20, 16384, 320, 320),      # ties past one wave keep the fewest CTAs (S22-R1)
    ("32/8", 12, 16384, 384, 384),      # no tie: the least cost
], ids=["gqa16-8x8K", "gqa16-8x32K", "llama-1x16K", "llama-20x16K", "llama-12x16K"])
def test_one_wave_ties_take_the_most_ctas_within_the_target(model, batch, context, old, want):
    """Where the model ties sizes of one wave short of the CTA target, the plan takes the
    most CTAs up to the target (shorter chunks), not the fewest; ties that need more than
    one wave keep the fewest CTAs."""
    hq, hkv = map(int, model.split("/"))
    table = uniform(batch, context)
    plan = plan_decode(table, hq, hkv, 128, device=H100, path="v2tc")
    assert plan.slots_per_unit == 3 and plan.num_ctas == want
    geo = plan_geometry("v2tc", hq, hkv, 128, None, H100)
    pages = table.pages_per_request.astype(np.int64)
    fewest = wave_chunk_size(pages, 16, geo["ctas_per_chunk"], hkv, 4 * 128, 132, 3, 8,
                             int(pages.max()), 1 << 20, target=0)
    assert int((-(-pages // fewest)).sum()) * geo["ctas_per_chunk"] == old


def test_pick_tied_order():
    sizes = np.array([4, 8, 16, 32])
    ctas = np.array([512, 256, 128, 64])
    tied = np.array([True, True, True, False])
    assert pick_tied(sizes, ctas, tied, 264, prefer=16) == 16      # the target rule's size
    assert pick_tied(sizes, ctas, tied, 264, prefer=32) == 8       # not tied: most within
    assert pick_tied(sizes, ctas, tied, 100) == 16                 # none within: fewest
    assert pick_tied(sizes, ctas, np.array([True, False, False, False]), 264) == 4


def test_head_dim_256_plans_for_one_resident_cta():
    """Gemma-2 heads: one v2tc CTA per SM, so 12 x 8K runs best at 384 CTAs (2.9 waves:
    220.3 us) and the target rule's 288 (2.2 waves) took 265.8 (S22-R1)."""
    table = uniform(12, 8192)
    plan = plan_decode(table, 16, 8, 256, device=H200, path="v2tc")
    assert plan.slots_per_unit == 1 and plan.num_ctas == 384


def test_slots_follow_the_rings_shared_memory():
    assert [v2tc_slots_per_unit(d, "float16", H200) for d in (64, 96, 128, 256)] == [5, 4, 3, 1]
    # at head_dim 64 the unpadded ring leaves room for 6, the registers for 5
    from paged_decode.kernels import decode_v2_tc
    from paged_decode.specs import BLOCK_RESERVED_SMEM
    smem = decode_v2_tc.dynamic_smem_bytes(64, 4, 2) + BLOCK_RESERVED_SMEM
    assert H200.shared_mem_per_unit // smem == 6 and decode_v2_tc.register_ctas(64) == 5
    assert decode_v2_tc.register_ctas(64, 8) == 2 and decode_v2_tc.register_ctas(80) == 32
    assert v2tc_slots_per_unit(128, "bfloat16", H200) == 3
    bare = DeviceInfo("cuda", "unknown", 132, 2)       # no shared memory figure: no rule
    assert v2tc_slots_per_unit(128, "float16", bare) == 0
    assert plan_decode(uniform(12, 16384), 32, 8, 128, device=bare,
                       path="v2tc").slots_per_unit == 0


@pytest.mark.parametrize("kwargs,why", [
    ({"kv_dtype": "float8_e4m3fn"}, "fp8 pools keep their own target"),
    ({"query_tokens": 2}, "multi-token plans are not calibrated"),
    ({"target_ctas": 264}, "an explicit target"),
    ({"pages_per_chunk": 64}, "an explicit chunk size"),
])
def test_where_the_target_rule_stays(kwargs, why):
    plan = plan_decode(uniform(12, 16384), 32, 8, 128, device=H200, path="v2tc", **kwargs)
    assert plan.slots_per_unit == 0, why


def test_environment_turns_the_rule_off(monkeypatch):
    table = uniform(12, 16384)
    monkeypatch.setenv("PAGED_DECODE_WAVE_PLAN", "0")
    assert plan_decode(table, 32, 8, 128, device=H200, path="v2tc").num_ctas == 288
    monkeypatch.delenv("PAGED_DECODE_WAVE_PLAN")
    monkeypatch.setenv("PAGED_DECODE_TARGET_CTAS", "264")
    plan = plan_decode(table, 32, 8, 128, device=H200, path="v2tc")
    assert plan.slots_per_unit == 0 and plan.num_ctas == 288


def test_ragged_and_empty_requests():
    """Every request gets its chunks (an empty one exactly one) and the longest request's
    chunk sets the floor of the cost."""
    lengths = [0, 700, 16384, 3000, 0, 9000]
    pages = [-(-n // 16) for n in lengths]
    table = PageTable.build(np.arange(sum(pages), dtype=np.int32),
                            np.concatenate([[0], np.cumsum(pages)]),
                            [(n - 1) % 16 + 1 if n else 0 for n in lengths], page_size=16)
    plan = plan_decode(table, 32, 8, 128, device=H200, path="v2tc")
    assert plan.slots_per_unit == 3
    counts = np.asarray(plan.chunks_per_request)
    assert counts[0] == counts[4] == 1 and (counts >= 1).all()
    assert counts[2] == counts.max()
    assert plan.pages_per_chunk * 16 >= 128          # the chunk floor holds
    assert plan.matches(table)


def test_wave_chunk_size_honours_the_grid_bound_and_range():
    pages = np.array([4096, 4096], np.int64)
    ppc = wave_chunk_size(pages, 16, 8, 8, 512, 132, 3, lower=8, upper=4096, max_chunks=3)
    assert -(-pages // ppc).sum() <= 3
    ppc = wave_chunk_size(pages, 16, 8, 8, 512, 132, 3, lower=1024, upper=4096,
                          max_chunks=65535)
    assert 1024 <= ppc <= 4096


def test_slots_are_checked():
    with pytest.raises(InvalidArgumentError, match="make_plan.*slots_per_unit"):
        make_plan(uniform(2, 512), 32, 8, 128, device=H200, slots_per_unit=-1)
    good = make_plan(uniform(2, 512), 32, 8, 128, device=H200)
    with pytest.raises(InvalidArgumentError, match="DecodePlan.*slots_per_unit"):
        DecodePlan(good.batch_size, 32, 8, 128, 16, good.pages_per_chunk, good.heads_per_cta,
                   good.q_groups, good.target_ctas, False, good.cta_count_per_chunk,
                   good.chunks_per_request, good.request_indices, good.kv_tile_indices,
                   good.o_indptr, slots_per_unit=-2)


def test_a_wave_plan_decodes_right_on_the_emulated_tensor_cores():
    """A plan the wave rule made (for a small device: 4 SMs) runs on the emulated
    tensor-core partial and merge and matches the float64 oracle."""
    be = get_backend("emulated-cuda")
    small = DeviceInfo("cuda", "small", 4, 2, min_chunk_tokens=16, shared_mem_per_unit=233472)
    lengths = [300, 57, 190]
    pages = [-(-n // 16) for n in lengths]
    rng = np.random.default_rng(3)
    n_pages = sum(pages) + 2
    perm = rng.permutation(n_pages)[:sum(pages)].astype(np.int32)
    table = PageTable.build(perm, np.concatenate([[0], np.cumsum(pages)]),
                            [(n - 1) % 16 + 1 for n in lengths], page_size=16)
    plan = plan_decode(table, 8, 2, 64, device=small, path="v2tc")
    assert plan.slots_per_unit == 5 and plan.needs_merge
    q = rng.standard_normal((3, 8, 64)).astype(np.float16)
    k = rng.standard_normal((n_pages, 16, 2, 64)).astype(np.float16)
    v = rng.standard_normal((n_pages, 16, 2, 64)).astype(np.float16)
    out, lse = decode(q, k, v, table, plan, path="v2tc", backend=be, return_lse=True)
    ref_out, ref_lse = oracle_decode(q, k, v, table)
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref_out, ref_lse, "float16",
                          "v2tc on a wave plan")


def test_a_ragged_split_keeps_the_target_rules_plan():
    """128 requests of 512-4K tokens: the ragged rule splits the long ones; the wave rule
    would run one chunk per request, 2.5% slower on the H200 (S22-R4, R5)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(512, 4097, 128)
    pages = -(-lengths // 16)
    table = PageTable.build(np.arange(pages.sum(), dtype=np.int32),
                            np.concatenate([[0], np.cumsum(pages)]), (lengths - 1) % 16 + 1,
                            page_size=16)
    waves = plan_decode(table, 32, 8, 128, device=H200, path="v2tc")
    target = make_plan(table, 32, 8, 128, device=H200, ctas_per_chunk=8)
    assert waves.slots_per_unit == 0
    assert waves.pages_per_chunk == target.pages_per_chunk
    assert waves.num_chunks > 128                       # the long requests are split


def test_info_names_the_rule(monkeypatch):
    from paged_decode.cli import _v2tc_plan_rule
    assert _v2tc_plan_rule(H200).startswith("wave rule, 5 / 4 / 3 / 1 resident CTAs")
    monkeypatch.setenv("PAGED_DECODE_WAVE_PLAN", "0")
    assert _v2tc_plan_rule(H200) == "CTA-target rule (PAGED_DECODE_WAVE_PLAN=0)"


@pytest.mark.parametrize("seed", range(40))
def test_random_tables_get_valid_wave_plans(seed):
    """Ragged lengths, empty requests, page sizes 1-256, windows and headroom: a wave plan
    covers every request (empty ones with one chunk), keeps the chunk floor where the
    longest request allows it, stays under the grid bound and matches its table."""
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 3, 16, 64, 256]))
    b = int(rng.integers(1, 200))
    lengths = rng.integers(0, 40000, b) * (rng.random(b) > 0.1)
    pages = -(-lengths // page)
    table = PageTable.build(np.arange(pages.sum(), dtype=np.int32),
                            np.concatenate([[0], np.cumsum(pages)]),
                            np.where(lengths > 0, (lengths - 1) % page + 1, 0), page_size=page)
    window = int(rng.choice([-1, 4095, 100]))
    hq, hkv, d = [(32, 8, 128), (28, 4, 128), (32, 2, 128), (16, 8, 256), (8, 8, 64)][seed % 5]
    plan = plan_decode(table, hq, hkv, d, device=H200, path="v2tc", window_left=window,
                       headroom=int(rng.choice([0, 64])))
    counts = np.asarray(plan.chunks_per_request)
    assert counts.shape == (b,) and counts.min() >= 1 and counts.sum() <= 65535
    assert plan.matches(table)
    if lengths.max() > 0 and plan.slots_per_unit:
        assert plan.pages_per_chunk * page >= min(128, page * int(plan_pages(table, window)))


def plan_pages(table: PageTable, window: int) -> int:
    """The longest request's pages the plan covers (its window's pages)."""
    from paged_decode.variants import window_table
    return int(window_table(table, window).pages_per_request.max())


def test_the_bench_v2tc_arm_runs_the_wave_plan_unless_told_to_keep_its_own(monkeypatch):
    """The bench's v2tc arm replaces the case's v2 plan by its own (the wave rule where
    the device calibrates it); a sweep's plan (a CTA target) is timed as given with
    ``keep_plan``, and a forced chunk size always."""
    import dataclasses

    from paged_decode.bench.arms import make_arm
    be = get_backend("emulated-cuda")
    dev = dataclasses.replace(be.device_info(), compute_units=132, ctas_per_unit=2,
                              min_chunk_tokens=128, shared_mem_per_unit=233472)
    monkeypatch.setattr(be, "device_info", lambda: dev)
    table = uniform(12, 2048)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((12, 32, 128)).astype(np.float16)
    k, v = (rng.standard_normal((int(table.indices.size), 16, 8, 128)).astype(np.float16)
            for _ in range(2))
    v2 = plan_decode(table, 32, 8, 128, device=dev, path="v2")
    assert v2.slots_per_unit == 0
    got = make_arm("v2tc", be, q, k, v, table, v2, 0.088).call.plan
    want = plan_decode(table, 32, 8, 128, device=dev, path="v2tc")
    assert got.slots_per_unit == 3 and got.num_ctas == want.num_ctas != v2.num_ctas
    sweep = plan_decode(table, 32, 8, 128, device=dev, path="v2tc", target_ctas=528)
    assert make_arm("v2tc", be, q, k, v, table, sweep, 0.088, keep_plan=True).call.plan is sweep
    assert make_arm("v2tc", be, q, k, v, table, sweep, 0.088).call.plan is not sweep
    forced = plan_decode(table, 32, 8, 128, device=dev, pages_per_chunk=16)
    assert make_arm("v2tc", be, q, k, v, table, forced, 0.088).call.plan is forced
