"""Metal's SIMD-group matrices (``<metal_simdgroup_matrix>``) on the CPU emulator.

Part of the Metal prelude (``metal_prelude.py`` appends ``SIMDGROUP_MATRIX``). What the
Metal Shading Language specification (section 2.4, "SIMD-group Matrix Data Types", and
section 6.7, "SIMD-Group Matrix Functions", Tables 6.9 and 6.10) defines, with the
semantics chosen where it leaves them open:

- ``simdgroup_matrix<T, Cols, Rows>`` with ``T`` float, half or bfloat and ``Cols = Rows
  = 8``; ``simdgroup_float8x8``, ``simdgroup_half8x8``, ``simdgroup_bfloat8x8``.
  ``simdgroup_matrix<T, 8, 8>(T d)`` is the diagonal matrix ``d I``;
  ``make_filled_simdgroup_matrix<T, Cols, Rows = Cols>(T v)`` has every element ``v``.
  A value-initialized matrix (``simdgroup_float8x8{}``, the tail of an array initializer)
  is zero, a default-initialized one indeterminate, as with the MSL header's defaulted
  constructor.
- ``simdgroup_load(d, src, elements_per_row = 8, matrix_origin = 0, transpose = false)``:
  ``d[r][c] = src[(origin.y + r) * epr + origin.x + c]``, transposed
  ``d[r][c] = src[(origin.y + c) * epr + origin.x + r]`` (``matrix_origin`` is (column,
  row) in the memory layout, in elements, in both cases: the specification does not say,
  JuliaGPU Metal.jl's lowering to AIR implies it); ``simdgroup_store(a, dst, ...)``
  writes the same places. Device and threadgroup memory alike (address spaces are
  erased on the CPU).
- ``simdgroup_multiply(d, a, b)``: ``d = a b``; ``simdgroup_multiply_accumulate(d, a, b,
  c)``: ``d = a b + c``; ``a * b``. Operands may mix element types (llama.cpp's Metal GEMM
  multiplies half matrices into float accumulators); ``c`` and ``d`` share one. The
  specification does not say how products are summed or rounded; here every operand is
  converted to float exactly (half and bfloat are subsets of float), each element is
  ``c`` plus the 8 products in order of ``k`` by float32 fused multiply-adds, rounded once
  to ``d``'s type (round to nearest even). A half or bfloat accumulator on Apple hardware
  may round differently.
- ``m.thread_elements()``: this lane's two elements, a ``vec<T, 2>&``. The specification
  leaves the mapping of elements to lanes unspecified; the emulator uses the one MLX
  relies on (``BaseMMAFrag<T, 8, 8>::get_coord`` in
  ``mlx/backend/metal/kernels/steel/attn/mma.h``, and ``BlockMMA`` in ``steel/gemm/mma.h``;
  Philip Turner's metal-flash-attention draws the same layout): lane ``l`` holds row
  ``(l / 4 & 4) + (l / 2) % 4``, columns ``(l / 4 & 2) * 2 + (l % 2) * 2`` and ``+ 1``.

Every operation is a collective of the SIMD group (the specification: "all operations
must be executed only under uniform control-flow within the SIMD-group"), run on the
runtime's warp meetings (``C_MATRIX``): a lane that skips one, or reaches another, is
reported as a divergent warp collective, and so are lanes passing different pointers,
row strides, origins or transposes to one load or store, and a SIMD group of fewer than
32 threads. An operation that reads other lanes' elements meets twice: each lane
publishes a description of its operands (``Warp::slot``), reads its peers' between the
meetings and writes its own result after the second, so ``d`` may alias ``a``, ``b`` or
``c``.
"""

