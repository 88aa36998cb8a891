"""CUDA-graph mode of the FlashInfer decode wrapper: fixed launches that read buffers.

FlashInfer's graph mode fixes the batch size for the wrapper's life; ``plan`` copies the
page table into caller-owned buffers and a captured ``run`` reads them, so one capture
replays correctly after any later plan of the same batch size. paged-decode does the same
with a fixed launch shape chosen at the first plan:

- ``pages_per_chunk`` (a kernel scalar, so baked into a capture) is the first plan's
  searched chunk size, raised where needed so that ``num_chunks = B + ceil(max_pages /
  pages_per_chunk)`` stays within about twice the device's CTA target (``max_pages``: the
  indices buffer's length, which bounds the pages of any later plan);
- every later table then needs at most ``num_chunks`` chunks (``sum_r ceil(pages_r /
  ppc) <= B + ceil(sum_r pages_r / ppc)``), so the partial's grid (``num_chunks``) and
  the merge's (``[B, Hq, D]``) never change;
- each plan rewrites the chunk map (``request_indices``, ``kv_tile_indices``,
  ``o_indptr``) into device buffers the wrapper owns, at fixed addresses; spare chunks
  point one tile past the last request's end, so they read no page and write zeros and
  ``-inf`` into workspace rows the merge never reads;
- the kernels read the caller's ``indptr`` / ``last_page_len`` buffers and either the
  caller's ``indices`` buffer or, for a combined cache (whose pages are addressed as
  ``2p``, ``fi_cache``), a doubled copy the wrapper writes at plan time;
- the split-KV partials live in the caller's float workspace buffer, as FlashInfer's do.

On the ``reference`` backend (no kernels, no graphs) ``run`` rebuilds a page table from
the buffers' current contents instead, so the semantics ("run reads what the last plan
copied into the buffers") are tested on the CPU; ``emulated-cuda`` runs the kernel path
itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import Backend, array_kind, c_contiguous
from ..backends.launching import LaunchingBackend
from ..errors import InvalidArgumentError, check_writable
from ..page_table import PageTable
from ..plan import MAX_CHUNKS, DecodePlan, chunk_counts
from .fi_arrays import as_backend, copy_into, is_cuda_tensor

#: backends graph mode runs on: the kernels' own (CUDA and its emulator), and the CPU
#: reference (which re-reads the buffers on every run)
GRAPH_BACKENDS = ("cuda", "emulated-cuda", "reference")


@dataclass(frozen=True)
class GraphPlan:
    """What the partial and merge launches read of a plan (``DecodePlan``'s fields), with
    the chunk map in wrapper-owned backend arrays rewritten by every plan:
    ``request_indices``, ``kv_tile_indices`` int32 ``[num_chunks]``, ``o_indptr`` int32
    ``[B + 1]``."""

    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_chunk: int
    heads_per_cta: int
    q_groups: int
    num_chunks: int
    request_indices: Any
    kv_tile_indices: Any
    o_indptr: Any


@dataclass(frozen=True)
class BufferTable:
    """The four CSR arrays the kernels read (``launches.TABLE_FIELDS``), as backend views
    of the caller's buffers (``indices``: the doubled copy for a combined cache)."""

    indices: Any
    indptr: Any
    last_page_len: Any
    first_page_offset: Any


def fixed_chunking(plan0: DecodePlan, max_pages: int, target_chunks: int) -> tuple[int, int]:
    """``(pages_per_chunk, num_chunks)`` for the wrapper's life (see the module doc)."""
    b = plan0.batch_size
    cap = min(MAX_CHUNKS, max(2 * target_chunks, b + 1))
    ppc = max(plan0.pages_per_chunk, -(-max_pages // max(1, cap - b)))
    return ppc, b + -(-max_pages // ppc)


def chunk_map(pages: np.ndarray, ppc: int, num_chunks: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``request_indices``, ``kv_tile_indices`` (``[num_chunks]``, spare chunks one tile
    past the last request's end) and ``o_indptr [B + 1]`` for requests of ``pages``."""
    counts = chunk_counts(pages, ppc)
    used = int(counts.sum())
    if used > num_chunks:   # excluded by fixed_chunking's bound; never launch past the grid
        raise InvalidArgumentError(f"graph mode: {used} chunks needed, {num_chunks} fixed")
    o_indptr = np.concatenate([[0], np.cumsum(counts)])
    req = np.repeat(np.arange(pages.size), counts)
    tiles = np.arange(used) - o_indptr[req]
    spare = num_chunks - used
    req = np.concatenate([req, np.full(spare, pages.size - 1)])
    tiles = np.concatenate([tiles, np.full(spare, counts[-1])])
    return req, tiles, o_indptr


class GraphState:
    """The fixed launch shape, the wrapper-owned device buffers and backend views of the
    caller's buffers; made by the first plan, rewritten in place by every plan."""

    def __init__(self, fn: str, be: Backend, buffers: tuple[Any, Any, Any], plan0: DecodePlan
                 ) -> None:
        if be.name not in GRAPH_BACKENDS:
            raise InvalidArgumentError(f"{fn}: use_cuda_graph=True runs on backends "
                                       f"{', '.join(GRAPH_BACKENDS)}, not {be.name!r}")
        if be.name == "cuda" and not all(is_cuda_tensor(x) or array_kind(x) == "cupy"
                                         for x in buffers):
            raise InvalidArgumentError(f"{fn}: the index buffers must be CUDA arrays (torch "
                                       "CUDA tensors or CuPy) for the cuda backend's kernels "
                                       "to read them")
        self.be = be
        self.user = buffers              # caller's (indptr, indices, last_page_len)
        names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                 "paged_kv_last_page_len_buffer")
        b = plan0.batch_size
        max_pages = int(buffers[1].shape[0])
        target = be.device_info().target_ctas(None, fn=fn)
        ppc, c = fixed_chunking(plan0, max_pages, -(-target // plan0.cta_count_per_chunk))
        xp = be.array_module()
        with be.launch_context(buffers[0]):   # views and buffers on the caller's stream
            self.views = tuple(as_backend(fn, n, be, x) for n, x in zip(names, buffers))
            own = [xp.zeros((n,), dtype=np.int32) for n in (c, c, b + 1, b, max(1, max_pages))]
        self.plan = GraphPlan(b, plan0.num_qo_heads, plan0.num_kv_heads, plan0.head_dim,
                              plan0.page_size, ppc, plan0.heads_per_cta, plan0.q_groups, c,
                              *own[:3])
        self.first_page_offset, self.doubled = own[3], own[4]
        self.written: tuple[np.ndarray, ...] = ()    # what the last plan wrote (``load``)

    @property
    def kernels_read_buffers(self) -> bool:
        """Whether runs launch on the buffers (kernel backends) or rebuild a table."""
        return isinstance(self.be, LaunchingBackend)

    def load(self, indptr: np.ndarray, indices: np.ndarray, last_page_len: np.ndarray,
             pages: np.ndarray) -> None:
        """What a plan writes: the caller's arrays into the caller's buffers, the chunk
        map and the doubled ids into the wrapper's (one host-to-device copy each)."""
        for buf, vals in zip(self.user, (indptr, indices, last_page_len)):
            copy_into(buf, vals)
        self.written = tuple(np.array(x, np.int64) for x in (indptr, indices, last_page_len))
        req, tiles, o_indptr = chunk_map(pages, self.plan.pages_per_chunk,
                                         self.plan.num_chunks)
        with self.be.launch_context(self.user[0]):
            for buf, vals in ((self.plan.request_indices, req),
                              (self.plan.kv_tile_indices, tiles),
                              (self.plan.o_indptr, o_indptr), (self.doubled, 2 * indices)):
                copy_into(buf, vals)

    def check_buffers(self, fn: str, pools: Any) -> None:
        """Raise unless the caller's buffers are safe to read as the last plan left the
        launches (``pools``: the run's ``KVPools``). A caller may rewrite page ids and
        last-page lengths between plan and run (FlashInfer's kernels read the buffers,
        and so do these), but not the page counts: the chunk map was made from
        ``indptr``. So: ``indptr`` as the plan wrote it; page ids in ``[0, num_pages)``,
        and as the plan wrote them for a combined cache (whose kernels read the plan's
        doubled copy); ``last_page_len`` in ``[1, P]`` for a request with pages, ``[0,
        P]`` without. One copy back to the host per buffer (a synchronization), so in an
        eager run only: nothing can be read back inside a capture, and a replay reads
        whatever the buffers hold."""
        if self.be.capturing():
            return
        ip, idx, lpl = (np.asarray(self.be.to_numpy(v)).astype(np.int64) for v in self.views)
        want_ip, want_idx = self.written[0], self.written[1]
        n, p = want_idx.size, pools.page_size
        idx, lpl = idx[:n], lpl[: want_ip.size - 1]
        bad = np.flatnonzero(ip[: want_ip.size] != want_ip)
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(
                f"{fn}: paged_kv_indptr_buffer[{i}] holds {int(ip[i])}, but the last plan "
                f"wrote {int(want_ip[i])}: call plan after changing the page counts (the "
                "launches' chunks were made from them)")
        if pools.interleaved and (idx != want_idx).any():
            i = int(np.flatnonzero(idx != want_idx)[0])
            raise InvalidArgumentError(
                f"{fn}: paged_kv_indices_buffer[{i}] holds {int(idx[i])}, but the last plan "
                f"wrote {int(want_idx[i])}: with a combined K/V cache call plan after "
                "changing page ids (the kernels read the plan's doubled copy)")
        bad = np.flatnonzero((idx < 0) | (idx >= pools.num_pages))
        if bad.size:
            i = int(bad[0])
            raise InvalidArgumentError(
                f"{fn}: paged_kv_indices_buffer[{i}] holds page {int(idx[i])}, outside the "
                f"cache's {pools.num_pages} pages")
        low = np.where(np.diff(want_ip) > 0, 1, 0)
        bad = np.flatnonzero((lpl < low) | (lpl > p))
        if bad.size:
            r = int(bad[0])
            raise InvalidArgumentError(
                f"{fn}: paged_kv_last_page_len_buffer[{r}] holds {int(lpl[r])}, outside "
                f"[{int(low[r])}, page_size = {p}] for request {r}")

    def table(self, interleaved: bool) -> BufferTable:
        """The CSR arrays the kernels read, for a combined cache or a pair."""
        indptr, indices, lpl = self.views
        return BufferTable(self.doubled if interleaved else indices, indptr, lpl,
                           self.first_page_offset)

    def host_table(self, page_size: int, interleaved: bool) -> PageTable:
        """A page table of the buffers' current contents (the reference backend's run)."""
        indptr, indices, lpl = (np.asarray(self.be.to_numpy(x)) for x in self.views)
        n = int(indptr[-1])
        ids = indices[:n].astype(np.int64) * (2 if interleaved else 1)
        # a request without pages is empty whatever its last_page_len (as checked_table
        # reads FlashInfer's tables; the kernels read it so too)
        lpl = np.where(np.diff(indptr.astype(np.int64)) > 0, lpl, 0)
        return PageTable.build(ids, indptr, lpl, page_size=page_size)

    def workspace(self, fn: str, ws: Any, hq: int, d: int) -> tuple[Any, Any, Any]:
        """``v_part [C, Hq, D]``, ``lse_part [C, Hq]`` and a spare ``lse [B, Hq]``, float32
        views of the caller's float workspace buffer (``ws``, any dtype, contiguous)."""
        c, b = self.plan.num_chunks, self.plan.batch_size
        sizes = (c * hq * d, c * hq, b * hq)
        arr = as_backend(fn, "float_workspace_buffer", self.be, ws)
        check_writable(fn, "float_workspace_buffer", arr, " (the partials are written there)")
        if not c_contiguous(arr):    # a strided buffer's bytes are not one run of floats
            raise InvalidArgumentError(f"{fn}: float_workspace_buffer must be a contiguous "
                                       "array (FlashInfer: a uint8 tensor)")
        try:
            raw = arr.reshape(-1).view(np.uint8)
        except (ValueError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"{fn}: float_workspace_buffer must be a contiguous "
                                       "array (FlashInfer: a uint8 tensor)") from exc
        need = 4 * sum(sizes)
        if raw.size < need:
            raise InvalidArgumentError(f"{fn}: float_workspace_buffer holds {raw.size} bytes; "
                                       f"graph mode needs {need} for {c} chunks x {hq} heads "
                                       f"x {d} (FlashInfer recommends 128 MB)")
        f32 = raw[:need].view(np.float32)
        v_part = f32[: sizes[0]].reshape(c, hq, d)
        lse_part = f32[sizes[0]: sizes[0] + sizes[1]].reshape(c, hq)
        spare = f32[sizes[0] + sizes[1]:].reshape(b, hq)
        return v_part, lse_part, spare


__all__ = ["GRAPH_BACKENDS", "BufferTable", "GraphPlan", "GraphState", "chunk_map",
           "fixed_chunking"]
