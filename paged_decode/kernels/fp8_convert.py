"""The fp8 conversions of the kernels: one routine per direction and dialect.

``fp8_to_float<FMT>`` (a byte to its exact float value) is what every kernel that reads
an fp8 pool calls, through ``widen_piece<fp8_e4m3 / fp8_e5m2>`` in CUDA (8 bytes, half of
a 16-byte ring piece that two lanes share), ``fp8x4_to_pairs`` (4 bytes to two 16-bit
pairs: the tensor-core partial's byte ring into its 16-bit scratch tile) and ``load4kv``
in Metal; ``fp8_from_float<FMT>`` (``saturate(round_ne(x))``, NaN kept) is the append
kernel's quantization. Both are written with integer and exact float operations only
(no intrinsics), so the CPU emulator runs the very text the GPU compiles, and tests check
them over all 256 codes and against ``ml_dtypes`` rounding (``tests/test_fp8.py``).

Formats (``paged_decode/fp8.py``): e4m3fn (bias 7, no infinity, NaN ``S.1111.111``,
max 448) and e5m2 (bias 15, IEEE infinities and NaNs, max 57344). A normal code
``(e, m)`` is ``2^(e - BIAS) (1 + m / 2^MAN)``: its float32 bits are ``(e + 127 - BIAS)
<< 23 | m << (23 - MAN)``; a subnormal one (``e = 0``) is ``m 2^(1 - BIAS - MAN)``,
computed as an exact float product (no float32 subnormal is involved, so flushing
denormals cannot change it).

On sm_89 and later the CUDA widen (8 bytes, half of a 16-byte ring piece) and
``fp8x4_to_pairs`` use the hardware ``cvt.rn.f16x2.e4m3x2``
/ ``e5m2x2`` (exact: every fp8 value is a float16), then float16 -> float32; elsewhere,
and on the emulator, the scalar routine. Only the GPU tests (``tests/test_fp8_gpu.py``)
check that path.
"""

