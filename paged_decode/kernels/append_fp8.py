"""The quantizing append kernel: ``append.py``'s writes into fp8 pools.

Same contract and ``desc`` columns as ``append.py`` (``AppendWrite``: copy-on-write copies
of slots ``[0, lo)`` from ``src``, new rows into slots ``[lo, hi)``), with rows in float16,
bfloat16 or float32 (``TIN``) quantized on the way in: element ``x`` of a row written to
layer ``l`` is stored as ``fp8_from_float(x / scale[l])`` (``saturate(round_ne(.))``, NaN
kept; ``fp8_convert.py``), ``k_scale`` for K and ``v_scale`` for V, float32 ``[L]`` (one
per pool layer). The copies move the stored bytes unchanged. Pools ``[L, num_pages, P,
Hkv, D]`` of one byte per element (``L = 1`` without a layer axis), rows ``[row_layers,
N, Hkv, D]``; ``row_elems = Hkv * D``. Elements move one at a time (an append writes a few
rows per sequence; the copies are at most a page).

CUDA: grid ``(T, layers in the grid)`` as ``append.py``, 128 threads per block, pools
written in place. Metal: one threadgroup per (page, layer) writing the whole new pools
``k_out``, ``v_out`` (MLX has no input/output aliasing; ``append.py`` says why), the
pools ``uint8_t`` and the format the template parameter ``KV_FP8``; element-wise
accesses, so inputs in MLX's constant space (fewer than 8 elements) work too.
"""

from __future__ import annotations

from .append import CUDA_APPEND_COMMON, METAL_APPEND_COMMON, THREADS
from .common import CUDA_COMMON, METAL_COMMON
from .kernel_def import Dtype, KernelDef, KernelSpec, MetalKernel, TemplateValue, metal_fp8

# ---------------------------------------------------------------------------- CUDA
CUDA_BODY = r"""
// grid: (T touched pages, layers in the grid); block: 128 threads.
template <typename TIN, typename TKV>
__global__ void __launch_bounds__(128) pd_append_fp8(
    const TIN* __restrict__ k_rows,              // [row_layers, N, row_elems]
    const TIN* __restrict__ v_rows,
    const int* __restrict__ desc,                // [5, T]: page src row0 lo hi
    unsigned char* k_pages,                      // [L, num_pages, P, row_elems] fp8 codes
    unsigned char* v_pages,
    const float* __restrict__ k_scale,           // [L]
    const float* __restrict__ v_scale,           // [L]
    int num_touched, int num_rows, int row_elems, int page_size, int num_pages,
    int grid_layer0, int layer0, int row_layers, int copy_cow) {
  const int l = grid_layer0 + (int)blockIdx.y;
  const pd::AppendBlock b = pd::append_block(desc, num_touched, blockIdx.x, l, row_elems,
                                             num_rows, page_size, num_pages, layer0,
                                             row_layers, copy_cow);
  const float ks = k_scale[l], vs = v_scale[l];
  for (long long i = b.first + threadIdx.x; i < b.last; i += blockDim.x) {
    if (i < (long long)b.lo * row_elems) {
      k_pages[b.dst0 + i] = k_pages[b.src0 + i];
      v_pages[b.dst0 + i] = v_pages[b.src0 + i];
    } else {
      k_pages[b.dst0 + i] = pd::fp8_from_float<TKV>(pd::to_float(k_rows[b.row_base + i]) / ks);
      v_pages[b.dst0 + i] = pd::fp8_from_float<TKV>(pd::to_float(v_rows[b.row_base + i]) / vs);
    }
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_APPEND_COMMON + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# Inputs: k_rows, v_rows (TIN), desc (int32 [5, T], columns sorted by page), k_pages,
# v_pages (uint8_t), k_scale, v_scale (float32 [L]), then the CUDA scalars but
# grid_layer0 (0-d int32); outputs: the new pools k_out, v_out (uint8_t). Template: TIN,
# KV_FP8. Launch: grid (num_pages * 128, L, 1) threads, threadgroup (128, 1, 1).
METAL_INPUTS = ("k_rows", "v_rows", "desc", "k_pages", "v_pages", "k_scale", "v_scale",
                "num_touched", "num_rows", "row_elems", "page_size", "num_pages", "layer0",
                "row_layers", "copy_cow")
METAL_OUTPUTS = ("k_out", "v_out")
METAL_HEADER = METAL_COMMON + METAL_APPEND_COMMON

METAL_SOURCE = r"""
  const int l = int(threadgroup_position_in_grid.y);
  const pd::AppendPage p = pd::append_page(
      desc, num_touched, int(threadgroup_position_in_grid.x), l, row_elems, num_rows,
      page_size, num_pages, layer0, row_layers, copy_cow);
  const float ks = k_scale[l], vs = v_scale[l];
  for (long i = thread_position_in_threadgroup.x; i < p.n; i += threads_per_threadgroup.x) {
    if (i < long(p.lo) * row_elems) {           // copy-on-write source (or the page)
      k_out[p.dst0 + i] = k_pages[p.src0 + i];
      v_out[p.dst0 + i] = v_pages[p.src0 + i];
    } else if (i < long(p.hi) * row_elems) {    // a new row, quantized
      k_out[p.dst0 + i] = pd::fp8_from_float<KV_FP8>(float(k_rows[p.row_base + i]) / ks);
      v_out[p.dst0 + i] = pd::fp8_from_float<KV_FP8>(float(v_rows[p.row_base + i]) / vs);
    } else {                                    // unchanged
      k_out[p.dst0 + i] = k_pages[p.dst0 + i];
      v_out[p.dst0 + i] = v_pages[p.dst0 + i];
    }
  }
"""


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"TIN": Dtype(spec.q_dtype), "TKV": Dtype(spec.out_dtype),
            "KV_FP8": metal_fp8(spec.out_dtype)}


KERNEL = KernelDef(
    kernel="append_fp8", cuda_name="pd_append_fp8", cuda_source=CUDA_SOURCE,
    template=("TIN", "TKV"), arguments=_arguments, threads=lambda spec: THREADS,
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS),
    cuda_only=("TKV",), metal_only=("KV_FP8",))
