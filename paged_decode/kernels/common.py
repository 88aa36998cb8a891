"""Device helpers shared by every CUDA kernel (prepended to each kernel's source).

16-byte vector loads of K/V rows, conversion of those vectors to float (fp8 pools:
``fp8_convert.py``, appended here), scalar loads and stores of q and outputs in any
supported dtype, and the butterfly reductions.
"""

from .fp8_convert import CUDA_FP8, METAL_FP8

CUDA_COMMON = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC compiles without the C math headers, so INFINITY is spelled out here.
#define PD_INF __int_as_float(0x7f800000)
#define PD_NAN __int_as_float(0x7fffffff)

namespace pd {

// A score that is not finite (a NaN or infinite q or K element, or an overflow) becomes
// NaN: it then poisons its head's running sum and accumulators instead of passing for a
// masked token (fmaxf skips NaN, exp2f(NaN) is NaN, 0 * NaN is NaN).
__device__ __forceinline__ float finite_or_nan(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u ? PD_NAN : x;
}

// log2(e): a sink logit (natural units) in the kernels' log2 units.
#define PD_LOG2E 1.4426950408889634f

// tanh on the hardware exp2 and reciprocal, a few ulp of relative error everywhere:
// 1 - 2 / (2^(2 |y| log2 e) + 1) from |y| = 1/8 on (no cancellation there: the result is
// at least 0.124), its odd series to y^7 below (truncation < 2e-10 relative). tanhf costs
// about 40 instructions with its division; the soft-capped v2tc partial took 1.4-1.8x its
// plain GPU time with it (H200, run S7-R3).
__device__ __forceinline__ float tanh_fast(float y) {
  const float a = fabsf(y), y2 = y * y;
  const float big = 1.f - __fdividef(2.f, exp2f(a * (2.f * PD_LOG2E)) + 1.f);
  const float small = y * fmaf(y2, fmaf(y2, fmaf(y2, -17.f / 315.f, 2.f / 15.f), -1.f / 3.f), 1.f);
  return a < 0.125f ? small : copysignf(big, y);
}

// The logit the softmax sees, in log2 units: a non-finite score becomes NaN
// (finite_or_nan first: tanh would turn an infinite score into a finite one), then with
// SOFT_CAP it is capped at cap = c * log2(e): cap * tanh(x / cap) (docs/variants.md).
template <bool SOFT_CAP>
__device__ __forceinline__ float logit(float x, float cap) {
  x = finite_or_nan(x);
  if constexpr (SOFT_CAP) x = cap * tanh_fast(x * (1.f / cap));
  return x;
}

// A K/V element type: how many live in one 16-byte vector, and how to widen them.
template <typename T> struct KV;
template <> struct KV<__half> {
  static constexpr int PER16 = 8;
  static __device__ __forceinline__ void widen(const uint4& u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 t = __half22float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
  }
};
template <> struct KV<__nv_bfloat16> {
  static constexpr int PER16 = 8;
  static __device__ __forceinline__ void widen(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 t = __bfloat1622float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
  }
};
template <> struct KV<float> {
  static constexpr int PER16 = 4;
  static __device__ __forceinline__ void widen(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
};

// The ring's 16-byte pieces: kv_piece is the global address of load j of a lane whose
// elements start at p, widen_piece widens the KV<T>::PER16 elements the lane takes from
// a piece (all of it here; fp8 lanes share pieces in pairs: fp8_convert.py, sel & 1 picks
// the half).
template <typename T>
__device__ __forceinline__ const uint4* kv_piece(const T* p, int j) {
  return reinterpret_cast<const uint4*>(p) + j;
}
template <typename T>
__device__ __forceinline__ void widen_piece(const uint4& u, float* f, int sel) { KV<T>::widen(u, f); }

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// Sum over aligned groups of WIDTH lanes (WIDTH a power of two <= 32); every lane of the
// group gets the total. All 32 lanes must call it.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off >= 1; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// Per-CTA timeline stamps (diagnostics: ``PAGED_DECODE_TIMELINE=1`` compiles every kernel
// with PD_TIMELINE, ``bench/device/timeline.py`` reads them). With PD_TIMELINE, and once
// the host has pointed pd_timeline at a buffer of PD_TIMELINE_FIELDS uint64 per CTA
// (grid order: blockIdx.y * gridDim.x + blockIdx.x), thread 0 of a kernel that stamps
// writes its SM (field 0, at stamp 0) and %globaltimer nanoseconds (field 1 + i) at
// stamp i. Otherwise, and on the emulator, pd_stamp compiles to nothing.
#define PD_TIMELINE_FIELDS 5
#ifdef PD_TIMELINE
extern "C" {   // C linkage: the host finds it by this name in every module
__device__ unsigned long long* pd_timeline = nullptr;
}
#endif
__device__ __forceinline__ void pd_stamp(int i) {
#if defined(PD_TIMELINE) && defined(__CUDA_ARCH__)
  if (threadIdx.x == 0 && pd_timeline != nullptr) {
    const unsigned long long at =
        ((unsigned long long)blockIdx.y * gridDim.x + blockIdx.x) * PD_TIMELINE_FIELDS;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (i == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      pd_timeline[at] = sm;
    }
    pd_timeline[at + 1 + i] = t;
  }
#else
  (void)i;
#endif
}

// Asynchronous 16-byte global->shared copies (sm_80+). With pred false the 16 bytes are
// zero-filled and global memory is not read. Each thread waits for its own groups only.
// Without __CUDA_ARCH__: the CPU emulator (PD_EMU_CP_ASYNC) keeps each copy in flight
// until the wait that lands its group, its destination poisoned meanwhile, so reading a
// slot too early or refilling one another thread still reads shows up; any other host
// compiler copies synchronously (a copy that landed at once).
// PD_L2_PREFETCH (0, 64, 128 or 256; the host passes ``specs.l2_prefetch_bytes(spec)``, and
// this default matches ``specs.L2_PREFETCH``): the L2 prefetch size each copy hints, so that
// L2 asks DRAM for whole lines at once.
#ifndef PD_L2_PREFETCH
#define PD_L2_PREFETCH 128
#endif
#if PD_L2_PREFETCH == 256
#define PD_L2_HINT ".L2::256B"
#elif PD_L2_PREFETCH == 128
#define PD_L2_HINT ".L2::128B"
#elif PD_L2_PREFETCH == 64
#define PD_L2_HINT ".L2::64B"
#elif PD_L2_PREFETCH == 0
#define PD_L2_HINT ""
#else
#error "PD_L2_PREFETCH must be 0, 64, 128 or 256"
#endif
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__)
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global" PD_L2_HINT " [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(pred ? 16 : 0));
#elif defined(PD_EMU_CP_ASYNC)
  pd_emu::cp_async16(smem, gmem, pred);
#else
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (pred) v = *reinterpret_cast<const uint4*>(gmem);
  *reinterpret_cast<uint4*>(smem) = v;
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#elif defined(PD_EMU_CP_ASYNC)
  pd_emu::cp_async_commit();
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#elif defined(PD_EMU_CP_ASYNC)
  pd_emu::cp_async_wait(N);
#endif
}

