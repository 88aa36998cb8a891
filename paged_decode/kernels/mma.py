"""Tensor-core building blocks shared by the CUDA kernels that use ``mma.sync`` (the
cascade prefix kernel, ``prefix_tc.py``, and the tensor-core decode partial,
``decode_v2_tc.py``): one copy of the fragment helpers and of the per-warp tile phases.

Fragment layouts (PTX ISA, ``mma.m16n8k16`` with 16-bit A/B): lane = 4 * grp + tig;
A regs {(grp, 2tig..+1), (grp+8, 2tig..), (grp, 2tig+8..), (grp+8, 2tig+8..)}; B regs
{(k = 2tig..+1, n = grp), (k = 2tig+8.., n = grp)}; C {(grp, 2tig..+1), (grp+8, 2tig..+1)};
the lower 16 bits of a register hold the lower index. The S accumulator of two adjacent
8-token tiles is then exactly the A operand of P V for those 16 tokens (no shuffles).
Q and K fragments come from shared memory through ``ldmatrix``, V fragments through
``ldmatrix.trans``. Without ``__CUDA_ARCH__`` (the CPU emulator), or with
``PD_EMULATE_MMA`` defined, products and matrix loads are computed from the same
fragments and row addresses with warp shuffles.

A warp's tile phases (``qk_tile``, ``softmax_tile``, ``pv_tile``, ``row_sums``) work on
16 query rows held in shared memory (rows of ``LD`` 16-bit elements, ``LD`` = head_dim +
8: padded so that the eight row addresses of one ``ldmatrix`` fall in different banks)
against ``8 * NT`` K/V token rows in shared memory laid out by ``tile_at``: rows whose
16-byte pieces are XOR-swizzled by row in groups of 8 or 4 (``TileRow``), which also keeps
each 32-byte global sector that ``cp.async`` copies in one aligned span (the tile starts
128-byte aligned, ``align_smem``). Each lane
keeps the online-softmax state of rows ``grp`` and ``grp + 8`` (``m_run``, ``l_run`` in
base 2; ``l_run`` is this lane's share of the row sum until ``row_sums``) and the
accumulators ``o[DT][4]`` of those rows (C layout, ``DT = D / 8`` column tiles).
"""

#: bytes of slack a kernel keeps so that ``align_smem`` can round its swizzled tiles'
#: start up to 128 bytes
ALIGN_SLACK = 128


