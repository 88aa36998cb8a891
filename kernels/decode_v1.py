"""The v1 kernel (comparison arm): one CTA per (request, query head) over the whole KV
range, split across the CTA's warps and combined in shared memory.

CUDA dialect. It reuses the v2 device routine ``pd::attend_range`` with one query head
per CTA, so the two arms share their arithmetic and differ only in the work split: v1
reads each K/V element once per *query* head and never splits a request across CTAs.
Output ``out [B, Hq, D]`` (output dtype) and ``lse [B, Hq]`` float32, log2.
"""

from .decode_v2 import CUDA_SOURCE as _V2_SOURCE

# Template parameters, in order: TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, NUM_WARPS, STAGES
KERNEL_NAME = "pd_decode_v1"

CUDA_BODY = r"""
// grid: (B * Hq); block: NUM_WARPS * 32 threads.
template <typename TQ, typename TKV, typename TO, int HEAD_DIM, int PAGE_SIZE, int NUM_WARPS, int STAGES>
__global__ void __launch_bounds__(NUM_WARPS * 32) pd_decode_v1(
    const TQ* __restrict__ q,                    // [B, Hq, D]
    const TKV* __restrict__ k_pages,             // [num_pages, P, Hkv, D]
    const TKV* __restrict__ v_pages,             // [num_pages, P, Hkv, D]
    const int* __restrict__ indices,             // [total_pages]
    const int* __restrict__ indptr,              // [B + 1]
    const int* __restrict__ last_page_len,       // [B]
    const int* __restrict__ first_page_offset,   // [B]
    TO* __restrict__ out,                        // [B, Hq, D]
    float* __restrict__ lse_out,                 // [B, Hq], log2
    int num_qo_heads, int num_kv_heads, float scale_log2) {
  const int r = blockIdx.x / num_qo_heads, h = blockIdx.x % num_qo_heads;
  const int kvh = h / (num_qo_heads / num_kv_heads);
  const long long pb = indptr[r], npages = indptr[r + 1] - pb;
  const long long fpo = first_page_offset[r];
  long long seq = npages > 0 ? (npages - 1) * PAGE_SIZE + last_page_len[r] - fpo : 0;
  seq = seq < 0 ? 0 : seq;
  pd::attend_range<TQ, TKV, TO, HEAD_DIM, PAGE_SIZE, 1, NUM_WARPS, STAGES>(
      q, k_pages, v_pages, indices + pb, fpo, 0, seq, r, kvh, h, num_qo_heads, num_kv_heads,
      scale_log2, out, lse_out, ((long long)r * num_qo_heads + h) * HEAD_DIM,
      (long long)r * num_qo_heads + h);
}
"""

CUDA_SOURCE = _V2_SOURCE + CUDA_BODY
