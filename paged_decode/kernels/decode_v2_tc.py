"""The tensor-core v2 partial: split-KV paged decode on ``mma.sync`` (CUDA, sm_80+), and
its Metal dialect on ``simdgroup_matrix`` (below ``CUDA_SOURCE``; it has run only on the
CPU emulator, never on Apple hardware).

The same work and contract as the v2 partial (``decode_v2.py``, ``Backend.partial``):
``q [B, Hq, D]`` float16 or bfloat16 (T, the mma operands' type), ``k_pages, v_pages
[num_pages, P, Hkv, D]`` of q's dtype or fp8 codes (TKV; one byte each), the CSR arrays,
the plan's ``request_indices [C]`` / ``kv_tile_indices [C]`` -> ``v_out [C, Hq, D]`` (each
row normalized by its own softmax denominator; float32 for the merge, or the output dtype
when the plan needs no merge) and ``lse_out [C, Hq]`` float32 in log2 units. An empty
chunk writes zeros and -inf; a head with a non-finite score in the chunk writes NaN
(output row and LSE). Pool offsets are 64-bit. ``v_scale`` (float32) multiplies every
row: an fp8 pool's V scale (its K scale is in ``scale_log2``), 1 for 16-bit pools.

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

Ring rows: a row of K or V (head_dim times the element size) is unpadded where it is a
multiple of 64 bytes (96-byte fp8 rows take 128) and its 16-byte pieces are swizzled
(``tile_at`` and ``TileRow`` in ``mma.py`` say why: conflict-free ``ldmatrix`` and whole
32-byte sectors for ``cp.async``).

fp8 pools (``docs/tensor-core-decode.md``, "fp8 pools"): the ring holds the codes (16
per 16-byte piece), and the fp8 tile phases (``qk_tile_fp8``,
``pv_tile_fp8``) read them with the same ``ldmatrix`` as 16-bit rows, widening each
register's four codes exactly (``fp8x4_to_pairs``) into the mma's operand pairs: K's
columns come in a permuted order that the Q tile is stored in too (``q_column``), V's as
even and odd output tiles that the combine puts back in order. No 16-bit copy of a stage
is made. A 16-bit pool (TKV = T) compiles to the kernel without them.

Metal: the same grid, contract and combine with 8 x 8 ``simdgroup_matrix`` tiles, 8 or 16
rows per threadgroup, SIMD groups of 8 tokens per stage, a double buffer of ordinary loads
(the comment above ``METAL_INPUTS`` has the details); fp8 codes are widened into T as
they are staged.

Variants (``docs/variants.md``), both dialects: ``SOFT_CAP`` caps each scaled score with
the shared ``logit`` (``soft_cap_log2`` = c * log2(e)); ``SINK`` joins ``sinks [Hq]``
(float32, natural-log units) as one more state of the final combine, only in a partial that
writes the output (a merged partial never holds it); a sliding window is the host's window
table (first page offsets), no parameter.
"""

from __future__ import annotations

from .common import CUDA_COMMON, METAL_COMMON
from .kernel_def import Dtype, KernelDef, KernelSpec, MetalKernel, TemplateValue, metal_fp8
from .merge import CUDA_MERGE_GROUP
from .mma import ALIGN_SLACK, CUDA_MMA, tile_row_bytes

NUM_WARPS = 4
ROWS = 16                     # query rows per CTA: one mma M tile
TOKENS_PER_WARP = 16          # K/V tokens per warp per stage (two 8-token n tiles)
SMEM_PAD = 8                  # elements of padding per smem row (bank-conflict-free frags)
MAX_GROUP = 2 * ROWS          # the largest GQA group (two row tiles)
DEFAULT_STAGES = 2   # fastest or within 0.5% in every cell: results/h200/2026-12-01-s6/tune_tc
MAX_DYNAMIC_SMEM = 227 * 1024  # the sm_90 opt-in limit per block


#: CTAs of 4 warps per SM that the 16-bit kernels' registers allow on sm_90, by head_dim
#: (ptxas: 94 / 125 / 125 / 233 registers a thread at 64 / 96 / 128 / 256, S10-R2;
#: ``tests/test_cuda_compile.py`` checks them against this machine's compiler)
_REGISTER_CTAS_4_WARPS = {64: 5, 96: 4, 128: 4, 256: 2}


