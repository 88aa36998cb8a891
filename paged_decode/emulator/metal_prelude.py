"""The Metal-dialect prelude: the MSL types and built-ins our Metal kernel bodies use, on
the CPU.

Included (as ``pd_emu_metal.h``) ahead of the MLX-style translation unit that
``metal.py`` generates. Address-space qualifiers (``device``, ``constant``,
``threadgroup``, ``thread``) are not macros: ``metal.py`` removes them where they qualify
a declaration and turns ``threadgroup`` arrays into references into the running
threadgroup's arena (32 KB, Metal's limit), so identifiers spelled like a qualifier keep
working. SIMD groups are the runtime's 32-lane warps. SIMD-group matrices
(``simdgroup_matrix``) are ``metal_simdgroup.py``'s, appended at the end.
"""

from .metal_simdgroup import SIMDGROUP_MATRIX

METAL_PRELUDE = r"""
#pragma once
#include "pd_emu_rt.h"
#include <cmath>
#include <cstdint>
#include <sys/types.h>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;

// bfloat: 16-bit brain float, IEEE round-to-nearest-even from float. MSL's bfloat
// converts only explicitly (Apple's compiler rejects `bfloat b = 1.0f;` and a bfloat
// assigned a uchar), so the constructor is explicit: a kernel relying on an implicit
// conversion fails to compile here as it would on a Mac.
struct bfloat {
  std::uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = (std::uint16_t)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    bits = (std::uint16_t)(u >> 16);
  }
  operator float() const {
    const std::uint32_t u = (std::uint32_t)bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // compound assignment in float, rounded back (Metal's bfloat arithmetic)
  bfloat& operator+=(float x) { return *this = bfloat(float(*this) + x); }
  bfloat& operator-=(float x) { return *this = bfloat(float(*this) - x); }
  bfloat& operator*=(float x) { return *this = bfloat(float(*this) * x); }
  bfloat& operator/=(float x) { return *this = bfloat(float(*this) / x); }
};
typedef half float16_t;
typedef bfloat bfloat16_t;

// as_type<T>(x): a bit cast between types of one size (MSL's reinterpretation).
template <typename T, typename U>
inline T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T t;
  std::memcpy(&t, &x, sizeof(T));
  return t;
}

namespace pd_metal {

// Vectors of 2, 3 or 4 components (members x, y, z, w and operator[]; no swizzles).
template <typename T, int N> struct vec_storage;
template <typename T> struct alignas(2 * sizeof(T)) vec_storage<T, 2> { T x, y; };
template <typename T> struct alignas(4 * sizeof(T)) vec_storage<T, 3> { T x, y, z; };
template <typename T> struct alignas(4 * sizeof(T)) vec_storage<T, 4> { T x, y, z, w; };

template <typename T, int N>
struct vec : vec_storage<T, N> {
  vec() = default;
  explicit vec(T s) { for (int i = 0; i < N; ++i) (*this)[i] = s; }
  template <typename... A, typename = std::enable_if_t<sizeof...(A) == N && (N > 1)>>
  vec(A... a) {
    const T v[N] = {static_cast<T>(a)...};
    for (int i = 0; i < N; ++i) (*this)[i] = v[i];
  }
  template <typename U>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) (*this)[i] = static_cast<T>(o[i]);
  }
  T& operator[](int i) { return (&this->x)[i]; }
  const T& operator[](int i) const { return (&this->x)[i]; }
};

#define PD_METAL_VEC_OP(op)                                                          \
  template <typename T, int N>                                                       \
  inline vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {             \
    vec<T, N> r;                                                                     \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b[i];                                 \
    return r;                                                                        \
  }                                                                                  \
  template <typename T, int N>                                                       \
  inline vec<T, N> operator op(const vec<T, N>& a, T b) {                            \
    vec<T, N> r;                                                                     \
    for (int i = 0; i < N; ++i) r[i] = a[i] op b;                                    \
    return r;                                                                        \
  }                                                                                  \
  template <typename T, int N>                                                       \
  inline vec<T, N> operator op(T a, const vec<T, N>& b) {                            \
    vec<T, N> r;                                                                     \
    for (int i = 0; i < N; ++i) r[i] = a op b[i];                                    \
    return r;                                                                        \
  }                                                                                  \
  template <typename T, int N>                                                       \
  inline vec<T, N>& operator op##=(vec<T, N>& a, const vec<T, N>& b) {               \
    for (int i = 0; i < N; ++i) a[i] = a[i] op b[i];                                 \
    return a;                                                                        \
  }
PD_METAL_VEC_OP(+)
PD_METAL_VEC_OP(-)
PD_METAL_VEC_OP(*)
PD_METAL_VEC_OP(/)
#undef PD_METAL_VEC_OP

inline pd_emu::Fiber* me() { return pd_emu::self(); }

}  // namespace pd_metal

typedef pd_metal::vec<float, 2> float2;
typedef pd_metal::vec<float, 3> float3;
typedef pd_metal::vec<float, 4> float4;
typedef pd_metal::vec<half, 2> half2;
typedef pd_metal::vec<half, 3> half3;
typedef pd_metal::vec<half, 4> half4;
typedef pd_metal::vec<bfloat, 2> bfloat2;
typedef pd_metal::vec<bfloat, 4> bfloat4;
typedef pd_metal::vec<int, 2> int2;
typedef pd_metal::vec<int, 3> int3;
typedef pd_metal::vec<int, 4> int4;
typedef pd_metal::vec<uint, 2> uint2;
typedef pd_metal::vec<uint, 3> uint3;
typedef pd_metal::vec<uint, 4> uint4;
typedef pd_metal::vec<short, 2> short2;
typedef pd_metal::vec<ushort, 2> ushort2;
typedef pd_metal::vec<long, 2> long2;
typedef pd_metal::vec<ulong, 2> ulong2;
namespace metal {
template <typename T, int N>
using vec = pd_metal::vec<T, N>;   // metal::vec<T, N>, as MLX's headers spell vectors
}  // namespace metal

namespace metal {

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2,
                                  mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return (mem_flags)((unsigned)a | (unsigned)b);
}

// ---------------------------------------------------------------- synchronization
inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) {
  pd_emu::barrier_arrive(pd_emu::self());
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) {
  (void)pd_emu::collective<int>(0xffffffffu, 0, pd_emu::C_SYNCWARP, 0, 32);
}

// ---------------------------------------------------------------- SIMD-group functions
template <typename T>
inline T simd_shuffle_xor(T v, ushort mask) {
  return pd_emu::collective<T>(0xffffffffu, v, pd_emu::C_SHFL_XOR, (int)mask, 32);
}
template <typename T>
inline T simd_shuffle(T v, ushort lane) {
  return pd_emu::collective<T>(0xffffffffu, v, pd_emu::C_SHFL_IDX, (int)lane, 32);
}
template <typename T>
inline T simd_broadcast(T v, ushort lane) { return simd_shuffle(v, lane); }
template <typename T>
inline T simd_shuffle_down(T v, ushort delta) {
  return pd_emu::collective<T>(0xffffffffu, v, pd_emu::C_SHFL_DOWN, (int)delta, 32);
}
template <typename T>
inline T simd_shuffle_up(T v, ushort delta) {
  return pd_emu::collective<T>(0xffffffffu, v, pd_emu::C_SHFL_UP, (int)delta, 32);
}
inline float simd_sum(float v) {
  return pd_emu::collective<float>(0xffffffffu, v, pd_emu::C_SUM_F32, 0, 32);
}
inline float simd_max(float v) {
  return pd_emu::collective<float>(0xffffffffu, v, pd_emu::C_MAX_F32, 0, 32);
}
inline float simd_min(float v) {
  return pd_emu::collective<float>(0xffffffffu, v, pd_emu::C_MIN_F32, 0, 32);
}

// ---------------------------------------------------------------- math (float)
inline float exp2(float x) { return std::exp2(x); }
inline float log2(float x) { return std::log2(x); }
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline float fabs(float x) { return std::fabs(x); }
inline float abs(float x) { return std::fabs(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float fmax(float a, float b) { return std::fmax(a, b); }
inline float fmin(float a, float b) { return std::fmin(a, b); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float rint(float x) { return std::nearbyint(x); }   // ties to even (default mode)
inline bool isinf(float x) { return std::isinf(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
template <int N>
inline pd_metal::vec<float, N> fma(const pd_metal::vec<float, N>& a,
                                   const pd_metal::vec<float, N>& b,
                                   const pd_metal::vec<float, N>& c) {
  pd_metal::vec<float, N> r;
  for (int i = 0; i < N; ++i) r[i] = std::fma(a[i], b[i], c[i]);
  return r;
}
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return x < lo ? lo : (x > hi ? hi : x); }

namespace precise {
inline float exp2(float x) { return std::exp2(x); }
inline float tanh(float x) { return std::tanh(x); }
inline float log2(float x) { return std::log2(x); }
inline float exp(float x) { return std::exp(x); }
}  // namespace precise
namespace fast {
inline float exp2(float x) { return std::exp2(x); }
inline float log2(float x) { return std::log2(x); }
inline float exp(float x) { return std::exp(x); }
}  // namespace fast

}  // namespace metal

using namespace metal;

// ---------------------------------------------------------------- thread attributes
// The values MLX's generated signature receives, computed from the running fiber.
namespace pd_metal {
inline uint3 u3(pd_emu::U3 v) { return uint3(v.x, v.y, v.z); }
inline uint attr_linear() { return (uint)me()->linear; }
inline uint3 attr_thread_position_in_grid() {
  const pd_emu::Fiber* f = me();
  const pd_emu::Block* b = f->block;
  return uint3(b->bid.x * b->bdim.x + f->tid.x, b->bid.y * b->bdim.y + f->tid.y,
               b->bid.z * b->bdim.z + f->tid.z);
}
inline uint3 attr_thread_position_in_threadgroup() { return u3(me()->tid); }
inline uint3 attr_threadgroup_position_in_grid() { return u3(me()->block->bid); }
inline uint3 attr_threads_per_threadgroup() { return u3(me()->block->bdim); }
inline uint3 attr_dispatch_threads_per_threadgroup() { return u3(me()->block->bdim); }
inline uint3 attr_threadgroups_per_grid() { return u3(me()->block->gdim); }
inline uint3 attr_threads_per_grid() {
  const pd_emu::Block* b = me()->block;
  return uint3(b->gdim.x * b->bdim.x, b->gdim.y * b->bdim.y, b->gdim.z * b->bdim.z);
}
inline uint3 attr_grid_size() { return attr_threads_per_grid(); }
inline uint3 attr_grid_origin() { return uint3(0u, 0u, 0u); }
inline uint attr_thread_index_in_simdgroup() { return (uint)me()->lane; }
inline uint attr_thread_index_in_threadgroup() { return attr_linear(); }
inline uint attr_thread_index_in_quadgroup() { return attr_linear() % 4u; }
inline uint attr_simdgroup_index_in_threadgroup() { return attr_linear() / 32u; }
inline uint attr_simdgroups_per_threadgroup() {
  return ((uint)me()->block->nthreads + 31u) / 32u;
}
inline uint attr_dispatch_simdgroups_per_threadgroup() {
  return attr_simdgroups_per_threadgroup();
}
inline uint attr_quadgroup_index_in_threadgroup() { return attr_linear() / 4u; }
inline uint attr_quadgroups_per_threadgroup() {
  return ((uint)me()->block->nthreads + 3u) / 4u;
}
inline uint attr_dispatch_quadgroups_per_threadgroup() {
  return attr_quadgroups_per_threadgroup();
}
inline uint attr_threads_per_simdgroup() { return 32u; }
inline uint attr_thread_execution_width() { return 32u; }

// ``threadgroup T x[N];``: storage in the running threadgroup's arena at an offset
// reserved once per declaration site and template instantiation (``Site``), like CUDA's
// ``__shared__``; Metal allows 32 KB of threadgroup memory.
constexpr std::size_t TG_CAP = 32 * 1024;
template <typename T, typename Site>
inline T& tg_var(const char* name) {
  static const std::size_t off =
      pd_emu::reserve_static(sizeof(T), alignof(T) < 16 ? 16 : alignof(T), TG_CAP, name);
  if (off == pd_emu::STATIC_SMEM_OVER)
    pd_emu::fail("threadgroup memory exceeds Metal's %zu bytes", (std::size_t)TG_CAP);
  return *reinterpret_cast<T*>(me()->block->static_smem + off);
}
}  // namespace pd_metal
""" + SIMDGROUP_MATRIX
