"""The CUDA-dialect prelude: the types and built-ins our CUDA kernels use, on the CPU.

Included (as ``pd_emu_cuda.h``) ahead of the kernel source; ``<cuda_fp16.h>`` and
``<cuda_bf16.h>`` resolve to empty stubs. ``__shared__`` declarations are not macros:
``rewrite.py`` turns them into references into the running block's arena.
"""

CUDA_PRELUDE = r"""
#pragma once
#include "pd_emu_rt.h"

// ------------------------------------------------------------------ qualifiers
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __constant__ static

// ------------------------------------------------------------------ vector types
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// ------------------------------------------------------------------ bit casts
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
// byte i of the result is byte (s >> 4i) & 7 of {y, x} (x bytes 0-3, y bytes 4-7): the
// CUDA intrinsic's default mode
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long in = ((unsigned long long)y << 32) | x;
  unsigned r = 0u;
  for (int i = 0; i < 4; ++i)
    r |= (unsigned)((in >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}

// ------------------------------------------------------------------ half and bfloat16
struct __half {
  unsigned short __x;
};
struct __half2 { __half x, y; };
struct __nv_bfloat16 {
  unsigned short __x;
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };

inline float __half2float(__half h) {
  _Float16 v;
  std::memcpy(&v, &h.__x, 2);
  return (float)v;
}
inline __half __float2half_rn(float f) {
  const _Float16 v = (_Float16)f;   // IEEE round-to-nearest-even
  __half h;
  std::memcpy(&h.__x, &v, 2);
  return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float a, float b) {
  return {__float2half_rn(a), __float2half_rn(b)};
}
inline float __low2float(__half2 h) { return __half2float(h.x); }
inline float __high2float(__half2 h) { return __half2float(h.y); }

inline float __bfloat162float(__nv_bfloat16 b) { return __uint_as_float((unsigned)b.__x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned u = __float_as_uint(f);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) { b.__x = (unsigned short)((u >> 16) | 0x40u); return b; }
  u += 0x7fffu + ((u >> 16) & 1u);
  b.__x = (unsigned short)(u >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

// ------------------------------------------------------------------ thread geometry
#define threadIdx (pd_emu::self()->tid)
#define blockIdx (pd_emu::self()->block->bid)
#define blockDim (pd_emu::self()->block->bdim)
#define gridDim (pd_emu::self()->block->gdim)
#define warpSize 32

// ------------------------------------------------------------------ synchronization
inline void __syncthreads() {
  pd_emu::Fiber* f = pd_emu::self();
  pd_emu::barrier_arrive(f);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  (void)pd_emu::collective<int>(mask, 0, pd_emu::C_SYNCWARP, 0, 32);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return pd_emu::collective<T>(mask, v, pd_emu::C_SHFL_XOR, lane_mask, width);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return pd_emu::collective<T>(mask, v, pd_emu::C_SHFL_IDX, src_lane, width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return pd_emu::collective<T>(mask, v, pd_emu::C_SHFL_DOWN, (int)delta, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return pd_emu::collective<T>(mask, v, pd_emu::C_SHFL_UP, (int)delta, width);
}
// votes: a warp-wide maximum (minimum) of 0 / 1 (the lanes of a C_MAX_F32 / C_MIN_F32 meet)
inline int __any_sync(unsigned mask, int pred) {
  return pd_emu::collective<float>(mask, pred ? 1.f : 0.f, pd_emu::C_MAX_F32, 0, 32) > 0.f;
}
inline int __all_sync(unsigned mask, int pred) {
  return pd_emu::collective<float>(mask, pred ? 1.f : 0.f, pd_emu::C_MIN_F32, 0, 32) > 0.f;
}
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { pd_emu::thread_fence(); }
// blocks run on several OS threads at once: a device atomic is a host atomic. Our kernels
// use one only to publish a block's global writes (the fused merge's count), so each is
// checked as such a release (and __ldcg after it as the acquire): a missing fence is a
// wrong answer on a GPU only rarely.
inline int atomicAdd(int* p, int v) {
  pd_emu::check_release("atomicAdd");
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

// ------------------------------------------------------------------ memory
// kernels/common.py's cp.async helpers call the runtime's (deferred) copies under this
#define PD_EMU_CP_ASYNC 1
#define PD_EMU 1   // pd_emu:: (the runtime's checks) is linked
template <typename T>
inline T __ldg(const T* p) {
  // a vector load must be aligned to its size where the buffer sits on a GPU; g++'s own
  // instruction may or may not fault on a misaligned one
  if (sizeof(T) > 1 && (sizeof(T) & (sizeof(T) - 1)) == 0) pd_emu::check_load(p, sizeof(T));
  return *p;
}
// a load through L2 (our kernels use it only for what other blocks published: the fused
// merge's partial rows) is checked as the acquire half of the atomic's publication
template <typename T>
inline T __ldcg(const T* p) {
  pd_emu::check_acquire("__ldcg");
  return *p;
}
inline std::size_t __cvta_generic_to_shared(const void* p) { return (std::size_t)p; }

// ------------------------------------------------------------------ math
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
"""

STUB_HEADERS = {
    "cuda_fp16.h": "#pragma once\n// emulator: the prelude defines __half\n",
    "cuda_bf16.h": "#pragma once\n// emulator: the prelude defines __nv_bfloat16\n",
    "cuda_runtime.h": "#pragma once\n",
}
