"""The shared-prefix kernel of cascade decode: level 0 on tensor cores (CUDA, sm_80+).

Level 0 of a cascade attends the ``R = M * G`` stacked query rows of one KV head (M
members, G query heads per KV head) to the same shared pages. That is a small prefill-like
matrix product, so this kernel runs it as one: a CTA takes a tile of 16 * NUM_WARPS rows
of one KV head and one chunk of the prefix, stages K/V tiles of KT tokens in shared
memory once for all its rows, and computes S = Q K^T and O += P V with
``mma.sync.m16n8k16`` (f16 or bf16 inputs, float32 accumulators) under an online softmax
in base 2. Each prefix K/V element is read once per row tile instead of once per 8 rows
(the v2 partial at 8 heads per CTA).

Contract (CUDA dialect; the Metal backend runs level 0 on the stacked v2 partial instead):
``q [B, Hq, D]`` (the batch's queries, same dtype as the pools), ``k_pages, v_pages
[num_pages, P, Hkv, D]`` (f16 or bf16), ``page_ids [S]`` (the shared pages, all full),
``members [M]`` (request indices), chunk ``c`` covers pages ``[c * ppc, min((c + 1) * ppc,
S))`` -> ``v_out [M * C, Hq, D]`` float32, row ``m * C + c`` = member ``m``'s chunk ``c``
(member-major, as the merge input of ``cascade.run_cascade`` wants it), each row
normalized by its own softmax denominator, and ``lse_out [M * C, Hq]`` float32 in log2
units. Every row, head and column of both outputs is written; an empty chunk writes zeros
and ``-inf``. Pool offsets are 64-bit.

The fragment layouts and the per-warp tile phases (S = Q K^T, the online softmax, O += P V)
are ``mma.py``'s, shared with the tensor-core decode partial.
"""

from __future__ import annotations

from .. import settings
from ..errors import InvalidArgumentError, env_positive_int
from .common import CUDA_COMMON
from .kernel_def import Dtype, KernelDef, KernelSpec, TemplateValue
from .mma import ALIGN_SLACK, CUDA_MMA, tile_row_bytes

NUM_WARPS = 4
ROWS_PER_WARP = 16
SMEM_PAD = 8                  # elements of padding per smem row (bank-conflict-free frags)


TILE_ENV = "PAGED_DECODE_PREFIX_TILE"


def tokens_per_tile(head_dim: int) -> int:
    """K/V tokens per shared-memory tile (``KT`` in the kernel): 64, 32 at head_dim 256
    (registers and shared memory); ``PAGED_DECODE_PREFIX_TILE`` (32 or 64) overrides."""
    env = settings.get(TILE_ENV)
    if env:
        if env not in ("32", "64"):
            raise InvalidArgumentError(f"{TILE_ENV} must be 32 or 64, got {env!r}")
        return int(env)
    return 64 if head_dim <= 128 else 32


def dynamic_smem_bytes(head_dim: int, num_warps: int = NUM_WARPS,
                       tile: int | None = None) -> int:
    """The Q tile (padded 16-bit rows) plus a double-buffered K and V tile (16-bit rows,
    unpadded and swizzled: ``tile_at``) that the kernel aligns to 128 bytes in 128 bytes
    of slack."""
    q_row = (head_dim + SMEM_PAD) * 2
    kt = tokens_per_tile(head_dim) if tile is None else tile
    return (ROWS_PER_WARP * num_warps * q_row + ALIGN_SLACK
            + 2 * 2 * kt * tile_row_bytes(head_dim * 2))


CTAS_ENV = "PAGED_DECODE_PREFIX_CTAS_PER_SM"


def ctas_per_sm(head_dim: int, smem_per_sm: int) -> int:
    """Prefix CTAs one SM holds by shared memory (1 KB per block reserved), 1 to 4 (4 by
    registers at head_dim 64; measured 181 registers at 128, 241 at 256 on sm_90, which
    allow 2);
    ``PAGED_DECODE_PREFIX_CTAS_PER_SM`` overrides (tuning)."""
    env = env_positive_int(CTAS_ENV)
    if env is not None:
        return env
    fit = smem_per_sm // (dynamic_smem_bytes(head_dim) + 1024)
    return max(1, min(4, fit))