// Programmatic dependent launch (sm_90+; elsewhere, and on the emulator, nothing). A
// partial allows the grid launched after it with the programmatic-serialization attribute
// (the merge: backends/cuda_pdl.py) to be scheduled while its own CTAs still run; that
// grid's CTAs wait, first thing, until this grid has finished and its writes are visible.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#ifndef PD_CLUSTER
#define PD_CLUSTER 1
#endif
#if PD_CLUSTER > 1
// Thread-block clusters (sm_90): the CTA's rank in its cluster; a barrier of every thread
// of the cluster whose arrival releases and whose wait acquires (shared-memory writes
// before it are visible to every CTA of the cluster after it); the address of the same
// shared variable in CTA `rank` of the cluster (distributed shared memory, read through
// a generic pointer).
#if defined(__CUDA_ARCH__)
#define PD_CLUSTER_DIMS __cluster_dims__(PD_CLUSTER, 1, 1)
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  __syncwarp();   // .aligned: the warp's threads must execute the barrier together
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
template <typename X>
__device__ __forceinline__ const X* cluster_map(const X* p, unsigned rank) {
  unsigned long long a;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(a) : "l"(p), "r"(rank));
  return reinterpret_cast<const X*>(a);
}
#else
#define PD_CLUSTER_DIMS
__device__ __forceinline__ unsigned cluster_rank() { return pd_emu::cluster_rank(); }
__device__ __forceinline__ void cluster_sync() {
  __syncwarp();   // as on a GPU: the warp meets first
  pd_emu::cluster_sync();
}
template <typename X>
__device__ __forceinline__ const X* cluster_map(const X* p, unsigned rank) {
  return static_cast<const X*>(pd_emu::cluster_map(p, rank));
}
#endif
#else
#define PD_CLUSTER_DIMS
#endif

