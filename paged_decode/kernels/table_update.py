"""The table-update kernel: a step table's CSR arrays follow the pool, on the device.

A ``StepTable`` (``paged_decode/step_table.py``) keeps a batch's page table in one int32
device buffer of fixed capacity, ``TABLE_SECTIONS`` in this order (``cap`` rows,
``page_cap`` page slots):

- ``indptr [cap+1]``, ``last_page_len [cap]``, ``first_page_offset [cap]``,
  ``indices [page_cap]`` (slots past ``indptr[cap]`` are unused).

Between two steps each row ``r`` of the new table is a run of the old table's row
``src_row[r]`` (pages ``skip[r]`` to ``skip[r] + keep[r]`` of it: a front trim skips
pages, an append keeps the pages before its first changed one) followed by new page ids.
The host sends only that, as one int32 delta buffer, ``DELTA_SECTIONS`` in this order:

- ``indptr [cap+1]``, ``last_page_len [cap]``, ``first_page_offset [cap]``: the new
  header, copied as it is;
- ``src_row [cap]`` (``-1``: nothing kept), ``skip [cap]``, ``keep [cap]``;
- ``changed_indptr [cap+1]``, ``changed [M]``: row ``r``'s new page ids are
  ``changed[changed_indptr[r]:changed_indptr[r + 1]]``.

Contract (every dialect and ``apply_delta``, the array-op version): ``new`` is ``old``
with the header replaced by the delta's and, for every row ``r`` and ``i`` in ``[0,
indptr[r+1] - indptr[r])``, ``new.indices[indptr[r] + i] = old.indices[old.indptr[src] +
skip[r] + i]`` when ``i < keep[r]``, else ``changed[changed_indptr[r] + i - keep[r]]``.
The kernel reads ``old`` and writes ``new``, which must not overlap (CUDA updates in
place by copying the buffer to a scratch one first; Metal returns a fresh buffer, whose
unused index slots it fills with ``-1``). The host guarantees the ranges (the pool made
them); the kernels do not re-check them.

Grid: ``cap + 1`` blocks of 128 threads; block ``r < cap`` writes row ``r``, block
``cap`` writes ``indptr[0]`` (and, on Metal, the unused tail).
"""

from __future__ import annotations

import numpy as np

from .common import CUDA_COMMON, METAL_COMMON
from .kernel_def import KernelDef, MetalKernel

THREADS = 128
TABLE_SECTIONS = ("indptr", "last_page_len", "first_page_offset", "indices")
DELTA_SECTIONS = ("indptr", "last_page_len", "first_page_offset", "src_row", "skip", "keep",
                  "changed_indptr", "changed")


def table_words(cap: int, page_cap: int) -> int:
    """int32 words of a table buffer of ``cap`` rows and ``page_cap`` page slots."""
    return 3 * cap + 1 + page_cap


def table_views(buf: np.ndarray, cap: int) -> dict[str, np.ndarray]:
    """The sections of a (host or device) table buffer, by ``TABLE_SECTIONS`` name."""
    return {"indptr": buf[:cap + 1], "last_page_len": buf[cap + 1:2 * cap + 1],
            "first_page_offset": buf[2 * cap + 1:3 * cap + 1], "indices": buf[3 * cap + 1:]}


def delta_views(buf: np.ndarray, cap: int) -> dict[str, np.ndarray]:
    """The sections of a delta buffer, by ``DELTA_SECTIONS`` name."""
    out, at = {}, 0
    for name in DELTA_SECTIONS:
        n = cap + 1 if name in ("indptr", "changed_indptr") else cap
        if name == "changed":
            out[name] = buf[at:]
        else:
            out[name] = buf[at:at + n]
            at += n
    return out


def delta_header_words(cap: int) -> int:
    """Words of a delta buffer before ``changed``."""
    return 7 * cap + 2


def apply_delta(old: np.ndarray, delta: np.ndarray, cap: int) -> np.ndarray:
    """The contract in numpy (the reference and MLX backends' update, and the tests'
    model): a new table buffer (unused index slots ``-1``) from ``old`` and ``delta``."""
    o, d = table_views(old, cap), delta_views(delta, cap)
    new = np.full_like(old, -1)
    n = table_views(new, cap)
    for name in ("indptr", "last_page_len", "first_page_offset"):
        n[name][:] = d[name]
    ip = d["indptr"].astype(np.int64)
    count = np.diff(ip)
    keep = np.minimum(d["keep"].astype(np.int64), count)
    rows = np.repeat(np.arange(cap), count)
    i = np.arange(int(ip[-1])) - ip[:-1][rows]
    kept = i < keep[rows]
    src = d["src_row"].astype(np.int64)[rows]
    old_at = o["indptr"].astype(np.int64)[np.maximum(src, 0)] + d["skip"][rows] + i
    ch_at = d["changed_indptr"].astype(np.int64)[rows] + i - keep[rows]
    vals = np.where(kept, o["indices"][np.where(kept, old_at, 0)],
                    d["changed"][np.where(kept, 0, ch_at)] if d["changed"].size else -1)
    n["indices"][:i.size] = vals
    return new