CUDA_BODY = r"""
namespace pd {

extern __shared__ __align__(16) unsigned char pd_prefix_smem[];

// Staging: piece `piece` (16 bytes: 8 16-bit elements) of the K and V
// rows of one token (entry `entry` of pool page `page`, KV head `kvh`) into row `tok` of
// the shared-memory tiles `ks` / `vs` (laid out by tile_at<ROWB, GRP>) with cp.async;
// `ok` false zero-fills both without reading global memory.
template <typename T, int D, int ROWB, int GRP>
__device__ __forceinline__ void stage_kv_piece(unsigned char* ks, unsigned char* vs,
                                               const T* k_pages, const T* v_pages, int tok,
                                               int page, int entry, int kvh, int piece, bool ok,
                                               long long page_stride, long long row_stride) {
  constexpr int PER = 16 / (int)sizeof(T);       // elements per piece
  const T* kp = k_pages;
  const T* vp = v_pages;
  if (ok) {
    const long long off = (long long)page * page_stride
                          + (long long)entry * row_stride + (long long)kvh * D + piece * PER;
    kp += off;
    vp += off;
  }
  cp_async16(ks + tile_at<ROWB, GRP>(tok, piece), kp, ok);
  cp_async16(vs + tile_at<ROWB, GRP>(tok, piece), vp, ok);
}

}  // namespace pd

// grid: (C * row_tiles, Hkv) with the row tile fastest (the CTAs reading one chunk of one
// KV head run side by side and share its K/V in L2); block: NUM_WARPS * 32 threads.
template <typename T, int HEAD_DIM, int PAGE_SIZE, int NUM_WARPS, int KT>
__global__ void __launch_bounds__(NUM_WARPS * 32) pd_prefix_tc(
    const T* __restrict__ q,                  // [B, Hq, D]
    const T* __restrict__ k_pages,            // [num_pages, P, Hkv, D]
    const T* __restrict__ v_pages,            // [num_pages, P, Hkv, D]
    const int* __restrict__ page_ids,         // [S], the shared pages
    const int* __restrict__ members,          // [M]
    float* __restrict__ v_out,                // [M * C, Hq, D]
    float* __restrict__ lse_out,              // [M * C, Hq], log2
    int num_shared_pages, int num_members, int num_chunks, int pages_per_chunk,
    int num_qo_heads, int num_kv_heads, int row_tiles, float scale_log2) {
  using namespace pd;
  constexpr int D = HEAD_DIM;
  constexpr int ROWS = 16 * NUM_WARPS;           // query rows per CTA
  constexpr int LD = D + 8;                      // padded Q row, in elements
  using Row = TileRow<D * 2>;                    // K/V rows, swizzled
  constexpr int GRP = Row::GROUP;
  constexpr int ROWB = Row::BYTES;
  constexpr int THREADS = NUM_WARPS * 32;
  constexpr int PIECES = D / 8;                  // 16-byte pieces per row
  constexpr int NT = KT / 8;                     // 8-token column tiles of S
  constexpr int DT = D / 8;                      // 8-wide column tiles of O
  static_assert(D % 16 == 0, "head_dim must be a multiple of 16");
  static_assert(KT % 16 == 0 && (D / 8) % 2 == 0, "ldmatrix takes 16-token, 16-column blocks");
  static_assert((KT * PIECES) % THREADS == 0, "a K/V tile must split evenly over the threads");

  unsigned char* smem = pd_prefix_smem;
  T* qs = reinterpret_cast<T*>(smem);                // [ROWS][LD]
  // [2][KT] rows of ROWB, 128-byte aligned for the swizzle (the host adds the slack)
  unsigned char* ks = align_smem(reinterpret_cast<unsigned char*>(qs + ROWS * LD));
  unsigned char* vs = ks + 2 * KT * ROWB;                                  // [2][KT] rows of ROWB

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tig = lane & 3;
  const int c = blockIdx.x / row_tiles, rt = blockIdx.x % row_tiles;
  const int kvh = blockIdx.y;
  const int group = num_qo_heads / num_kv_heads;
  const int rows = num_members * group;          // stacked rows of this KV head
  const int page_begin = c * pages_per_chunk;
  const int page_end = min(page_begin + pages_per_chunk, num_shared_pages);
  const int t_begin = page_begin * PAGE_SIZE;
  const int n_tok = page_end > page_begin ? (page_end - page_begin) * PAGE_SIZE : 0;
  const int n_tiles = (n_tok + KT - 1) / KT;

  // Q tile: row i of this CTA is stacked row rt * ROWS + i = member m, head kvh * G + g.
  for (int e = tid; e < ROWS * D; e += THREADS) {
    const int i = e / D, d = e % D, row = rt * ROWS + i;
    T x = from_float<T>(0.f);
    if (row < rows) {
      const int m = row / group, g = row % group;
      x = q[((long long)members[m] * num_qo_heads + kvh * group + g) * D + d];
    }
    qs[i * LD + d] = x;
  }

  const long long row_stride = (long long)num_kv_heads * D;            // elements per token
  const long long page_stride = (long long)PAGE_SIZE * row_stride;
  // The page ids of the tokens a thread copies are loaded one tile ahead of their copies
  // (fetch), so issuing a tile's cp.async never waits on a global load.
  constexpr int PER_THREAD = KT * PIECES / THREADS;
  int ids[PER_THREAD];
  auto fetch = [&](int tile) {
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int i = tile * KT + (tid + j * THREADS) / PIECES;          // token in the chunk
      ids[j] = i < n_tok ? page_ids[(t_begin + i) / PAGE_SIZE] : 0;
    }
  };
  auto issue = [&](int tile) {                   // with the ids fetched for this tile
    const int buf = tile & 1;
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      const int e = tid + j * THREADS, tok = e / PIECES, piece = e % PIECES;
      const int i = tile * KT + tok;                                   // token in the chunk
      stage_kv_piece<T, D, ROWB, GRP>(ks + buf * KT * ROWB, vs + buf * KT * ROWB, k_pages,
                                      v_pages, tok, ids[j], (t_begin + i) % PAGE_SIZE, kvh,
                                      piece, i < n_tok, page_stride, row_stride);
    }
    cp_async_commit();
  };

  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-PD_INF, -PD_INF}, l_run[2] = {0.f, 0.f};   // rows grp, grp + 8
  const T* qw = qs + warp * 16 * LD;

  if (n_tiles > 0) {
    fetch(0);
    issue(0);
    fetch(1);
  }
  for (int tile = 0; tile < n_tiles; ++tile) {
    const int buf = tile & 1;
    if (tile + 1 < n_tiles) {
      issue(tile + 1);
      fetch(tile + 2);                            // consumed by the next round's issue
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();                              // this tile (and the Q tile) landed
    const unsigned char* kt = ks + buf * KT * ROWB;

    // S = Q K^T for this warp's 16 rows and KT tokens, the online softmax, O += P V
    float s[NT][4];
    qk_tile<T, D, LD, NT, ROWB, GRP>(s, qw, kt);
    softmax_tile<NT, DT>(s, m_run, l_run, o, tile * KT + 2 * tig, n_tok, scale_log2);
    pv_tile<T, LD, NT, DT, ROWB, GRP>(o, s, vs + buf * KT * ROWB);
    __syncthreads();                              // buffer `buf` is refilled next round
  }

  row_sums(l_run);                               // finish: the full row sums
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = rt * ROWS + warp * 16 + grp + 8 * h;
    if (row >= rows) continue;
    const int m = row / group, g = row % group;
    const long long out_row = ((long long)m * num_chunks + c) * num_qo_heads + kvh * group + g;
    const bool live = !(l_run[h] <= 0.f);          // NaN (a non-finite score) propagates
    const float inv = live ? 1.f / l_run[h] : 0.f;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      float2 val = make_float2(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      *reinterpret_cast<float2*>(v_out + out_row * D + j * 8 + 2 * tig) = val;
    }
    if (tig == 0) lse_out[out_row] = live ? m_run[h] + log2f(l_run[h]) : -PD_INF;
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_MMA + CUDA_BODY


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"T": Dtype(spec.kv_dtype), "HEAD_DIM": spec.head_dim, "PAGE_SIZE": spec.page_size,
            "NUM_WARPS": spec.num_warps, "KT": spec.tile_tokens}


KERNEL = KernelDef(
    kernel="prefix", cuda_name="pd_prefix_tc", cuda_source=CUDA_SOURCE,
    template=("T", "HEAD_DIM", "PAGE_SIZE", "NUM_WARPS", "KT"), arguments=_arguments,
    threads=lambda spec: spec.num_warps * 32,
    dynamic_smem=lambda spec: dynamic_smem_bytes(spec.head_dim, spec.num_warps,
                                                 spec.tile_tokens))
