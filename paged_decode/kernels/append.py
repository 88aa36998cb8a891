"""The append kernel: the K/V writes of a batched ``PagePool.append_batch`` in one launch.

The host (``PagePool``) turns an append of many sequences into a list of the pages it
writes ("touched pages") and hands it over as ``AppendWrite``. Each touched page gets one
column of ``desc``, int32 ``[5, T]`` (``DESC_FIELDS``):

- ``page``: the page written (a fresh page, a sequence's own partial last page, or the
  private copy of a shared one);
- ``src``: where its slots ``[0, lo)`` come from: ``page`` itself, or the shared page it
  replaces (copy-on-write);
- ``row0``: slot ``s`` in ``[lo, hi)`` takes new row ``row0 + s``;
- ``lo``, ``hi``: the slots the new rows fill.

Contract (every dialect and the array-op backends), pools ``[L, num_pages, P, Hkv, D]``
(``L = 1`` without a layer axis), rows ``[row_layers, N, Hkv, D]`` in the pools' dtype:
for every column, (1) with ``copy_cow`` and ``src != page``, in every layer
``pages[l, page, :lo] = pages[l, src, :lo]``; (2) in layers ``layer0 <= l < layer0 +
row_layers``, ``pages[l, page, s] = rows[l - layer0, row0 + s]`` for ``lo <= s < hi``;
nothing else changes. A page is written by one column only; a copy-on-write source may
be written in the same launch, but only at slots ``>= lo`` (the sequence that still owns
it appends there), so the copies read nothing the launch writes and the order of blocks
does not matter.

Rows move as words of ``VEC`` bytes (16 where the row's bytes and the arrays' addresses
allow, ``vector_bytes``); the kernels never look at the element type.

CUDA: grid ``(T, layers in the grid)``, 128 threads per block; block ``(t, y)`` handles
column ``t`` in layer ``grid_layer0 + y``, K and V. The copy-on-write copies are made by
the same blocks that write the rows, for every layer (a call that writes one layer still
copies the page in all of them, so the grid then spans every layer): one launch, no
ordering between a copy and a write (they touch different slots).

Metal (MLX ``metal_kernel`` body): MLX cannot write an input in place (its kernels return
fresh outputs; there is no input/output aliasing), so the kernel writes the *whole* new
pools ``k_out``, ``v_out``: one threadgroup of 128 threads per (page, layer) finds its
page among the touched pages (``desc`` sorted by page, binary search) and writes each
slot from the new rows, the copy-on-write source or the old pool. That is O(pool bytes)
per call, against O(appended rows) on CUDA. Word accesses reinterpret ``device``
pointers, so the backends run this kernel only when every K/V input has at least 8
elements (MLX passes smaller inputs in the ``constant`` space); nothing ran on Apple
hardware.
"""

from __future__ import annotations

import numpy as np

from .common import CUDA_COMMON, METAL_COMMON
from .kernel_def import KernelDef, MetalKernel

THREADS = 128                      # per block / threadgroup, both dialects
DESC_FIELDS = ("page", "src", "row0", "lo", "hi")
WORD_BYTES = (16, 8, 4, 2)         # VEC values the kernels are specialized on
#: inputs with fewer elements reach a Metal kernel in the constant address space
METAL_MIN_ELEMENTS = 8


def word_widths(row_bytes: int) -> list[int]:
    """The ``WORD_BYTES`` widths that divide ``row_bytes``, widest first: those an append
    of rows of that size can take (``vector_bytes`` picks among them by the addresses)."""
    return [w for w in WORD_BYTES if row_bytes % w == 0]


def vector_bytes(row_bytes: int, addresses: tuple[int, ...] = ()) -> int:
    """Bytes per access: the widest of 16, 8, 4, 2 that divides ``row_bytes`` and every
    address in ``addresses`` (rows start at multiples of ``row_bytes`` from them)."""
    for w in word_widths(row_bytes):
        if all(a % w == 0 for a in addresses):
            return w
    raise ValueError(f"append: a K/V row of {row_bytes} bytes is not a whole number of "
                     "2-byte words")