# ---------------------------------------------------------------------------- CUDA
CUDA_BODY = r"""
// grid: cap + 1 blocks; block: THREADS threads. old and new must not overlap.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) pd_table_update(
    const int* __restrict__ old_table,   // [3 cap + 1 + page_cap]
    const int* __restrict__ delta,       // [7 cap + 2 + M]
    int* __restrict__ new_table,         // [3 cap + 1 + page_cap]
    int cap) {
  const int r = blockIdx.x;
  const int* d_indptr = delta;
  if (r == cap) {
    if (threadIdx.x == 0) new_table[0] = d_indptr[0];
    return;
  }
  const int* d_lpl = delta + cap + 1;
  const int* d_fpo = delta + 2 * cap + 1;
  const int* d_src = delta + 3 * cap + 1;
  const int* d_skip = delta + 4 * cap + 1;
  const int* d_keep = delta + 5 * cap + 1;
  const int* d_cindptr = delta + 6 * cap + 1;
  const int* d_changed = delta + 7 * cap + 2;
  const int* old_indices = old_table + 3 * cap + 1;
  int* new_indices = new_table + 3 * cap + 1;
  const int begin = d_indptr[r], count = d_indptr[r + 1] - begin;
  const int src = d_src[r];
  const int keep = d_keep[r] < count ? d_keep[r] : count;
  const int from = src >= 0 ? old_table[src] + d_skip[r] : 0;
  const int c0 = d_cindptr[r];
  for (int i = threadIdx.x; i < count; i += THREADS)
    new_indices[begin + i] = i < keep ? old_indices[from + i] : d_changed[c0 + i - keep];
  if (threadIdx.x == 0) {
    new_table[r + 1] = d_indptr[r + 1];
    new_table[cap + 1 + r] = d_lpl[r];
    new_table[2 * cap + 1 + r] = d_fpo[r];
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# Inputs: old_table, delta (int32), cap and page_cap (0-d int32); output new_table (int32,
# the whole buffer). Launch: grid ((cap + 1) * 128, 1, 1) threads, threadgroup (128, 1, 1).
METAL_INPUTS = ("old_table", "delta", "cap", "page_cap")
METAL_OUTPUTS = ("new_table",)
METAL_HEADER = METAL_COMMON

METAL_SOURCE = r"""
  const int r = int(threadgroup_position_in_grid.x);
  const int tid = int(thread_position_in_threadgroup.x);
  const int n = int(threads_per_threadgroup.x);
  device const int* d_indptr = delta;
  device int* new_indices = new_table + 3 * cap + 1;
  if (r == cap) {                  // indptr[0] and the unused index slots
    if (tid == 0) new_table[0] = d_indptr[0];
    for (int i = d_indptr[cap] + tid; i < page_cap; i += n) new_indices[i] = -1;
    return;
  }
  device const int* d_lpl = delta + cap + 1;
  device const int* d_fpo = delta + 2 * cap + 1;
  device const int* d_src = delta + 3 * cap + 1;
  device const int* d_skip = delta + 4 * cap + 1;
  device const int* d_keep = delta + 5 * cap + 1;
  device const int* d_cindptr = delta + 6 * cap + 1;
  device const int* d_changed = delta + 7 * cap + 2;
  // auto: MLX passes an input of fewer than 8 elements in the constant address space
  // (capacity 1 with a page capacity of 3 or less), which a device pointer cannot hold
  auto old_indices = old_table + 3 * cap + 1;
  const int begin = d_indptr[r], count = d_indptr[r + 1] - begin;
  const int src = d_src[r];
  const int keep = d_keep[r] < count ? d_keep[r] : count;
  const int from = src >= 0 ? old_table[src] + d_skip[r] : 0;
  const int c0 = d_cindptr[r];
  for (int i = tid; i < count; i += n)
    new_indices[begin + i] = i < keep ? old_indices[from + i] : d_changed[c0 + i - keep];
  if (tid == 0) {
    new_table[r + 1] = d_indptr[r + 1];
    new_table[cap + 1 + r] = d_lpl[r];
    new_table[2 * cap + 1 + r] = d_fpo[r];
  }
"""

KERNEL = KernelDef(
    kernel="table_update", cuda_name="pd_table_update", cuda_source=CUDA_SOURCE,
    template=("THREADS",), arguments=lambda spec: {"THREADS": THREADS},
    threads=lambda spec: THREADS,
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS),
    cuda_only=("THREADS",))
