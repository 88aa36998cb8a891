"""The tensor-core v2 partial: split-KV paged decode on ``mma.sync`` (CUDA, sm_80+).

The same work and contract as the v2 partial (``decode_v2.py``, ``Backend.partial``), for
16-bit pools: ``q [B, Hq, D]`` (the pools' dtype, float16 or bfloat16), ``k_pages, v_pages
[num_pages, P, Hkv, D]``, the CSR arrays, the plan's ``request_indices [C]`` /
``kv_tile_indices [C]`` -> ``v_out [C, Hq, D]`` (each row normalized by its own softmax
denominator; float32 for the merge, or the output dtype when the plan needs no merge) and
``lse_out [C, Hq]`` float32 in log2 units. An empty chunk writes zeros and -inf; a head
with a non-finite score in the chunk writes NaN (output row and LSE). Pool offsets are
64-bit.

Tiling: one CTA per (chunk, KV head, row tile). The G query heads of a KV head are the M
dimension of ``mma.m16n8k16`` tiles: 16 rows per CTA (rows past G are zero and never
written), so G <= 16 takes one CTA per (chunk, KV head) and 17 <= G <= 32 two
(``row_tiles``; the second reads the same K/V right after the first, from L2). The CTA's
NUM_WARPS warps split the chunk's tokens: a stage holds KT = 16 * NUM_WARPS consecutive
tokens of K and V in shared memory and warp w computes tokens [16 w, 16 w + 16) of it
against all 16 rows (S = Q K^T, the online softmax, O += P V: the tile phases of
``mma.py``), each warp with its own softmax state; the warps' states are combined through
shared memory at the end (as in the v2 partial).

Pipeline: K/V tokens stream through a STAGES-deep ring of ``cp.async`` 16-byte copies
(STAGES - 1 stages in flight while one is computed, one barrier per stage). Tokens of a
stage may come from different pages (any page size 1-256, a first page offset): each
token's page is looked up on its own (one thread per token of a stage, a stage ahead of the
copies that use it, through shared memory).
"""

from __future__ import annotations

from .common import CUDA_COMMON
from .kernel_def import Dtype, KernelDef, KernelSpec, TemplateValue
from .mma import CUDA_MMA

NUM_WARPS = 4
ROWS = 16                     # query rows per CTA: one mma M tile
TOKENS_PER_WARP = 16          # K/V tokens per warp per stage (two 8-token n tiles)
SMEM_PAD = 8                  # elements of padding per smem row (bank-conflict-free frags)
MAX_GROUP = 2 * ROWS          # the largest GQA group (two row tiles)
DEFAULT_STAGES = 2   # fastest or within 0.5% in every cell: results/h200/2026-12-01-s6/tune_tc
MAX_DYNAMIC_SMEM = 227 * 1024  # the sm_90 opt-in limit per block


