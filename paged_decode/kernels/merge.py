"""The merge kernel: variable-length merge of (V, LSE) partials over an indptr.

CUDA dialect. ``v [N, H, D]`` float32 normalized partials, ``lse [N, H]`` float32 (log2),
``o_indptr [M+1]`` -> ``v_out [M, H, D]`` (output dtype), ``lse_out [M, H]`` float32.
With ``GATHER`` the i-th merge input is row ``rows[i]`` of ``v`` / ``lse`` (``rows
[o_indptr[M]]`` int32), so partials written in another order (cascade's two levels) are
merged without a reordering copy; without it ``rows`` is not read.
One warp per (output row, head), four per block; or, with ``SPLIT`` > 1 (few outputs
over many partials, ``launches.merge_split``), one block of ``SPLIT`` warps per (output
row, head), the group's partials spread evenly over the warps in runs of up to 32, their
sums added through shared memory. Lanes hold float4 slices of D. Rows whose LSE is
``-inf`` (empty chunks) contribute nothing and are not read; a NaN or ``+inf`` LSE (a
poisoned chunk; no kernel writes +inf) makes the group's output and LSE NaN; an empty
group gives zeros and -inf. With ``SINK`` each group takes one more state, the head's
sink (``sinks [H]`` float32, natural units): LSE ``sinks[h] * log2(e)``, value 0
(``docs/variants.md``); an all-empty group then gives zeros and the sink's LSE, a NaN or
``+inf`` sink poisons the group like a partial would.
Knows nothing of pages or GQA; cascade decode reuses it unchanged.
"""

from __future__ import annotations

from .common import CUDA_COMMON, METAL_COMMON
from .kernel_def import Dtype, KernelDef, KernelSpec, MetalKernel, TemplateValue

#: one warp per (output row, head) without a split; the CUDA body's __launch_bounds__(128)
#: says the same
WARPS_PER_BLOCK = 4
#: warps per (output row, head) the split merge may take (the kernel's ``SPLIT``)
SPLITS = (1, 2, 4, 8, 16)
#: CUDA's limit on one kernel's static ``__shared__`` memory, which holds a split merge's
#: ``MergeSplitSmem``
STATIC_SMEM_LIMIT = 48 * 1024


def split_smem_bytes(head_dim: int, split: int) -> int:
    """Static shared memory of a merge block at ``split`` warps per (row, head): none
    unsplit; else ``MergeSplitSmem``, each warp's max, poison flag, row sum and
    ``head_dim`` sums in float32."""
    return 0 if split == 1 else split * (head_dim + 3) * 4


def split_fits(head_dim: int, split: int) -> bool:
    """Whether a merge block at ``split`` warps per (row, head) fits CUDA's static shared
    memory at ``head_dim`` (``split_smem_bytes``)."""
    return split_smem_bytes(head_dim, split) <= STATIC_SMEM_LIMIT


#: partials each warp of a split merge loads at once: twice the unsplit merge's 4, because
#: the split merge serves the cells where a few groups over many partials run alone on
#: the device and only loads in flight hide the latency
SPLIT_UNROLL = 8

