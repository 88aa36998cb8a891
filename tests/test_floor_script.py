"""bench/device/floor.py's paged read, run by the CPU emulator: it must read exactly the
K and V rows of every chunk of a plan (each 16-byte piece once, through the page table,
nothing past a chunk's visible tokens), or the GPU figure it gives would not be the cost
of a paged read of the cell's bytes. The GPU runs it only for timing."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from paged_decode import emulator
from paged_decode.emulator.launch import Buffer, launch
from paged_decode.kernels.common import CUDA_COMMON
from paged_decode.page_table import PageTable
from paged_decode.plan import chunk_token_ranges
from paged_decode.problems import ProblemSpec, make_problem

pytestmark = pytest.mark.skipif(not emulator.available()[0],
                                reason=f"emulator unavailable: {emulator.available()[1]}")

FLOOR = Path(__file__).resolve().parents[1] / "bench" / "device" / "floor.py"


def floor_source(name: str) -> str:
    """A string literal assigned at the top of floor.py (the script imports CuPy)."""
    tree = ast.parse(FLOOR.read_text())
    return next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == [name])


def expected_xor(k: np.ndarray, v: np.ndarray, table: PageTable, plan) -> np.ndarray:
    """[C, Hkv] XOR of every 32-bit word of the K and V rows each chunk covers."""
    t_begin, t_end = chunk_token_ranges(table, plan)
    hkv = k.shape[2]
    kw = k.reshape(*k.shape[:3], -1).view(np.uint32)
    vw = v.reshape(*v.shape[:3], -1).view(np.uint32)
    out = np.zeros((plan.num_chunks, hkv), np.uint32)
    p = table.page_size
    for c, r in enumerate(plan.request_indices):
        pages = table.indices[table.indptr[r]:table.indptr[r + 1]]
        for t in range(t_begin[c], t_end[c]):
            a = table.first_page_offset[r] + t
            page, e = pages[a // p], a % p
            for h in range(hkv):
                out[c, h] ^= np.bitwise_xor.reduce(kw[page, e, h]) ^ np.bitwise_xor.reduce(
                    vw[page, e, h])
    return out


@pytest.mark.parametrize("kernel,dtype", [("pd_floor_paged_16bit", "float16"),
                                          ("pd_floor_paged_8bit", "float8_e4m3fn")])
def test_the_paged_read_reads_every_row_of_every_chunk_once(kernel, dtype):
    from paged_decode import plan_decode
    from paged_decode.device import DeviceInfo
    spec = ProblemSpec(4, 0, 8, 2, 128, 16, seed=7)
    pr = make_problem(spec, lengths=[70, 0, 300, 17], offsets=[3, 0, 15, 9])
    elt = 1 if dtype.startswith("float8") else 2
    rng = np.random.default_rng(3)
    # the pools' bytes as random words: the kernel reads bytes, the dtype only sets the row
    shape = pr.k_pages.shape[:3] + (128 * elt // 4,)
    k, v = (rng.integers(0, 2 ** 32, shape, dtype=np.uint32) for _ in range(2))
    dev = DeviceInfo("cuda", "test", 4, 2)
    plan = plan_decode(pr.table, 8, 2, 128, device=dev, pages_per_chunk=3)
    assert plan.num_chunks > pr.table.batch_size           # requests split into chunks
    t = pr.table
    out = np.full(plan.num_chunks * 2, 0xDEADBEEF, np.uint32)
    args = [Buffer("k", k), Buffer("v", v), Buffer("indices", t.indices.astype(np.int32)),
            Buffer("indptr", t.indptr.astype(np.int32)),
            Buffer("last_page_len", t.last_page_len.astype(np.int32)),
            Buffer("first_page_offset", t.first_page_offset.astype(np.int32)),
            Buffer("request_indices", plan.request_indices.astype(np.int32)),
            Buffer("kv_tile_indices", plan.kv_tile_indices.astype(np.int32)),
            np.int32(plan.pages_per_chunk), np.int32(2), np.int32(1), Buffer("out", out, True)]
    launch(CUDA_COMMON + floor_source("PAGED_SOURCE"), kernel, (plan.num_chunks, 2), 128, args)
    want = expected_xor(k, v, t, plan)
    assert np.array_equal(out.reshape(plan.num_chunks, 2), want)
    # the check can fail: a chunk that skips its first token's rows gives another XOR
    bad = floor_source("PAGED_SOURCE").replace("const long long i = t + (long long)u * TOK;",
                                               "const long long i = t + (long long)u * TOK + 1;")
    out[:] = 0xDEADBEEF
    launch(CUDA_COMMON + bad, kernel, (plan.num_chunks, 2), 128, args)
    assert not np.array_equal(out.reshape(plan.num_chunks, 2), want)
