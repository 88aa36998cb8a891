"""The v2 partial kernel: split-KV paged decode, one CTA per (chunk, KV head, q-group).

CUDA dialect, and a Metal (MLX ``metal_kernel``) body below. Contract (``Backend.partial``):
``q [B, Hq, D]``, ``k_pages, v_pages [num_pages, P, Hkv, D]``, CSR arrays, the plan's
``request_indices [C]`` / ``kv_tile_indices [C]`` -> ``v_out [C, Hq, D]`` (each row
normalized by its own softmax denominator; float32 for the merge, or the output dtype
when the plan needs no merge) and ``lse_out [C, Hq]`` float32 in log2 units. An empty
chunk writes zeros and -inf; a head with a non-finite score in the chunk writes NaN
(output row and LSE).

Thread mapping: a K/V row of D elements is read by TPR lanes with VEC elements each
(16-byte pieces); a warp covers 32 / TPR rows ("sub-warps") at once, and a CTA of
NUM_WARPS warps walks the chunk's tokens in steps of U tokens per sub-warp. K/V pieces
stream through a STAGES-deep ``cp.async`` ring in shared memory (STAGES - 1 steps in
flight while one is computed). Each sub-warp keeps an
online-softmax state per query head of its group (QH heads share every K/V load);
states are combined with shuffles inside the warp and through shared memory across
warps. Offsets into the pools are 64-bit.
"""

from __future__ import annotations

from .common import CUDA_COMMON, METAL_COMMON
from .kernel_def import Dtype, KernelDef, KernelSpec, MetalKernel, TemplateValue, metal_fp8

TOKENS_PER_STAGE = 4          # U in the kernels
#: elements a lane takes from one 16-byte piece of a row (the kernels' KV<T>::PER16): all
#: of it, except fp8, whose lanes share each piece in pairs (8 elements each, like
#: float16: kernels/fp8_convert.py)
PIECE_ELEMENTS = {"float16": 8, "bfloat16": 8, "float32": 4, "float8_e4m3fn": 8,
                  "float8_e5m2": 8}