#: One warp's merge of one (output row, head): ``pd::merge_group``, shared by the merge
#: kernel and the tensor-core partial's fused merge (``decode_v2_tc.py``: its last CTA of a
#: request merges that request's partials, written by other CTAs of the same grid, so it
#: reads them through L2 with ``COHERENT``: ``__ldcg``, never the non-coherent read-only
#: path a ``const __restrict__`` load may take).
CUDA_MERGE_GROUP = r"""
namespace pd {
template <bool COHERENT, typename X>
__device__ __forceinline__ X merge_load(const X* p) {
  if constexpr (COHERENT) return __ldcg(p); else return *p;
}

// Shared memory of a split merge (SPLIT warps on one group): each warp's max, poison flag,
// row sum and HEAD_DIM sums.
template <int HEAD_DIM, int SPLIT>
struct MergeSplitSmem {
  float mx[SPLIT], bad[SPLIT], den[SPLIT];
  float acc[SPLIT][HEAD_DIM];
};

// Merge rows o_indptr[o]:o_indptr[o + 1] (through rows[] with GATHER) of head h of v / lse
// into v_out / lse_out row o; called by a whole warp (lane: its lane). With SPLIT > 1 it is
// called by all SPLIT warps of the block (part: the warp's index, red: the block's shared
// MergeSplitSmem) on the same (o, h), and synchronizes the block (__syncthreads, twice);
// warp p takes the runs of `run` rows starting at beg + run (p + SPLIT k). UNROLL: rows
// each warp loads at once.
template <typename TO, int HEAD_DIM, bool GATHER, bool SINK, bool COHERENT, int SPLIT = 1,
          int UNROLL = 4>
__device__ __forceinline__ void merge_group(
    const float* v, const float* lse, const int* o_indptr, const int* rows,
    const float* sinks, TO* v_out, float* lse_out, int num_heads, long long o, int h,
    int lane, int part = 0, MergeSplitSmem<HEAD_DIM, SPLIT>* red = nullptr) {
  static_assert(HEAD_DIM % 4 == 0, "head_dim must be a multiple of 4");
  static_assert(UNROLL >= 1 && 32 % UNROLL == 0, "UNROLL must divide 32");
  constexpr int NV4 = HEAD_DIM / 4;                 // float4 per row
  constexpr int PER_LANE = (NV4 + 31) / 32;
  const long long beg = o_indptr[o], end = o_indptr[o + 1];
  // the group's rows go to the warps in runs of `run` rows (lane j < run: row base + j),
  // warp `part` taking runs part, part + SPLIT, ...: 32 unsplit; split, the group spread
  // evenly over the warps (at most 32), so a warp's chain of dependent loads is one LSE
  // and ceil(run / UNROLL) row loads per run
  const int run = SPLIT == 1 ? 32 : (int)min(32LL, max(1LL, (end - beg + SPLIT - 1) / SPLIT));
  // partial row r of head h, as float4; the float4 column a lane reads k-th
  const auto row_of = [&](long long r) {
    return reinterpret_cast<const float4*>(v + (r * num_heads + h) * HEAD_DIM);
  };
  const auto col = [lane](int k) { return lane + 32 * k; };
  // this warp's first run: its rows, their LSEs (kept for pass 2) and the rows of its
  // first UNROLL, read at once, before their weights are known, so the group's LSEs and
  // first rows make one round trip; a row of weight 0 read here is never used (it may be
  // NaN), and every row of [beg, end) is in bounds
  const long long base0 = beg + (long long)run * part;
  const int count0 = end - base0 <= 0 ? 0 : (end - base0 < run ? (int)(end - base0) : run);
  const long long src_first = lane < count0 ? (GATHER ? (long long)rows[base0 + lane] : base0 + lane)
                                            : 0;
  float4 x0[UNROLL][PER_LANE];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const long long ru = __shfl_sync(0xffffffffu, src_first, u);
    const float4* row = row_of(ru);
#pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
      const int c = col(k);
      x0[u][k] = (u < count0 && c < NV4) ? merge_load<COHERENT>(row + c)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  const float s_first = lane < count0 ? merge_load<COHERENT>(lse + src_first * num_heads + h)
                                      : -PD_INF;
  // pass 1: the group's max LSE (fmaxf skips NaN) and whether any row is poisoned (NaN or
  // +inf: not `< inf`)
  float mx = s_first, bad = lane < count0 && !(s_first < PD_INF) ? 1.f : 0.f;
  for (long long base = base0 + (long long)run * SPLIT; base < end; base += (long long)run * SPLIT) {
    const long long i = base + lane;
    if (lane < run && i < end) {
      const long long src = GATHER ? (long long)rows[i] : i;
      const float s = merge_load<COHERENT>(lse + src * num_heads + h);
      mx = fmaxf(mx, s);
      bad = s < PD_INF ? bad : 1.f;
    }
  }
  mx = pd::warp_max(mx);
  bad = pd::warp_max(bad);                          // warp-uniform
  if constexpr (SPLIT > 1) {                        // then block-uniform
    if (lane == 0) { red->mx[part] = mx; red->bad[part] = bad; }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < SPLIT; ++p) { mx = fmaxf(mx, red->mx[p]); bad = fmaxf(bad, red->bad[p]); }
  }
  // the sink: one more state of value 0, counted once per group (not per partial)
  const float sk = SINK ? sinks[h] * PD_LOG2E : -PD_INF;
  if (SINK) {
    mx = fmaxf(mx, sk);
    bad = sk < PD_INF ? bad : 1.f;
  }
  float4 acc[PER_LANE];
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  float den = 0.f;                                  // this lane's rows' weights
  if (mx > -PD_INF && bad == 0.f) {
    // pass 2, a run at a time: lane j < run weighs row base + j (0 for an empty chunk or
    // past the group), then the warp reads the weighted rows UNROLL at a time
    // (independent loads in flight; a row of weight 0 is neither read, past the first
    // batch, nor used: it may be NaN)
    for (long long base = base0; base < end; base += (long long)run * SPLIT) {
      const long long i = base + lane;
      float w = 0.f;
      long long src = 0;
      if (lane < run && i < end) {
        float s = s_first;
        src = src_first;
        if (base != base0) {
          src = GATHER ? (long long)rows[i] : i;
          s = merge_load<COHERENT>(lse + src * num_heads + h);
        }
        if (s > -PD_INF) w = exp2f(s - mx);
      }
      den += w;
      const int count = end - base < run ? (int)(end - base) : run;
      for (int j = 0; j < count; j += UNROLL) {
        float wu[UNROLL];
        float4 x[UNROLL][PER_LANE];
        const bool first = base == base0 && j == 0;       // warp-uniform: rows read above
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          wu[u] = __shfl_sync(0xffffffffu, w, j + u);       // j + u <= 31
          const long long ru = __shfl_sync(0xffffffffu, src, j + u);
          const float4* row = row_of(ru);
#pragma unroll
          for (int k = 0; k < PER_LANE; ++k) {
            const int c = col(k);
            x[u][k] = first ? x0[u][k]
                            : (wu[u] > 0.f && c < NV4) ? merge_load<COHERENT>(row + c)
                                                        : make_float4(0.f, 0.f, 0.f, 0.f);
          }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
          if (wu[u] > 0.f) {                                 // warp-uniform
#pragma unroll
            for (int k = 0; k < PER_LANE; ++k) {
              acc[k].x = fmaf(wu[u], x[u][k].x, acc[k].x); acc[k].y = fmaf(wu[u], x[u][k].y, acc[k].y);
              acc[k].z = fmaf(wu[u], x[u][k].z, acc[k].z); acc[k].w = fmaf(wu[u], x[u][k].w, acc[k].w);
            }
          }
      }
    }
  }
  den = pd::group_sum<32>(den);
  if constexpr (SPLIT > 1) {
    // every warp's sums into shared memory; warp 0 adds them (in warp order) and stores
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      const int c = lane + 32 * j;
      if (c < NV4) {
        red->acc[part][4 * c + 0] = acc[j].x; red->acc[part][4 * c + 1] = acc[j].y;
        red->acc[part][4 * c + 2] = acc[j].z; red->acc[part][4 * c + 3] = acc[j].w;
      }
    }
    if (lane == 0) red->den[part] = den;
    __syncthreads();
    if (part != 0) return;
    den = 0.f;
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p = 0; p < SPLIT; ++p) {
      den += red->den[p];
#pragma unroll
      for (int j = 0; j < PER_LANE; ++j) {
        const int c = lane + 32 * j;
        if (c < NV4) {
          acc[j].x += red->acc[p][4 * c + 0]; acc[j].y += red->acc[p][4 * c + 1];
          acc[j].z += red->acc[p][4 * c + 2]; acc[j].w += red->acc[p][4 * c + 3];
        }
      }
    }
  }
  if (SINK && mx > -PD_INF) den += exp2f(sk - mx);
  const bool live = den > 0.f;
  const float inv = bad != 0.f ? PD_NAN : (live ? 1.f / den : 0.f);   // 0 * NaN is NaN
  TO* dst = v_out + (o * num_heads + h) * HEAD_DIM;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int c = lane + 32 * j;
    if (c < NV4) {
      dst[4 * c + 0] = pd::from_float<TO>(acc[j].x * inv);
      dst[4 * c + 1] = pd::from_float<TO>(acc[j].y * inv);
      dst[4 * c + 2] = pd::from_float<TO>(acc[j].z * inv);
      dst[4 * c + 3] = pd::from_float<TO>(acc[j].w * inv);
    }
  }
  if (lane == 0) lse_out[o * num_heads + h] = bad != 0.f ? PD_NAN : (live ? mx + log2f(den) : -PD_INF);
}

// The cluster merge, declared everywhere (a kernel names it in a branch it discards
// unless PD_CLUSTER > 1) and defined only where clusters are compiled in.
template <typename TO, int HEAD_DIM, int CLD, int K, int THREADS, bool SINK>
__device__ void cluster_merge(const float* comb, const float* lse, const float* sinks,
                              TO* v_out, float* lse_out, int num_heads, int r, int h0,
                              int rows, int tid);
#if PD_CLUSTER > 1
// The cluster merge (v2tc's fused merge within a thread-block cluster): the K CTAs of a
// cluster are request r's K partials, in order (rank k: partial o_indptr[r] + k), each
// holding its `rows` rows of heads h0.. in its own shared memory, row i at comb[i * CLD]
// (float32, HEAD_DIM wide) and its LSE (log2) at lse[i]. Every thread of the cluster calls
// it; the rows' float4 columns are spread over the cluster's threads, each reading its
// column of the K partials from the other CTAs' shared memory between two cluster
// barriers (the second keeps every CTA's shared memory alive until all have read it).
// The arithmetic is merge_group's (SPLIT 1), in its order: the same max, the same fmaf
// chain in partial order, the weights summed as its lane butterfly sums them, the sink
// added once; so the result equals the merge kernel's bit for bit.
template <typename TO, int HEAD_DIM, int CLD, int K, int THREADS, bool SINK>
__device__ void cluster_merge(
    const float* comb, const float* lse, const float* sinks, TO* v_out, float* lse_out,
    int num_heads, int r, int h0, int rows, int tid) {
  static_assert(K >= 2 && K <= 32, "a cluster merge merges 2 to 32 partials");
  constexpr int NV4 = HEAD_DIM / 4;
  cluster_sync();                                   // every CTA's rows are in place
  const int me = (int)cluster_rank();
  for (int e = me * THREADS + tid; e < rows * NV4; e += K * THREADS) {
    const int i = e / NV4, c4 = e % NV4;
    float s[K];
    float4 x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {                   // every load issued before any use
      s[k] = *cluster_map(lse + i, (unsigned)k);
      x[k] = *cluster_map(reinterpret_cast<const float4*>(comb + i * CLD) + c4, (unsigned)k);
    }
    float mx = -PD_INF, bad = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      mx = fmaxf(mx, s[k]);                         // fmaxf skips NaN
      bad = s[k] < PD_INF ? bad : 1.f;
    }
    const int h = h0 + i;
    const float sk = SINK ? sinks[h] * PD_LOG2E : -PD_INF;
    if (SINK) {
      mx = fmaxf(mx, sk);
      bad = sk < PD_INF ? bad : 1.f;
    }
    constexpr int P = next_pow2(K);
    float w[P];
#pragma unroll
    for (int k = 0; k < P; ++k) w[k] = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx > -PD_INF && bad == 0.f) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (s[k] > -PD_INF) w[k] = exp2f(s[k] - mx);
        if (w[k] > 0.f) {
          acc.x = fmaf(w[k], x[k].x, acc.x); acc.y = fmaf(w[k], x[k].y, acc.y);
          acc.z = fmaf(w[k], x[k].z, acc.z); acc.w = fmaf(w[k], x[k].w, acc.w);
        }
      }
    }
    // the lane butterfly of group_sum<32> with partial k on lane k: lane 0's sum (the
    // steps past P add zeros, which changes nothing)
#pragma unroll
    for (int off = P / 2; off >= 1; off >>= 1)
#pragma unroll
      for (int k = 0; k < off; ++k) w[k] += w[k + off];
    float den = w[0];
    if (SINK && mx > -PD_INF) den += exp2f(sk - mx);
    const bool live = den > 0.f;
    const float inv = bad != 0.f ? PD_NAN : (live ? 1.f / den : 0.f);   // 0 * NaN is NaN
    TO* dst = v_out + ((long long)r * num_heads + h) * HEAD_DIM + 4 * c4;
    dst[0] = pd::from_float<TO>(acc.x * inv);
    dst[1] = pd::from_float<TO>(acc.y * inv);
    dst[2] = pd::from_float<TO>(acc.z * inv);
    dst[3] = pd::from_float<TO>(acc.w * inv);
    if (c4 == 0)
      lse_out[(long long)r * num_heads + h] =
          bad != 0.f ? PD_NAN : (live ? mx + log2f(den) : -PD_INF);
  }
  cluster_sync();                                   // no CTA leaves while read
}
#endif
}  // namespace pd
"""