def register_ctas(head_dim: int, num_warps: int = NUM_WARPS) -> int:
    """CTAs of ``num_warps`` warps per SM the 16-bit kernel's registers allow on sm_90
    (the count for 4 warps scaled by 4 / ``num_warps``); 32, the hardware's limit, for a
    head_dim with no count."""
    per4 = _REGISTER_CTAS_4_WARPS.get(head_dim)
    return 32 if per4 is None else max(1, per4 * NUM_WARPS // num_warps)


def row_tiles(group: int) -> int:
    """CTAs per (chunk, KV head): 16-row tiles of the GQA group (1 or 2)."""
    return -(-group // ROWS)


def tile_tokens(num_warps: int = NUM_WARPS) -> int:
    """K/V tokens per pipeline stage (``KT`` in the kernel)."""
    return TOKENS_PER_WARP * num_warps


def kv_bytes(kv_dtype: str) -> int:
    """Bytes of one pool element: 1 for the fp8 formats (a byte ring), else 2."""
    return 1 if metal_fp8(kv_dtype) else 2


def _row_bytes(head_dim: int) -> int:
    return (head_dim + SMEM_PAD) * 2


def stage_bytes(head_dim: int, num_warps: int = NUM_WARPS, elem: int = 2) -> int:
    """Shared memory of one ring stage: KT tokens of K and of V, rows of
    ``mma.tile_row_bytes`` (``elem`` 2: 16-bit pools, 1: fp8 codes)."""
    return 2 * tile_tokens(num_warps) * tile_row_bytes(head_dim * elem)


def _fixed_bytes(head_dim: int) -> int:
    # the Q tile, and the slack the kernel aligns the ring up to 128 bytes in
    return ROWS * _row_bytes(head_dim) + ALIGN_SLACK


def _combine_bytes(head_dim: int, num_warps: int) -> int:
    # the warps' float32 accumulators (16 rows of head_dim + 8 each), over the ring after
    # the loop
    return num_warps * ROWS * (head_dim + 8) * 4


def dynamic_smem_bytes(head_dim: int, num_warps: int, stages: int, elem: int = 2) -> int:
    """The Q tile and the K/V ring (``elem``: bytes per pool element), the ring's space at
    least the warps' combine, which reuses it after the loop."""
    return _fixed_bytes(head_dim) + max(stages * stage_bytes(head_dim, num_warps, elem),
                                        _combine_bytes(head_dim, num_warps))


def max_stages(head_dim: int, num_warps: int = NUM_WARPS, elem: int = 2) -> int:
    """The deepest ring one block's dynamic shared memory holds."""
    return ((MAX_DYNAMIC_SMEM - _fixed_bytes(head_dim))
            // stage_bytes(head_dim, num_warps, elem))


CUDA_BODY = r"""
namespace pd {
extern __shared__ __align__(16) unsigned char pd_tc_smem[];

// fp8 pools: the tile phases on the byte ring itself, each code widened in registers
// (fp8x4_to_pairs, exact) right where the mma takes it, no 16-bit copy of the stage.
// ldmatrix reads a byte row of 16 codes as eight 16-bit elements, so:
// - K (non-transposed): lane (grp, tig) gets codes 4 tig .. 4 tig + 3 of token grp of a
//   16-column chunk. They are the mma's B pair (2 tig, 2 tig + 1) and pair (2 tig + 8,
//   2 tig + 9) when the Q tile holds each chunk's columns in that order (``q_column``):
//   a dot product does not care how its terms are numbered, only that Q and K agree.
// - V (transposed): lane (grp, tig) gets codes 2 grp, 2 grp + 1 of tokens 2 tig and
//   2 tig + 1; regrouped by token they are the B pairs of output columns 2 grp (even
//   tile) and 2 grp + 1 (odd tile), so O's chunk c is two 8-column tiles, o[2c] holding
//   columns c * 16 + 2 n and o[2c + 1] columns c * 16 + 2 n + 1 (n its mma column),
//   put back in order by the combine.

// The chunk column whose value the Q tile holds at column `k` (0-15) of a chunk.
__device__ __forceinline__ int q_column(int k) {
  return k < 8 ? 4 * (k >> 1) + (k & 1) : 4 * ((k - 8) >> 1) + 2 + (k & 1);
}

// s = Q K^T (16 rows x 16 tokens, NT = 2 tiles of 8) for one warp over fp8 K rows `kt`
// (laid out by tile_at<ROWB, GRP>); `qw`: the Q tile in q_column order.
template <typename TKV, typename T, int D, int ROWB, int GRP, int LD>
__device__ __forceinline__ void qk_tile_fp8(float (&s)[2][4], const T* qw, const unsigned char* kt) {
  static_assert(D % 32 == 0, "fp8 K is read 32 columns (two chunks) at a time");
  const int lane = threadIdx.x & 31;
  const int lrow = lane & 7, lm = lane >> 3, lhi = lm & 1, lq = lane >> 4;
#pragma unroll
  for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
  const smem_addr_t k_lane = smem_addr(kt) + tile_at<ROWB, GRP>((lm >> 1) * 8 + lrow, lm & 1);
#pragma unroll
  for (int cc = 0; cc < D / 32; ++cc) {
    unsigned kr[4];                  // matrix m: tokens 8 (m >> 1) + 0-7, chunk 2 cc + (m & 1)
    ldsm_x4_at<false>(kr, chunk_addr<GRP>(k_lane, 2 * cc));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      unsigned a[4];
      ldsm_x4<false>(a, qw + (lrow + 8 * lhi) * LD + (2 * cc + h) * 16 + 8 * lq);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        unsigned b[2];
        fp8x4_to_pairs<TKV, Pair<T>>(kr[2 * n + h], b);
        mma_16816<T>(s[n], a, b);
      }
    }
  }
}

// A transposed ldmatrix register of fp8 V, codes (token 2 tig: columns 2 grp, 2 grp + 1;
// token 2 tig + 1: the same columns), regrouped by column: (2 tig, 2 tig + 1) of column
// 2 grp in the low half, of column 2 grp + 1 in the high half: bytes (0, 2, 1, 3), one
// PRMT (the shifts and masks it replaced took six instructions in nvcc's sm_90 SASS).
__device__ __forceinline__ unsigned codes_by_column(unsigned w) {
  return __byte_perm(w, 0u, 0x3120u);
}

// o += P V for one warp over fp8 V rows `vt` (16 tokens, laid out by tile_at<ROWB, GRP>):
// P is softmax_tile's s as in pv_tile; o in the even / odd tile order above.
template <typename TKV, typename T, int D, int ROWB, int GRP, int DT>
__device__ __forceinline__ void pv_tile_fp8(float (&o)[DT][4], const float (&s)[2][4],
                                            const unsigned char* vt) {
  static_assert(DT == D / 8 && D % 32 == 0, "fp8 V is read 32 columns (two chunks) at a time");
  const int lane = threadIdx.x & 31;
  const int lrow = lane & 7, lm = lane >> 3;
  unsigned a[4];
  a[0] = Pair<T>::pack(s[0][0], s[0][1]);
  a[1] = Pair<T>::pack(s[0][2], s[0][3]);
  a[2] = Pair<T>::pack(s[1][0], s[1][1]);
  a[3] = Pair<T>::pack(s[1][2], s[1][3]);
  const smem_addr_t v_lane = smem_addr(vt) + tile_at<ROWB, GRP>((lm & 1) * 8 + lrow, lm >> 1);
#pragma unroll
  for (int cc = 0; cc < D / 32; ++cc) {
    unsigned vr[4];                  // matrix m: tokens 8 (m & 1) + 0-7, chunk 2 cc + (m >> 1)
    ldsm_x4_at<true>(vr, chunk_addr<GRP>(v_lane, 2 * cc));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // tokens 0-7 (lo) and 8-15 (hi) of the k step; [0]: the even column, [1]: the odd
      unsigned lo[2], hi[2];
      fp8x4_to_pairs<TKV, Pair<T>>(codes_by_column(vr[2 * h]), lo);
      fp8x4_to_pairs<TKV, Pair<T>>(codes_by_column(vr[2 * h + 1]), hi);
      const unsigned be[2] = {lo[0], hi[0]}, bo[2] = {lo[1], hi[1]};
      mma_16816<T>(o[2 * (2 * cc + h)], a, be);
      mma_16816<T>(o[2 * (2 * cc + h) + 1], a, bo);
    }
  }
}
}  // namespace pd

// grid: (C chunks, Hkv * row_tiles), the row tile fastest; block: NUM_WARPS * 32 threads.
// T: the queries' and the mma operands' type; TKV: the pools' element, T itself or an fp8
// format (pd::fp8_e4m3 / pd::fp8_e5m2: a byte ring, widened in registers by the fp8 tile
// phases above).
// SOFT_CAP: scores capped at soft_cap_log2 (log2 units, ``logit``); SINK: the heads'
// sinks join the final combine (only where the kernel writes the output: merged partials
// never hold a sink, the merge adds it once; with MERGE the fused merge is that merge).
// MERGE: the fused merge. Each CTA counts itself done in merge_counters[(request,
// head slot)] after its partial rows are written and fenced; the request's last CTA (the
// one whose count completes o_indptr[r + 1] - o_indptr[r]) merges the request's partials
// of its heads into merged_out / merged_lse (TF: the output dtype) as the merge kernel
// would (pd::merge_group, the same code), and sets the counter back to 0 for the next
// launch, so the counters stay zero between launches (graph replays included).
template <typename T, typename TKV, typename TO, int HEAD_DIM, int PAGE_SIZE, int NUM_WARPS,
          int STAGES, bool SOFT_CAP, bool SINK, bool MERGE, typename TF>
__global__ void __launch_bounds__(NUM_WARPS * 32) PD_CLUSTER_DIMS pd_decode_v2_tc(
    const T* __restrict__ q,                     // [B, Hq, D]
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
    int num_qo_heads, int num_kv_heads, int row_tiles, int pages_per_chunk, float scale_log2,
    float soft_cap_log2, float v_scale,
    const int* __restrict__ o_indptr,            // [B + 1] with MERGE (else unread)
    int* __restrict__ merge_counters,            // [B, gridDim.y] with MERGE, zero between launches
    TF* __restrict__ merged_out,                 // [B, Hq, D] with MERGE (else unwritten)
    float* __restrict__ merged_lse,              // [B, Hq], log2, with MERGE
    int batch_size) {                            // B
  using namespace pd;
  constexpr int D = HEAD_DIM;
  constexpr int LD = D + 8;                      // padded 16-bit smem row, in elements
  constexpr bool FP8 = sizeof(TKV) == 1;         // a byte ring, widened in registers
  using Row = TileRow<D * (int)sizeof(TKV)>;     // ring rows, swizzled
  constexpr int GRP = Row::GROUP;
  constexpr int ROWB = Row::BYTES;
  constexpr int THREADS = NUM_WARPS * 32;
  constexpr int PIECES = D * (int)sizeof(TKV) / 16;   // 16-byte pieces per ring row
  constexpr int KT = 16 * NUM_WARPS;             // tokens per stage, 16 per warp
  constexpr int NT = 2;                          // 8-token column tiles of a warp's S
  constexpr int DT = D / 8;                      // 8-wide column tiles of O
  constexpr int PER_THREAD = KT * PIECES / THREADS;   // K (and V) pieces a thread copies
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static_assert((KT * PIECES) % THREADS == 0, "a K/V stage must split evenly over the threads");
  static_assert(STAGES >= 2, "the pipeline needs at least two stages");
  static_assert(!MERGE || sizeof(TO) == 4, "a fused merge reads float32 partials");
  // the cluster merge: a cluster's CTAs are one request's chunks of one head slot, and they
  // merge their rows through each other's shared memory (no partial rows in global memory)
  constexpr bool CLUSTER_MERGE = MERGE && PD_CLUSTER > 1;

  unsigned char* smem = pd_tc_smem;
  T* qs = reinterpret_cast<T*>(smem);            // [16][LD]
  // [STAGES][KT] rows of ROWB, 128-byte aligned for the swizzle (the host adds the slack)
  unsigned char* ks = align_smem(reinterpret_cast<unsigned char*>(qs + 16 * LD));
  unsigned char* vs = ks + STAGES * KT * ROWB;   // [STAGES][KT] rows of ROWB

  allow_dependents();                 // the merge may be scheduled now; it waits for this grid
  pd_stamp(0);                        // timeline (PD_TIMELINE only): the CTA started
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const GridCell cell = grid_cell((unsigned)row_tiles);
  const int c = (int)cell.chunk, kvh = (int)cell.kv_head, rt = (int)cell.sub;
  const int group = num_qo_heads / num_kv_heads;
  const int g0 = rt * 16;                        // first GQA row of this CTA
  const int rows = min(16, group - g0);          // live rows; the rest are zero padding
  const int h0 = kvh * group + g0;               // query head of row 0
  const int r = request_indices[c];
  const long long tile = kv_tile_indices[c] < 0 ? 0 : kv_tile_indices[c];
  // The request's table entries. Below 32 * SPEC requests every lane loads those of
  // requests lane, lane + 32, ... beside request_indices[c] and r's are shuffled out once
  // r lands, so the plan's round trip and the table's overlap instead of adding up in the
  // prologue's chain; larger batches load r's after r.
  constexpr int SPEC = 4;
  // indptr[r], indptr[r + 1], last_page_len[r], first_page_offset[r]
  int p_begin, p_end, last_len, first_off;
  if (batch_size < 32 * SPEC) {
    // lane r % 32 keeps request r's entries from its load r / 32 (and lane (r + 1) % 32
    // indptr[r + 1]); the loads do not wait for r, only the selects do
    int b = 0, e = 0, l = 0, f = 0;
#pragma unroll
    for (int j = 0; j < SPEC; ++j) {
      const int t = lane + 32 * j;
      const int ip = t <= batch_size ? indptr[t] : 0;
      const int lp = t < batch_size ? last_page_len[t] : 0;
      const int fo = t < batch_size ? first_page_offset[t] : 0;
      if (j == r / 32) { b = ip; l = lp; f = fo; }
      if (j == (r + 1) / 32) e = ip;
    }
    p_begin = __shfl_sync(0xffffffffu, b, r & 31);
    p_end = __shfl_sync(0xffffffffu, e, (r + 1) & 31);
    last_len = __shfl_sync(0xffffffffu, l, r & 31);
    first_off = __shfl_sync(0xffffffffu, f, r & 31);
  } else {
    p_begin = indptr[r]; p_end = indptr[r + 1];
    last_len = last_page_len[r]; first_off = first_page_offset[r];
  }
  const long long pb = p_begin, npages = (long long)p_end - p_begin;
  const long long fpo = first_off;
  const TokenRange range = chunk_tokens<PAGE_SIZE>(npages, last_len, fpo, tile, pages_per_chunk);
  // Token positions relative to the request's first page fit in 32 bits; only the pool
  // offset needs 64.
  const int a_begin = (int)(fpo + range.t_begin), n_tok = (int)(range.t_end - range.t_begin);
  const int n_stages = (n_tok + KT - 1) / KT;
  const int* __restrict__ page_ids = indices + pb;

  // Token rows: thread tid < KT looks up token tid of a stage (its pool row, page *
  // PAGE_SIZE + entry, 0 past the range) one stage before that stage's copies are issued:
  // `page_of` loads the page id, `row_of` makes the row of it at the next round, where it
  // is stored to sm_rows before the barrier that publishes it. So no instruction of the
  // round that loads it waits on that global load (ptxas puts a consumer in the load's own
  // block right after it), and a copy costs one shared load and a multiply-add, not a
  // page-and-entry address per piece. A pool holds fewer than 2^32 rows (the host refuses
  // more).
  __shared__ unsigned sm_rows[STAGES][KT];
  auto page_of = [&](int stage) -> int {
    const int i = stage * KT + tid;                                     // token in the range
    const unsigned a = (unsigned)(a_begin + i);                         // entry in the pages
    return tid < KT && i < n_tok ? page_ids[a / PAGE_SIZE] : 0;
  };
  auto row_of = [&](int stage, int page) -> unsigned {
    const int i = stage * KT + tid;
    const unsigned a = (unsigned)(a_begin + i);
    return tid < KT && i < n_tok ? (unsigned)page * PAGE_SIZE + a % PAGE_SIZE : 0u;
  };
  // The prologue is a chain of dependent loads (the plan, the request's table entries, the
  // page ids, the first stage); the page ids of the first STAGES stages are loaded here,
  // before Q, so that Q's round trip overlaps theirs instead of adding one to the chain.
  int first_page[STAGES];
#pragma unroll
  for (int s = 0; s < STAGES; ++s) first_page[s] = page_of(s);

  // Q tile: row i is query head h0 + i (zeros past the group; made visible to every warp
  // by the barrier before the loop); over fp8 pools each chunk's columns in q_column
  // order. A thread takes whole 16-column chunks, loaded as two 16-byte pieces into
  // registers (16-bit loads when q is not 16-byte aligned) before any is stored.
  static_assert(sizeof(T) == 2, "the Q tile is moved as 16-bit column pairs");
  constexpr int QCH = D / 16;                    // chunks per row
  constexpr int Q_PER = (16 * QCH + THREADS - 1) / THREADS;
  const bool q_vec = ((unsigned long long)q & 15) == 0;
  unsigned qw[Q_PER][8];
#pragma unroll
  for (int j = 0; j < Q_PER; ++j) {
    const int e = tid + j * THREADS, i = e / QCH;
#pragma unroll
    for (int k = 0; k < 8; ++k) qw[j][k] = 0u;
    if (e < 16 * QCH && i < rows) {
      const T* src = q + ((long long)r * num_qo_heads + h0 + i) * D + (e % QCH) * 16;
      if (q_vec) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(src));
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(src) + 1);
        qw[j][0] = a.x; qw[j][1] = a.y; qw[j][2] = a.z; qw[j][3] = a.w;
        qw[j][4] = b.x; qw[j][5] = b.y; qw[j][6] = b.z; qw[j][7] = b.w;
      } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(src);
#pragma unroll
        for (int k = 0; k < 8; ++k) qw[j][k] = h[2 * k] | (unsigned)h[2 * k + 1] << 16;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < Q_PER; ++j) {
    const int e = tid + j * THREADS;
    if (e < 16 * QCH) {
      // q_column order moves whole column pairs (it maps 2k to an even column)
      unsigned w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = qw[j][FP8 ? q_column(2 * k) / 2 : k];
      uint4* dst = reinterpret_cast<uint4*>(qs + (e / QCH) * LD + (e % QCH) * 16);
      dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }

  const unsigned row_bytes = (unsigned)(num_kv_heads * D * (int)sizeof(TKV));
  // A thread copies piece `piece` of the tokens tok_first + j * TOK_STEP when the threads
  // cover whole rows (THREADS % PIECES == 0, every shape but head_dim 96); otherwise each
  // of its copies has its own token and piece.
  constexpr bool WHOLE_ROWS = THREADS % PIECES == 0;
  constexpr int TOK_STEP = WHOLE_ROWS ? THREADS / PIECES : 0;
  const int tok_first = tid / PIECES, piece_first = tid % PIECES;
  const unsigned char* k_head = reinterpret_cast<const unsigned char*>(k_pages + (long long)kvh * D);
  const unsigned char* v_head = reinterpret_cast<const unsigned char*>(v_pages + (long long)kvh * D);
  // Copy stage `stage`'s K/V tokens into ring slot stage % STAGES (tokens past the range
  // zero-filled; nothing past the last stage) and commit one group: one group per call
  // keeps the wait counts of the loop exact.
  auto issue = [&](int stage) {
    const int slot = stage % STAGES;
    if (stage < n_stages) {
      const int live = n_tok - stage * KT;                             // tokens of the stage in range
      // the rows of up to 8 copies are loaded before those copies: ptxas keeps a shared
      // load behind the copies ahead of it (they write shared memory), so a load between
      // copies would wait its whole latency (8 at most: head_dim 256 makes 16 copies)
      constexpr int RB = PER_THREAD < 8 ? PER_THREAD : 8;
      static_assert(PER_THREAD % RB == 0, "copies come in whole batches of rows");
      // copy c's token of the stage and its 16-byte piece of the row
      auto tok_of = [&](int c) {
        return WHOLE_ROWS ? tok_first + c * TOK_STEP : (tid + c * THREADS) / PIECES;
      };
      auto piece_of = [&](int c) { return WHOLE_ROWS ? piece_first : (tid + c * THREADS) % PIECES; };
#pragma unroll
      for (int j0 = 0; j0 < PER_THREAD; j0 += RB) {
        unsigned row[RB];
#pragma unroll
        for (int j = 0; j < RB; ++j) row[j] = sm_rows[slot][tok_of(j0 + j)];
#pragma unroll
        for (int j = 0; j < RB; ++j) {
          const int tok = tok_of(j0 + j), piece = piece_of(j0 + j);
          const unsigned long long off = (unsigned long long)row[j] * row_bytes + piece * 16;
          const int at = tile_at<ROWB, GRP>(slot * KT + tok, piece);
          cp_async16(ks + at, k_head + off, tok < live);
          cp_async16(vs + at, v_head + off, tok < live);
        }
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
    if (tid < KT) sm_rows[s][tid] = row_of(s, first_page[s]);
  __syncthreads();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  int next_page = first_page[STAGES - 1];
  for (int stage = 0; stage < n_stages; ++stage) {
    // the rows of stage + STAGES - 1; their slot's last reader, that stage's issue a round
    // or more ago, is behind a barrier
    if (tid < KT) sm_rows[(stage + STAGES - 1) % STAGES][tid] = row_of(stage + STAGES - 1, next_page);
    cp_async_wait<STAGES - 2>();                 // this thread's copies of `stage` landed
    // every thread's copies of `stage` (and the rows above) landed, and every warp is done
    // with stage - 1, whose slot the issue below refills
    __syncthreads();
    issue(stage + STAGES - 1);
    if (stage == 0) pd_stamp(1);                 // timeline: the first stage has landed
    next_page = page_of(stage + STAGES);         // its row is made at the next round
    const int slot = stage % STAGES;
    const int tok0 = stage * KT + warp * 16;     // this warp's first token in the range
    if (tok0 < n_tok) {                          // warp-uniform: a tail warp may sit out
      const unsigned char* kt = ks + (slot * KT + warp * 16) * ROWB;
      const unsigned char* vt = vs + (slot * KT + warp * 16) * ROWB;
      float s[NT][4];
      if constexpr (FP8) qk_tile_fp8<TKV, T, D, ROWB, GRP, LD>(s, qs, kt);
      else qk_tile<T, D, LD, NT, ROWB, GRP>(s, qs, kt);
      softmax_tile<NT, DT, SOFT_CAP>(s, m_run, l_run, o, tok0 + 2 * tig, n_tok, scale_log2,
                                     soft_cap_log2);
      if constexpr (FP8) pv_tile_fp8<TKV, T, D, ROWB, GRP, DT>(o, s, vt);
      else pv_tile<T, LD, NT, DT, ROWB, GRP>(o, s, vt);
    }
  }
  cp_async_wait<0>();                            // no copy may outlive the loop
  pd_stamp(2);                                   // timeline: the loop ended
  row_sums(l_run);

  // Combine the warps' states through shared memory: warp w's float32 accumulator row i
  // at comb[(w * 16 + i) * CLD], live rows only (the padding rows past `rows` are never
  // read), over the ring (every warp is past its last read once the barrier below
  // releases; the host sizes the ring's space to hold them, ``dynamic_smem_bytes``); the
  // states in sm_m / sm_l. CLD = D + 8 floats puts the 8 rows of a fragment store in
  // distinct banks (at a stride of D they all fall in the same 8 banks).
  constexpr int CLD = D + 8;
  __shared__ float sm_m[NUM_WARPS][16];
  __shared__ float sm_l[NUM_WARPS][16];
  __shared__ float sm_lse[CLUSTER_MERGE ? 16 : 1];   // the cluster merge's row LSEs
  float* comb = reinterpret_cast<float*>(ks);
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = grp + 8 * h;
    if (i < rows) {
      if (tig == 0) { sm_m[warp][i] = m_run[h]; sm_l[warp][i] = l_run[h]; }
      float* row = comb + (warp * 16 + i) * CLD;
      if constexpr (FP8) {           // o[2c] / o[2c + 1]: chunk c's even / odd columns
#pragma unroll
        for (int c16 = 0; c16 < DT / 2; ++c16)
          *reinterpret_cast<float4*>(row + c16 * 16 + 4 * tig) =
              make_float4(o[2 * c16][2 * h], o[2 * c16 + 1][2 * h], o[2 * c16][2 * h + 1],
                          o[2 * c16 + 1][2 * h + 1]);
      } else {
#pragma unroll
        for (int j = 0; j < DT; ++j)
          *reinterpret_cast<float2*>(row + j * 8 + 2 * tig) = make_float2(o[j][2 * h], o[j][2 * h + 1]);
      }
    }
  }
  __syncthreads();
  // A thread combines 4 adjacent columns of a row per step, the steps unrolled so that
  // their shared loads and exp2s overlap (one element per step, in a rolled loop, left
  // each step's chain of latencies exposed: 16 steps at GQA 16).
  constexpr int Q4 = D / 4;                      // 4-column groups per row
  constexpr int STEPS = (16 * Q4 + THREADS - 1) / THREADS;
#pragma unroll
  for (int k = 0; k < STEPS; ++k) {
    const int e = tid + k * THREADS;
    if (e >= rows * Q4) break;
    const int i = e / Q4, d = e % Q4 * 4;
    float mx = -PD_INF;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmaxf(mx, sm_m[w][i]);
    // the sink: one more state of weight 1 at sinks[h] * log2(e), no value (as in v2)
    float sk = -PD_INF;
    if constexpr (SINK && !MERGE) {
      sk = sinks[h0 + i] * PD_LOG2E;
      mx = fmaxf(mx, sk);                        // a NaN sink is skipped here, poisons den
    }
    const float ref = mx == -PD_INF ? 0.f : mx;  // avoids (-inf) - (-inf)
    float num[4] = {0.f, 0.f, 0.f, 0.f}, den = SINK && !MERGE ? exp2f(sk - ref) : 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = exp2f(sm_m[w][i] - ref);
      const float4 x = *reinterpret_cast<const float4*>(comb + (w * 16 + i) * CLD + d);
      num[0] = fmaf(wt, x.x, num[0]); num[1] = fmaf(wt, x.y, num[1]);
      num[2] = fmaf(wt, x.z, num[2]); num[3] = fmaf(wt, x.w, num[3]);
      den = fmaf(wt, sm_l[w][i], den);
    }
    // den is 0 for an empty range and NaN when a score was not finite (a warp's NaN sum
    // survives its weight of 0): NaN output and LSE, never the empty answer
    const bool live = !(den <= 0.f);
    const float lse = live ? mx + log2f(den) : -PD_INF;
    // v_scale: an fp8 pool's V scale (1 for 16-bit pools; the K scale is in scale_log2)
    if constexpr (CLUSTER_MERGE) {
      // over warp 0's row: only this thread reads or writes these 4 columns of row i
      *reinterpret_cast<float4*>(comb + i * CLD + d) =
          live ? make_float4(num[0] / den * v_scale, num[1] / den * v_scale,
                             num[2] / den * v_scale, num[3] / den * v_scale)
               : make_float4(0.f, 0.f, 0.f, 0.f);
      if (d == 0) sm_lse[i] = lse;
    } else {
      const long long out_row = (long long)c * num_qo_heads + h0 + i;
#pragma unroll
      for (int u = 0; u < 4; ++u)
        v_out[out_row * D + d + u] = from_float<TO>(live ? num[u] / den * v_scale : 0.f);
      if (d == 0) lse_out[out_row] = lse;
    }
  }
  pd_stamp(3);                                   // timeline: this CTA's rows are written
  if constexpr (CLUSTER_MERGE) {
    cluster_merge<TF, D, CLD, PD_CLUSTER, THREADS, SINK>(
        comb, sm_lse, sinks, merged_out, merged_lse, num_qo_heads, r, h0, rows, tid);
  } else if constexpr (MERGE) {
    // the fence orders this thread's partial rows before the count that publishes them
    __shared__ int sm_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      const long long slot = (long long)r * gridDim.y + cell.slot;
      const int parts = o_indptr[r + 1] - o_indptr[r];
      const int done = atomicAdd(merge_counters + slot, 1) + 1;
      sm_last = done == parts;
      if (done == parts) merge_counters[slot] = 0;   // all of the slot counted
    }
    __syncthreads();
    if (!sm_last) return;
    __threadfence();                 // then read the other CTAs' rows, through L2
    // partial rows each warp loads at once: 8 makes 5-8 partials (8 x 8K over e4m3fn has
    // 8) one round trip instead of two; below head_dim 128 it costs registers (80 -> 128
    // at 64, NVRTC 13.0: 4 CTAs per SM where the ring holds 5), at 128 and up it does not
    // cost a CTA
    constexpr int MERGE_ROWS = D >= 128 ? 8 : 4;
    for (int i = warp; i < rows; i += NUM_WARPS)
      merge_group<TF, D, false, SINK, true, 1, MERGE_ROWS>(
          reinterpret_cast<const float*>(v_out), lse_out, o_indptr, nullptr, sinks, merged_out,
          merged_lse, num_qo_heads, r, h0 + i, lane);
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_MMA + CUDA_MERGE_GROUP + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# MLX ``metal_kernel`` dialect on ``simdgroup_matrix`` 8 x 8 tiles (``<metal_simdgroup_matrix>``):
# the CUDA kernel's contract, grid, chunk arithmetic, online softmax and warp combine, with
# Metal's shapes. One threadgroup per (chunk, KV head, row tile) as in CUDA (grid (C, Hkv *
# row_tiles), row_tiles = ceil(G / 16)); a threadgroup holds ROWS = 8 query rows (G <= 8:
# one 8-row matrix tile) or 16 (two tiles; G > 8), rows past G zero and never written.
# NUM_WARPS SIMD groups split the tokens: a stage holds KT = 8 * NUM_WARPS tokens of K and
# V in threadgroup memory and SIMD group w takes tokens [8 w, 8 w + 8) of it: S = Q K^T
# (HEAD_DIM / 8 products of half or bfloat tiles into a float accumulator per row tile),
# the online softmax on the accumulator's thread_elements(), O += P V (P rounded to T in
# the same lane layout, HEAD_DIM / 8 float accumulators per row tile). Metal has no
# cp.async: the stage after the current one is copied by ordinary loads and stores into
# the other half of a double buffer while the current one is computed, one barrier per
# stage. NUM_WARPS is the most SIMD groups (at most 4) whose double buffer and Q tile fit
# Metal's 32 KB of threadgroup memory (``metal_simdgroups``): 4 at head_dim 64 and 96, 3
# at 128, 1 at 256 (a choice of fit, not measured: nothing here ran on Apple hardware).
# Inputs (in order): q, k_pages, v_pages, indices, indptr, last_page_len,
# first_page_offset, request_indices, kv_tile_indices, sinks ([Hq] float32 with SINK, a
# stand-in otherwise), num_qo_heads, num_kv_heads, row_tiles, pages_per_chunk (0-d
# int32), scale_log2, soft_cap_log2, v_scale (0-d float32); outputs: v_out, lse_out.
# Template arguments, in order: T, TO (dtypes: T is q's; fp8 pools are uint8_t),
# HEAD_DIM, PAGE_SIZE, NUM_WARPS, SOFT_CAP, SINK, ROWS, KV_FP8 (the pools' fp8 format, 0
# for none: ``kernel_def.metal_fp8``; the codes are widened into T as they are staged).
# Launch: grid (C * NUM_WARPS * 32, Hkv * row_tiles, 1) threads, threadgroup
# (NUM_WARPS * 32, 1, 1).
METAL_TILE = 8                    # simdgroup_matrix rows, columns and depth
# 16 bytes of padding per threadgroup row, as MLX's steel attention pads its tiles (the
# bank effect is not measured here)
METAL_SMEM_PAD = 8                # TcShape::LD in the Metal header
METAL_TG_BYTES = 32 * 1024        # Metal's threadgroup memory per threadgroup
METAL_MAX_SIMDGROUPS = 4
METAL_INPUTS = ("q", "k_pages", "v_pages", "indices", "indptr", "last_page_len",
                "first_page_offset", "request_indices", "kv_tile_indices", "sinks",
                "num_qo_heads", "num_kv_heads", "row_tiles", "pages_per_chunk", "scale_log2",
                "soft_cap_log2", "v_scale")
METAL_OUTPUTS = ("v_out", "lse_out")


def metal_rows(group: int) -> int:
    """Query rows per threadgroup of the Metal dialect: one 8-row tile up to 8 heads per
    KV head, two above (the threadgroups per (chunk, KV head) stay ``row_tiles(group)``)."""
    return METAL_TILE if group <= METAL_TILE else ROWS


def metal_threadgroup_bytes(head_dim: int, simdgroups: int, rows: int = ROWS) -> int:
    """Threadgroup memory of the Metal dialect: the Q tile and the K/V double buffer (16-bit,
    padded rows) and the SIMD groups' row states (the combine's accumulators reuse the
    double buffer)."""
    ld = head_dim + METAL_SMEM_PAD
    ring = 2 * 2 * METAL_TILE * simdgroups * ld * 2
    return rows * ld * 2 + ring + 2 * simdgroups * rows * 4


def metal_simdgroups(head_dim: int) -> int:
    """SIMD groups per threadgroup of the Metal dialect: the most (at most 4) whose
    threadgroup memory fits 32 KB at 16 rows."""
    n = METAL_MAX_SIMDGROUPS
    while n > 1 and metal_threadgroup_bytes(head_dim, n) > METAL_TG_BYTES:
        n -= 1
    return n


METAL_TC = r"""
namespace pd {

// Shapes of one threadgroup (template arguments of the body).
template <int HEAD_DIM, int NUM_WARPS, int ROWS>
struct TcShape {
  static constexpr int LD = HEAD_DIM + 8;          // padded threadgroup row, in elements
  static constexpr int KT = 8 * NUM_WARPS;         // tokens per stage, 8 per SIMD group
  static constexpr int DT = HEAD_DIM / 8;          // 8-wide column tiles of a row
  static constexpr int MT = ROWS / 8;              // 8-row tiles
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int BUF = 2 * KT * LD;          // one buffer: KT rows of K, then of V
  static constexpr int RING_FLOATS = BUF;          // two buffers of 16-bit elements, in floats
  static constexpr int COMB = NUM_WARPS * ROWS * HEAD_DIM;   // the combine's floats
  static_assert(HEAD_DIM % 8 == 0, "head_dim must be a multiple of 8");
  static_assert(ROWS == 8 || ROWS == 16, "a threadgroup holds one or two 8-row tiles");
  static_assert(COMB <= RING_FLOATS, "the combine reuses the double buffer");
};

// The row and first column of this lane's two elements of an 8 x 8 matrix
// (thread_elements()): the layout MLX's kernels rely on (BaseMMAFrag<T, 8, 8>::get_coord),
// which the specification leaves unspecified.
inline int tile_row(uint lane) { return int((lane / 4 & 4) + (lane / 2) % 4); }
inline int tile_col(uint lane) { return int((lane / 4 & 2) * 2 + (lane % 2) * 2); }

// Copy stage `stage`'s KT tokens of K and V into one buffer (K rows [0, KT), V rows [KT,
// 2 KT), LD apart), tokens past the range zero-filled (their scores are masked and their
// zero V rows keep P V finite). Each token's page is looked up on its own: a stage may
// span pages of any size, from any first page offset. Every thread takes part. FP8: the
// fp8 format of uint8_t pools (0: pools of T), widened exactly by load4kv on the way in.
template <typename T, int HEAD_DIM, int PAGE_SIZE, int KT, int LD, int THREADS, int FP8,
          typename KP, typename IP>
inline void stage_kv(threadgroup T* buf, KP k_pages, KP v_pages, IP page_ids, long a_begin,
                     int n_tok, int stage, long head_off, long row_stride, uint tid) {
  constexpr int PIECES = HEAD_DIM / 4;             // 4-element pieces per row
  for (int e = int(tid); e < KT * PIECES; e += THREADS) {
    const int tok = e / PIECES, d = (e % PIECES) * 4;
    const int i = stage * KT + tok;                // token in the range
    threadgroup T* kd = buf + tok * LD + d;
    threadgroup T* vd = buf + (KT + tok) * LD + d;
    if (i < n_tok) {
      const long a = a_begin + i;                  // entry in the request's pages
      const long off = (long(page_ids[a / PAGE_SIZE]) * PAGE_SIZE + a % PAGE_SIZE) * row_stride
                       + head_off + d;
      if (FP8 == 0) {
        // explicit: the branch is compiled for fp8 pools too (uchar), and MSL converts
        // to bfloat only explicitly
        for (int j = 0; j < 4; ++j) {
          kd[j] = T(float(k_pages[off + j]));
          vd[j] = T(float(v_pages[off + j]));
        }
      } else {
        const float4 kf = load4kv<FP8>(k_pages + off), vf = load4kv<FP8>(v_pages + off);
        for (int j = 0; j < 4; ++j) {
          kd[j] = T(kf[j]);
          vd[j] = T(vf[j]);
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        kd[j] = T(0.0f);
        vd[j] = T(0.0f);
      }
    }
  }
}

// One SIMD group's 8 tokens (K rows kt, V rows vt of the current buffer; the first is
// token tok0 of the range) against row tile mt of the Q tile: S = Q K^T, the online
// softmax of this lane's row (m_run, and l_run over this lane's two columns), O += P V.
// Every lane of the SIMD group must call it (matrix operations are collectives).
// SOFT_CAP: scores capped at cap_log2 (log2 units, ``logit``).
template <typename T, int HEAD_DIM, int LD, bool SOFT_CAP>
inline void attend_tile(threadgroup const T* qt, threadgroup const T* kt, threadgroup const T* vt,
                        thread simdgroup_float8x8* o, thread float& m_run, thread float& l_run,
                        int tok0, int n_tok, float scale_log2, float cap_log2, uint lane) {
  constexpr int DT = HEAD_DIM / 8;
  simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8>(0.0f);
  for (int kk = 0; kk < DT; ++kk) {
    simdgroup_matrix<T, 8, 8> qa, kb;
    simdgroup_load(qa, qt + kk * 8, LD);
    // K^T: kb[d][t] = K[t][d]; the pointer is moved to the tile's origin rather than
    // passing matrix_origin, whose axes under transpose the specification leaves open
    simdgroup_load(kb, kt + kk * 8, LD, 0, true);
    simdgroup_multiply_accumulate(s, qa, kb, s);
  }
  // this lane holds the scores of row tile_row(lane), tokens tok0 + c + e (e = 0, 1)
  const int c = tile_col(lane);
  thread auto& se = s.thread_elements();
  float x[2];
  for (int e = 0; e < 2; ++e)
    x[e] = tok0 + c + e < n_tok ? logit<SOFT_CAP>(se[e] * scale_log2, cap_log2) : -INFINITY;
  // the row's max over its four lanes (its columns differ in lane bits 0 and 3)
  float mx = fmax(x[0], x[1]);
  mx = fmax(mx, simd_shuffle_xor(mx, ushort(1)));
  mx = fmax(mx, simd_shuffle_xor(mx, ushort(8)));
  mx = fmax(m_run, mx);
  const float ref = mx == -INFINITY ? 0.0f : mx;   // avoids (-inf) - (-inf)
  const float alpha = exp2(m_run - ref);
  m_run = mx;
  l_run *= alpha;
  // P in the pools' type, element for element in the accumulator's lane layout (the row
  // sums keep the float p)
  simdgroup_matrix<T, 8, 8> p;
  thread auto& pe = p.thread_elements();
  for (int e = 0; e < 2; ++e) {
    const float pr = exp2(x[e] - ref);
    l_run += pr;
    pe[e] = T(pr);
  }
  for (int j = 0; j < DT; ++j) {
    thread auto& oe = o[j].thread_elements();
    oe[0] *= alpha;
    oe[1] *= alpha;
    simdgroup_matrix<T, 8, 8> vb;
    simdgroup_load(vb, vt + j * 8, LD);
    simdgroup_multiply_accumulate(o[j], p, vb, o[j]);
  }
}

}  // namespace pd
"""

METAL_HEADER = METAL_COMMON + METAL_TC

METAL_SOURCE = r"""
  typedef pd::TcShape<HEAD_DIM, NUM_WARPS, ROWS> S;
  constexpr int LD = S::LD, KT = S::KT, DT = S::DT, MT = S::MT;
  const uint tid = thread_position_in_threadgroup.x;
  const uint lane = thread_index_in_simdgroup, warp = simdgroup_index_in_threadgroup;
  // one threadgroup per (chunk, KV head, row tile), the row tile fastest
  const int c = int(threadgroup_position_in_grid.x);
  const int kvh = int(threadgroup_position_in_grid.y) / row_tiles;
  const int rt = int(threadgroup_position_in_grid.y) % row_tiles;
  const int group = num_qo_heads / num_kv_heads;
  const int g0 = rt * ROWS;                        // first GQA row of this threadgroup
  const int rows = group - g0 < ROWS ? group - g0 : ROWS;   // live rows; the rest zero
  const int h0 = kvh * group + g0;                 // query head of row 0
  const int r = request_indices[c];
  const long tile = kv_tile_indices[c] < 0 ? 0 : kv_tile_indices[c];
  const long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long fpo = first_page_offset[r];
  const pd::TokenRange range = pd::chunk_tokens<PAGE_SIZE>(npages, last_page_len[r], fpo,
                                                           tile, pages_per_chunk);
  const long a_begin = fpo + range.t_begin;
  const int n_tok = int(range.t_end - range.t_begin);
  const int n_stages = (n_tok + KT - 1) / KT;

  threadgroup T qs[ROWS * LD];                     // [ROWS][LD]
  // the double buffer, [2][K, V][KT][LD] of T; the combine's float accumulators after
  // the loop (declared as float for their alignment)
  threadgroup float ring[S::RING_FLOATS];
  threadgroup float sm_m[NUM_WARPS * ROWS];
  threadgroup float sm_l[NUM_WARPS * ROWS];
  threadgroup T* kv = reinterpret_cast<threadgroup T*>(ring);

  // Q tile: row i is query head h0 + i, zeros past the live rows (published by the
  // loop's first barrier, or the combine's)
  for (int e = int(tid); e < ROWS * HEAD_DIM; e += S::THREADS) {
    const int i = e / HEAD_DIM, d = e % HEAD_DIM;
    qs[i * LD + d] = i < rows ? q[(long(r) * num_qo_heads + h0 + i) * HEAD_DIM + d] : T(0.0f);
  }

  simdgroup_float8x8 o[MT][DT];
  float m_run[MT], l_run[MT];                      // this lane's row of each row tile
  for (int mt = 0; mt < MT; ++mt) {
    m_run[mt] = -INFINITY;
    l_run[mt] = 0.0f;
    for (int j = 0; j < DT; ++j) o[mt][j] = make_filled_simdgroup_matrix<float, 8>(0.0f);
  }

  const long row_stride = long(num_kv_heads) * HEAD_DIM;   // elements per token
  const long head_off = long(kvh) * HEAD_DIM;
  const auto page_ids = indices + pb;             // device or constant space (MLX's choice)
  if (n_stages > 0)
    pd::stage_kv<T, HEAD_DIM, PAGE_SIZE, KT, LD, S::THREADS, KV_FP8>(
        kv, k_pages, v_pages, page_ids, a_begin, n_tok, 0, head_off, row_stride, tid);
  for (int stage = 0; stage < n_stages; ++stage) {
    // stage `stage`'s copies are visible, and every SIMD group is done with stage - 1,
    // whose buffer the copy below refills
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (stage + 1 < n_stages)
      pd::stage_kv<T, HEAD_DIM, PAGE_SIZE, KT, LD, S::THREADS, KV_FP8>(
          kv + ((stage + 1) % 2) * S::BUF, k_pages, v_pages, page_ids, a_begin, n_tok,
          stage + 1, head_off, row_stride, tid);
    threadgroup const T* buf = kv + (stage % 2) * S::BUF;
    const int tok0 = stage * KT + int(warp) * 8;   // this SIMD group's first token
    if (tok0 < n_tok) {                            // SIMD-group uniform: a tail group sits out
      for (int mt = 0; mt < MT; ++mt)
        if (mt * 8 < rows)                         // threadgroup uniform: skip padding tiles
          pd::attend_tile<T, HEAD_DIM, LD, SOFT_CAP>(
              qs + mt * 8 * LD, buf + int(warp) * 8 * LD, buf + (KT + int(warp) * 8) * LD,
              o[mt], m_run[mt], l_run[mt], tok0, n_tok, scale_log2, soft_cap_log2, lane);
    }
  }

  // Combine the SIMD groups' states: accumulators of group w, row i at comb[(w * ROWS +
  // i) * HEAD_DIM] (over the double buffer: every group is past its last read once the
  // barrier below releases), states in sm_m / sm_l; then every live row normalized, with
  // its log2 LSE (as in CUDA).
  threadgroup float* comb = ring;
  for (int mt = 0; mt < MT; ++mt) {                // row sums over a row's four lanes
    l_run[mt] += simd_shuffle_xor(l_run[mt], ushort(1));
    l_run[mt] += simd_shuffle_xor(l_run[mt], ushort(8));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int mt = 0; mt < MT; ++mt) {
    const int i = mt * 8 + pd::tile_row(lane);
    if (pd::tile_col(lane) == 0) {
      sm_m[int(warp) * ROWS + i] = m_run[mt];
      sm_l[int(warp) * ROWS + i] = l_run[mt];
    }
    for (int j = 0; j < DT; ++j)
      simdgroup_store(o[mt][j], comb + (int(warp) * ROWS + mt * 8) * HEAD_DIM + j * 8,
                      HEAD_DIM);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(tid); e < rows * HEAD_DIM; e += S::THREADS) {
    const int i = e / HEAD_DIM, d = e % HEAD_DIM;
    float mx = -INFINITY;
    for (int w = 0; w < NUM_WARPS; ++w) mx = fmax(mx, sm_m[w * ROWS + i]);
    // the sink: one more state of weight 1 at sinks[h] * log2(e), no value (as in CUDA)
    float sk = -INFINITY;
    if (SINK) {
      sk = float(sinks[h0 + i]) * PD_LOG2E;
      mx = fmax(mx, sk);                             // a NaN sink is skipped here, poisons den
    }
    const float ref = mx == -INFINITY ? 0.0f : mx;   // avoids (-inf) - (-inf)
    float num = 0.0f, den = SINK ? exp2(sk - ref) : 0.0f;
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float wt = exp2(sm_m[w * ROWS + i] - ref);
      num = fma(wt, comb[(w * ROWS + i) * HEAD_DIM + d], num);
      den = fma(wt, sm_l[w * ROWS + i], den);
    }
    // den is 0 for an empty range and NaN when a score was not finite: NaN output and
    // LSE, never the empty answer
    const bool live = !(den <= 0.0f);
    const long out_row = long(c) * num_qo_heads + h0 + i;
    // v_scale: an fp8 pool's V scale (1 for 16-bit pools; the K scale is in scale_log2)
    v_out[out_row * HEAD_DIM + d] = pd::from_float<TO>(live ? num / den * v_scale : 0.0f);
    if (d == 0) lse_out[out_row] = live ? mx + log2(den) : -INFINITY;
  }
"""


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"T": Dtype(spec.q_dtype), "TKV": Dtype(spec.kv_dtype), "TO": Dtype(spec.out_dtype),
            "HEAD_DIM": spec.head_dim, "PAGE_SIZE": spec.page_size,
            "NUM_WARPS": spec.num_warps, "STAGES": spec.stages, "SOFT_CAP": spec.soft_cap,
            "SINK": spec.sink, "ROWS": spec.heads_per_cta, "KV_FP8": metal_fp8(spec.kv_dtype),
            "MERGE": bool(spec.merged_dtype),
            "TF": Dtype(spec.merged_dtype or spec.out_dtype)}


KERNEL = KernelDef(
    kernel="v2tc", cuda_name="pd_decode_v2_tc", cuda_source=CUDA_SOURCE,
    template=("T", "TKV", "TO", "HEAD_DIM", "PAGE_SIZE", "NUM_WARPS", "STAGES", "SOFT_CAP",
              "SINK", "MERGE", "TF"),
    arguments=_arguments, threads=lambda spec: spec.num_warps * 32,
    dynamic_smem=lambda spec: dynamic_smem_bytes(spec.head_dim, spec.num_warps, spec.stages,
                                                 kv_bytes(spec.kv_dtype)),
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS),
    # Metal has a fixed double buffer, and its row count per threadgroup (8 or 16: CUDA's
    # mma tile is always 16) is a template argument; its pools' element is the array's own
    # (uint8_t for fp8), the format a number
    cuda_only=("TKV", "STAGES", "MERGE", "TF"), metal_only=("ROWS", "KV_FP8"))
