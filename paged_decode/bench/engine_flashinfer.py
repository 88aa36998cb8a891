"""The FlashInfer arms of the engine suite: the same decode loop on FlashInfer 0.3.x.

Per step, as an engine driving FlashInfer does it: the host page table gains the new
token of every sequence (a new page where the last one is full; a shared partial last
page is copied first, as our pool does: every holder but the last in batch order copies),
in vectorized numpy (``HostPages``); the copies run on the device; one ``plan`` of the new
CSR table; then per layer ``append_paged_kv_cache`` writes the new K/V into FlashInfer's
own cache ``[L][num_pages, P, Hkv, D]`` (NHD, torch) and ``run`` decodes (tensor-core
decode). Two arms:

- ``flashinfer``: the appends and runs launched eagerly after ``plan``;
- ``flashinfer-captured``: the wrapper in FlashInfer's CUDA-graph mode (``plan`` copies
  the table into fixed buffers, which the captured appends read too), the L appends and
  runs captured once in a torch CUDA graph and replayed after each step's ``plan``, as
  engines serving FlashInfer do (vLLM, SGLang).

fp8 caches (``--kv-dtype``): FlashInfer's own fp8 decode (``plan(kv_data_type=)``,
``run(k_scale=, v_scale=)``), each layer's new rows quantized by torch ops before its
append (``run_loop``). A cache whose ``k_scale`` is too small for FlashInfer 0.3.1's
finite mask (``flashinfer_mask``: an amax-calibrated e5m2 cache) is refused, not run.

K and V differ everywhere: their own prompt rows (V at half K's spread, so the two
scales differ by about 2x) and their own new rows, so a ``run`` given the K and V caches
or scales swapped fails the oracle.

Timing is ours' (``engine.py``): the CUDA events bracket the host bookkeeping, the copies,
``plan`` and the launches (or the replay), as ours bracket ``begin`` and the step. Needs
the ``cuda`` backend with torch and FlashInfer importable; elsewhere an arm is reported as
not run, with why. ``run_loop`` takes the FlashInfer module and device as arguments, so
the CPU tests drive it with ``paged_decode.compat.flashinfer`` on CPU torch tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import Backend
from ..fp8 import amax_scales, is_fp8, max_finite
from ..page_table import PageTable
from ..reference import oracle_decode, row_rel_error
from .engine_case import (
    V_SIGMA,
    EngineArm,
    EngineCase,
    EventTimer,
    NoTimer,
    mean_us,
    median_us,
    prompts,
)
from .flashinfer_arm import _import_flashinfer, available
from .flashinfer_mask import finite_mask_refusal

ARMS = ("flashinfer", "flashinfer-captured")


@dataclass
class StepTable:
    """What one step of ``HostPages`` gives FlashInfer: the CSR table (int32 host arrays
    ``indptr [B+1]``, ``indices [N]``, ``last_page_len [B]``), the new tokens' positions
    ``[B]`` and the copy-on-write pairs ``(src, dst)`` (int64 page ids)."""

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    positions: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray


class HostPages:
    """The engine's host page table in vectorized numpy: a ``[B, max_pages]`` page array,
    pages and tokens per sequence, page refcounts; pages are handed out in ascending id
    order (as our pool's free list does) and never freed within a run.

    ``lens``: prompt lengths; sequence ``i > B // 2`` with ``i`` even is a fork of
    sequence 0 (it holds sequence 0's pages, refcounted), the others own their pages.
    ``steps``: how many one-token steps the arrays must hold."""

    def __init__(self, lens: list[int], page_size: int, steps: int) -> None:
        p, b = page_size, len(lens)
        self.p, self.b = p, b
        room = max(-(-(n + steps) // p) for n in lens) + 1
        self.num_pages = sum(-(-(n + steps + 1) // p) for n in lens) + b
        self.table = np.zeros((b, room), np.int64)
        self.npages = np.zeros(b, np.int64)
        self.length = np.zeros(b, np.int64)
        self.ref = np.zeros(self.num_pages, np.int64)
        self.next = 0
        half = b // 2
        self.forks = np.array([i > half and i % 2 == 0 for i in range(b)])
        for i, n in enumerate(lens):
            if self.forks[i]:
                k = int(self.npages[0])
                self.table[i, :k] = self.table[0, :k]
                self.npages[i], self.length[i] = k, self.length[0]
                self.ref[self.table[0, :k]] += 1
                continue
            k = -(-n // p)
            self.table[i, :k] = self._alloc(k)
            self.ref[self.table[i, :k]] = 1
            self.npages[i], self.length[i] = k, n

    def _alloc(self, n: int) -> np.ndarray:
        if self.next + n > self.num_pages:
            raise RuntimeError(f"HostPages: {self.next + n} pages needed, {self.num_pages} "
                               "allocated")
        ids = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return ids

    def pages(self, r: int) -> np.ndarray:
        return self.table[r, : int(self.npages[r])]

    def csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(indptr, indices, last_page_len)`` int32 of the current state."""
        mask = np.arange(self.table.shape[1])[None, :] < self.npages[:, None]
        indptr = np.zeros(self.b + 1, np.int32)
        np.cumsum(self.npages, out=indptr[1:])
        return (indptr, self.table[mask].astype(np.int32),
                ((self.length - 1) % self.p + 1).astype(np.int32))

    def step(self) -> StepTable:
        """Every sequence gains one token; returns the table FlashInfer is planned on."""
        rows = np.arange(self.b)
        last = self.table[rows, self.npages - 1]
        full = self.length % self.p == 0
        shared = ~full & (self.ref[last] > 1)
        # holders of one shared page copy in batch order until one holder is left: with
        # every holder appending, the last in batch order keeps the page
        if shared.any():
            sr = np.flatnonzero(shared)
            held = self.ref[last[sr]]
            order = np.lexsort((sr, last[sr]))
            sr, held = sr[order], held[order]
            first = np.r_[True, last[sr][1:] != last[sr][:-1]]
            rank = np.arange(sr.size) - np.maximum.accumulate(np.where(first,
                                                                       np.arange(sr.size), 0))
            keep = sr[rank >= held - 1]
            shared[keep] = False
        need = np.flatnonzero(full | shared)
        new = np.zeros(self.b, np.int64)
        new[need] = self._alloc(need.size)
        self.ref[new[need]] = 1
        cow = np.flatnonzero(shared)
        src, dst = last[cow], new[cow]
        np.add.at(self.ref, src, -1)
        self.table[cow, self.npages[cow] - 1] = dst
        grow = np.flatnonzero(full)
        self.table[grow, self.npages[grow]] = new[grow]
        self.npages[grow] += 1
        self.length += 1
        indptr, indices, lpl = self.csr()
        return StepTable(indptr, indices, lpl, (self.length - 1).astype(np.int32), src, dst)


def run_flashinfer(be: Backend, case: EngineCase, arm: str = "flashinfer", *,
                   seed: int = 0) -> EngineArm:
    """Arm ``arm`` (``ARMS``) on the H200 path: the ``cuda`` backend, FlashInfer and torch."""
    if be.name != "cuda":
        return EngineArm(arm, False, note="needs the cuda backend", kv_dtype=case.kv_dtype)
    ok, why = available()
    if not ok:
        return EngineArm(arm, False, note=why, kv_dtype=case.kv_dtype)
    import torch
    return run_loop(_import_flashinfer(), torch, torch.device("cuda"), case, arm, seed=seed)


def run_loop(fi: Any, torch: Any, dev: Any, case: EngineCase, arm: str, *,
             seed: int = 0, mask_guard: bool = True) -> EngineArm:
    """The loop of arm ``arm`` with FlashInfer module ``fi`` (FlashInfer's API) on torch
    device ``dev``; on a CPU device the captured arm runs its body eagerly each step and
    no GPU time is reported.

    fp8 caches (``case.kv_dtype``; torch ``float8_e4m3fn`` / ``float8_e5m2``): per-layer
    K and V scales, each calibrated on its own prompt rows (``amax_scales``),
    ``plan(kv_data_type=)`` the format, ``run`` the layer's ``k_scale`` / ``v_scale``.
    FlashInfer 0.3.1's ``append_paged_kv_cache`` copies rows of the cache's dtype (its
    kernel reads them as that type), so each layer's new rows are quantized first by torch
    ops (``_quantizer``), inside the timed step.

    ``mask_guard``: refuse (not run, with why) scales at which FlashInfer 0.3.1's
    tensor-core decode would not mask the padded K slots (``flashinfer_mask``); off only
    for a ``fi`` that masks with -inf after scaling (``paged_decode.compat.flashinfer``,
    the CPU tests' drop-in)."""
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32}.get(case.dtype)
    if dt is None or (dev.type == "cuda" and dt == torch.float32):
        return EngineArm(arm, False, note=f"FlashInfer decode takes f16/bf16, not {case.dtype}",
                         kv_dtype=case.kv_dtype)
    fp8 = is_fp8(case.kv_dtype)
    cdt = getattr(torch, case.kv_dtype) if fp8 else dt       # the caches' dtype
    captured = arm == "flashinfer-captured"
    p, hkv, d, hq, nl, b = (case.page_size, case.num_kv_heads, case.head_dim,
                            case.num_qo_heads, case.layers, case.batch)
    host = HostPages(prompts(case, seed), p, case.steps)
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    # an fp8 cache is allocated and index-written as its bytes (uint8: zeros and index
    # copies need no fp8 kernels) and read by FlashInfer through an fp8 view of them
    writes = [tuple(torch.zeros(host.num_pages, p, hkv, d, device=dev,
                                dtype=torch.uint8 if fp8 else dt) for _ in range(2))
              for _ in range(nl)]
    caches = [tuple(c.view(cdt) for c in kv) if fp8 else kv for kv in writes]
    own = np.flatnonzero(~host.forks)
    slots = torch.from_numpy(np.concatenate([
        host.pages(int(r))[np.arange(int(host.length[r])) // p] * p
        + np.arange(int(host.length[r])) % p for r in own])).to(dev)
    quant = _quantizer(torch, cdt, case.kv_dtype) if fp8 else None
    scales: list[dict[str, float]] = []      # run's keywords per layer (fp8 only)
    for k, v in writes:        # every prompt row of a layer: K's and V's own rows
        got: dict[str, float] = {}
        for name, cache, sigma in (("k_scale", k, 1.0), ("v_scale", v, V_SIGMA)):
            rows = torch.randn(int(slots.numel()), hkv, d, generator=gen, device=dev,
                               dtype=dt) * sigma
            if quant is not None:
                got[name] = float(amax_scales([float(rows.abs().max())], case.kv_dtype)[0])
                rows = quant(rows, got[name]).view(torch.uint8)
            cache.view(-1, hkv, d)[slots] = rows
        if got:
            scales.append(got)
    k_scales, v_scales = ([x[n] for x in scales] for n in ("k_scale", "v_scale"))
    why = finite_mask_refusal(d ** -0.5, min(k_scales, default=1.0))   # plan's sm_scale
    if mask_guard and why is not None:
        return EngineArm(arm, False, case.dtype, note=why, kv_dtype=case.kv_dtype,
                         k_scale=k_scales, v_scale=v_scales)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    i32 = {"dtype": torch.int32, "device": dev}
    # fixed device buffers: the table (graph mode's plan copies into them; the appends of
    # both arms read them) and the new tokens' batch indices and positions
    bufs = (torch.zeros(b + 1, **i32), torch.zeros(int(host.table.size), **i32),
            torch.zeros(b, **i32))
    if captured:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
            paged_kv_last_page_len_buffer=bufs[2])
    else:
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                        use_tensor_cores=True)
    batch_idx = torch.arange(b, **i32)
    positions = torch.zeros(b, **i32)
    pos_host = torch.zeros(b, dtype=torch.int32)
    if dev.type == "cuda":
        pos_host = pos_host.pin_memory()
    qs = [torch.randn(b, hq, d, generator=gen, device=dev, dtype=dt) for _ in range(nl)]
    ks = [torch.randn(b, hkv, d, generator=gen, device=dev, dtype=dt) for _ in range(nl)]
    vs = [torch.randn(b, hkv, d, generator=gen, device=dev, dtype=dt) * V_SIGMA
          for _ in range(nl)]
    outs = [torch.empty(b, hq, d, device=dev, dtype=dt) for _ in range(nl)]

    def layers() -> None:
        for layer in range(nl):
            kv = caches[layer]
            kn, vn = ks[layer], vs[layer]
            if quant is not None:      # the new rows in the cache's format
                kn = quant(kn, scales[layer]["k_scale"])
                vn = quant(vn, scales[layer]["v_scale"])
            fi.append_paged_kv_cache(kn, vn, batch_idx, positions, kv,
                                     bufs[1], bufs[0], bufs[2], kv_layout="NHD")
            wrapper.run(qs[layer], kv, out=outs[layer], **(scales[layer] if fp8 else {}))

    def prepare(t: StepTable) -> None:
        """Host side of a step, and its small copies: copy-on-write, the table, plan."""
        if t.copy_src.size:
            src, dst = (torch.from_numpy(x).to(dev) for x in (t.copy_src, t.copy_dst))
            for k, v in writes:
                k[dst] = k[src]
                v[dst] = v[src]
        pos_host.numpy()[:] = t.positions
        positions.copy_(pos_host, non_blocking=True)
        ip, ix, lpl = (torch.from_numpy(x) for x in (t.indptr, t.indices, t.last_page_len))
        if not captured:      # the eager appends read the same device buffers
            bufs[0].copy_(ip, non_blocking=True)
            bufs[1][: ix.numel()].copy_(ix, non_blocking=True)
            bufs[2].copy_(lpl, non_blocking=True)
        wrapper.plan(ip, ix, lpl, hq, hkv, d, p, pos_encoding_mode="NONE", q_data_type=dt,
                     kv_data_type=cdt)

    timer = _timer(torch, dev)
    graph: Callable[[], None] | None = None
    walls, hosts, gpus, errors = [], [], [], []
    for step in range(case.steps):
        _sync(torch, dev)
        t0 = time.perf_counter()
        with timer:
            prepare(host.step())
            if graph is not None:
                graph()
            else:
                layers()
                if captured and dev.type == "cuda":
                    graph = _capture(torch, layers)     # step 0: run eagerly, then capture
            t1 = time.perf_counter()
        _sync(torch, dev)
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        hosts.append(t1 - t0)
        gpus.append(timer.last)
        if step in (0, 1, case.steps - 1):      # 1: the first replay of the captured arm
            errors += [_check(writes[layer], host, qs[layer], outs[layer],
                              {"kv_dtype": case.kv_dtype, **scales[layer]} if fp8 else {})
                       for layer in (0, nl - 1)]
    version = getattr(fi, "__version__", "paged-decode drop-in")
    mode = "CUDA graph of L x (append + run) per step" if captured else "eager launches"
    kv = f", {case.kv_dtype} cache (new rows quantized by torch ops)" if fp8 else ""
    return EngineArm(arm, True, case.dtype, f"flashinfer {version} tensor-core decode, "
                     f"{mode}{kv}", step_us=median_us(walls), mean_us=mean_us(walls),
                     host_us=median_us(hosts), gpu_us=median_us(gpus), errors=errors,
                     kv_dtype=case.kv_dtype, k_scale=k_scales, v_scale=v_scales)