CUDA_FP8 = r"""
namespace pd {

// The pool element types of fp8 pools (one byte each): the kernels' TKV.
struct fp8_e4m3 { unsigned char bits; };
struct fp8_e5m2 { unsigned char bits; };

// Format facts: exponent and mantissa bits, bias, the NaN code ml_dtypes writes, the
// largest finite value; FN: no infinities (e4m3fn), NaN only at S.1111.111.
template <typename T> struct FP8;
template <> struct FP8<fp8_e4m3> {
  static constexpr int EXP = 4, MAN = 3, BIAS = 7;
  static constexpr unsigned NAN_CODE = 0x7fu;
  static constexpr bool FN = true;
  static __device__ __forceinline__ float max_finite() { return 448.f; }
};
template <> struct FP8<fp8_e5m2> {
  static constexpr int EXP = 5, MAN = 2, BIAS = 15;
  static constexpr unsigned NAN_CODE = 0x7eu;
  static constexpr bool FN = false;
  static __device__ __forceinline__ float max_finite() { return 57344.f; }
};

// The exact value of fp8 code b (its low 8 bits) of format T.
template <typename T>
__device__ __forceinline__ float fp8_to_float(unsigned b) {
  constexpr int M = FP8<T>::MAN;
  constexpr unsigned EMAX = (1u << FP8<T>::EXP) - 1u, MMAX = (1u << M) - 1u;
  const unsigned e = (b >> M) & EMAX, m = b & MMAX;
  // 2^(1 - BIAS - MAN): the subnormal step (a normal float32)
  const float step = __uint_as_float((unsigned)(128 - FP8<T>::BIAS - M) << 23);
  float mag = e == 0u ? (float)m * step
                      : __uint_as_float(((e + 127u - (unsigned)FP8<T>::BIAS) << 23) | (m << (23 - M)));
  if (FP8<T>::FN) {
    if (e == EMAX && m == MMAX) mag = PD_NAN;
  } else if (e == EMAX) {
    mag = m != 0u ? PD_NAN : PD_INF;
  }
  return (b & 0x80u) ? -mag : mag;
}

// saturate(round_ne(x)) as an fp8 code of format T: NaN stays NaN (its sign kept),
// anything beyond the largest finite value (infinities included) becomes it, ties round
// to even (subnormals by rintf of an exact product, normals on the float32 bits).
template <typename T>
__device__ __forceinline__ unsigned char fp8_from_float(float x) {
  constexpr int M = FP8<T>::MAN, BIAS = FP8<T>::BIAS;
  const unsigned u = __float_as_uint(x);
  const unsigned sign = (u >> 24) & 0x80u;
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned char)(sign | FP8<T>::NAN_CODE);
  const float a = fminf(__uint_as_float(u & 0x7fffffffu), FP8<T>::max_finite());
  const float min_normal = __uint_as_float((unsigned)(128 - BIAS) << 23);   // 2^(1 - BIAS)
  unsigned code;
  if (a < min_normal) {
    // a / step, exact (a power-of-two product), in [0, 2^MAN]: 2^MAN is the smallest
    // normal code, which is what a round-up there must give
    code = (unsigned)rintf(a * __uint_as_float((unsigned)(126 + BIAS + M) << 23));
  } else {
    const unsigned bits = __float_as_uint(a);
    constexpr unsigned DROP = 23 - M;
    const unsigned r = bits + ((1u << (DROP - 1)) - 1u) + ((bits >> DROP) & 1u);
    code = (r >> DROP) - ((127u - (unsigned)BIAS) << M);
  }
  return (unsigned char)(sign | code);
}

// Widening 8 fp8 bytes, half `sel & 1` of a 16-byte ring piece, to floats: an fp8 lane
// takes 8 elements of a row, as a float16 lane does (16 would double its q and
// accumulator registers: 168 registers and spills at 4 heads per CTA, measured with ptxas
// for sm_90), so lanes 2c and 2c + 1 copy the same 16-byte piece (one global transaction:
// the DRAM bytes are fp8's) and each widens its half.
template <typename T>
__device__ __forceinline__ void widen_fp8(const uint4& u, float* f, int sel) {
  const unsigned w[2] = {(sel & 1) ? u.z : u.x, (sel & 1) ? u.w : u.y};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const unsigned short pair = (unsigned short)(w[i] >> (16 * j));
      unsigned h2;
      if (FP8<T>::FN) asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
      else asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(pair));
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&h2));
      f[4 * i + 2 * j] = t.x;
      f[4 * i + 2 * j + 1] = t.y;
    }
  }
#else
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = fp8_to_float<T>((w[i / 4] >> (8 * (i % 4))) & 0xffu);
#endif
}

// Four fp8 codes of format T (the bytes of w, the lowest first) as two pairs of 16-bit
// values, the lower code in the lower half, packed by PACK (mma.py's Pair<__half> or
// Pair<__nv_bfloat16>): exact, every fp8 value being both a float16 and a bfloat16. The
// tensor-core partial widens its byte ring with it (8 codes into one 16-byte row piece).
// sm_89+: cvt.rn.f16x2.e4m3x2 / e5m2x2 per pair (bfloat16 then repacked through float, exact);
// elsewhere, and on the emulator, fp8_to_float per code.
template <typename T, typename PACK>
__device__ __forceinline__ void fp8x4_to_pairs(unsigned w, unsigned (&p)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // w's halves unpacked in PTX, so ptxas hands the high one to the cvt as an operand half
  // (R.H1) instead of shifting it down first (one SHF per call in nvcc 13.0's SASS)
  unsigned h[2];
  if (FP8<T>::FN)
    asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e4m3x2 %0, lo; "
        "cvt.rn.f16x2.e4m3x2 %1, hi;}" : "=r"(h[0]), "=r"(h[1]) : "r"(w));
  else
    asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.rn.f16x2.e5m2x2 %0, lo; "
        "cvt.rn.f16x2.e5m2x2 %1, hi;}" : "=r"(h[0]), "=r"(h[1]) : "r"(w));
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if constexpr (PACK::BF16) {
      const float2 t = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
      p[j] = PACK::pack(t.x, t.y);
    } else {
      p[j] = h[j];
    }
  }
#else
#pragma unroll
  for (int j = 0; j < 2; ++j)
    p[j] = PACK::pack(fp8_to_float<T>((w >> (16 * j)) & 0xffu),
                      fp8_to_float<T>((w >> (16 * j + 8)) & 0xffu));
#endif
}

// fp8 pools: 8 elements per lane and load (half of a shared 16-byte piece).
template <> struct KV<fp8_e4m3> { static constexpr int PER16 = 8; };
template <> struct KV<fp8_e5m2> { static constexpr int PER16 = 8; };
// the 16-byte piece holding a lane's 8 bytes (aligned down: rows are whole pieces)
template <>
__device__ __forceinline__ const uint4* kv_piece<fp8_e4m3>(const fp8_e4m3* p, int j) {
  return reinterpret_cast<const uint4*>(reinterpret_cast<unsigned long long>(p + 8 * j) & ~15ull);
}
template <>
__device__ __forceinline__ const uint4* kv_piece<fp8_e5m2>(const fp8_e5m2* p, int j) {
  return reinterpret_cast<const uint4*>(reinterpret_cast<unsigned long long>(p + 8 * j) & ~15ull);
}
template <>
__device__ __forceinline__ void widen_piece<fp8_e4m3>(const uint4& u, float* f, int sel) {
  widen_fp8<fp8_e4m3>(u, f, sel);
}
template <>
__device__ __forceinline__ void widen_piece<fp8_e5m2>(const uint4& u, float* f, int sel) {
  widen_fp8<fp8_e5m2>(u, f, sel);
}

}  // namespace pd
"""