def row_loads(kv_dtype: str, head_dim: int, requested: int = 1) -> int:
    """16-byte loads a lane makes per K/V row (the kernels' RowMap): enough for the row
    to fit in one warp, at least ``requested``."""
    per16 = PIECE_ELEMENTS[kv_dtype]
    min_vec = -(-head_dim // 32)
    return max(-(-min_vec // per16), requested)


def stage_bytes_per_thread(kv_dtype: str, head_dim: int, requested_loads: int = 1) -> int:
    """Ring bytes per thread and stage: 16-byte loads per row x tokens x (K, V)."""
    return TOKENS_PER_STAGE * 2 * row_loads(kv_dtype, head_dim, requested_loads) * 16


def ring_smem_bytes(spec: KernelSpec) -> int:
    """Dynamic shared memory of v2 and v1, the K/V staging ring: per thread, STAGES x 4
    tokens x (K, V) x the 16-byte pieces of its slice of a row."""
    return spec.num_warps * 32 * spec.stages * stage_bytes_per_thread(
        spec.kv_dtype, spec.head_dim, max(1, spec.row_loads))


def warp_threads(spec: KernelSpec) -> int:
    """Threads per block of the kernels whose block is ``NUM_WARPS`` warps."""
    return spec.num_warps * 32

CUDA_BODY = r"""
namespace pd {

// Geometry of one K/V row read: VEC elements per lane (a multiple of one 16-byte load),
// LANES lanes carry data, TPR (a power of two) lanes per row, RPW rows per warp.
// ROW_LOADS asks for at least that many 16-byte loads per lane (fewer lanes per row:
// fewer shuffle levels and less per-row overhead, more registers).
template <typename TKV, int HEAD_DIM, int ROW_LOADS>
struct RowMap {
  static constexpr int PER16 = KV<TKV>::PER16;
  static constexpr int MIN_VEC = (HEAD_DIM + 31) / 32;
  static constexpr int MIN_LOADS = (MIN_VEC + PER16 - 1) / PER16;
  static constexpr int NLOAD = MIN_LOADS > ROW_LOADS ? MIN_LOADS : ROW_LOADS;
  static constexpr int VEC = NLOAD * PER16;
  static constexpr int LANES = (HEAD_DIM + VEC - 1) / VEC;
  static constexpr int TPR = next_pow2(LANES);
  static constexpr int RPW = 32 / TPR;
  static_assert(HEAD_DIM % PER16 == 0, "head_dim must fill whole 16-byte vectors");
  static_assert(TPR <= 32, "a row must fit in one warp");
};

// Dynamic shared memory: the per-thread staging ring of the K/V pipeline.
extern __shared__ __align__(16) uint4 pd_stage_ring[];

// Ring slot (stage, u, kv, j) of this thread.
template <int U, int NLOAD, int THREADS>
__device__ __forceinline__ uint4* ring_slot(int stage, int u, int kv, int j) {
  return pd_stage_ring + (((stage * U + u) * 2 + kv) * NLOAD + j) * THREADS + threadIdx.x;
}

// Phase: the ring fill. Start the copies of this thread's pieces of the K and V rows of
// step `step`'s U tokens into ring stage step % STAGES, and commit them as one group (a
// step past the range copies nothing but still commits: one group per step keeps the
// wait counts of the loop exact).
template <typename TKV, int PAGE_SIZE, int STAGES, int U, int NSW, int NLOAD, int THREADS>
__device__ __forceinline__ void issue_stage(
    int step, int n_steps, int n_tok, int a_begin, int sw, bool active,
    const TKV* __restrict__ k_pages, const TKV* __restrict__ v_pages,
    const int* __restrict__ page_ids, long long page_stride, long long row_stride,
    long long head_off) {
  constexpr long long STEP = (long long)NSW * U;                      // tokens per stage
  const int stage = step % STAGES;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = step * (int)STEP + u * NSW + sw;       // token index within the range
    const bool ok = step < n_steps && i < n_tok;
    const TKV* kp = k_pages;
    const TKV* vp = v_pages;
    if (ok) {
      const int a = a_begin + i;
      const long long off = (long long)page_ids[a / PAGE_SIZE] * page_stride
                            + (long long)((a % PAGE_SIZE) * row_stride) + head_off;
      kp += off;
      vp += off;
    }
#pragma unroll
    for (int j = 0; j < NLOAD; ++j) {
      cp_async16(ring_slot<U, NLOAD, THREADS>(stage, u, 0, j), kv_piece(kp, j), ok && active);
      cp_async16(ring_slot<U, NLOAD, THREADS>(stage, u, 1, j), kv_piece(vp, j), ok && active);
    }
  }
  cp_async_commit();
}

// Phase: this lane's partial q.k logits s[g][u] (over its VEC elements) of the QH heads
// for the U tokens in ring stage `stage`; the softmax phases reduce them across the row.
// sel0: this lane's first load index in its row (col * NLOAD: which half of a shared
// fp8 piece is its own).
template <typename TKV, int QH, int U, int VEC, int NLOAD, int THREADS>
__device__ __forceinline__ void scores(const float (&qf)[QH][VEC], int stage, int sel0,
                                       float (&s)[QH][U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float kf[VEC];
#pragma unroll
    for (int j = 0; j < NLOAD; ++j)
      widen_piece<TKV>(*ring_slot<U, NLOAD, THREADS>(stage, u, 0, j), kf + j * KV<TKV>::PER16, sel0 + j);
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      float x = 0.f;
#pragma unroll
      for (int i = 0; i < VEC; ++i) x = fmaf(qf[g][i], kf[i], x);
      s[g][u] = x;
    }
  }
}

// Phase (TRANSPOSE): reduce the partial logits by head transposition, run the online
// softmax of head col / HLANES (state m_h, l_h) over the step's tokens and rescale every
// head's accumulators by its alpha (shuffled in from a lane of that head). Leaves p of
// this lane's head in s[0][u].
template <bool SOFT_CAP, int QH, int U, int VEC, int TPR, int HLANES, int NSW>
__device__ __forceinline__ void softmax_transposed(
    float (&s)[QH][U], float& m_h, float& l_h, float (&acc)[QH][VEC],
    int step, int sw, int n_tok, int col, int sub0, float cap) {
  constexpr long long STEP = (long long)NSW * U;
#pragma unroll
  for (int half = QH / 2, off = TPR / 2; half >= 1; half >>= 1, off >>= 1) {
    const bool up = (col & off) != 0;        // keep heads [half, 2 half) of the range
#pragma unroll
    for (int h = 0; h < half; ++h)
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float give = up ? s[h][u] : s[h + half][u];
        const float keep = up ? s[h + half][u] : s[h][u];
        s[h][u] = keep + __shfl_xor_sync(0xffffffffu, give, off);
      }
  }
#pragma unroll
  for (int off = HLANES / 2; off >= 1; off >>= 1)
#pragma unroll
    for (int u = 0; u < U; ++u) s[0][u] += __shfl_xor_sync(0xffffffffu, s[0][u], off);
  float mx = m_h;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool ok = step * (int)STEP + u * NSW + sw < n_tok;
    s[0][u] = ok ? logit<SOFT_CAP>(s[0][u], cap) : -PD_INF;
    mx = fmaxf(mx, s[0][u]);
  }
  const float ref = mx == -PD_INF ? 0.f : mx;   // avoids (-inf) - (-inf)
  const float alpha = exp2f(m_h - ref);
  l_h *= alpha;
  m_h = mx;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    s[0][u] = exp2f(s[0][u] - ref);
    l_h += s[0][u];
  }
#pragma unroll
  for (int g = 0; g < QH; ++g) {
    const float a = __shfl_sync(0xffffffffu, alpha, sub0 + g * HLANES);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] *= a;
  }
}

// Phase (other QH): reduce each (token, head) logit by a butterfly over the row's lanes,
// run the online softmax of every head (state m[g], l[g]) and rescale its accumulators.
// Leaves p in s[g][u].
template <bool SOFT_CAP, int QH, int U, int VEC, int TPR, int NSW>
__device__ __forceinline__ void softmax_per_head(
    float (&s)[QH][U], float (&m)[QH], float (&l)[QH], float (&acc)[QH][VEC],
    int step, int sw, int n_tok, float cap) {
  constexpr long long STEP = (long long)NSW * U;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool ok = step * (int)STEP + u * NSW + sw < n_tok;
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      const float x = group_sum<TPR>(s[g][u]);
      s[g][u] = ok ? logit<SOFT_CAP>(x, cap) : -PD_INF;
    }
  }
#pragma unroll
  for (int g = 0; g < QH; ++g) {
    float mx = m[g];
#pragma unroll
    for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[g][u]);
    const float ref = mx == -PD_INF ? 0.f : mx;   // avoids (-inf) - (-inf)
    const float alpha = exp2f(m[g] - ref);
    l[g] *= alpha;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] *= alpha;
    m[g] = mx;
    // l[g] takes the p in token order, as the transposed l_h does
#pragma unroll
    for (int u = 0; u < U; ++u) {
      s[g][u] = exp2f(s[g][u] - ref);
      l[g] += s[g][u];
    }
  }
}

// The softmax weight of head g for token u: shuffled in from a lane of head g under
// TRANSPOSE (its p was computed once, there), else this lane's own.
template <bool TRANSPOSE, int QH, int U, int HLANES>
__device__ __forceinline__ float v_weight(const float (&s)[QH][U], int g, int u, int sub0) {
  if constexpr (TRANSPOSE) return __shfl_sync(0xffffffffu, s[0][u], sub0 + g * HLANES);
  else return s[g][u];
}

// Phase: acc[g] += p(g, u) * v_u over the U tokens in ring stage `stage`, in token order.
template <typename TKV, bool TRANSPOSE, int QH, int U, int VEC, int NLOAD, int THREADS, int HLANES>
__device__ __forceinline__ void accumulate_v(float (&acc)[QH][VEC], const float (&s)[QH][U],
                                             int stage, int sub0, int sel0) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float vf[VEC];
#pragma unroll
    for (int j = 0; j < NLOAD; ++j)
      widen_piece<TKV>(*ring_slot<U, NLOAD, THREADS>(stage, u, 1, j), vf + j * KV<TKV>::PER16, sel0 + j);
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      const float p = v_weight<TRANSPOSE, QH, U, HLANES>(s, g, u, sub0);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
    }
  }
}

// Phase: combine the RPW sub-warp states of this warp (lanes TPR, 2*TPR, ... apart).
template <int QH, int VEC, int TPR>
__device__ __forceinline__ void combine_subwarps(float (&m)[QH], float (&l)[QH], float (&acc)[QH][VEC]) {
#pragma unroll
  for (int off = TPR; off < 32; off <<= 1) {
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[g], off);
      const float mx = fmaxf(m[g], mo);
      const float ref = mx == -PD_INF ? 0.f : mx;
      const float a = exp2f(m[g] - ref), b = exp2f(mo - ref);
      l[g] = l[g] * a + lo * b;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], off);
        acc[g][i] = acc[g][i] * a + ao * b;
      }
      m[g] = mx;
    }
  }
}

// Phase: combine the warps' states through shared memory and write the normalized rows
// and log2 LSEs. With SINK (a final store only: the output, never a merged partial) the
// sink of head h0 + g joins as one more state of weight 1 at m = sinks[h0 + g] * log2(e)
// and no value. v_scale multiplies the normalized rows (an fp8 pool's V scale, 1
// otherwise: attention is linear in V and a sink has no value, so every partial may
// carry it and the merge stays exact). Every thread of the CTA must call it (it holds a
// barrier).
template <typename TO, int HEAD_DIM, int QH, int VEC, int NUM_WARPS, bool SINK>
__device__ __forceinline__ void combine_warps_and_store(
    const float (&m)[QH], const float (&l)[QH], const float (&acc)[QH][VEC],
    int warp, int sub, int col, bool active, int d0, const float* __restrict__ sinks, int h0,
    float v_scale, TO* __restrict__ out_v, float* __restrict__ out_lse, long long out_row, long long out_lse_idx) {
  __shared__ float sm_m[NUM_WARPS][QH];
  __shared__ float sm_l[NUM_WARPS][QH];
  __shared__ float sm_acc[NUM_WARPS][QH][HEAD_DIM];
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      if (col == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
      if (active)
#pragma unroll
        for (int i = 0; i < VEC; ++i)
          if (d0 + i < HEAD_DIM) sm_acc[warp][g][d0 + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < QH * HEAD_DIM; e += NUM_WARPS * 32) {
    const int g = e / HEAD_DIM, d = e % HEAD_DIM;
    float mx = -PD_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
    float sk = -PD_INF;
    if constexpr (SINK) {
      sk = sinks[h0 + g] * PD_LOG2E;
      mx = fmaxf(mx, sk);            // a NaN sink is skipped here and poisons den below
    }
    const float ref = mx == -PD_INF ? 0.f : mx;
    float num = 0.f, den = SINK ? exp2f(sk - ref) : 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = exp2f(sm_m[w][g] - ref);
      num = fmaf(wt, sm_acc[w][g][d], num);
      den = fmaf(wt, sm_l[w][g], den);
    }
    // den is 0 for an empty range and NaN when a score was not finite (a warp's NaN sum
    // survives its weight of 0): NaN output and LSE, never the empty answer
    const bool live = !(den <= 0.f);
    out_v[out_row + (long long)g * HEAD_DIM + d] = from_float<TO>(live ? num / den * v_scale : 0.f);
    if (d == 0) out_lse[out_lse_idx + g] = live ? mx + log2f(den) : -PD_INF;
  }
}

// Attend the QH query heads h0 .. h0+QH-1 of request r to its visible tokens
// [t_begin, t_end) under KV head kvh; write normalized rows to out_v[out_row + g*D] and
// log2 LSEs to out_lse[out_lse_idx + g]. Every thread of the CTA must call it.
// K/V rows stream through a STAGES-deep cp.async ring in shared memory: each thread
// copies exactly the 16-byte pieces it later reads, so only its own cp.async groups are
// waited for and no barrier is needed inside the loop.
// SOFT_CAP: logits capped at cap_log2 (log2 units); SINK: the heads' sinks join the
// final store (only where it writes the output). An fp8 TKV is widened in registers
// (widen_piece<fp8_*>); its K scale is folded into scale_log2 by the host, its V scale is
// v_scale.
template <typename TQ, typename TKV, typename TO, int HEAD_DIM, int PAGE_SIZE, int QH, int NUM_WARPS, int STAGES, int ROW_LOADS, bool SOFT_CAP, bool SINK>
__device__ __forceinline__ void attend_range(
    const TQ* __restrict__ q, const TKV* __restrict__ k_pages, const TKV* __restrict__ v_pages,
    const int* __restrict__ page_ids, long long fpo, long long t_begin, long long t_end,
    int r, int kvh, int h0, int num_qo_heads, int num_kv_heads, float scale_log2,
    float cap_log2, const float* __restrict__ sinks, float v_scale,
    TO* __restrict__ out_v, float* __restrict__ out_lse, long long out_row, long long out_lse_idx) {
  using M = RowMap<TKV, HEAD_DIM, ROW_LOADS>;
  constexpr int VEC = M::VEC, NLOAD = M::NLOAD, TPR = M::TPR, RPW = M::RPW;
  constexpr int NSW = NUM_WARPS * RPW;           // sub-warps per CTA
  // tokens per sub-warp per stage: 4, or 2 at 8 heads per CTA (register budget: the QH x U
  // logits and QH x VEC accumulators per lane; measured on the H200, 2026-11-30: 1.8x
  // faster at QH 8, 5% slower at QH 7); the ring is sized for 4
  constexpr int U = QH >= 8 ? 2 : 4;
  constexpr int THREADS = NUM_WARPS * 32;
  static_assert(STAGES >= 2, "the pipeline needs at least two stages");

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = lane / TPR, col = lane % TPR;
  const bool active = col < M::LANES;
  const int d0 = col * VEC;
  const int sw = warp * RPW + sub;

  float qf[QH][VEC];
#pragma unroll
  for (int g = 0; g < QH; ++g)
#pragma unroll
    for (int i = 0; i < VEC; ++i)
      qf[g][i] = (active && d0 + i < HEAD_DIM)
                     ? to_float(q[((long long)r * num_qo_heads + h0 + g) * HEAD_DIM + d0 + i]) * scale_log2
                     : 0.f;
  float m[QH], l[QH], acc[QH][VEC];
#pragma unroll
  for (int g = 0; g < QH; ++g) {
    m[g] = -PD_INF; l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }

  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;   // elements per token
  const long long head_off = (long long)kvh * HEAD_DIM + d0;
  constexpr long long STEP = (long long)NSW * U;                      // tokens per stage
  const int n_steps = t_end > t_begin ? (int)((t_end - t_begin + STEP - 1) / STEP) : 0;
  // Token positions relative to the first page of the request fit in 32 bits (a request
  // holds fewer than 2^31 tokens); only the pool offset needs 64 bits.
  const int a_begin = (int)(fpo + t_begin), n_tok = (int)(t_end - t_begin);
  const long long page_stride = (long long)PAGE_SIZE * row_stride;
  auto issue = [&](int step) {
    issue_stage<TKV, PAGE_SIZE, STAGES, U, NSW, NLOAD, THREADS>(
        step, n_steps, n_tok, a_begin, sw, active, k_pages, v_pages, page_ids, page_stride,
        row_stride, head_off);
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  // With a power-of-two QH the per-token head sums are reduced by transposition: each
  // shuffle level hands half of a lane's head partials to its partner, so after log2(QH)
  // levels lane `col` holds head HL = col / (TPR / QH) alone and finishes with a butterfly
  // over its TPR / QH lanes; the softmax of that head runs once per lane (not once per
  // head in every lane), and alpha / p reach every lane by indexed shuffles. Other QH
  // (3, 5, 6, 7) keep one full butterfly per (token, head).
  constexpr bool TRANSPOSE = (QH & (QH - 1)) == 0 && QH <= TPR;
  constexpr int HLANES = TRANSPOSE ? TPR / QH : TPR;   // lanes sharing one head's sums
  const int sub0 = lane - col;                         // first lane of this sub-warp
  float m_h = -PD_INF, l_h = 0.f;   // TRANSPOSE: the state of head col / HLANES

  for (int step = 0; step < n_steps; ++step) {
    issue(step + STAGES - 1);
    cp_async_wait<STAGES - 1>();                 // this thread's copies of `step` landed
    const int stage = step % STAGES;
    float s[QH][U];
    scores<TKV, QH, U, VEC, NLOAD, THREADS>(qf, stage, col * NLOAD, s);
    if constexpr (TRANSPOSE)
      softmax_transposed<SOFT_CAP, QH, U, VEC, TPR, HLANES, NSW>(s, m_h, l_h, acc, step, sw, n_tok, col, sub0, cap_log2);
    else
      softmax_per_head<SOFT_CAP, QH, U, VEC, TPR, NSW>(s, m, l, acc, step, sw, n_tok, cap_log2);
    accumulate_v<TKV, TRANSPOSE, QH, U, VEC, NLOAD, THREADS, HLANES>(acc, s, stage, sub0, col * NLOAD);
  }
  if constexpr (TRANSPOSE) {
    // every lane of a sub-warp takes each head's state from a lane that reduced it (the
    // sub-warp's lanes of head g saw the same tokens: their states are equal)
#pragma unroll
    for (int g = 0; g < QH; ++g) {
      m[g] = __shfl_sync(0xffffffffu, m_h, sub0 + g * HLANES);
      l[g] = __shfl_sync(0xffffffffu, l_h, sub0 + g * HLANES);
    }
  }
  cp_async_wait<0>();                              // no copy may outlive the loop

  combine_subwarps<QH, VEC, TPR>(m, l, acc);
  combine_warps_and_store<TO, HEAD_DIM, QH, VEC, NUM_WARPS, SINK>(
      m, l, acc, warp, sub, col, active, d0, sinks, h0, v_scale, out_v, out_lse, out_row, out_lse_idx);
}

}  // namespace pd

// grid: (C chunks, Hkv * q_groups); block: NUM_WARPS * 32 threads.
template <typename TQ, typename TKV, typename TO, int HEAD_DIM, int PAGE_SIZE, int QH, int NUM_WARPS, int STAGES, int ROW_LOADS, bool SOFT_CAP, bool SINK>
__global__ void __launch_bounds__(NUM_WARPS * 32) pd_decode_v2_partial(
    const TQ* __restrict__ q,                    // [B, Hq, D]
    const TKV* __restrict__ k_pages,             // [num_pages, P, Hkv, D]
    const TKV* __restrict__ v_pages,             // [num_pages, P, Hkv, D]
    const int* __restrict__ indices,             // [total_pages]
    const int* __restrict__ indptr,              // [B + 1]
    const int* __restrict__ last_page_len,       // [B]
    const int* __restrict__ first_page_offset,   // [B]
    const int* __restrict__ request_indices,     // [C]
    const int* __restrict__ kv_tile_indices,     // [C]
    const float* __restrict__ sinks,             // [Hq] natural units with SINK (else unread)
    TO* __restrict__ v_out,                      // [C, Hq, D]
    float* __restrict__ lse_out,                 // [C, Hq], log2
    int num_qo_heads, int num_kv_heads, int q_groups, int pages_per_chunk, float scale_log2,
    float soft_cap_log2, float v_scale) {
  pd::allow_dependents();             // the merge may be scheduled now; it waits for this grid
  const pd::GridCell cell = pd::grid_cell((unsigned)q_groups);
  const int c = (int)cell.chunk, kvh = (int)cell.kv_head, qg = (int)cell.sub;
  const int h0 = kvh * (num_qo_heads / num_kv_heads) + qg * QH;
  const int r = request_indices[c];
  const long long tile = kv_tile_indices[c] < 0 ? 0 : kv_tile_indices[c];
  const long long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long long fpo = first_page_offset[r];
  const pd::TokenRange range = pd::chunk_tokens<PAGE_SIZE>(npages, last_page_len[r], fpo, tile,
                                                          pages_per_chunk);
  pd::attend_range<TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, QH, NUM_WARPS, STAGES, ROW_LOADS, SOFT_CAP, SINK>(
      q, k_pages, v_pages, indices + pb, fpo, range.t_begin, range.t_end, r, kvh, h0, num_qo_heads,
      num_kv_heads, scale_log2, soft_cap_log2, sinks, v_scale, v_out, lse_out,
      ((long long)c * num_qo_heads + h0) * HEAD_DIM,
      (long long)c * num_qo_heads + h0);
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# MLX ``metal_kernel`` dialect: ``METAL_HEADER`` is the ``header`` argument, ``METAL_SOURCE``
# the body (MLX generates the signature). Same thread mapping, chunk arithmetic and
# accumulation order as the CUDA kernel; without cp.async, K/V pieces are loaded straight
# from device memory (no staging ring). The per-token reduction is CUDA's too: with a
# power-of-two QH <= TPR the head partials are transposed across the lanes of a row
# (simd_shuffle_xor), each lane runs the online softmax of one head, and alpha / p / the
# final m, l reach the other lanes by indexed simd_shuffle; other QH keep one butterfly
# (group_sum) per (token, head). U = 2 tokens per sub-group per step at QH >= 8, else 4,
# as in CUDA. Inputs (in order): q, k_pages, v_pages, indices, indptr, last_page_len,
# first_page_offset, request_indices, kv_tile_indices, sinks ([Hq] float32 with SINK, a
# stand-in otherwise), num_qo_heads, num_kv_heads, q_groups, pages_per_chunk (0-d int32),
# scale_log2, soft_cap_log2, v_scale (0-d float32); outputs: v_out, lse_out. Template
# arguments, in order: TQ, TKV, TO (dtypes; uint8_t for an fp8 pool), HEAD_DIM,
# PAGE_SIZE, QH, NUM_WARPS, SOFT_CAP, SINK, KV_FP8 (the fp8 format, 0 for none:
# ``kernel_def.metal_fp8``). Launch: grid (C * NUM_WARPS * 32, Hkv * q_groups, 1)
# threads, threadgroup (NUM_WARPS * 32, 1, 1).
METAL_INPUTS = ("q", "k_pages", "v_pages", "indices", "indptr", "last_page_len",
                "first_page_offset", "request_indices", "kv_tile_indices", "sinks",
                "num_qo_heads", "num_kv_heads", "q_groups", "pages_per_chunk", "scale_log2",
                "soft_cap_log2", "v_scale")
METAL_OUTPUTS = ("v_out", "lse_out")

METAL_ATTEND = r"""
namespace pd {

// Geometry of one K/V row read: VEC elements per lane (whole 16-byte pieces, loaded as
// 4-element vectors), LANES lanes carry data, TPR (a power of two) lanes per row, RPW rows
// per SIMD group.
template <typename TKV, int HEAD_DIM>
struct RowMap {
  // elements per lane and 16-byte piece; 8 for fp8 (uint8_t) pools, as for half (16
  // would double a lane's q and accumulator registers, as in CUDA)
  static constexpr int PER16 = sizeof(TKV) == 1 ? 8 : 16 / int(sizeof(TKV));
  static constexpr int MIN_VEC = (HEAD_DIM + 31) / 32;
  static constexpr int VEC = MIN_VEC <= PER16 ? PER16 : ((MIN_VEC + PER16 - 1) / PER16) * PER16;
  static constexpr int LANES = (HEAD_DIM + VEC - 1) / VEC;
  static constexpr int TPR = next_pow2(LANES);
  static constexpr int RPW = 32 / TPR;
  static_assert(HEAD_DIM % PER16 == 0, "head_dim must fill whole 16-byte vectors");
  static_assert(TPR <= 32, "a row must fit in one SIMD group");
};

// Threadgroup memory of the cross-SIMD-group combine: HPR heads per round, so that the
// accumulators stay within half of Metal's 32 KB (one round when they fit, as in CUDA).
template <int HEAD_DIM, int QH, int NUM_WARPS>
struct Combine {
  static constexpr int HPR = NUM_WARPS * QH * HEAD_DIM * 4 <= 16384 ? QH : 1;
  static constexpr int STATE = NUM_WARPS * QH;
  static constexpr int ACC = NUM_WARPS * HPR * HEAD_DIM;
};

// The phases below take the accumulators' element type A from the caller (float; a
// deduced type rather than a fixed one, so that attend_range's declaration alone decides
// it).

// Phase: the pool offset of this thread's piece of each of the step's U tokens and whether
// the token is in the range (the K/V loads are predicated on it; no staging ring).
template <int PAGE_SIZE, int U, int NSW, typename IP>
inline void token_offsets(IP page_ids, long fpo, long t_begin, long t_end, long step, int sw,
                          long row_stride, long head_off, thread long (&kv_off)[U],
                          thread bool (&ok)[U]) {
  constexpr long STEP = long(NSW) * U;                      // tokens per step
  for (int u = 0; u < U; ++u) {
    const long t = t_begin + step * STEP + long(u) * NSW + sw;
    ok[u] = t < t_end;
    kv_off[u] = 0;
    if (ok[u]) {
      const long a = fpo + t;
      const long page = page_ids[a / PAGE_SIZE];
      kv_off[u] = (page * PAGE_SIZE + a % PAGE_SIZE) * row_stride + head_off;
    }
  }
}

// Phase: this lane's partial q.k logits s[g][u] (over its VEC elements) of the QH heads
// for the step's U tokens; the softmax phases reduce them across the row. FP8: the pool's
// fp8 format (0: none; load4kv widens the bytes in registers).
template <int FP8, int QH, int U, int VEC, typename KP>
inline void scores(const thread float (&qf)[QH][VEC], KP k_pages, const thread long (&kv_off)[U],
                   const thread bool (&ok)[U], bool active, thread float (&s)[QH][U]) {
  for (int u = 0; u < U; ++u) {
    float kf[VEC];
    for (int j = 0; j < VEC / 4; ++j) {
      const float4 x = (ok[u] && active) ? load4kv<FP8>(k_pages + kv_off[u] + 4 * j) : float4(0.0f);
      kf[4 * j] = x.x; kf[4 * j + 1] = x.y; kf[4 * j + 2] = x.z; kf[4 * j + 3] = x.w;
    }
    for (int g = 0; g < QH; ++g) {
      float x = 0.0f;
      for (int i = 0; i < VEC; ++i) x = fma(qf[g][i], kf[i], x);
      s[g][u] = x;
    }
  }
}

// Phase (TRANSPOSE): reduce the partial logits by head transposition, run the online
// softmax of head col / HLANES (state m_h, l_h) over the step's tokens and rescale every
// head's accumulators by its alpha (shuffled in from a lane of that head). Leaves p of
// this lane's head in s[0][u].
template <bool SOFT_CAP, int QH, int U, int VEC, int TPR, int HLANES, typename A>
inline void softmax_transposed(thread float (&s)[QH][U], thread float& m_h, thread float& l_h,
                               thread A (&acc)[QH][VEC], const thread bool (&ok)[U], int col,
                               int sub0, float cap) {
  // hn: the number of heads kept per level (`half` in CUDA, a type name in Metal)
  for (int hn = QH / 2, off = TPR / 2; hn >= 1; hn >>= 1, off >>= 1) {
    const bool up = (col & off) != 0;        // keep heads [hn, 2 hn) of the range
    for (int h = 0; h < hn; ++h)
      for (int u = 0; u < U; ++u) {
        const float give = up ? s[h][u] : s[h + hn][u];
        const float keep = up ? s[h + hn][u] : s[h][u];
        s[h][u] = keep + simd_shuffle_xor(give, ushort(off));
      }
  }
  for (int off = HLANES / 2; off >= 1; off >>= 1)
    for (int u = 0; u < U; ++u) s[0][u] += simd_shuffle_xor(s[0][u], ushort(off));
  float mx = m_h;
  for (int u = 0; u < U; ++u) {
    s[0][u] = ok[u] ? logit<SOFT_CAP>(s[0][u], cap) : -INFINITY;
    mx = fmax(mx, s[0][u]);
  }
  const float ref = mx == -INFINITY ? 0.0f : mx;   // avoids (-inf) - (-inf)
  const float alpha = exp2(m_h - ref);
  l_h *= alpha;
  m_h = mx;
  for (int u = 0; u < U; ++u) {
    s[0][u] = exp2(s[0][u] - ref);
    l_h += s[0][u];
  }
  for (int g = 0; g < QH; ++g) {
    const float a = simd_shuffle(alpha, ushort(sub0 + g * HLANES));
    for (int i = 0; i < VEC; ++i) acc[g][i] *= a;
  }
}

// Phase (other QH): reduce each (token, head) logit by a butterfly over the row's lanes,
// run the online softmax of every head (state m[g], l[g]) and rescale its accumulators.
// Leaves p in s[g][u].
template <bool SOFT_CAP, int QH, int U, int VEC, int TPR, typename A>
inline void softmax_per_head(thread float (&s)[QH][U], thread float (&m)[QH], thread float (&l)[QH],
                             thread A (&acc)[QH][VEC], const thread bool (&ok)[U], float cap) {
  for (int u = 0; u < U; ++u) {
    for (int g = 0; g < QH; ++g) {
      const float x = group_sum<TPR>(s[g][u]);
      s[g][u] = ok[u] ? logit<SOFT_CAP>(x, cap) : -INFINITY;
    }
  }
  for (int g = 0; g < QH; ++g) {
    float mx = m[g];
    for (int u = 0; u < U; ++u) mx = fmax(mx, s[g][u]);
    const float ref = mx == -INFINITY ? 0.0f : mx;   // avoids (-inf) - (-inf)
    const float alpha = exp2(m[g] - ref);
    l[g] *= alpha;
    for (int i = 0; i < VEC; ++i) acc[g][i] *= alpha;
    m[g] = mx;
    // l[g] takes the p in token order, as the transposed l_h does
    for (int u = 0; u < U; ++u) {
      s[g][u] = exp2(s[g][u] - ref);
      l[g] += s[g][u];
    }
  }
}

// The softmax weight of head g for token u: shuffled in from a lane of head g under
// TRANSPOSE (its p was computed once, there), else this lane's own. A plain `if` on the
// constant, folded (see TRANSPOSE in attend_range).
template <bool TRANSPOSE, int QH, int U, int HLANES>
inline float v_weight(const thread float (&s)[QH][U], int g, int u, int sub0) {
  if (TRANSPOSE) return simd_shuffle(s[0][u], ushort(sub0 + g * HLANES));
  return s[g][u];
}

// Phase: acc[g] += p(g, u) * v_u over the step's U tokens, in token order.
template <int FP8, bool TRANSPOSE, int QH, int U, int VEC, int HLANES, typename KP, typename A>
inline void accumulate_v(thread A (&acc)[QH][VEC], const thread float (&s)[QH][U], KP v_pages,
                         const thread long (&kv_off)[U], const thread bool (&ok)[U], bool active,
                         int sub0) {
  for (int u = 0; u < U; ++u) {
    float vf[VEC];
    for (int j = 0; j < VEC / 4; ++j) {
      const float4 x = (ok[u] && active) ? load4kv<FP8>(v_pages + kv_off[u] + 4 * j) : float4(0.0f);
      vf[4 * j] = x.x; vf[4 * j + 1] = x.y; vf[4 * j + 2] = x.z; vf[4 * j + 3] = x.w;
    }
    for (int g = 0; g < QH; ++g) {
      const float p = v_weight<TRANSPOSE, QH, U, HLANES>(s, g, u, sub0);
      for (int i = 0; i < VEC; ++i) acc[g][i] = fma(p, vf[i], acc[g][i]);
    }
  }
}

// Phase: combine the RPW sub-group states of this SIMD group (lanes TPR, 2*TPR, ... apart).
template <int QH, int VEC, int TPR, typename A>
inline void combine_subwarps(thread float (&m)[QH], thread float (&l)[QH], thread A (&acc)[QH][VEC]) {
  for (ushort off = TPR; off < 32; off <<= 1) {
    for (int g = 0; g < QH; ++g) {
      const float mo = simd_shuffle_xor(m[g], off);
      const float lo = simd_shuffle_xor(l[g], off);
      const float mx = fmax(m[g], mo);
      const float ref = mx == -INFINITY ? 0.0f : mx;
      const float a = exp2(m[g] - ref), b = exp2(mo - ref);
      l[g] = l[g] * a + lo * b;
      for (int i = 0; i < VEC; ++i) {
        const float ao = simd_shuffle_xor(acc[g][i], off);
        acc[g][i] = acc[g][i] * a + ao * b;
      }
      m[g] = mx;
    }
  }
}

// Phase: combine the SIMD groups' states through threadgroup memory, CB::HPR heads per
// round, and write the normalized rows (times v_scale) and log2 LSEs; with SINK the sink
// of head h0 + g joins as one more state (weight 1 at sinks[h0 + g] * log2(e), no value),
// as in CUDA. Every thread of the threadgroup must call it (it holds barriers).
template <typename TO, int HEAD_DIM, int QH, int VEC, int NUM_WARPS, bool SINK, typename A,
          typename SP>
inline void combine_warps_and_store(
    const thread float (&m)[QH], const thread float (&l)[QH], const thread A (&acc)[QH][VEC],
    threadgroup float* sm_m, threadgroup float* sm_l, threadgroup float* sm_acc,
    uint tid, uint warp, int sub, int col, bool active, int d0, SP sinks, int h0,
    float v_scale, device TO* out_v, device float* out_lse, long out_row, long out_lse_idx) {
  typedef Combine<HEAD_DIM, QH, NUM_WARPS> CB;
  constexpr int THREADS = NUM_WARPS * 32;
  if (sub == 0 && col == 0) {
    for (int g = 0; g < QH; ++g) {
      sm_m[warp * QH + g] = m[g];
      sm_l[warp * QH + g] = l[g];
    }
  }
  for (int g0 = 0; g0 < QH; g0 += CB::HPR) {
    if (g0 > 0) threadgroup_barrier(mem_flags::mem_threadgroup);   // previous round read
    if (sub == 0 && active) {
      for (int gg = 0; gg < CB::HPR; ++gg)
        for (int i = 0; i < VEC; ++i)
          if (d0 + i < HEAD_DIM) sm_acc[(warp * CB::HPR + gg) * HEAD_DIM + d0 + i] = acc[g0 + gg][i];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = int(tid); e < CB::HPR * HEAD_DIM; e += THREADS) {
      const int gg = e / HEAD_DIM, d = e % HEAD_DIM, g = g0 + gg;
      float mx = -INFINITY;
      for (int w = 0; w < NUM_WARPS; ++w) mx = fmax(mx, sm_m[w * QH + g]);
      float sk = -INFINITY;
      if (SINK) {
        sk = float(sinks[h0 + g]) * PD_LOG2E;
        mx = fmax(mx, sk);           // a NaN sink is skipped here and poisons den below
      }
      const float ref = mx == -INFINITY ? 0.0f : mx;
      float num = 0.0f, den = SINK ? exp2(sk - ref) : 0.0f;
      for (int w = 0; w < NUM_WARPS; ++w) {
        const float wt = exp2(sm_m[w * QH + g] - ref);
        num = fma(wt, sm_acc[(w * CB::HPR + gg) * HEAD_DIM + d], num);
        den = fma(wt, sm_l[w * QH + g], den);
      }
      // den is 0 for an empty range and NaN when a score was not finite (as in CUDA)
      const bool live = !(den <= 0.0f);
      out_v[out_row + long(g) * HEAD_DIM + d] = from_float<TO>(live ? num / den * v_scale : 0.0f);
      if (d == 0) out_lse[out_lse_idx + g] = live ? mx + log2(den) : -INFINITY;
    }
  }
}

// Attend the QH query heads h0 .. h0+QH-1 of request r to its visible tokens
// [t_begin, t_end) under KV head kvh; write normalized rows to out_v[out_row + g*D] and
// log2 LSEs to out_lse[out_lse_idx + g]. Every thread of the threadgroup must call it.
// SOFT_CAP: logits capped at cap_log2 (log2 units); SINK: the heads' sinks join the
// final store (only where it writes the output). KV_FP8: the fp8 format of a uint8_t
// pool (0: none), widened in registers; its K scale is in scale_log2, its V scale v_scale.
template <typename TQ, typename TKV, typename TO, int HEAD_DIM, int PAGE_SIZE, int QH,
          int NUM_WARPS, bool SOFT_CAP, bool SINK, int KV_FP8, typename QP, typename KP,
          typename IP, typename SP>
inline void attend_range(
    QP q, KP k_pages, KP v_pages, IP page_ids, long fpo, long t_begin, long t_end,
    int r, int kvh, int h0, int num_qo_heads, int num_kv_heads, float scale_log2,
    float cap_log2, SP sinks, float v_scale, device TO* out_v, device float* out_lse, long out_row,
    long out_lse_idx,
    threadgroup float* sm_m, threadgroup float* sm_l, threadgroup float* sm_acc,
    uint tid, uint lane, uint warp) {
  typedef RowMap<TKV, HEAD_DIM> M;
  constexpr int VEC = M::VEC, TPR = M::TPR, RPW = M::RPW;
  constexpr int NSW = NUM_WARPS * RPW;           // sub-groups per threadgroup
  // tokens per sub-group per step: 4, or 2 at 8 heads per threadgroup (register budget:
  // the QH x U logits and QH x VEC accumulators per lane), as in CUDA (the rule was
  // measured there, not on an Apple GPU)
  constexpr int U = QH >= 8 ? 2 : 4;

  const int sub = int(lane) / TPR, col = int(lane) % TPR;
  const bool active = col < M::LANES;
  const int d0 = col * VEC;
  const int sw = int(warp) * RPW + sub;

  float qf[QH][VEC];
  for (int g = 0; g < QH; ++g)
    for (int i = 0; i < VEC; ++i)
      qf[g][i] = (active && d0 + i < HEAD_DIM)
                     ? to_float(q[(long(r) * num_qo_heads + h0 + g) * HEAD_DIM + d0 + i]) * scale_log2
                     : 0.0f;
  float m[QH], l[QH], acc[QH][VEC];
  for (int g = 0; g < QH; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.0f;
  }

  const long row_stride = long(num_kv_heads) * HEAD_DIM;   // elements per token
  const long head_off = long(kvh) * HEAD_DIM + d0;
  constexpr long STEP = long(NSW) * U;                      // tokens per step
  const long n_steps = t_end > t_begin ? (t_end - t_begin + STEP - 1) / STEP : 0;
  // With a power-of-two QH the per-token head sums are reduced by transposition: each
  // shuffle level hands half of a lane's head partials to its partner, so after log2(QH)
  // levels lane `col` holds head col / (TPR / QH) alone and finishes with a butterfly
  // over its TPR / QH lanes; the softmax of that head runs once per lane (not once per
  // head in every lane), and alpha / p reach every lane by indexed shuffles. Other QH
  // (3, 5, 6, 7) keep one full butterfly per (token, head). TRANSPOSE is a compile-time
  // constant and a plain `if` on it is folded (MSL 3.x is C++14-based, where CUDA's
  // `if constexpr` is at best a compiler extension); both branches are valid for every QH.
  constexpr bool TRANSPOSE = (QH & (QH - 1)) == 0 && QH <= TPR;
  constexpr int HLANES = TRANSPOSE ? TPR / QH : TPR;   // lanes sharing one head's sums
  const int sub0 = int(lane) - col;                    // first lane of this sub-group
  float m_h = -INFINITY, l_h = 0.0f;   // TRANSPOSE: the state of head col / HLANES

  for (long step = 0; step < n_steps; ++step) {
    long kv_off[U];                              // pool offset of token u's piece
    bool ok[U];
    token_offsets<PAGE_SIZE, U, NSW>(page_ids, fpo, t_begin, t_end, step, sw, row_stride,
                                     head_off, kv_off, ok);
    float s[QH][U];
    scores<KV_FP8, QH, U, VEC>(qf, k_pages, kv_off, ok, active, s);
    if (TRANSPOSE)
      softmax_transposed<SOFT_CAP, QH, U, VEC, TPR, HLANES>(s, m_h, l_h, acc, ok, col, sub0,
                                                            cap_log2);
    else
      softmax_per_head<SOFT_CAP, QH, U, VEC, TPR>(s, m, l, acc, ok, cap_log2);
    accumulate_v<KV_FP8, TRANSPOSE, QH, U, VEC, HLANES>(acc, s, v_pages, kv_off, ok, active, sub0);
  }
  if (TRANSPOSE) {
    // every lane of a sub-group takes each head's state from a lane that reduced it (the
    // sub-group's lanes of head g saw the same tokens: their states are equal)
    for (int g = 0; g < QH; ++g) {
      m[g] = simd_shuffle(m_h, ushort(sub0 + g * HLANES));
      l[g] = simd_shuffle(l_h, ushort(sub0 + g * HLANES));
    }
  }

  combine_subwarps<QH, VEC, TPR>(m, l, acc);
  combine_warps_and_store<TO, HEAD_DIM, QH, VEC, NUM_WARPS, SINK>(
      m, l, acc, sm_m, sm_l, sm_acc, tid, warp, sub, col, active, d0, sinks, h0, v_scale,
      out_v, out_lse, out_row, out_lse_idx);
}

}  // namespace pd
"""

METAL_HEADER = METAL_COMMON + METAL_ATTEND

METAL_SOURCE = r"""
  // one threadgroup per (chunk, KV head, q-group)
  const int c = int(threadgroup_position_in_grid.x);
  const int qgs = q_groups;
  const int kvh = int(threadgroup_position_in_grid.y) / qgs;
  const int qg = int(threadgroup_position_in_grid.y) % qgs;
  const int h0 = kvh * (num_qo_heads / num_kv_heads) + qg * QH;
  const int r = request_indices[c];
  const long tile = kv_tile_indices[c] < 0 ? 0 : kv_tile_indices[c];
  const long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long fpo = first_page_offset[r];
  const pd::TokenRange range = pd::chunk_tokens<PAGE_SIZE>(npages, last_page_len[r], fpo,
                                                           tile, pages_per_chunk);
  const long t_begin = range.t_begin, t_end = range.t_end;

  typedef pd::Combine<HEAD_DIM, QH, NUM_WARPS> CB;
  threadgroup float sm_m[CB::STATE];
  threadgroup float sm_l[CB::STATE];
  threadgroup float sm_acc[CB::ACC];
  pd::attend_range<TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, QH, NUM_WARPS, SOFT_CAP, SINK, KV_FP8>(
      q, k_pages, v_pages, indices + pb, fpo, t_begin, t_end, r, kvh, h0, num_qo_heads,
      num_kv_heads, scale_log2, soft_cap_log2, sinks, v_scale, v_out, lse_out,
      (long(c) * num_qo_heads + h0) * HEAD_DIM,
      long(c) * num_qo_heads + h0, sm_m, sm_l, sm_acc, thread_position_in_threadgroup.x,
      thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
"""


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"TQ": Dtype(spec.q_dtype), "TKV": Dtype(spec.kv_dtype), "TO": Dtype(spec.out_dtype),
            "HEAD_DIM": spec.head_dim, "PAGE_SIZE": spec.page_size, "QH": spec.heads_per_cta,
            "NUM_WARPS": spec.num_warps, "STAGES": spec.stages,
            "ROW_LOADS": max(1, spec.row_loads), "SOFT_CAP": spec.soft_cap, "SINK": spec.sink,
            "KV_FP8": metal_fp8(spec.kv_dtype)}


KERNEL = KernelDef(
    kernel="v2", cuda_name="pd_decode_v2_partial", cuda_source=CUDA_SOURCE,
    template=("TQ", "TKV", "TO", "HEAD_DIM", "PAGE_SIZE", "QH", "NUM_WARPS", "STAGES",
              "ROW_LOADS", "SOFT_CAP", "SINK"),
    arguments=_arguments, threads=warp_threads, dynamic_smem=ring_smem_bytes,
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS),
    # Metal has no staging ring and one row mapping
    cuda_only=("STAGES", "ROW_LOADS"), metal_only=("KV_FP8",))
