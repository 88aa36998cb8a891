"""The FlashInfer arm of the engine suite: the same decode loop on FlashInfer 0.3.x.

Per step, as an engine driving FlashInfer does it: the host page table (numpy, one page
list per sequence) gains the new token (a new page where the last one is full; forks'
shared partial pages are copied first, as our pool does), ``append_paged_kv_cache``
writes every layer's new K/V into FlashInfer's own cache ``[L][num_pages, P, Hkv, D]``
(NHD, torch), one ``plan`` per step, one ``run`` per layer (tensor-core decode).
Needs the ``cuda`` backend with torch and FlashInfer importable; elsewhere the arm is
reported as not run, with why. Not yet run on a GPU when this file was written: the
first H200 run of ``bench/device/run.sh engine`` checks it (its outputs are verified
against the float64 oracle like every arm).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..backends import Backend
from ..reference import max_rel_error, oracle_decode
from .engine_case import EngineArm, EngineCase, mean_us, median_us, prompts
from .flashinfer_arm import _import_flashinfer, available


def run_flashinfer(be: Backend, case: EngineCase, *, seed: int = 0) -> EngineArm:
    if be.name != "cuda":
        return EngineArm("flashinfer", False, note="needs the cuda backend")
    ok, why = available()
    if not ok:
        return EngineArm("flashinfer", False, note=why)
    import torch
    fi = _import_flashinfer()
    dev = torch.device("cuda")
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(case.dtype)
    if dt is None:
        return EngineArm("flashinfer", False, note="FlashInfer decode takes f16/bf16, "
                                                   f"not {case.dtype}")
    p, hkv, d, hq, nl = (case.page_size, case.num_kv_heads, case.head_dim,
                         case.num_qo_heads, case.layers)
    lens = prompts(case, seed)
    b = case.batch
    num_pages = sum(-(-(n + case.steps + 1) // p) for n in lens) + b
    gen = torch.Generator(device=dev).manual_seed(seed + 1)
    caches = [(torch.zeros(num_pages, p, hkv, d, dtype=dt, device=dev),
               torch.zeros(num_pages, p, hkv, d, dtype=dt, device=dev)) for _ in range(nl)]
    # the host table: page lists, lengths, refcounts (forks share request 0's pages)
    free = list(range(num_pages - 1, -1, -1))
    ref = np.zeros(num_pages, np.int64)
    pages: list[list[int]] = []
    length: list[int] = []
    half = b // 2
    for i, n in enumerate(lens):
        if i > half and i % 2 == 0:
            pages.append(list(pages[0]))
            length.append(length[0])
            ref[pages[0]] += 1
            continue
        own = [free.pop() for _ in range(-(-n // p))]
        ref[own] = 1
        pages.append(own)
        length.append(n)
        for k, v in caches:
            flat_k, flat_v = k.view(-1, hkv, d), v.view(-1, hkv, d)
            slots = torch.tensor([own[t // p] * p + t % p for t in range(n)], device=dev)
            flat_k[slots] = torch.randn(n, hkv, d, generator=gen, device=dev, dtype=dt)
            flat_v[slots] = flat_k[slots]
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    qs = [torch.randn(b, hq, d, generator=gen, device=dev, dtype=dt) for _ in range(nl)]
    ks = [torch.randn(b, hkv, d, generator=gen, device=dev, dtype=dt) for _ in range(nl)]
    outs = [torch.empty(b, hq, d, device=dev, dtype=dt) for _ in range(nl)]
    walls, hosts, gpus, errors = [], [], [], []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(case.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        copies = []
        for r in range(b):                    # the engine's host bookkeeping
            if length[r] % p == 0:
                pg = free.pop()
                ref[pg] = 1
                pages[r].append(pg)
            elif ref[pages[r][-1]] > 1:       # copy-on-write of a shared partial page
                pg = free.pop()
                ref[pg] = 1
                ref[pages[r][-1]] -= 1
                copies.append((pages[r][-1], pg))
                pages[r][-1] = pg
            length[r] += 1
        indptr = np.zeros(b + 1, np.int32)
        np.cumsum([len(x) for x in pages], out=indptr[1:])
        indices = np.concatenate([np.asarray(x, np.int32) for x in pages])
        last = np.array([(n - 1) % p + 1 for n in length], np.int32)
        t_ip, t_ix, t_last = (torch.from_numpy(a).to(dev, non_blocking=True)
                              for a in (indptr, indices, last))
        if copies:
            src = torch.tensor([c[0] for c in copies], device=dev)
            dst = torch.tensor([c[1] for c in copies], device=dev)
            for k, v in caches:
                k[dst] = k[src]
                v[dst] = v[src]
        append_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev)
        seq_lens = torch.from_numpy(np.asarray(length, np.int32)).to(dev)
        bi, pos = fi.get_batch_indices_positions(append_indptr, seq_lens, b)
        wrapper.plan(torch.from_numpy(indptr), torch.from_numpy(indices),
                     torch.from_numpy(last), hq, hkv, d, p, pos_encoding_mode="NONE",
                     q_data_type=dt, kv_data_type=dt)
        for layer in range(nl):
            k, v = caches[layer]
            fi.append_paged_kv_cache(ks[layer], ks[layer], bi, pos, (k, v), t_ix, t_ip,
                                     t_last, kv_layout="NHD")
            wrapper.run(qs[layer], (k, v), out=outs[layer])
        t1 = time.perf_counter()
        stop.record()
        stop.synchronize()
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        hosts.append(t1 - t0)
        gpus.append(start.elapsed_time(stop) * 1e-3)
        if step in (0, case.steps - 1):
            errors += [_check(caches[layer], pages, length, p, qs[layer], outs[layer])
                       for layer in (0, nl - 1)]
    version = getattr(fi, "__version__", "?")
    return EngineArm("flashinfer", True, case.dtype, f"flashinfer {version} tensor-core "
                     "decode", step_us=median_us(walls), mean_us=mean_us(walls),
                     host_us=median_us(hosts), gpu_us=median_us(gpus), errors=errors)


def _check(cache: tuple[Any, Any], pages: list[list[int]], length: list[int], p: int,
           q: Any, out: Any) -> float:
    """Requests 0 and B-1 against the float64 oracle."""
    from ..page_table import PageTable
    rows = [0, len(pages) - 1]
    k, v = (c.float().cpu().numpy() for c in cache)
    sel = [pages[r] for r in rows]
    table = PageTable.build(np.concatenate(sel), np.cumsum([0] + [len(x) for x in sel]),
                            [(length[r] - 1) % p + 1 for r in rows], page_size=p)
    want, _ = oracle_decode(q[rows].float().cpu().numpy(), k, v, table)
    return max_rel_error(out[rows].float().cpu().numpy(), want)


__all__ = ["run_flashinfer"]