def _quantizer(torch: Any, cdt: Any, fmt: str) -> Callable[[Any, float], Any]:
    """``rows [N, Hkv, D]`` (16-bit) -> ``saturate(round_ne(rows / scale))`` in torch fp8
    dtype ``cdt`` (format ``fmt``): ``docs/fp8.md``'s convention, ``x / scale`` in
    float32. The clamp is there because torch's cast does not saturate (e5m2 would make
    infinities); NaN stays NaN."""
    top = max_finite(fmt)

    def quantize(rows: Any, scale: float) -> Any:
        return (rows.float() / scale).clamp_(-top, top).to(cdt)
    return quantize


def _capture(torch: Any, body: Callable[[], None]) -> Callable[[], None]:
    """``body`` captured in a torch CUDA graph (after one warm-up run on the capture's
    side stream, torch's documented pattern); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g.replay


def _sync(torch: Any, dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timer(torch: Any, dev: Any) -> Any:
    """torch CUDA events around the block (NaN off CUDA)."""
    if dev.type != "cuda":
        return NoTimer()
    return EventTimer(lambda: torch.cuda.Event(enable_timing=True),
                      lambda s, e: s.elapsed_time(e))


def _check(cache: tuple[Any, Any], host: HostPages, q: Any, out: Any,
           quant: dict[str, Any]) -> float:
    """Requests 0, the last and a fork against the float64 oracle on the cache as stored:
    16-bit values, or (``quant``: ``kv_dtype``, ``k_scale``, ``v_scale``) the bytes of an
    fp8 cache, which the oracle dequantizes with the layer's scales."""
    forks = np.flatnonzero(host.forks)
    rows = sorted({0, host.b - 1, *(forks[:1].tolist())})
    k, v = (c.cpu().numpy() if quant else c.float().cpu().numpy() for c in cache)
    sel = [host.pages(r) for r in rows]
    table = PageTable.build(np.concatenate(sel), np.cumsum([0] + [x.size for x in sel]),
                            [(int(host.length[r]) - 1) % host.p + 1 for r in rows],
                            page_size=host.p)
    want, _ = oracle_decode(q[rows].float().cpu().numpy(), k, v, table, **quant)
    return row_rel_error(out[rows].float().cpu().numpy(), want)   # per (request, head) row


__all__ = ["ARMS", "HostPages", "StepTable", "run_flashinfer", "run_loop"]