// The visible tokens [t_begin, t_end) of chunk `tile` of a request (pages [tile * ppc,
// (tile + 1) * ppc) of its npages, the first `fpo` entries of its first page retired, its
// last page holding last_len entries): token t lives at entry fpo + t of the request's
// pages. A chunk past the end, or of an empty request, is empty.
struct TokenRange { long long t_begin, t_end; };
template <int PAGE_SIZE>
__device__ __forceinline__ TokenRange chunk_tokens(long long npages, long long last_len, long long fpo,
                                                   long long tile, int pages_per_chunk) {
  long long seq = npages > 0 ? (npages - 1) * PAGE_SIZE + last_len - fpo : 0;
  seq = seq < 0 ? 0 : seq;
  const long long page_begin = tile * pages_per_chunk;
  const long long page_end = page_begin + pages_per_chunk < npages ? page_begin + pages_per_chunk : npages;
  long long t_begin = page_begin * PAGE_SIZE - fpo;
  t_begin = t_begin < 0 ? 0 : (t_begin > seq ? seq : t_begin);
  long long t_end = page_end >= npages ? seq : page_end * PAGE_SIZE - fpo;
  t_end = t_end < 0 ? 0 : (t_end > seq ? seq : t_end);
  return {t_begin, t_end};
}

// The place of a CTA in a (chunks, head slots) grid of `per_head` slots per KV head: its
// chunk, slot, KV head (slot / per_head) and slot within that head (slot % per_head).
// CTAs are handed out in linear order (x fastest), so chunks first (the grid's own order)
// runs one head's chunks of many requests side by side, and requests that share pages
// read them at about the same time. PD_HEADS_FIRST numbers the head slots of a chunk
// first instead: their K/V rows of one page row are adjacent in the [num_pages, P, Hkv,
// D] pools, so an L2 prefetch that runs past one head's row (head_dim 96: a 192-byte row
// under a 128-byte hint) fetches what the next head's CTA, running alongside, reads next,
// not bytes evicted before that CTA starts; over fp8 rows (128 bytes at head_dim 128) the
// heads' rows are read together. The host sets it per kernel (specs.heads_first).
// Unsigned, as blockIdx is: a signed division of the slot cost v2tc 296 SASS
// instructions at head_dim 128 under NVRTC 13.0 (index arithmetic downstream of it).
// PD_CLUSTER > 1 (the cluster merge, v2tc): clusters of PD_CLUSTER CTAs along x, each one
// request's PD_CLUSTER chunks (every request has that many) of one head slot; heads first
// then orders whole clusters, head slots first.
#ifndef PD_HEADS_FIRST
#define PD_HEADS_FIRST 0
#endif
struct GridCell { unsigned chunk, slot, kv_head, sub; };
__device__ __forceinline__ GridCell grid_cell(unsigned per_head) {
#if PD_HEADS_FIRST && PD_CLUSTER > 1
  const unsigned long long l = (unsigned long long)blockIdx.y * gridDim.x + blockIdx.x;
  const unsigned long long cl = l / PD_CLUSTER;          // the cluster's place
  const unsigned slot = (unsigned)(cl % gridDim.y);
  const unsigned chunk = (unsigned)(cl / gridDim.y * PD_CLUSTER + l % PD_CLUSTER);
#elif PD_HEADS_FIRST
  const unsigned long long l = (unsigned long long)blockIdx.y * gridDim.x + blockIdx.x;
  const unsigned chunk = (unsigned)(l / gridDim.y), slot = (unsigned)(l % gridDim.y);
#else
  const unsigned chunk = blockIdx.x, slot = blockIdx.y;
#endif
  return {chunk, slot, slot / per_head, slot % per_head};
}

