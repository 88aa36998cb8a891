"""External comparison arm: FlashInfer 0.6+'s XQA decode over the same pools and table.

FlashInfer 0.6 added ``flashinfer.decode.xqa_batch_decode_with_kv_cache``, its port of
TensorRT-LLM's XQA decode kernel, which takes any GQA ratio. On sm_90 it runs XQA's
generic kernel for 16-bit pools (its Hopper GMMA kernel is for fp8 pools). FlashInfer 0.6
and 0.3.1 cannot be imported in one process (both are ``flashinfer``), so a bench call
runs this arm with FlashInfer 0.6 on ``PYTHONPATH`` (``bench/device/flashinfer06_setup.sh``)
and the ``flashinfer`` / ``flashinfer-tc`` arms with 0.3.1 in another call.

Facts of FlashInfer 0.6.18 this relies on (read from its ``decode.py`` and ``xqa.py``):

- ``xqa_batch_decode_with_kv_cache(query [B, Hq, D], (k_cache, v_cache),
  workspace_buffer, block_tables [B, max_pages] int32, seq_lens [B] uint32, max_seq_len,
  bmm1_scale, bmm2_scale, window_left=-1, out=None, sinks=None, kv_layout="NHD",
  enable_pdl=None, ...)``: K and V pools ``[num_pages, P, Hkv, D]`` (NHD, this package's
  layout), a dense page table per request (entries past a request's pages unread), the
  workspace zero before its first use (its first 8 MB are semaphores);
- the scales: XQA applies ``1 / sqrt(D)`` itself and multiplies the scores by
  ``q_scale = bmm1_scale / bmm2_scale * sqrt(D)`` and the output by ``bmm2_scale``, so
  ``bmm1_scale = sm_scale * k_scale`` and ``bmm2_scale = v_scale`` (1 for 16-bit pools);
- page sizes 16, 32, 64 and 128 only; head_dim a multiple of 16 up to 512; float16 or
  bfloat16 queries; no logits soft cap; no first-page offset (a request starts at entry 0
  of its first page), as FlashInfer's other decodes;
- ``sliding_win_size = window_left + 1``: the last ``W + 1`` tokens, this package's
  ``window_left`` meaning.

Every refusal raises ``ValueError`` before any import where it can (testable without
torch), ``RuntimeError`` for a missing or too old FlashInfer; the benchmark marks the arm
unavailable for that case. **Status:** the table conversion and the refusals are checked
on the CPU; on the H200 the arm passed its smoke test (GQA 4 and 16, eager and graph
replay) and was timed beside v2 / v2tc in S18-R2 (``docs/benchmarks/h200-2026-12-04-s18.md``).
Its sliding window has not run on a GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..page_table import PageTable
from .flashinfer_arm import (
    _captured,
    _random_problem,
    _reference,
    _torch,
    _version_tuple,
    check_cuda_tensors,
    check_dtypes,
    check_table_for_flashinfer,
    smoke_report,
    smoke_start,
    torch_and_flashinfer,
)
from .sdpa_arm import check_shapes

#: page sizes XQA compiles (``jit/xqa.py``: TOKENS_PER_PAGE)
XQA_PAGE_SIZES = (16, 32, 64, 128)


def check_xqa_problem(head_dim: int, page_size: int, *,
                      logits_soft_cap: float | None = None) -> None:
    """``ValueError`` for what XQA cannot run: page sizes outside 16-128, head dims not a
    multiple of 16 or over 512, a logits soft cap."""
    if page_size not in XQA_PAGE_SIZES:
        raise ValueError(f"FlashInfer's XQA decode takes page sizes {list(XQA_PAGE_SIZES)}, "
                         f"not {page_size}")
    if head_dim % 16 or not 16 <= head_dim <= 512:
        raise ValueError(f"FlashInfer's XQA decode takes head_dim a multiple of 16 in "
                         f"[16, 512], not {head_dim}")
    if logits_soft_cap is not None:
        raise ValueError("FlashInfer's XQA decode has no logits soft cap")


def xqa_tables(table: PageTable) -> tuple[np.ndarray, np.ndarray]:
    """XQA's page table and lengths of ``table``: ``block_tables [B, max_pages]`` int32
    (request r's pages in order, zero past them: XQA reads a row only up to its length)
    and ``seq_lens [B]`` uint32 (visible tokens). ``table`` must pass
    ``check_table_for_flashinfer`` (no first-page offset)."""
    indptr = np.asarray(table.indptr, np.int64)
    indices = np.asarray(table.indices, np.int32)
    pages = np.diff(indptr)
    width = max(1, int(pages.max(initial=0)))
    block = np.zeros((table.batch_size, width), np.int32)
    cols = np.arange(width)
    mask = cols[None, :] < pages[:, None]
    block[mask] = indices[: int(indptr[-1])]
    seq = np.asarray(table.visible_lens, np.int64).astype(np.uint32)
    return block, seq


def make_flashinfer_xqa(q: Any, k_pages: Any, v_pages: Any, table: PageTable, *,
                        sm_scale: float, window_left: int = -1,
                        logits_soft_cap: float | None = None, k_scale: float | None = None,
                        v_scale: float | None = None, workspace_bytes: int = 256 << 20
                        ) -> tuple[Callable[[], Any], Any, str]:
    """FlashInfer's XQA decode over ``table``: returns ``(call, out, description)``.

    ``q [B, Hq, D]``, ``k_pages`` / ``v_pages [num_pages, P, Hkv, D]`` are CUDA torch
    tensors. ``call()`` writes ``out [B, Hq, D]`` (``q``'s dtype) and returns it; the page
    table, lengths and workspace are made here once, so the call allocates nothing and
    can be captured in a CUDA graph. The first kernel build happens here (JIT)."""
    b, hq, hkv, d, p = check_shapes(tuple(q.shape), tuple(k_pages.shape),
                                    tuple(v_pages.shape), table)
    check_table_for_flashinfer(table)
    check_xqa_problem(d, p, logits_soft_cap=logits_soft_cap)
    check_dtypes(q.dtype, k_pages.dtype)
    torch, fi, version = torch_and_flashinfer()
    xqa = getattr(getattr(fi, "decode", None), "xqa_batch_decode_with_kv_cache", None)
    if xqa is None or _version_tuple(version) < (0, 6):
        raise RuntimeError(f"flashinfer {version} has no XQA decode (0.6 or later: "
                           "bench/device/flashinfer06_setup.sh)")
    check_cuda_tensors(q, k_pages, v_pages)
    block, seq = xqa_tables(table)
    dev = q.device
    with torch.cuda.device(dev):
        workspace = torch.zeros(int(workspace_bytes), dtype=torch.uint8, device=dev)
        block_t = torch.from_numpy(block).to(dev)
        seq_t = torch.from_numpy(seq.view(np.int32)).to(dev).view(torch.uint32)
        out = torch.empty_like(q)
        max_len = int(seq.max())
        kv = (k_pages, v_pages)
        bmm1 = float(sm_scale) * (1.0 if k_scale is None else float(k_scale))
        bmm2 = 1.0 if v_scale is None else float(v_scale)

        def call() -> Any:
            return xqa(q, kv, workspace, block_t, seq_t, max_len, bmm1_scale=bmm1,
                       bmm2_scale=bmm2, window_left=int(window_left), out=out,
                       kv_layout="NHD")

        call()                       # JIT-builds the kernel now; surfaces errors now
        torch.cuda.synchronize(dev)
    return call, out, f"flashinfer {version} XQA decode"


def smoke(dtype_name: str = "float16") -> int:
    """The arm at GQA 4 and 16 against a float32 torch reference, eagerly and from a CUDA
    graph; one line each, returns the number of failures."""
    start = smoke_start("xqa smoke", dtype_name)
    if start is None:
        return 1
    torch = _torch()
    dtype, tol = start
    failures = 0
    for hq, hkv in ((32, 8), (32, 2)):
        t0 = time.perf_counter()
        name = f"gqa{hq // hkv}"
        try:
            q, k, v, table = _random_problem(3, 1000, 16, hq, hkv, 128, dtype, seed=hq // hkv)
            scale = 128 ** -0.5
            ref = _reference(q, k, v, table, scale)
            call, out, desc = make_flashinfer_xqa(q, k, v, table, sm_scale=scale)
            graph = _captured(call)
            for how, run in (("eager", call), ("graph", graph.replay)):
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                failures += not smoke_report("xqa smoke", f"{name} {how}", out, ref, tol,
                                             desc, t0)
        except Exception as exc:
            failures += 1
            print(f"[xqa smoke] FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    print(f"[xqa smoke] {'passed' if not failures else f'{failures} failure(s)'}", flush=True)
    return failures


__all__ = ["XQA_PAGE_SIZES", "check_xqa_problem", "make_flashinfer_xqa",
           "smoke", "xqa_tables"]


if __name__ == "__main__":  # python -m paged_decode.bench.flashinfer_xqa_arm [--smoke] [dtype]
    args = [a for a in sys.argv[1:] if a != "--smoke"]
    sys.exit(1 if smoke(args[0] if args else "float16") else 0)