def tile_row_bytes(dense: int) -> int:
    """Bytes of one K/V tile row of ``dense`` bytes of data (head_dim x element size),
    ``TileRow<dense>::BYTES`` in the kernels (swizzled, ``tile_at``): ``dense`` where it is
    a multiple of 64, else rounded up to a multiple of 128."""
    return dense if dense % 64 == 0 else -(-dense // 128) * 128


CUDA_MMA = r"""
namespace pd {

// Two floats as one 16-bit pair register (lower index in the lower half), and back.
template <typename T> struct Pair;
template <> struct Pair<__half> {
  static constexpr bool BF16 = false;
  static __device__ __forceinline__ unsigned pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(unsigned u) {
    return __half22float2(*reinterpret_cast<__half2*>(&u));
  }
};
template <> struct Pair<__nv_bfloat16> {
  static constexpr bool BF16 = true;
  static __device__ __forceinline__ unsigned pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ float2 unpack(unsigned u) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
  }
};

// d += A (16 x 16, row) * B (16 x 8, col), float32 accumulators (layouts: module doc).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if defined(__CUDA_ARCH__) && !defined(PD_EMULATE_MMA)
  if constexpr (!Pair<T>::BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  // The same product from the same fragments: lane (grp, tig) fetches rows grp and grp+8
  // of A and columns 2tig, 2tig+1 of B from the lanes holding them.
  const int lane = threadIdx.x & 31, grp = lane >> 2, tig = lane & 3;
  const unsigned long long mine_a01 = (unsigned long long)a[0] | ((unsigned long long)a[1] << 32);
  const unsigned long long mine_a23 = (unsigned long long)a[2] | ((unsigned long long)a[3] << 32);
  const unsigned long long mine_b = (unsigned long long)b[0] | ((unsigned long long)b[1] << 32);
#pragma unroll
  for (int src = 0; src < 4; ++src) {
    const unsigned long long a01 = __shfl_sync(0xffffffffu, mine_a01, grp * 4 + src);
    const unsigned long long a23 = __shfl_sync(0xffffffffu, mine_a23, grp * 4 + src);
    const unsigned long long bc0 = __shfl_sync(0xffffffffu, mine_b, (2 * tig) * 4 + src);
    const unsigned long long bc1 = __shfl_sync(0xffffffffu, mine_b, (2 * tig + 1) * 4 + src);
    const float2 r0lo = Pair<T>::unpack((unsigned)a01), r1lo = Pair<T>::unpack((unsigned)(a01 >> 32));
    const float2 r0hi = Pair<T>::unpack((unsigned)a23), r1hi = Pair<T>::unpack((unsigned)(a23 >> 32));
    const float2 c0lo = Pair<T>::unpack((unsigned)bc0), c0hi = Pair<T>::unpack((unsigned)(bc0 >> 32));
    const float2 c1lo = Pair<T>::unpack((unsigned)bc1), c1hi = Pair<T>::unpack((unsigned)(bc1 >> 32));
    d[0] += r0lo.x * c0lo.x + r0lo.y * c0lo.y + r0hi.x * c0hi.x + r0hi.y * c0hi.y;
    d[1] += r0lo.x * c1lo.x + r0lo.y * c1lo.y + r0hi.x * c1hi.x + r0hi.y * c1hi.y;
    d[2] += r1lo.x * c0lo.x + r1lo.y * c0lo.y + r1hi.x * c0hi.x + r1hi.y * c0hi.y;
    d[3] += r1lo.x * c1lo.x + r1lo.y * c1lo.y + r1hi.x * c1hi.x + r1hi.y * c1hi.y;
  }
#endif
}

// A shared-memory address as the matrix loads take it: the 32-bit shared-window address
// on the GPU, the pointer itself where the loads are emulated. The swizzled tiles below
// XOR its low bits, which is why a tile starts 128-byte aligned (``align_smem``).
#if defined(__CUDA_ARCH__) && !defined(PD_EMULATE_MMA)
typedef unsigned smem_addr_t;
__device__ __forceinline__ smem_addr_t smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
#else
typedef unsigned long long smem_addr_t;
__device__ __forceinline__ smem_addr_t smem_addr(const void* p) {
  return (unsigned long long)p;
}
#endif

// `p` rounded up to the next multiple of 128 in the shared window (the caller keeps 127
// bytes of slack after it).
__device__ __forceinline__ unsigned char* align_smem(unsigned char* p) {
  return p + ((128u - (unsigned)(smem_addr(p) & 127u)) & 127u);
}

// Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix .x4): lane l passes
// the address of row l % 8 of matrix l / 8 (16-byte aligned); register i receives matrix
// i's elements (row l / 4, columns 2 (l % 4) and +1), or with TRANS (rows 2 (l % 4) and +1,
// column l / 4), the lower index in the lower half.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4_at(unsigned (&r)[4], smem_addr_t a) {
#if defined(__CUDA_ARCH__) && !defined(PD_EMULATE_MMA)
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  }
#else
#if defined(PD_EMU)
  pd_emu::check_shared(reinterpret_cast<const void*>(a), 16,
                       TRANS ? "ldmatrix.trans row" : "ldmatrix row");
#endif
  const int lane = threadIdx.x & 31;
  const unsigned long long mine = a;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (TRANS) {
      const unsigned short* p0 = reinterpret_cast<const unsigned short*>(
          __shfl_sync(0xffffffffu, mine, i * 8 + 2 * (lane & 3)));
      const unsigned short* p1 = reinterpret_cast<const unsigned short*>(
          __shfl_sync(0xffffffffu, mine, i * 8 + 2 * (lane & 3) + 1));
      r[i] = (unsigned)p0[lane >> 2] | ((unsigned)p1[lane >> 2] << 16);
    } else {
      const unsigned short* p = reinterpret_cast<const unsigned short*>(
          __shfl_sync(0xffffffffu, mine, i * 8 + (lane >> 2)));
      r[i] = (unsigned)p[2 * (lane & 3)] | ((unsigned)p[2 * (lane & 3) + 1] << 16);
    }
  }
#endif
}

// The same from a generic pointer to the row.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* row) {
  ldsm_x4_at<TRANS>(r, smem_addr(row));
}

// The row of a K/V tile holding DENSE bytes (head_dim x element size; tile_row_bytes on
// the host): DENSE itself where it is a multiple of 64 bytes, else DENSE rounded up to a
// multiple of 128 (96-byte fp8 rows). Every row is swizzled (tile_at) in groups of GROUP
// 16-byte chunks: 8 (128 bytes) where the rows are whole 128-byte lines, 4 (64 bytes)
// where they end half way through one (192-byte rows at head_dim 96, 64-byte fp8 rows).
// Not padding: a row padded by 16 bytes starts every other row off a 32-byte boundary,
// and cp.async then moves those rows' sectors twice from L2.
template <int DENSE>
struct TileRow {
  static constexpr int BYTES = DENSE % 64 == 0 ? DENSE : (DENSE + 127) / 128 * 128;
  static constexpr int GROUP = BYTES % 128 == 0 ? 8 : 4;
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a shared-memory tile of ROWB-byte
// rows swizzled in groups of GROUP chunks (TileRow): the chunk's index within its group is
// XORed with a function of row % 8, so the 8 rows of one chunk that an ldmatrix matrix
// reads fall in 8 distinct 16-byte bank slots, and a 32-byte global sector copied by two
// 16-byte cp.async pieces lands in one aligned 32-byte span (its two halves at most
// swapped). GROUP 8 (ROWB a multiple of 128): XOR row % 8. GROUP 4 (ROWB a multiple of 64,
// not of 128: a row starts at slot 0 or 4 of the 8 by its parity): XOR (row / 2) % 4, so
// the 8 rows take 4 x parity + (chunk % 4 XOR (row / 2) % 4), 8 distinct slots. Tiles start
// at a row that is a multiple of 8, 128-byte aligned (align_smem).
template <int ROWB, int GROUP>
__device__ __forceinline__ int tile_at(int row, int chunk) {
  static_assert((GROUP == 8 && ROWB % 128 == 0) || (GROUP == 4 && ROWB % 128 == 64),
                "rows of whole 128-byte lines swizzle in groups of 8 chunks, rows of an "
                "odd number of 64-byte halves in groups of 4");
  return row * ROWB + ((chunk ^ (GROUP == 8 ? row & 7 : (row >> 1) & 3)) << 4);
}

// The address of chunk `even` + `bit` of a tile row, from `lane` = the address of its
// chunk `bit` (tile_at(row, bit), `bit` 0 or 1); `even` an even chunk that unrolling makes
// a constant. Chunk c of the row is at (row's start + ((bit ^ x) << 4)) ^ ((even % GROUP)
// << 4) plus 16 GROUP bytes per group (x the row's swizzle; a row starts GROUP x 16-byte
// aligned): one XOR with a constant per matrix load in the token loop (tile_at's own form
// costs three). Adding 8 rows to `lane` keeps it valid: the swizzle repeats every 8 rows.
template <int GROUP>
__device__ __forceinline__ smem_addr_t chunk_addr(smem_addr_t lane, int even) {
  return (lane ^ (smem_addr_t)((even & (GROUP - 1)) << 4)) + ((even / GROUP) * 16 * GROUP);
}

// Phase: s = Q K^T (16 rows x 8 NT tokens) for one warp: `qw` points at the warp's 16
// query rows (rows of LD elements), `kt` at its first K token row (rows of KROWB bytes,
// laid out by tile_at<KROWB, KGRP>), both in shared memory.
template <typename T, int D, int LD, int NT, int KROWB, int KGRP>
__device__ __forceinline__ void qk_tile(float (&s)[NT][4], const T* qw, const void* kt) {
  static_assert(D % 16 == 0 && NT % 2 == 0, "ldmatrix takes 16-token, 16-column blocks");
  const int lane = threadIdx.x & 31;
  // ldmatrix row addresses: lane l points at row l % 8 of matrix l / 8
  const int lrow = lane & 7, lhi = (lane >> 3) & 1, lq = lane >> 4;
  // this lane's K row of tile pair 0 (token lrow + 8 lq), at its chunk lhi
  const smem_addr_t k_lane = smem_addr(kt) + tile_at<KROWB, KGRP>(lrow + 8 * lq, lhi);
#pragma unroll
  for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned a[4];                              // rows 0-7 / 8-15 x columns +0 / +8
    ldsm_x4<false>(a, qw + (lrow + 8 * lhi) * LD + kk * 16 + 8 * lq);
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
      unsigned b[4];                            // tokens of tiles n / n+1 x columns +0 / +8
      ldsm_x4_at<false>(b, chunk_addr<KGRP>(k_lane + n * 8 * KROWB, 2 * kk));
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_16816<T>(s[n], a, b0);
      mma_16816<T>(s[n + 1], a, b1);
    }
  }
}

// Phase: the online softmax (base 2) of one tile of raw scores, rows grp (s[.][0..1]) and
// grp + 8 (s[.][2..3]); the four lanes of a group hold a row between them. `tok0` is the
// token (in the range) of this lane's first column, 2 tig past the warp's first token;
// tokens at or past `n_tok` are masked, a visible score that is not finite becomes NaN
// and, with SOFT_CAP (the decode partial's variant; the prefix kernel has none), is
// capped at cap_log2 (log2 units): ``logit`` of kernels/common.py.
// Rescales o and l_run by the change of the running max; leaves p in s.
template <int NT, int DT, bool SOFT_CAP = false>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&m_run)[2],
                                             float (&l_run)[2], float (&o)[DT][4], int tok0,
                                             int n_tok, float scale_log2, float cap_log2 = 0.f) {
  float tmax[2] = {-PD_INF, -PD_INF};
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool live = tok0 + n * 8 + (e & 1) < n_tok;
      s[n][e] = live ? logit<SOFT_CAP>(s[n][e] * scale_log2, cap_log2) : -PD_INF;
      tmax[e >> 1] = fmaxf(tmax[e >> 1], s[n][e]);
    }
  float alpha[2], base[2];
  bool grew = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
    tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
    const float m_new = fmaxf(m_run[h], tmax[h]);
    grew |= m_new > m_run[h];
    base[h] = m_new == -PD_INF ? 0.f : m_new;   // avoids (-inf) - (-inf)
    alpha[h] = exp2f(m_run[h] - base[h]);
    m_run[h] = m_new;
    l_run[h] *= alpha[h];
  }
  // A row whose max did not grow has alpha 1 (or 0 on an o of zeros: no visible score
  // yet), so the rescale changes nothing unless some row of the warp grew; past the first
  // tiles that is rare, and skipping it saves DT * 4 multiplies per tile (the call must be
  // warp-uniform).
  if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      o[j][0] *= alpha[0]; o[j][1] *= alpha[0];
      o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
    }
  }
  // the row sums take p in float32 (an exact LSE); P V takes p rounded to T (unbiased)
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = exp2f(s[n][e] - base[e >> 1]);
      s[n][e] = p;
      l_run[e >> 1] += p;
    }
}

// Phase: o += P V for one warp: the p of column tiles 2kk, 2kk+1 (softmax_tile's s) are
// the A operand of 16 tokens; `vt` points at the warp's first V token row (shared memory,
// rows of VROWB bytes laid out by tile_at<VROWB, VGRP>).
template <typename T, int LD, int NT, int DT, int VROWB, int VGRP>
__device__ __forceinline__ void pv_tile(float (&o)[DT][4], const float (&s)[NT][4], const void* vt) {
  static_assert(NT % 2 == 0 && DT % 2 == 0, "ldmatrix takes 16-token, 16-column blocks");
  const int lane = threadIdx.x & 31;
  const int lrow = lane & 7, lhi = (lane >> 3) & 1, lq = lane >> 4;
  // this lane's V row of token block 0 (token lrow + 8 lhi), at its chunk lq
  const smem_addr_t v_lane = smem_addr(vt) + tile_at<VROWB, VGRP>(lrow + 8 * lhi, lq);
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    unsigned a[4];
    a[0] = Pair<T>::pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = Pair<T>::pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = Pair<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = Pair<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int j = 0; j < DT; j += 2) {
      unsigned b[4];                            // tokens +0 / +8 x columns of tiles j / j+1
      ldsm_x4_at<true>(b, chunk_addr<VGRP>(v_lane + kk * 16 * VROWB, j));
      const unsigned b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma_16816<T>(o[j], a, b0);
      mma_16816<T>(o[j + 1], a, b1);
    }
  }
}

// Phase: the full row sums of rows grp and grp + 8 (each lane holds a share of them) in
// every lane of the group.
__device__ __forceinline__ void row_sums(float (&l_run)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
}

}  // namespace pd
"""