class AppendWrite:
    """What one append launch writes (the kernel's arguments, host side; never changed
    after it is made: a plain class with slots because the decode loop makes one per
    step and per layer, and a frozen dataclass costs several times as much to make).

    ``desc``: int32 ``[5, T]`` (rows ``DESC_FIELDS``, see the module docstring);
    ``num_rows``: N new rows per layer; ``layer0``, ``row_layers``: the pool layers the
    rows go to (``0`` and ``1`` for a pool without layers); ``copy_cow``: make the
    copy-on-write copies (``False`` when another layer of an earlier append is written);
    ``shared``: ``(matrix, i)`` when ``desc`` is ``matrix[i]`` of a read-only C-contiguous
    int32 ``[K, 5, T]`` matrix that several appends share (the worked-out appends of
    ``append_lookahead``): a backend keeping device copies of read-only arrays uploads
    it once for all of them.
    """

    __slots__ = ("desc", "num_rows", "layer0", "row_layers", "copy_cow", "shared")

    def __init__(self, desc: np.ndarray, num_rows: int, layer0: int, row_layers: int,
                 copy_cow: bool, shared: tuple[np.ndarray, int] | None = None) -> None:
        self.desc, self.num_rows, self.layer0 = desc, num_rows, layer0
        self.row_layers, self.copy_cow, self.shared = row_layers, copy_cow, shared

    @property
    def num_touched(self) -> int:
        return int(self.desc.shape[1])

    @property
    def copies(self) -> bool:
        """Whether the launch makes a copy-on-write copy."""
        return self.copy_cow and bool((self.desc[1] != self.desc[0]).any())

    def by_page(self) -> np.ndarray:
        """``desc`` with its columns sorted by page id (the Metal kernel searches it)."""
        return np.ascontiguousarray(self.desc[:, np.argsort(self.desc[0], kind="stable")])

    def flat_rows(self, num_layers: int, num_pages: int, page_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The contract as row copies, for array-op backends: with the pools viewed as
        ``[num_layers * num_pages * page_size, Hkv * D]`` and the rows as ``[row_layers *
        N, Hkv * D]``, int64 (copy destinations, copy sources) into the pools, then
        (write destinations into the pools, write sources into the rows). The copies
        read no row the writes write, so either order is right."""
        page, src, row0, lo, hi = (f.astype(np.int64) for f in self.desc)
        # every written slot: column c, slot s in [lo, hi)
        n = hi - lo
        col = np.repeat(np.arange(page.size), n)
        slot = lo[col] + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        layers = np.arange(self.layer0, self.layer0 + self.row_layers)[:, None]
        w_dst = ((layers * num_pages + page[col]) * page_size + slot).reshape(-1)
        w_src = ((layers - self.layer0) * self.num_rows + row0[col] + slot).reshape(-1)
        # every copied slot: slots [0, lo) of the columns whose source is another page
        cols = np.flatnonzero(src != page) if self.copy_cow else np.zeros(0, np.int64)
        m = lo[cols]
        ccol = np.repeat(cols, m)
        cslot = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
        every = np.arange(num_layers)[:, None] * num_pages
        c_dst = ((every + page[ccol]) * page_size + cslot).reshape(-1)
        c_src = ((every + src[ccol]) * page_size + cslot).reshape(-1)
        return c_dst, c_src, w_dst, w_src


def table_row_desc(desc: np.ndarray, rows: np.ndarray, capacity: int) -> np.ndarray:
    """An engine step's descriptor: ``desc`` (int32 ``[..., 5, n]``, one column per live
    sequence, ``row0`` counted in the call's rows) with ``row0`` counted in the step
    table's rows instead (``rows`` int64 ``[n]``: each sequence's table row), padded with
    empty columns to ``capacity`` (int32 ``[..., 5, capacity]``; the kernel reads the
    step's ``[capacity, Hkv, D]`` rows)."""
    n = desc.shape[-1]
    out = np.zeros((*desc.shape[:-1], capacity), np.int32)
    out[..., :n] = desc
    out[..., 2, :n] = rows - desc[..., 3, :]      # slot lo takes row (table row)
    return out


# ---------------------------------------------------------------------------- CUDA
# Template parameter: VEC (bytes per word). Scalars: T (columns of desc), N (rows per
# layer), row_words (words per K/V row), page_size, num_pages; grid_layer0 (the layer of
# blockIdx.y == 0), layer0 / row_layers (the layers the rows go to), copy_cow (0/1).
# What both append kernels (this one and ``append_fp8.py``) share: the slots block (t, l)
# writes, from column t of desc. Offsets count row units (words here, elements there).
CUDA_APPEND_COMMON = r"""
namespace pd {
struct AppendBlock {
  int lo;                              // slots [0, lo) are copied (when first == 0)
  long long first, last;               // units [first, last) of the page are written
  long long dst0, src0, row_base;      // the page, its copy-on-write source, its rows
};
__device__ __forceinline__ AppendBlock append_block(
    const int* __restrict__ desc, int num_touched, int t, int l, int row_len, int num_rows,
    int page_size, int num_pages, int layer0, int row_layers, int copy_cow) {
  const int page = desc[t];
  const int src = desc[num_touched + t];
  const int row0 = desc[2 * num_touched + t];
  const int lo = desc[3 * num_touched + t];
  const int hi = desc[4 * num_touched + t];
  const bool copy = copy_cow != 0 && src != page;      // slots [0, lo) from src
  const bool rows_here = l >= layer0 && l < layer0 + row_layers;
  // units [first, last) of the page: i = slot * row_len + unit
  AppendBlock b;
  b.lo = lo;
  b.first = copy ? 0 : (long long)lo * row_len;
  b.last = (long long)(rows_here ? hi : (copy ? lo : 0)) * row_len;
  const long long layer_units = (long long)l * num_pages * page_size * row_len;
  b.dst0 = layer_units + (long long)page * page_size * row_len;
  b.src0 = layer_units + (long long)src * page_size * row_len;
  b.row_base = ((long long)(l - layer0) * num_rows + row0) * row_len;
  return b;
}
}  // namespace pd
"""

CUDA_BODY = r"""
namespace pd {
template <int BYTES> struct Word;
template <> struct Word<16> { typedef uint4 type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<4> { typedef unsigned int type; };
template <> struct Word<2> { typedef unsigned short type; };
}  // namespace pd

// grid: (T touched pages, layers in the grid); block: 128 threads.
template <int VEC>
__global__ void __launch_bounds__(128) pd_append(
    const typename pd::Word<VEC>::type* __restrict__ k_rows,   // [row_layers, N, row_words]
    const typename pd::Word<VEC>::type* __restrict__ v_rows,
    const int* __restrict__ desc,                               // [5, T]: page src row0 lo hi
    typename pd::Word<VEC>::type* k_pages,                      // [L, num_pages, P, row_words]
    typename pd::Word<VEC>::type* v_pages,
    int num_touched, int num_rows, int row_words, int page_size, int num_pages,
    int grid_layer0, int layer0, int row_layers, int copy_cow) {
  const pd::AppendBlock b = pd::append_block(desc, num_touched, blockIdx.x,
                                             grid_layer0 + (int)blockIdx.y, row_words,
                                             num_rows, page_size, num_pages, layer0,
                                             row_layers, copy_cow);
  for (long long i = b.first + threadIdx.x; i < b.last; i += blockDim.x) {
    if (i < (long long)b.lo * row_words) {
      k_pages[b.dst0 + i] = k_pages[b.src0 + i];
      v_pages[b.dst0 + i] = v_pages[b.src0 + i];
    } else {
      k_pages[b.dst0 + i] = k_rows[b.row_base + i];
      v_pages[b.dst0 + i] = v_rows[b.row_base + i];
    }
  }
}
"""

CUDA_SOURCE = CUDA_COMMON + CUDA_APPEND_COMMON + CUDA_BODY

# ---------------------------------------------------------------------------- Metal
# Inputs: k_rows, v_rows (pool dtype), desc (int32 [5, T], columns sorted by page),
# k_pages, v_pages, then the CUDA scalars but grid_layer0 (0-d int32); outputs: the new
# pools k_out, v_out. Template: VEC. Launch: grid (num_pages * 128, L, 1) threads,
# threadgroup (128, 1, 1).
METAL_INPUTS = ("k_rows", "v_rows", "desc", "k_pages", "v_pages", "num_touched", "num_rows",
                "row_words", "page_size", "num_pages", "layer0", "row_layers", "copy_cow")
METAL_OUTPUTS = ("k_out", "v_out")
# Both Metal append bodies: the column of desc of this threadgroup's page (columns sorted
# by page, binary search) and the offsets of its slots (row units: words or elements).
METAL_APPEND_COMMON = r"""
namespace pd {
struct AppendPage {
  int lo, hi;                          // slots [0, lo) from src, [lo, hi) new rows
  long dst0, src0, row_base, n;        // the page, its source, its rows; units per page
};
template <typename DP>
inline AppendPage append_page(DP desc, int num_touched, int page, int l, int row_len,
                              int num_rows, int page_size, int num_pages, int layer0,
                              int row_layers, int copy_cow) {
  const bool rows_here = l >= layer0 && l < layer0 + row_layers;
  int a = 0, b = num_touched;
  while (a < b) {
    const int m = (a + b) / 2;
    if (desc[m] < page) a = m + 1; else b = m;
  }
  int src = page, row0 = 0, lo = 0, hi = 0;
  if (a < num_touched && desc[a] == page) {
    if (copy_cow != 0) src = desc[num_touched + a];
    row0 = desc[2 * num_touched + a];
    lo = desc[3 * num_touched + a];
    hi = rows_here ? desc[4 * num_touched + a] : lo;
  }
  AppendPage p;
  p.lo = lo;
  p.hi = hi;
  const long layer_units = long(l) * num_pages * page_size * row_len;
  p.dst0 = layer_units + long(page) * page_size * row_len;
  p.src0 = layer_units + long(src) * page_size * row_len;
  p.row_base = (long(l - layer0) * num_rows + row0) * row_len;
  p.n = long(page_size) * row_len;
  return p;
}
}  // namespace pd
"""
METAL_HEADER = METAL_COMMON + METAL_APPEND_COMMON + r"""
namespace pd {
template <int BYTES> struct Word;
template <> struct Word<16> { typedef uint4 type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<4> { typedef uint type; };
template <> struct Word<2> { typedef ushort type; };
}  // namespace pd
"""

METAL_SOURCE = r"""
  typedef typename pd::Word<VEC>::type W;
  const pd::AppendPage p = pd::append_page(
      desc, num_touched, int(threadgroup_position_in_grid.x),
      int(threadgroup_position_in_grid.y), row_words, num_rows, page_size, num_pages, layer0,
      row_layers, copy_cow);
  const device W* ik = reinterpret_cast<const device W*>(k_pages);
  const device W* iv = reinterpret_cast<const device W*>(v_pages);
  const device W* rk = reinterpret_cast<const device W*>(k_rows);
  const device W* rv = reinterpret_cast<const device W*>(v_rows);
  device W* ok = reinterpret_cast<device W*>(k_out);
  device W* ov = reinterpret_cast<device W*>(v_out);
  for (long i = thread_position_in_threadgroup.x; i < p.n; i += threads_per_threadgroup.x) {
    if (i < long(p.lo) * row_words) {           // copy-on-write source (or the page)
      ok[p.dst0 + i] = ik[p.src0 + i];
      ov[p.dst0 + i] = iv[p.src0 + i];
    } else if (i < long(p.hi) * row_words) {    // a new row
      ok[p.dst0 + i] = rk[p.row_base + i];
      ov[p.dst0 + i] = rv[p.row_base + i];
    } else {                                    // unchanged
      ok[p.dst0 + i] = ik[p.dst0 + i];
      ov[p.dst0 + i] = iv[p.dst0 + i];
    }
  }
"""


KERNEL = KernelDef(
    kernel="append", cuda_name="pd_append", cuda_source=CUDA_SOURCE, template=("VEC",),
    arguments=lambda spec: {"VEC": spec.vector_bytes}, threads=lambda spec: THREADS,
    metal=MetalKernel(METAL_HEADER, METAL_SOURCE, METAL_INPUTS, METAL_OUTPUTS))