CUDA_BODY = f"constexpr int PD_MERGE_SPLIT_UNROLL = {SPLIT_UNROLL};\n" + r"""
// SPLIT 1: grid ceil(M * H / 4), block 128 threads (4 warps, one (row, head) each).
// SPLIT > 1: grid M * H, block SPLIT warps on one (row, head).
template <typename TO, int HEAD_DIM, bool GATHER, bool SINK, int SPLIT>
__global__ void __launch_bounds__(SPLIT > 1 ? 32 * SPLIT : 128) pd_merge_states(
    const float* __restrict__ v,          // [N, H, D]
    const float* __restrict__ lse,        // [N, H], log2
    const int* __restrict__ o_indptr,     // [M + 1]
    const int* __restrict__ rows,         // [o_indptr[M]] with GATHER (else unread)
    const float* __restrict__ sinks,      // [H] natural units with SINK (else unread)
    TO* __restrict__ v_out,               // [M, H, D]
    float* __restrict__ lse_out,          // [M, H], log2
    int num_heads, int num_out) {
  // launched as the partial's dependent (PDL): every CTA waits for the partial grid here,
  // before any read and before any early return (so this grid never ends before it)
  pd::wait_for_prerequisites();
  const int lane = threadIdx.x & 31;
  if constexpr (SPLIT > 1) {
    __shared__ pd::MergeSplitSmem<HEAD_DIM, SPLIT> red;
    const long long item = blockIdx.x;               // grid is exactly M * H: no tail
    pd::merge_group<TO, HEAD_DIM, GATHER, SINK, false, SPLIT, PD_MERGE_SPLIT_UNROLL>(
        v, lse, o_indptr, rows, sinks, v_out, lse_out, num_heads, item / num_heads,
        (int)(item % num_heads), lane, threadIdx.x >> 5, &red);
  } else {
    const long long item = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (item >= (long long)num_out * num_heads) return;   // whole warp; no barrier below
    pd::merge_group<TO, HEAD_DIM, GATHER, SINK, false>(v, lse, o_indptr, rows, sinks, v_out,
                                                        lse_out, num_heads, item / num_heads,
                                                        (int)(item % num_heads), lane);
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_MERGE_GROUP + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# MLX ``metal_kernel`` body: one SIMD group per (output row, head), 4 per threadgroup;
# ``simd_max`` where CUDA uses a max butterfly. Inputs: v, lse, o_indptr, sinks ([H]
# float32 with SINK, a stand-in otherwise), num_heads, num_out (0-d int32); outputs:
# v_out, lse_out. Template arguments: TO, HEAD_DIM, SINK.
# Launch: grid (ceil(M * H / 4) * 128, 1, 1) threads, threadgroup (128, 1, 1).
METAL_INPUTS = ("v", "lse", "o_indptr", "sinks", "num_heads", "num_out")
METAL_OUTPUTS = ("v_out", "lse_out")
METAL_HEADER = METAL_COMMON

METAL_SOURCE = r"""
  static_assert(HEAD_DIM % 4 == 0, "head_dim must be a multiple of 4");
  constexpr int NV4 = HEAD_DIM / 4;                 // float4 per row
  constexpr int PER_LANE = (NV4 + 31) / 32;
  const uint lane = thread_index_in_simdgroup;
  const long item = long(threadgroup_position_in_grid.x) * 4 + simdgroup_index_in_threadgroup;
  if (item >= long(num_out) * num_heads) return;   // whole SIMD group; no barrier below
  const long o = item / num_heads;
  const int h = int(item % num_heads);
  const long beg = o_indptr[o], end = o_indptr[o + 1];
  // the group's max LSE (fmax skips NaN) and whether a row is poisoned (NaN or +inf)
  float mx = -INFINITY, bad = 0.0f;
  for (long i = beg + lane; i < end; i += 32) {
    const float s = lse[i * num_heads + h];
    mx = fmax(mx, s);
    bad = s < INFINITY ? bad : 1.0f;
  }
  mx = simd_max(mx);
  bad = simd_max(bad);                             // SIMD-group-uniform
  // the sink: one more state of value 0, counted once per group (as in CUDA)
  const float sk = SINK ? float(sinks[h]) * PD_LOG2E : -INFINITY;
  if (SINK) {
    mx = fmax(mx, sk);
    bad = sk < INFINITY ? bad : 1.0f;
  }
  float4 acc[PER_LANE];
  for (int j = 0; j < PER_LANE; ++j) acc[j] = float4(0.0f);
  float den = 0.0f;
  if (mx > -INFINITY && bad == 0.0f) {
    for (long i = beg; i < end; ++i) {
      const float s = lse[i * num_heads + h];
      if (!(s > -INFINITY)) continue;               // empty chunk: no weight, not read
      const float w = exp2(s - mx);
      den += w;
      const long row = (i * num_heads + h) * HEAD_DIM;
      for (int j = 0; j < PER_LANE; ++j) {
        const int c = int(lane) + 32 * j;
        if (c < NV4) acc[j] = fma(float4(w), pd::load4(v + row + 4 * c), acc[j]);
      }
    }
  }
  if (SINK && mx > -INFINITY) den += exp2(sk - mx);
  const bool live = den > 0.0f;
  const float inv = bad != 0.0f ? NAN : (live ? 1.0f / den : 0.0f);   // 0 * NaN is NaN
  const long dst = (o * num_heads + h) * HEAD_DIM;
  for (int j = 0; j < PER_LANE; ++j) {
    const int c = int(lane) + 32 * j;
    if (c < NV4) {
      v_out[dst + 4 * c + 0] = pd::from_float<TO>(acc[j].x * inv);
      v_out[dst + 4 * c + 1] = pd::from_float<TO>(acc[j].y * inv);
      v_out[dst + 4 * c + 2] = pd::from_float<TO>(acc[j].z * inv);
      v_out[dst + 4 * c + 3] = pd::from_float<TO>(acc[j].w * inv);
    }
  }
  if (lane == 0) lse_out[o * num_heads + h] = bad != 0.0f ? NAN : (live ? mx + log2(den) : -INFINITY);
"""


def split_of(spec: KernelSpec) -> int:
    """Warps per (output row, head) of a merge specialization (``num_warps``; 0 is the
    unsplit merge's 1)."""
    return max(1, spec.num_warps)


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"TO": Dtype(spec.out_dtype), "HEAD_DIM": spec.head_dim, "GATHER": spec.gather,
            "SINK": spec.sink, "SPLIT": split_of(spec)}


def _threads(spec: KernelSpec) -> int:
    split = split_of(spec)
    return 32 * (split if split > 1 else WARPS_PER_BLOCK)


KERNEL = KernelDef(
    kernel="merge", cuda_name="pd_merge_states", cuda_source=CUDA_SOURCE,
    template=("TO", "HEAD_DIM", "GATHER", "SINK", "SPLIT"), arguments=_arguments,
    threads=_threads,
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS),
    cuda_only=("GATHER", "SPLIT"))     # the Metal merge has no row index and no split