# Metal: MLX has no fp8 dtype, so fp8 pools reach the kernels as ``uint8_t`` and the
# format is the template parameter KV_FP8 (0: not fp8, 1: e4m3fn, 2: e5m2). Same
# arithmetic as CUDA (as_type for the bit casts, rint for ties to even).
METAL_FP8 = r"""
namespace pd {

// The exact value of fp8 code b of format FMT (1: e4m3fn, 2: e5m2).
template <int FMT>
inline float fp8_to_float(uint b) {
  const int M = FMT == 1 ? 3 : 2, BIAS = FMT == 1 ? 7 : 15;
  const uint EMAX = FMT == 1 ? 15u : 31u, MMAX = (1u << M) - 1u;
  const uint e = (b >> M) & EMAX, m = b & MMAX;
  const float step = as_type<float>(uint(128 - BIAS - M) << 23);   // 2^(1 - BIAS - MAN)
  float mag = e == 0u ? float(m) * step
                      : as_type<float>(((e + 127u - uint(BIAS)) << 23) | (m << (23 - M)));
  if (FMT == 1) {
    if (e == EMAX && m == MMAX) mag = NAN;
  } else if (e == EMAX) {
    mag = m != 0u ? NAN : INFINITY;
  }
  return (b & 0x80u) != 0u ? -mag : mag;
}

// saturate(round_ne(x)) as an fp8 code of format FMT (as in CUDA).
template <int FMT>
inline uchar fp8_from_float(float x) {
  const int M = FMT == 1 ? 3 : 2, BIAS = FMT == 1 ? 7 : 15;
  const uint nan_code = FMT == 1 ? 0x7fu : 0x7eu;
  const float max_finite = FMT == 1 ? 448.0f : 57344.0f;
  const uint u = as_type<uint>(x);
  const uint sign = (u >> 24) & 0x80u;
  if ((u & 0x7fffffffu) > 0x7f800000u) return uchar(sign | nan_code);
  const float a = fmin(as_type<float>(u & 0x7fffffffu), max_finite);
  const float min_normal = as_type<float>(uint(128 - BIAS) << 23);
  uint code;
  if (a < min_normal) {
    code = uint(rint(a * as_type<float>(uint(126 + BIAS + M) << 23)));
  } else {
    const uint bits = as_type<uint>(a);
    const uint drop = uint(23 - M);
    const uint r = bits + ((1u << (drop - 1u)) - 1u) + ((bits >> drop) & 1u);
    code = (r >> drop) - ((127u - uint(BIAS)) << M);
  }
  return uchar(sign | code);
}

// Four consecutive K/V elements as a float4: load4 for a pool of real elements
// (FMT 0), else four fp8 bytes (byte loads: P may be a constant-space pointer) converted.
template <int FMT, typename P>
inline float4 load4kv(P p) {
  if (FMT == 0) return load4(p);
  const uint w = uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
  return float4(fp8_to_float<FMT>(w & 0xffu), fp8_to_float<FMT>((w >> 8) & 0xffu),
                fp8_to_float<FMT>((w >> 16) & 0xffu), fp8_to_float<FMT>(w >> 24));
}

}  // namespace pd
"""
