"""The tensor-core kernels' K/V tile layout (``TileRow``, ``tile_at``, ``chunk_addr`` in
``kernels/mma.py``), run through the CPU emulator: for every row size the kernels stage
(16-bit head_dim 64-256, fp8 head_dim 64-256), each row's chunks land inside the row
without collisions; the 8 rows one ``ldmatrix`` matrix reads take 8 distinct 16-byte bank
slots for every chunk (no bank conflict); the two 16-byte halves of every 32-byte global
sector land in one aligned 32-byte span (so ``cp.async`` moves each sector once from L2:
the padded rows before session 35 split them, 1.40x the bytes at head_dim 96); and
``chunk_addr`` finds every chunk from a lane's chunk 0 / 1 address, 8 and 16 rows on too.
Shared-memory layout is a performance property the oracle tests cannot see, so this is
where a layout that is correct but conflicted, or splits sectors, fails."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode import emulator
from paged_decode.emulator import Buffer, launch
from paged_decode.kernels.mma import tile_row_bytes

pytestmark = pytest.mark.skipif(not emulator.available()[0],
                                reason=f"emulator unavailable: {emulator.available()[1]}")

ROWS = 24          # three groups of 8 rows

TILE_MAP = r"""
// at[row][c]: tile_at of chunk c of row `row`; addr[row][bit][e / 2]: chunk_addr of chunk
// e + bit from the lane address of chunk bit (even e), at the row and 8 / 16 rows on;
// meta: the row's bytes and swizzle group
template <int DENSE>
__global__ void tile_map(int* at, long long* addr, long long* addr8, long long* addr16,
                         int* meta) {
  using Row = pd::TileRow<DENSE>;
  constexpr int C = DENSE / 16;
  constexpr int E = (C + 1) / 2;
  const int row = threadIdx.x;
  for (int c = 0; c < C; ++c) at[row * C + c] = pd::tile_at<Row::BYTES, Row::GROUP>(row, c);
  for (int bit = 0; bit < 2; ++bit) {
    const pd::smem_addr_t lane = (pd::smem_addr_t)pd::tile_at<Row::BYTES, Row::GROUP>(row, bit);
    for (int e = 0; 2 * e + bit < C; ++e) {
      const int k = (row * 2 + bit) * E + e;
      addr[k] = (long long)pd::chunk_addr<Row::GROUP>(lane, 2 * e);
      addr8[k] = (long long)pd::chunk_addr<Row::GROUP>(lane + 8 * Row::BYTES, 2 * e);
      addr16[k] = (long long)pd::chunk_addr<Row::GROUP>(lane + 16 * Row::BYTES, 2 * e);
    }
  }
  if (row == 0) { meta[0] = Row::BYTES; meta[1] = Row::GROUP; }
}
"""

#: K/V row bytes the kernels stage: 16-bit head_dim 64 / 96 / 128 / 256, fp8 64 / 96 /
#: 128 / 256
DENSE = (128, 192, 256, 512, 64, 96)


def source():
    """The tensor-core partial's CUDA source as the emulated backend compiles it (so the
    mutation runner's kernel mutants reach it), with ``tile_map`` appended."""
    from paged_decode.backends.emulated import EmulatedCudaBackend
    from paged_decode.specs import v2tc_spec
    return EmulatedCudaBackend().kernel_source(v2tc_spec("float16", "float32", 128, 16)) + TILE_MAP


def tile_map(dense):
    c = dense // 16
    e = (c + 1) // 2
    at = np.full((ROWS, c), -1, np.int32)
    addr, addr8, addr16 = (np.full((ROWS, 2, e), -1, np.int64) for _ in range(3))
    meta = np.zeros(2, np.int32)
    launch(source(), f"tile_map<{dense}>", 1, ROWS,
           [Buffer("at", at, True), Buffer("addr", addr, True), Buffer("addr8", addr8, True),
            Buffer("addr16", addr16, True), Buffer("meta", meta, True)])
    return at, addr, addr8, addr16, int(meta[0]), int(meta[1])


@pytest.mark.parametrize("dense", DENSE)
def test_tile_rows_are_unpadded_swizzled_conflict_free_and_keep_sectors_whole(dense):
    at, addr, addr8, addr16, row_bytes, group = tile_map(dense)
    assert row_bytes == tile_row_bytes(dense)
    # no padding where the row is whole 64-byte halves; 96-byte fp8 rows take 128
    assert row_bytes == (dense if dense % 64 == 0 else 128)
    assert group == (8 if row_bytes % 128 == 0 else 4)
    c = dense // 16
    for row in range(ROWS):
        mine = at[row]
        assert len(set(mine.tolist())) == c, "two chunks of a row at one place"
        assert mine.min() >= row * row_bytes and mine.max() + 16 <= (row + 1) * row_bytes
        assert (mine % 16 == 0).all()
        # a 32-byte global sector (chunks 2k, 2k + 1) lands in one aligned 32-byte span
        for k in range(c // 2):
            assert mine[2 * k] // 32 == mine[2 * k + 1] // 32, (row, k)
    # the 8 rows of an ldmatrix matrix (8-aligned) take 8 distinct 16-byte bank slots
    for first in range(0, ROWS, 8):
        for chunk in range(c):
            slots = (at[first:first + 8, chunk] // 16) % 8
            assert len(set(slots.tolist())) == 8, (first, chunk, slots)
    # chunk_addr from a lane's chunk `bit`: chunk even + bit, 8 and 16 rows on too
    for row in range(ROWS):
        for bit in range(2):
            for e in range((c - bit + 1) // 2):
                want = at[row, 2 * e + bit]
                assert addr[row, bit, e] == want
                if row + 8 < ROWS:
                    assert addr8[row, bit, e] == at[row + 8, 2 * e + bit]
                if row + 16 < ROWS:
                    assert addr16[row, bit, e] == at[row + 16, 2 * e + bit]