__host__ __device__ constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }

}  // namespace pd
""" + CUDA_FP8

# Metal dialect (MLX ``metal_kernel`` header text). MLX pastes ``header`` verbatim after
# its ``utils.h`` (``using namespace metal``, ``bfloat16_t``); template values are not
# visible here, so every helper is a template. Pointer arguments whose address space
# depends on the input's size (MLX passes inputs of fewer than 8 elements in the
# ``constant`` space) are template parameters too. ASCII only (MLX passes sources as ASCII).
METAL_COMMON = r"""
namespace pd {

// A non-finite score becomes NaN, which poisons its head's state (as in CUDA).
inline float finite_or_nan(float x) { return isfinite(x) ? x : NAN; }

// log2(e): a sink logit (natural units) in the kernels' log2 units.
#define PD_LOG2E 1.4426950408889634f

// The logit the softmax sees (log2 units): NaN for a non-finite score, then capped at
// cap = c * log2(e) with SOFT_CAP (as in CUDA; precise tanh: fast math is not trusted
// with large arguments, and nothing here has run on Apple hardware).
template <bool SOFT_CAP>
inline float logit(float x, float cap) {
  x = finite_or_nan(x);
  if (SOFT_CAP) x = cap * precise::tanh(x / cap);
  return x;
}

template <typename T> inline float to_float(T x) { return static_cast<float>(x); }
template <typename T> inline T from_float(float x) { return static_cast<T>(x); }

// Four consecutive K/V elements as a float4: one vector load for half and float rows in
// device memory, four scalar loads otherwise (bfloat, or a constant-space input).
inline float4 load4(const device half* p) {
  return float4(*reinterpret_cast<const device half4*>(p));
}
inline float4 load4(const device float* p) {
  return *reinterpret_cast<const device float4*>(p);
}
template <typename P>
inline float4 load4(P p) {
  return float4(float(p[0]), float(p[1]), float(p[2]), float(p[3]));
}

// Sum over aligned groups of WIDTH lanes of the SIMD group (WIDTH a power of two <= 32);
// every lane of the group gets the total. All 32 lanes must call it.
template <int WIDTH>
inline float group_sum(float x) {
  if (WIDTH == 32) return simd_sum(x);
  for (ushort off = WIDTH / 2; off >= 1; off >>= 1) x += simd_shuffle_xor(x, off);
  return x;
}

// The visible tokens [t_begin, t_end) of chunk `tile` of a request, for the Metal v2 and
// v2tc bodies: CUDA's chunk_tokens (token t lives at entry fpo + t of the request's pages;
// a chunk past the end, or of an empty request, is empty).
struct TokenRange { long t_begin, t_end; };
template <int PAGE_SIZE>
inline TokenRange chunk_tokens(long npages, long last_len, long fpo, long tile, long ppc) {
  long seq = npages > 0 ? (npages - 1) * PAGE_SIZE + last_len - fpo : 0;
  seq = seq < 0 ? 0 : seq;
  const long page_begin = tile * ppc;
  const long page_end = page_begin + ppc < npages ? page_begin + ppc : npages;
  long t_begin = page_begin * PAGE_SIZE - fpo;
  t_begin = t_begin < 0 ? 0 : (t_begin > seq ? seq : t_begin);
  long t_end = page_end >= npages ? seq : page_end * PAGE_SIZE - fpo;
  t_end = t_end < 0 ? 0 : (t_end > seq ? seq : t_end);
  TokenRange range;
  range.t_begin = t_begin;
  range.t_end = t_end;
  return range;
}

constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }

}  // namespace pd
""" + METAL_FP8