def row_tiles(group: int) -> int:
    """CTAs per (chunk, KV head): 16-row tiles of the GQA group (1 or 2)."""
    return -(-group // ROWS)


def tile_tokens(num_warps: int = NUM_WARPS) -> int:
    """K/V tokens per pipeline stage (``KT`` in the kernel)."""
    return TOKENS_PER_WARP * num_warps


def _row_bytes(head_dim: int) -> int:
    return (head_dim + SMEM_PAD) * 2


def stage_bytes(head_dim: int, num_warps: int = NUM_WARPS) -> int:
    """Shared memory of one ring stage: KT tokens of K and of V, padded 16-bit rows."""
    return 2 * tile_tokens(num_warps) * _row_bytes(head_dim)


def dynamic_smem_bytes(head_dim: int, num_warps: int, stages: int) -> int:
    """The Q tile plus the K/V ring (the warps' combine reuses the ring after the loop)."""
    return ROWS * _row_bytes(head_dim) + stages * stage_bytes(head_dim, num_warps)


def max_stages(head_dim: int, num_warps: int = NUM_WARPS) -> int:
    """The deepest ring one block's dynamic shared memory holds."""
    return (MAX_DYNAMIC_SMEM - ROWS * _row_bytes(head_dim)) // stage_bytes(head_dim, num_warps)


CUDA_BODY = r"""
namespace pd {
extern __shared__ __align__(16) unsigned char pd_tc_smem[];
}  // namespace pd

// grid: (C chunks, Hkv * row_tiles), the row tile fastest; block: NUM_WARPS * 32 threads.
template <typename T, typename TO, int HEAD_DIM, int PAGE_SIZE, int NUM_WARPS, int STAGES>
__global__ void __launch_bounds__(NUM_WARPS * 32) pd_decode_v2_tc(
    const T* __restrict__ q,                     // [B, Hq, D]
    const T* __restrict__ k_pages,               // [num_pages, P, Hkv, D]
    const T* __restrict__ v_pages,               // [num_pages, P, Hkv, D]
    const int* __restrict__ indices,             // [total_pages]
    const int* __restrict__ indptr,              // [B + 1]
    const int* __restrict__ last_page_len,       // [B]
    const int* __restrict__ first_page_offset,   // [B]
    const int* __restrict__ request_indices,     // [C]
    const int* __restrict__ kv_tile_indices,     // [C]
    TO* __restrict__ v_out,                      // [C, Hq, D]
    float* __restrict__ lse_out,                 // [C, Hq], log2
    int num_qo_heads, int num_kv_heads, int row_tiles, int pages_per_chunk, float scale_log2) {
  using namespace pd;
  constexpr int D = HEAD_DIM;
  constexpr int LD = D + 8;                      // padded smem row, in elements
  constexpr int THREADS = NUM_WARPS * 32;
  constexpr int PIECES = D / 8;                  // 16-byte pieces per row
  constexpr int KT = 16 * NUM_WARPS;             // tokens per stage, 16 per warp
  constexpr int NT = 2;                          // 8-token column tiles of a warp's S
  constexpr int DT = D / 8;                      // 8-wide column tiles of O
  constexpr int PER_THREAD = KT * PIECES / THREADS;   // K (and V) pieces a thread copies
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static_assert((KT * PIECES) % THREADS == 0, "a K/V stage must split evenly over the threads");
  static_assert(STAGES >= 2, "the pipeline needs at least two stages");

  unsigned char* smem = pd_tc_smem;
  T* qs = reinterpret_cast<T*>(smem);            // [16][LD]
  T* ks = qs + 16 * LD;                          // [STAGES][KT][LD]
  T* vs = ks + STAGES * KT * LD;                 // [STAGES][KT][LD]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int c = blockIdx.x;
  const int kvh = blockIdx.y / row_tiles, rt = blockIdx.y % row_tiles;
  const int group = num_qo_heads / num_kv_heads;
  const int g0 = rt * 16;                        // first GQA row of this CTA
  const int rows = min(16, group - g0);          // live rows; the rest are zero padding
  const int h0 = kvh * group + g0;               // query head of row 0
  const int r = request_indices[c];
  const long long tile = kv_tile_indices[c] < 0 ? 0 : kv_tile_indices[c];
  const long long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long long fpo = first_page_offset[r];
  const TokenRange range = chunk_tokens<PAGE_SIZE>(npages, last_page_len[r], fpo, tile,
                                                   pages_per_chunk);
  // Token positions relative to the request's first page fit in 32 bits; only the pool
  // offset needs 64.
  const int a_begin = (int)(fpo + range.t_begin), n_tok = (int)(range.t_end - range.t_begin);
  const int n_stages = (n_tok + KT - 1) / KT;
  const int* __restrict__ page_ids = indices + pb;

  // Q tile: row i is query head h0 + i (zeros past the group; made visible to every warp
  // by the first barrier of the loop)
  for (int e = tid; e < 16 * D; e += THREADS) {
    const int i = e / D, d = e % D;
    qs[i * LD + d] = i < rows ? q[((long long)r * num_qo_heads + h0 + i) * D + d] : from_float<T>(0.f);
  }

  const long long row_stride = (long long)num_kv_heads * D;            // elements per token
  const long long page_stride = (long long)PAGE_SIZE * row_stride;
  // Page ids: thread tid < KT looks up token tid of a stage (`lookup`) one stage before
  // that stage's copies are issued, and stores it to sm_ids at the next round, before
  // the barrier that publishes it; so an issue never waits on a global load, and a thread
  // holds one id, not one per piece it copies.
  __shared__ int sm_ids[STAGES][KT];
  auto lookup = [&](int stage) -> int {
    const int i = stage * KT + tid;                                     // token in the range
    return tid < KT && i < n_tok ? page_ids[(a_begin + i) / PAGE_SIZE] : 0;
  };
  // Copy stage `stage`'s K/V tokens into ring slot stage % STAGES (tokens past the range
  // zero-filled; nothing past the last stage) and commit one group: one group per call
  // keeps the wait counts of the loop exact.
  auto issue = [&](int stage) {
    const int slot = stage % STAGES;
    if (stage < n_stages) {
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) {
        const int e = tid + j * THREADS, tok = e / PIECES, piece = e % PIECES;
        const int i = stage * KT + tok;                                // token in the range
        stage_kv_piece<T, D>(ks + (slot * KT + tok) * LD, vs + (slot * KT + tok) * LD, k_pages,
                             v_pages, sm_ids[slot][tok], (a_begin + i) % PAGE_SIZE, kvh, piece,
                             i < n_tok, page_stride, row_stride);
      }
    }
    cp_async_commit();
  };

  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-PD_INF, -PD_INF}, l_run[2] = {0.f, 0.f};   // rows grp, grp + 8

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (tid < KT) sm_ids[s][tid] = lookup(s);
  __syncthreads();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  int next_id = lookup(STAGES - 1);
  for (int stage = 0; stage < n_stages; ++stage) {
    // the ids of stage + STAGES - 1; their slot's last reader, that stage's issue a round
    // or more ago, is behind a barrier
    if (tid < KT) sm_ids[(stage + STAGES - 1) % STAGES][tid] = next_id;
    cp_async_wait<STAGES - 2>();                 // this thread's copies of `stage` landed
    // every thread's copies of `stage` (and the ids above) landed, and every warp is done
    // with stage - 1, whose slot the issue below refills
    __syncthreads();
    issue(stage + STAGES - 1);
    next_id = lookup(stage + STAGES);            // stored at the next round
    const int slot = stage % STAGES;
    const int tok0 = stage * KT + warp * 16;     // this warp's first token in the range
    if (tok0 < n_tok) {                          // warp-uniform: a tail warp may sit out
      float s[NT][4];
      qk_tile<T, D, LD, NT>(s, qs, ks + (slot * KT + warp * 16) * LD);
      softmax_tile<NT, DT>(s, m_run, l_run, o, tok0 + 2 * tig, n_tok, scale_log2);
      pv_tile<T, LD, NT, DT>(o, s, vs + (slot * KT + warp * 16) * LD);
    }
  }
  cp_async_wait<0>();                            // no copy may outlive the loop
  row_sums(l_run);

  // Combine the warps' states through shared memory: the float32 accumulators of warp w,
  // row i at comb[(w * 16 + i) * D], over the ring (every warp is past its last read once
  // the barrier below releases); the states in sm_m / sm_l.
  __shared__ float sm_m[NUM_WARPS][16];
  __shared__ float sm_l[NUM_WARPS][16];
  float* comb = reinterpret_cast<float*>(ks);
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = grp + 8 * h;
    if (tig == 0) { sm_m[warp][i] = m_run[h]; sm_l[warp][i] = l_run[h]; }
#pragma unroll
    for (int j = 0; j < DT; ++j)
      *reinterpret_cast<float2*>(comb + (warp * 16 + i) * D + j * 8 + 2 * tig) =
          make_float2(o[j][2 * h], o[j][2 * h + 1]);
  }
  __syncthreads();
  for (int e = tid; e < rows * D; e += THREADS) {
    const int i = e / D, d = e % D;
    float mx = -PD_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, sm_m[w][i]);
    const float ref = mx == -PD_INF ? 0.f : mx;  // avoids (-inf) - (-inf)
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = exp2f(sm_m[w][i] - ref);
      num = fmaf(wt, comb[(w * 16 + i) * D + d], num);
      den = fmaf(wt, sm_l[w][i], den);
    }
    // den is 0 for an empty range and NaN when a score was not finite (a warp's NaN sum
    // survives its weight of 0): NaN output and LSE, never the empty answer
    const bool live = !(den <= 0.f);
    const long long out_row = (long long)c * num_qo_heads + h0 + i;
    v_out[out_row * D + d] = from_float<TO>(live ? num / den : 0.f);
    if (d == 0) lse_out[out_row] = live ? mx + log2f(den) : -PD_INF;
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_MMA + CUDA_BODY


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"T": Dtype(spec.kv_dtype), "TO": Dtype(spec.out_dtype), "HEAD_DIM": spec.head_dim,
            "PAGE_SIZE": spec.page_size, "NUM_WARPS": spec.num_warps, "STAGES": spec.stages}


KERNEL = KernelDef(
    kernel="v2tc", cuda_name="pd_decode_v2_tc", cuda_source=CUDA_SOURCE,
    template=("T", "TO", "HEAD_DIM", "PAGE_SIZE", "NUM_WARPS", "STAGES"),
    arguments=_arguments, threads=lambda spec: spec.num_warps * 32,
    dynamic_smem=lambda spec: dynamic_smem_bytes(spec.head_dim, spec.num_warps, spec.stages))