SIMDGROUP_MATRIX = r"""
// ---------------------------------------------------------------- SIMD-group matrices
// (paged_decode/emulator/metal_simdgroup.py says what is emulated and why)
namespace pd_metal {

template <typename T> struct sg_elem;                // the element types a matrix may hold
template <> struct sg_elem<float> { static constexpr int code = 0; };
template <> struct sg_elem<half> { static constexpr int code = 1; };
template <> struct sg_elem<bfloat> { static constexpr int code = 2; };

// The lane holding element (r, c), and the row / first column of a lane's two elements
// (MLX's BaseMMAFrag<T, 8, 8>::get_coord).
inline int sg_row(int lane) { return (lane >> 2 & 4) + (lane >> 1) % 4; }
inline int sg_col(int lane) { return (lane >> 2 & 2) * 2 + (lane % 2) * 2; }
inline int sg_owner(int r, int c) {
  return (r & 4) << 2 | (c & 4) << 1 | (r & 3) << 1 | (c >> 1 & 1);
}

// What one lane passes to an operation, published to the others between two meetings.
struct sg_args {
  const void* ptr;                 // memory operand of a load or store
  unsigned long epr, ox, oy;       // elements per row, matrix origin (column, row)
  bool transpose;
  const void* frag[3];             // the lane's a, b, c (multiplications)
};

inline const char* sg_op_name(int param) {
  return pd_emu::collective_name(pd_emu::C_MATRIX, param);
}
// The meeting's parameter: operation, element types and the call's place (a lane at
// another call of the same operation is a divergence).
inline int sg_param(int op, int types, int line, const char* file) {
  return op | types << 4 | (line & pd_emu::M_LINE_MASK) << pd_emu::M_LINE_SHIFT |
         (std::strcmp(file, "header.metal") == 0 ? pd_emu::M_HEADER : 0);
}
#define PD_SG_SITE int pd_line = __builtin_LINE(), const char* pd_file = __builtin_FILE()

// First meeting: every lane of the SIMD group arrives (with ``args`` published) or the
// runtime reports the divergence.
inline void sg_meet(int param, const sg_args* args) {
  pd_emu::Fiber* f = me();
  if (f->warp->nlanes != 32)
    pd_emu::fail_here("%s needs a full SIMD group of 32 threads; SIMD group %d has %d "
                      "(a threadgroup of %d threads): divergent SIMD-group matrix "
                      "operation", sg_op_name(param), f->warp->index, f->warp->nlanes,
                      f->block->nthreads);
  f->warp->slot[f->lane] = args;
  (void)pd_emu::collective<int>(0xffffffffu, 0, pd_emu::C_MATRIX, param, 32);
}
// Second meeting: every lane has read what it needs of the others.
inline void sg_leave(int param) {
  (void)pd_emu::collective<int>(0xffffffffu, 0, pd_emu::C_MATRIX, param | pd_emu::M_LEAVE,
                                32);
}
inline const sg_args& sg_peer(int lane) {
  return *static_cast<const sg_args*>(me()->warp->slot[lane]);
}

// A load or store takes one pointer, stride, origin and transpose for the whole group.
inline void sg_check_uniform(int param, const sg_args& mine) {
  const int lane = me()->lane;
  for (int l = 0; l < 32; ++l) {
    const sg_args& o = sg_peer(l);
    if (o.ptr != mine.ptr || o.epr != mine.epr || o.ox != mine.ox || o.oy != mine.oy ||
        o.transpose != mine.transpose)
      pd_emu::fail_here("%s: lanes %d and %d of SIMD group %d pass different arguments "
                        "(pointer %p / %p, elements_per_row %lu / %lu, matrix_origin "
                        "(%lu, %lu) / (%lu, %lu), transpose %d / %d): divergent "
                        "SIMD-group matrix operation (the arguments must be uniform)",
                        sg_op_name(param), lane, l, me()->warp->index, mine.ptr, o.ptr,
                        mine.epr, o.epr, mine.ox, mine.oy, o.ox, o.oy, (int)mine.transpose,
                        (int)o.transpose);
  }
}

// First meeting of a load or store (``mine`` lives until the second).
inline void sg_meet_memory(int param, const sg_args& mine) {
  sg_meet(param, &mine);
  sg_check_uniform(param, mine);
}
// Where element ``j`` of ``lane`` lives in a load's or store's memory layout.
inline unsigned long sg_index(const sg_args& m, int lane, int j) {
  const unsigned long r = (unsigned long)sg_row(lane), c = (unsigned long)sg_col(lane) + j;
  return m.transpose ? (m.oy + c) * m.epr + m.ox + r : (m.oy + r) * m.epr + m.ox + c;
}

// ``matrix_origin``: a ulong2, or a scalar broadcast to both (MSL's ``0`` default).
struct sg_origin {
  unsigned long x, y;
  sg_origin(const vec<unsigned long, 2>& o) : x(o.x), y(o.y) {}
  template <typename I, typename = std::enable_if_t<std::is_integral<I>::value>>
  sg_origin(I s) : x((unsigned long)s), y((unsigned long)s) {}
};

}  // namespace pd_metal

namespace metal {

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix: only 8 x 8 matrices exist");
  static constexpr int code = pd_metal::sg_elem<T>::code;   // float, half or bfloat only
  pd_metal::vec<T, 2> elems;   // this lane's two elements (see thread_elements)

  simdgroup_matrix() = default;
  // d * identity (MSL: "Creates a diagonal matrix with the given value")
  explicit simdgroup_matrix(T d, PD_SG_SITE) {
    pd_metal::sg_meet(pd_metal::sg_param(pd_emu::M_DIAGONAL, code, pd_line, pd_file),
                      nullptr);
    const int lane = pd_metal::me()->lane, r = pd_metal::sg_row(lane);
    const int c = pd_metal::sg_col(lane);
    elems[0] = r == c ? d : T(0.0f);
    elems[1] = r == c + 1 ? d : T(0.0f);
  }
  pd_metal::vec<T, 2>& thread_elements() { return elems; }
  const pd_metal::vec<T, 2>& thread_elements() const { return elems; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows = Cols>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value, PD_SG_SITE) {
  simdgroup_matrix<T, Cols, Rows> m;
  pd_metal::sg_meet(pd_metal::sg_param(pd_emu::M_FILL, m.code, pd_line, pd_file), nullptr);
  m.elems[0] = m.elems[1] = value;
  return m;
}

template <typename T, int Cols, int Rows>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src,
                           unsigned long elements_per_row = Cols,
                           pd_metal::sg_origin matrix_origin = 0,
                           bool transpose_matrix = false, PD_SG_SITE) {
  const int param = pd_metal::sg_param(pd_emu::M_LOAD, d.code, pd_line, pd_file);
  const pd_metal::sg_args mine{src, elements_per_row, matrix_origin.x, matrix_origin.y,
                               transpose_matrix, {}};
  pd_metal::sg_meet_memory(param, mine);
  const int lane = pd_metal::me()->lane;
  for (int j = 0; j < 2; ++j) d.elems[j] = src[pd_metal::sg_index(mine, lane, j)];
  pd_metal::sg_leave(param);
}

template <typename T, int Cols, int Rows>
inline void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, T* dst,
                            unsigned long elements_per_row = Cols,
                            pd_metal::sg_origin matrix_origin = 0,
                            bool transpose_matrix = false, PD_SG_SITE) {
  const int param = pd_metal::sg_param(pd_emu::M_STORE, a.code, pd_line, pd_file);
  const pd_metal::sg_args mine{dst, elements_per_row, matrix_origin.x, matrix_origin.y,
                               transpose_matrix, {}};
  pd_metal::sg_meet_memory(param, mine);
  const int lane = pd_metal::me()->lane;
  for (int j = 0; j < 2; ++j) dst[pd_metal::sg_index(mine, lane, j)] = a.elems[j];
  pd_metal::sg_leave(param);
}

namespace detail_sg {
// d = a b (+ c): this lane's two elements from every lane's a and b (module doc).
template <bool ACC, typename TD, typename TA, typename TB, typename TC>
inline void multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                     const simdgroup_matrix<TB, 8, 8>& b,
                     const simdgroup_matrix<TC, 8, 8>* c, int line, const char* file) {
  const int param = pd_metal::sg_param(
      ACC ? pd_emu::M_MULTIPLY_ACCUMULATE : pd_emu::M_MULTIPLY,
      d.code + 3 * a.code + 9 * b.code, line, file);
  const pd_metal::sg_args mine{nullptr, 0, 0, 0, false, {&a, &b, c}};
  pd_metal::sg_meet(param, &mine);
  const int lane = pd_metal::me()->lane, r = pd_metal::sg_row(lane);
  const int c0 = pd_metal::sg_col(lane);
  float acc[2];
  for (int j = 0; j < 2; ++j) {
    acc[j] = ACC ? float(c->elems[j]) : 0.0f;
    for (int k = 0; k < 8; ++k) {
      const auto* pa = static_cast<const simdgroup_matrix<TA, 8, 8>*>(
          pd_metal::sg_peer(pd_metal::sg_owner(r, k)).frag[0]);
      const auto* pb = static_cast<const simdgroup_matrix<TB, 8, 8>*>(
          pd_metal::sg_peer(pd_metal::sg_owner(k, c0 + j)).frag[1]);
      acc[j] = std::fma(float(pa->elems[k & 1]), float(pb->elems[(c0 + j) & 1]), acc[j]);
    }
  }
  pd_metal::sg_leave(param);   // every lane has read a and b: d may alias them
  d.elems[0] = TD(acc[0]);
  d.elems[1] = TD(acc[1]);
}
}  // namespace detail_sg

template <typename TD, typename TA, typename TB, int Cols, int Rows, int K>
inline void simdgroup_multiply(simdgroup_matrix<TD, Cols, Rows>& d,
                               const simdgroup_matrix<TA, K, Rows>& a,
                               const simdgroup_matrix<TB, Cols, K>& b, PD_SG_SITE) {
  detail_sg::multiply<false, TD, TA, TB, TD>(d, a, b, nullptr, pd_line, pd_file);
}

template <typename TD, typename TA, typename TB, typename TC, int Cols, int Rows, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, Cols, Rows>& d,
                                          const simdgroup_matrix<TA, K, Rows>& a,
                                          const simdgroup_matrix<TB, Cols, K>& b,
                                          const simdgroup_matrix<TC, Cols, Rows>& c,
                                          PD_SG_SITE) {
  static_assert(std::is_same<TD, TC>::value,
                "simdgroup_multiply_accumulate: c and d hold one element type");
  detail_sg::multiply<true, TD, TA, TB, TC>(d, a, b, &c, pd_line, pd_file);
}

template <typename T, int Cols, int Rows, int K>
inline simdgroup_matrix<T, Cols, Rows> operator*(const simdgroup_matrix<T, K, Rows>& a,
                                                 const simdgroup_matrix<T, Cols, K>& b) {
  simdgroup_matrix<T, Cols, Rows> d;
  simdgroup_multiply(d, a, b);
  return d;
}

}  // namespace metal
#undef PD_SG_SITE
"""

#: ``#include <metal_simdgroup_matrix>`` & co. in a header resolve to these (the prelude
#: defines what they declare)
METAL_STUB_HEADERS = {
    name: f"#pragma once\n// emulator: the Metal prelude defines <{name}>\n"
    for name in ("metal_stdlib", "metal_simdgroup", "metal_simdgroup_matrix")
}
