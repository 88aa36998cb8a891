"""The tensor-core prefix kernel (cascade level 0) on the CUDA emulator: every output row
against the float64 oracle of its member and chunk, NaN-poisoned outputs, negative
controls, the fallback to the v2 partial, and the level-0 planning. The same checks run
on the real GPU in ``test_cuda_gpu.py`` (``prefix_case`` is shared).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import PREFIX_RTOL, table_of
from mutants import Mutation, backend, control, mutant

import paged_decode as pd
from paged_decode import InvalidArgumentError, plan_decode
from paged_decode.backends import availability
from paged_decode.cascade import plan_cascade
from paged_decode.device import DeviceInfo
from paged_decode.dtypes import numpy_dtype
from paged_decode.emulator.launch import LEGACY_SCHEDULES
from paged_decode.reference import attention_f64, lse_error, max_rel_error

needs_emulator = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                    reason=f"emulator unavailable: "
                                           f"{availability('emulated-cuda').reason}")


def prefix_case(be, xp, *, dtype="float16", head_dim=64, page_size=16, hkv=2, group=3,
                members=3, shared_pages=9, ppc=5, extra_requests=2, seed=0,
                check=True) -> tuple[float, float]:
    """Run ``be.prefix_partial`` on a random problem and compare every (member, chunk,
    head) row with the float64 oracle over that chunk's tokens; returns the worst
    max-rel error of the outputs and the worst LSE error (with ``check``, asserts them
    within ``PREFIX_RTOL`` and 5e-5).

    Shared pages are a random subset of a larger pool in shuffled order, members a
    random subset of the batch, outputs NaN-poisoned; ``xp`` is numpy or cupy.
    """
    rng = np.random.default_rng(seed)
    npd = numpy_dtype(dtype)
    num_pages = shared_pages + 7
    shape = (num_pages, page_size, hkv, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32).astype(npd)
    v = rng.standard_normal(shape, dtype=np.float32).astype(npd)
    b = members + extra_requests
    hq = hkv * group
    q = (rng.standard_normal((b, hq, head_dim), dtype=np.float32) * 1.5).astype(npd)
    mem = np.sort(rng.choice(b, members, replace=False)).astype(np.int32)
    ids = rng.permutation(num_pages)[:shared_pages].astype(np.int32)
    level0 = table_of([ids], page_size, num_pages=num_pages)
    plan0 = plan_decode(level0, members * hq, hkv, head_dim, pages_per_chunk=ppc,
                        device=be.device_info())
    c0 = plan0.num_chunks
    row_tiles = -(-members * group // 64)
    v_out = xp.full((members * c0, hq, head_dim), np.nan, dtype=np.float32)
    l_out = xp.full((members * c0, hq), np.nan, dtype=np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    ran = be.prefix_partial(xp.asarray(q), xp.asarray(k), xp.asarray(v), level0, plan0,
                            xp.asarray(mem), row_tiles, scale, v_out, l_out)
    assert ran, "the prefix kernel declined a float16/bfloat16 problem"
    got_v, got_l = (np.asarray(x.get() if hasattr(x, "get") else x) for x in (v_out, l_out))
    assert np.isfinite(got_v).all() and np.isfinite(got_l).all(), "rows left unwritten"
    kk = k[ids].reshape(-1, hkv, head_dim).astype(np.float64)
    vv = v[ids].reshape(-1, hkv, head_dim).astype(np.float64)
    worst = worst_lse = 0.0
    for mi, r in enumerate(mem):
        for c in range(c0):
            t0, t1 = c * ppc * page_size, min((c + 1) * ppc, shared_pages) * page_size
            ref, ref_lse = attention_f64(q[r].astype(np.float64), kk[t0:t1], vv[t0:t1], scale)
            row = mi * c0 + c
            worst = max(worst, max_rel_error(got_v[row], ref))
            worst_lse = max(worst_lse, lse_error(got_l[row], ref_lse))
    if check:
        assert worst <= PREFIX_RTOL[dtype], f"max-rel {worst:.3e} > {PREFIX_RTOL[dtype]}"
        assert worst_lse <= 5e-5, f"lse error {worst_lse:.3e} > 5e-5"
    return worst, worst_lse


@pytest.fixture(scope="module")
def emu():
    return pd.get_backend("emulated-cuda")


# ---------------------------------------------------------------------------- oracle
@needs_emulator
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_prefix_kernel_matches_oracle(emu, dtype, head_dim):
    # 9 pages of 16 in chunks of 5 pages: an 80-token chunk (a full and a partial tile of
    # 64 tokens; 32-token tiles at 256) and a 64-token last chunk
    prefix_case(emu, np, dtype=dtype, head_dim=head_dim, seed=head_dim)


@needs_emulator
@pytest.mark.parametrize("members,group,hkv", [(24, 3, 1), (1, 1, 2), (70, 1, 1)])
def test_prefix_kernel_row_tiles(emu, members, group, hkv):
    # 72 and 70 stacked rows: two row tiles, the second partial; one row: 63 rows padded;
    # three chunks (not two, as many as row tiles: a swapped grid mapping would pass)
    prefix_case(emu, np, members=members, group=group, hkv=hkv, shared_pages=6, ppc=2,
                extra_requests=1, seed=members)


@needs_emulator
@pytest.mark.parametrize("page_size", [1, 8, 64])
def test_prefix_kernel_page_sizes(emu, page_size):
    prefix_case(emu, np, page_size=page_size, shared_pages=max(3, 96 // page_size),
                ppc=max(1, 40 // page_size), seed=page_size)


@needs_emulator
@pytest.mark.parametrize("head_dim", [64, 256])
def test_prefix_kernel_long_chunk_every_schedule(emu, head_dim):
    # chunks of 13 pages of 16: 208 tokens, 4 tiles of 64 (7 of 32 at head_dim 256), so
    # each K/V buffer is refilled after it was read: the barrier before the refill and the
    # cp.async waits matter; every schedule (one warp a tile ahead included), copies
    # in flight until their wait
    prefix_case(emu, np, head_dim=head_dim, shared_pages=26, ppc=13, seed=head_dim + 1)


# ---------------------------------------------------------------------------- controls
def _fails(be, **kw) -> bool:
    from paged_decode.emulator import KernelFault, RaceError
    try:
        out_err, lse_err = prefix_case(be, np, check=False, **kw)
    except (AssertionError, KernelFault, RaceError):   # unwritten (NaN) rows, a race
        return True
    return out_err > 0.1 or lse_err > 1e-3


@needs_emulator
@pytest.mark.parametrize("name", ["prefix-no-barrier-before-refill", "prefix-no-cp-async-wait"])
def test_barrier_and_wait_mutants_need_the_new_schedules(name):
    """The emulator before issue #18 (forward and reverse sweeps, synchronous cp.async)
    passes both; one warp running ahead, and copies in flight until their wait, fail
    them."""
    mutation = mutant(name).mutation
    legacy = backend(mutation, schedules=LEGACY_SCHEDULES, cp_async="sync")
    assert not _fails(legacy, shared_pages=26, ppc=13)
    assert _fails(backend(mutation), shared_pages=26, ppc=13)


@needs_emulator
@pytest.mark.parametrize("old,new", [
    # ignores the page list: reads pages 0, 1, ... instead of the shared pages
    ("ids[j] = i < n_tok ? page_ids[(t_begin + i) / PAGE_SIZE] : 0;",
     "ids[j] = i < n_tok ? (t_begin + i) / PAGE_SIZE : 0;"),
    # the page ids of the tile before (the prefetch one tile late)
    ("      fetch(tile + 2);                            // consumed",
     "      fetch(tile + 1);                            // consumed"),
    # reads KV head 0 for every CTA
    ("+ (long long)kvh * D + piece * PER", "+ piece * PER"),
    # takes the members' rows member-major (h = m * G + g without the KV head)
    ("kvh * group + g) * D + d]", "g) * D + d]"),
    # drops the mask of tokens past the chunk (zero-filled rows then get weight)
    ("const bool live = tok0 + n * 8 + (e & 1) < n_tok;", "const bool live = true;"),
    # a wrong A fragment: rows 8-15 and columns +8 swapped in the Q ldmatrix addresses
    ("ldsm_x4<false>(a, qw + (lrow + 8 * lhi) * LD + kk * 16 + 8 * lq);",
     "ldsm_x4<false>(a, qw + (lrow + 8 * lq) * LD + kk * 16 + 8 * lhi);"),
    # V fragments without the transpose
    ("ldsm_x4_at<true>(b, chunk_addr", "ldsm_x4_at<false>(b, chunk_addr"),
    # natural-log LSE
    ("m_run[h] + log2f(l_run[h])", "(m_run[h] + log2f(l_run[h])) * 0.6931472f"),
])
def test_prefix_kernel_mutants_fail(old, new):
    # chunks of 13 pages of 16: 208 tokens = three full tiles of 64 and a partial one
    assert _fails(backend(Mutation("cuda", ("prefix",), old, new), check_races=False),
                  shared_pages=26, ppc=13)


@needs_emulator
def test_prefix_kernel_unmutated_control_passes():
    assert not _fails(backend(control("cuda", ["prefix"]), check_races=False),
                      shared_pages=26, ppc=13)


# ---------------------------------------------------------------------------- cascade
@needs_emulator
def test_float32_pools_fall_back_to_v2_stacked(emu):
    from test_cascade import shared_batch

    from paged_decode.reference import oracle_decode
    q, pool, table = shared_batch([("group", 40, [5, 9]), ("solo", 7)], page_size=8,
                                  head_dim=64, dtype="float32")
    cplan = plan_cascade(table, q.shape[1], 2, 64, device=emu.device_info(),
                         min_shared_pages=2)
    assert cplan.prefix_row_tiles == 1
    out = pd.decode(q, pool.k, pool.v, table, cascade=cplan, backend=emu,
                    out_dtype="float32")
    assert "level 0: v2 on stacked queries" in pd.last_outcome().detail
    ref, _ = oracle_decode(q, pool.k, pool.v, table)
    assert max_rel_error(out, ref) <= 1e-5


@needs_emulator
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cascade_runs_tensor_core_level0(emu, dtype):
    from test_cascade import shared_batch

    from paged_decode.reference import oracle_decode
    q, pool, table = shared_batch([("group", 70, [5, 9, 2]), ("solo", 21), ("empty",),
                                   ("group", 40, [7, 4])], page_size=8, head_dim=64,
                                  dtype=dtype)
    cplan = plan_cascade(table, q.shape[1], 2, 64, device=emu.device_info(),
                         min_shared_pages=2)
    out, lse = pd.decode(q, pool.k, pool.v, table, cascade=cplan, backend=emu,
                         out_dtype="float32", return_lse=True)
    oc = pd.last_outcome()
    assert oc.path == "cascade" and "level 0: tensor-core prefix" in oc.detail
    ref, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    assert max_rel_error(out, ref) <= PREFIX_RTOL[dtype]
    assert lse_error(lse, ref_lse) <= 5e-5


# ---------------------------------------------------------------------------- planning
def _table_with_group(members=40, shared=64, page=16):
    return table_of([[*range(shared), shared + r] for r in range(members)], page,
                    num_pages=shared + members)


def test_level0_plan_fills_device_with_prefix_ctas():
    dev = DeviceInfo("cuda", "test", 132, 2, prefix_tile_rows=64)
    table = _table_with_group()
    cp = plan_cascade(table, 32, 8, 128, device=dev)
    assert cp.prefix_row_tiles == math.ceil(40 * 4 / 64) == 3
    assert cp.plan0.ctas_per_chunk == 8 * 3
    # one wave of resident prefix CTAs (2 per SM when shared memory is unknown): 11 chunks
    # of ceil(64 / 11) = 6 pages (ceil(64 / 6) = 11 chunks, 264 CTAs)
    assert cp.plan0.num_chunks == 11 and cp.plan0.num_ctas == 264
    # 228 KB per SM holds 2 CTAs of the head_dim 128 kernel; 3 of head_dim 96
    dev2 = DeviceInfo("cuda", "test", 132, 2, prefix_tile_rows=64,
                      shared_mem_per_unit=228 * 1024)
    assert plan_cascade(table, 32, 8, 128, device=dev2).plan0.num_ctas <= 264
    p96 = plan_cascade(table, 32, 8, 96, device=dev2).plan0
    assert p96.num_ctas <= 3 * 132 and (p96.num_chunks + 1) * 24 > 3 * 132
    # the chunk floor (min_chunk_tokens 256 = 16 pages) caps the split at 4 chunks
    dev3 = DeviceInfo("cuda", "test", 132, 2, prefix_tile_rows=64, min_chunk_tokens=256)
    assert plan_cascade(table, 32, 8, 128, device=dev3).plan0.num_chunks == 4
    v2 = plan_cascade(table, 32, 8, 128, device=dev, level0="v2")
    assert v2.prefix_row_tiles == 0 and v2.plan0.ctas_per_chunk == 8 * 20
    assert v2.plan0.num_chunks < cp.plan0.num_chunks


def test_level0_tc_needs_a_device_with_the_kernel():
    dev = DeviceInfo("metal", "no tc", 10, 4)
    with pytest.raises(InvalidArgumentError, match=r"plan_cascade: level0='tc' needs"):
        plan_cascade(_table_with_group(), 32, 8, 128, device=dev, level0="tc")
    with pytest.raises(InvalidArgumentError, match=r"plan_cascade: level0 must be"):
        plan_cascade(_table_with_group(), 32, 8, 128, device=dev, level0="fast")
    assert plan_cascade(_table_with_group(), 32, 8, 128, device=dev).prefix_row_tiles == 0


def test_plan_decode_rejects_bad_ctas_per_chunk():
    with pytest.raises(InvalidArgumentError, match=r"plan_decode: ctas_per_chunk must be"):
        plan_decode(_table_with_group(), 32, 8, 128, ctas_per_chunk=0,
                    device=DeviceInfo("x", "x", 4, 1))


# ---------------------------------------------------------------------------- prepared
@needs_emulator
def test_prepared_cascade_equals_decode(emu):
    from test_cascade import shared_batch

    from paged_decode.prepared import PreparedCascade, PreparedDecode, decode_cache
    from paged_decode.reference import oracle_decode
    q, pool, table = shared_batch([("group", 70, [5, 9, 2]), ("solo", 21)], page_size=8,
                                  head_dim=64, dtype="float16")
    cplan = plan_cascade(table, q.shape[1], 2, 64, device=emu.device_info(),
                         min_shared_pages=2)
    call = pd.prepare_decode(q, pool.k, pool.v, table, cascade=cplan, backend=emu,
                             out_dtype="float32", return_lse=True)
    assert isinstance(call, PreparedCascade) and call.compiled
    out, lse = call()
    oc = pd.last_outcome()
    assert oc.path == "cascade" and "prepared call" in oc.reason
    assert "level 0: tensor-core prefix" in oc.detail
    ref, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    assert max_rel_error(out, ref) <= PREFIX_RTOL["float16"]
    assert lse_error(lse, ref_lse) <= 5e-5
    # decode's fast path: the second identical call replays a cached PreparedCascade
    decode_cache.clear()
    o2 = np.full_like(out, np.nan)
    pd.decode(q, pool.k, pool.v, table, out=o2, cascade=cplan, backend=emu,
              out_dtype="float32")
    pd.decode(q, pool.k, pool.v, table, out=o2, cascade=cplan, backend=emu,
              out_dtype="float32")
    assert "prepared call" in pd.last_outcome().reason
    np.testing.assert_array_equal(o2, out)
    # without a shared prefix, cascade=True prepares the flat decode
    q1, pool1, t1 = shared_batch([("solo", 40), ("solo", 9)], page_size=8, head_dim=64,
                                 dtype="float16")
    flat = pd.prepare_decode(q1, pool1.k, pool1.v, t1, cascade=True, backend=emu)
    assert isinstance(flat, PreparedDecode)


@needs_emulator
def test_prepared_cascade_float32_runs_the_host_path(emu):
    from test_cascade import shared_batch
    q, pool, table = shared_batch([("group", 40, [5, 9])], page_size=8, head_dim=64,
                                  dtype="float32")
    cplan = plan_cascade(table, q.shape[1], 2, 64, device=emu.device_info(),
                         min_shared_pages=2)
    call = pd.prepare_decode(q, pool.k, pool.v, table, cascade=cplan, backend=emu)
    assert not call.compiled
    call()
    assert "level 0: v2 on stacked queries" in pd.last_outcome().detail
