"""The v1 kernel (comparison arm): one CTA per (request, query head) over the whole KV
range, split across the CTA's warps and combined in shared memory.

CUDA dialect. It reuses the v2 device routine ``pd::attend_range`` with one query head
per CTA, so the two arms share their arithmetic and differ only in the work split: v1
reads each K/V element once per *query* head and never splits a request across CTAs.
Output ``out [B, Hq, D]`` (output dtype) and ``lse [B, Hq]`` float32, log2.
"""

from __future__ import annotations

from .decode_v2 import CUDA_SOURCE as _V2_SOURCE
from .decode_v2 import METAL_HEADER as _V2_METAL_HEADER
from .decode_v2 import ring_smem_bytes, warp_threads
from .kernel_def import Dtype, KernelDef, KernelSpec, MetalKernel, TemplateValue, metal_fp8

CUDA_BODY = r"""
// grid: (B * Hq); block: NUM_WARPS * 32 threads.
template <typename TQ, typename TKV, typename TO, int HEAD_DIM, int PAGE_SIZE, int NUM_WARPS, int STAGES, bool SOFT_CAP, bool SINK>
__global__ void __launch_bounds__(NUM_WARPS * 32) pd_decode_v1(
    const TQ* __restrict__ q,                    // [B, Hq, D]
    const TKV* __restrict__ k_pages,             // [num_pages, P, Hkv, D]
    const TKV* __restrict__ v_pages,             // [num_pages, P, Hkv, D]
    const int* __restrict__ indices,             // [total_pages]
    const int* __restrict__ indptr,              // [B + 1]
    const int* __restrict__ last_page_len,       // [B]
    const int* __restrict__ first_page_offset,   // [B]
    const float* __restrict__ sinks,             // [Hq] natural units with SINK (else unread)
    TO* __restrict__ out,                        // [B, Hq, D]
    float* __restrict__ lse_out,                 // [B, Hq], log2
    int num_qo_heads, int num_kv_heads, float scale_log2, float soft_cap_log2, float v_scale) {
  const int r = blockIdx.x / num_qo_heads, h = blockIdx.x % num_qo_heads;
  const int kvh = h / (num_qo_heads / num_kv_heads);
  const long long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long long fpo = first_page_offset[r];
  long long seq = npages > 0 ? (npages - 1) * PAGE_SIZE + last_page_len[r] - fpo : 0;
  seq = seq < 0 ? 0 : seq;
  pd::attend_range<TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, 1, NUM_WARPS, STAGES, 1, SOFT_CAP, SINK>(
      q, k_pages, v_pages, indices + pb, fpo, 0, seq, r, kvh, h, num_qo_heads, num_kv_heads,
      scale_log2, soft_cap_log2, sinks, v_scale, out, lse_out, ((long long)r * num_qo_heads + h) * HEAD_DIM,
      (long long)r * num_qo_heads + h);
}
"""

CUDA_SOURCE = _V2_SOURCE + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# MLX ``metal_kernel`` body over the v2 header's ``pd::attend_range`` (one query head per
# threadgroup). Inputs: q, k_pages, v_pages, indices, indptr, last_page_len,
# first_page_offset, sinks ([Hq] float32 with SINK, a stand-in otherwise), num_qo_heads,
# num_kv_heads (0-d int32), scale_log2, soft_cap_log2, v_scale (0-d float32); outputs:
# out, lse_out. Template arguments: TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, NUM_WARPS, SOFT_CAP,
# SINK, KV_FP8 (as v2's).
# Launch: grid (B * Hq * NUM_WARPS * 32, 1, 1) threads, threadgroup (NUM_WARPS * 32, 1, 1).
METAL_INPUTS = ("q", "k_pages", "v_pages", "indices", "indptr", "last_page_len",
                "first_page_offset", "sinks", "num_qo_heads", "num_kv_heads", "scale_log2",
                "soft_cap_log2", "v_scale")
METAL_OUTPUTS = ("out", "lse_out")
METAL_HEADER = _V2_METAL_HEADER

METAL_SOURCE = r"""
  // one threadgroup per (request, query head)
  const int r = int(threadgroup_position_in_grid.x) / num_qo_heads;
  const int h = int(threadgroup_position_in_grid.x) % num_qo_heads;
  const int kvh = h / (num_qo_heads / num_kv_heads);
  const long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long fpo = first_page_offset[r];
  long seq = npages > 0 ? (npages - 1) * PAGE_SIZE + last_page_len[r] - fpo : 0;
  seq = seq < 0 ? 0 : seq;

  typedef pd::Combine<HEAD_DIM, 1, NUM_WARPS> CB;
  threadgroup float sm_m[CB::STATE];
  threadgroup float sm_l[CB::STATE];
  threadgroup float sm_acc[CB::ACC];
  pd::attend_range<TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, 1, NUM_WARPS, SOFT_CAP, SINK, KV_FP8>(
      q, k_pages, v_pages, indices + pb, fpo, 0, seq, r, kvh, h, num_qo_heads,
      num_kv_heads, scale_log2, soft_cap_log2, sinks, v_scale, out, lse_out, (long(r) * num_qo_heads + h) * HEAD_DIM,
      long(r) * num_qo_heads + h, sm_m, sm_l, sm_acc, thread_position_in_threadgroup.x,
      thread_index_in_simdgroup, simdgroup_index_in_threadgroup);
"""


def _arguments(spec: KernelSpec) -> dict[str, TemplateValue]:
    return {"TQ": Dtype(spec.q_dtype), "TKV": Dtype(spec.kv_dtype), "TO": Dtype(spec.out_dtype),
            "HEAD_DIM": spec.head_dim, "PAGE_SIZE": spec.page_size,
            "NUM_WARPS": spec.num_warps, "STAGES": spec.stages, "SOFT_CAP": spec.soft_cap,
            "SINK": spec.sink, "KV_FP8": metal_fp8(spec.kv_dtype)}


KERNEL = KernelDef(
    kernel="v1", cuda_name="pd_decode_v1", cuda_source=CUDA_SOURCE,
    template=("TQ", "TKV", "TO", "HEAD_DIM", "PAGE_SIZE", "NUM_WARPS", "STAGES", "SOFT_CAP",
              "SINK"),
    arguments=_arguments, threads=warp_threads, dynamic_smem=ring_smem_bytes,
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS),
    cuda_only=("STAGES",), metal_only=("KV_FP8",))
