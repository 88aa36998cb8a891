"""External comparison arm: FlashInfer's batch decode over the same pools and page table.

Neither torch nor FlashInfer is imported when this module is imported: ``available()``
and the ``make_*`` functions import them on first use, so the CPU test suite and the
reference backend never need them.

FlashInfer (``make_flashinfer_decode``)
    ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` over the same pools and page table
    as our kernels (``kv_layout="NHD"``, K and V passed as a ``(k_cache, v_cache)`` tuple
    of ``[num_pages, P, Hkv, D]`` tensors). ``plan`` runs once; the returned call is one
    ``wrapper.run(q, (k, v), out=out)``. On the GPU machine FlashInfer 0.3.1 is laid out
    from its source distribution by ``bench/device/flashinfer_setup.sh`` and JIT-compiles
    its kernels with nvcc on first use (tens of seconds per module; cached on disk).

    Facts of FlashInfer 0.3.1 this relies on (read from its ``decode.py`` and
    ``csrc/batch_decode.cu``):

    - ``plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
      page_size, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
      q_data_type="float16", kv_data_type=None, data_type=None, sm_scale=None, ...)``:
      host work (it reads indptr / last_page_len on the host, picks the split-KV grid and
      uploads its schedule into the workspace); it must not be captured.
    - ``run(q, paged_kv_cache, *, out=None, lse=None, return_lse=False, enable_pdl=None,
      ...)``: checks ``out`` (shape / dtype / device) and launches the kernel(s) on torch's
      current stream with the schedule ``plan`` chose; no allocation once ``out`` is
      given (a first call caches an ALiBi-slopes buffer, so we call it once here), no
      host synchronization. ``enable_pdl=None`` means programmatic dependent launch on
      sm90+, FlashInfer's default, which we keep.
    - CUDA graphs: a wrapper built with ``use_cuda_graph=False`` is capturable as long as
      ``plan`` is not called again (each ``plan`` may choose another grid and rewrites
      the schedule the captured kernels read). ``use_cuda_graph=True`` (with caller-owned
      ``paged_kv_indptr_buffer`` / ``paged_kv_indices_buffer`` /
      ``paged_kv_last_page_len_buffer``) exists so that *one* captured graph survives
      re-plans of a fixed batch size: the schedule is padded to the largest grid. We
      plan exactly once per case, so the default mode gives FlashInfer its exact grid;
      ``cuda_graph_mode=True`` builds the serving-engine variant instead.
    - CUDA-core decode (``use_tensor_cores=False``) dispatches the GQA group size
      ``Hq / Hkv`` over {1, 2, 3, 4, 8} only (``DISPATCH_GQA_GROUP_SIZE``); any other
      group (e.g. 7 for Qwen2-7B's 28/4 heads, or 16) fails in ``plan`` with "Unsupported
      group_size". We refuse those up front with ``ValueError`` (before a JIT compile).
      The tensor-core path (the prefill kernel with packed query heads) takes any group.
    - No first-page offset: a request's tokens start at entry 0 of its first page, and
      every request needs at least one page (``1 <= last_page_len <= P``).
    - Element types: float16 / bfloat16 (fp8 K/V too); no float32 kernels.
    - The tensor-core path masks padded K positions with a finite -5e4 on the raw logit,
      before the softmax scale (``k_scale`` folded in): at a small ``k_scale`` (e5m2 pools
      calibrated to 57344) padding is not masked, and we refuse (``flashinfer_mask``).

    Every refusal raises (``ValueError`` for geometry FlashInfer cannot express,
    ``RuntimeError`` for a missing install, FlashInfer's own exception otherwise): the
    benchmark marks the arm unavailable for that case and never times garbage.

The contiguous-SDPA arm is in ``sdpa_arm``; the smoke test below runs both.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..page_table import PageTable
from .flashinfer_mask import finite_mask_refusal
from .sdpa_arm import check_shapes, make_contiguous_sdpa

#: the FlashInfer release ``bench/device/flashinfer_setup.sh`` lays out
FLASHINFER_VERSION = "0.3.1"
#: where FlashInfer's JIT cache goes unless ``FLASHINFER_WORKSPACE_BASE`` says otherwise
#: (the setup script uses the same default, so its smoke-test builds are reused)
DEFAULT_JIT_BASE = "/tmp/paged-decode-flashinfer/jit"
#: GQA group sizes FlashInfer 0.3.x's CUDA-core decode compiles (DISPATCH_GQA_GROUP_SIZE)
CUDA_CORE_GROUP_SIZES = (1, 2, 3, 4, 8)


# ---------------------------------------------------------------------------- validation
def check_table_for_flashinfer(table: PageTable) -> None:
    """``ValueError`` unless FlashInfer's paged layout can express ``table``: no
    first-page offset, at least one request, at least one visible token in each."""
    if table.batch_size < 1:
        raise ValueError("FlashInfer decode needs at least one request")
    fpo = np.asarray(table.first_page_offset)
    if fpo.size and (fpo != 0).any():
        r = int(np.argmax(fpo != 0))
        raise ValueError(f"FlashInfer has no first-page offset, but request {r} has "
                         f"first_page_offset {int(fpo[r])} (a front-trimmed window)")
    vis = np.asarray(table.visible_lens)
    if (vis < 1).any():
        r = int(np.argmax(vis < 1))
        raise ValueError(f"FlashInfer decode needs >= 1 visible token per request; request "
                         f"{r} has none")


def window_pages(table: PageTable, window_left: int) -> PageTable:
    """``table`` without the leading pages that hold no token of the window (the last
    ``window_left + 1`` tokens of each request): what an engine serving a sliding window
    through FlashInfer plans on (SGLang's FlashInfer backend trims its page lists so);
    ``window_left`` then masks the tokens before the window in the first page kept.
    ``window_left < 0``: the table unchanged. Tables without first-page offsets."""
    if window_left < 0:
        return table
    p = table.page_size
    vis = np.asarray(table.visible_lens, np.int64)
    first = np.maximum(vis - (window_left + 1), 0) // p        # first page kept
    pages = np.asarray(table.pages_per_request, np.int64)
    ip = np.asarray(table.indptr, np.int64)
    keep = np.concatenate([np.arange(ip[r] + first[r], ip[r + 1])
                           for r in range(table.batch_size)]) if table.batch_size else \
        np.zeros(0, np.int64)
    indptr = np.concatenate([[0], np.cumsum(pages - first)])
    return PageTable.build(np.asarray(table.indices)[keep], indptr, table.last_page_len,
                           page_size=p, num_pages=table.num_pages)


def check_group_size(num_qo_heads: int, num_kv_heads: int, *, use_tensor_cores: bool,
                     version: str = FLASHINFER_VERSION) -> None:
    """``ValueError`` for a GQA group FlashInfer's CUDA-core decode does not compile
    (0.3.x and older: group sizes 1, 2, 3, 4 and 8). Later versions decide themselves."""
    if use_tensor_cores or _version_tuple(version) >= (0, 4):
        return
    group = num_qo_heads // max(num_kv_heads, 1)
    if group not in CUDA_CORE_GROUP_SIZES:
        raise ValueError(f"FlashInfer {version} CUDA-core decode supports GQA group sizes "
                         f"{list(CUDA_CORE_GROUP_SIZES)}, not {group} ({num_qo_heads}/"
                         f"{num_kv_heads} heads); use the tensor-core arm")


def check_head_dim(head_dim: int, *, use_tensor_cores: bool,
                   version: str = FLASHINFER_VERSION) -> None:
    """``ValueError`` for head_dim 96 on FlashInfer 0.3.x's decode, either arm. Its
    tensor-core decode made an illegal memory access at Phi-3-mini's heads (32/32 x 96,
    batch 8 and 32 x 2K / 8K, run S10-R4 of 2026-12-02), which ends the process's CUDA
    context. Its CUDA-core decode raised "Unsupported head_dim: 96" from its merge
    wherever it split the KV (batch 1 and 8), and where it did not split, it failed the
    bench's float64 oracle (batch 32, S22-R4 on the H200; batch 64, S32-R4 on an H100).
    So neither arm runs there. Later versions decide themselves."""
    if head_dim != 96 or _version_tuple(version) >= (0, 4):
        return
    if use_tensor_cores:
        raise ValueError(f"FlashInfer {version} tensor-core decode made an illegal memory "
                         f"access at head_dim 96 on the H200 (S10-R4); not run")
    raise ValueError(f"FlashInfer {version} CUDA-core decode fails the oracle at head_dim 96 "
                     f"where it does not split the KV and its merge refuses head_dim 96 "
                     f"where it does (S22-R4, S32-R4); not run")


#: element types FlashInfer 0.3.1's JIT can generate kernels for (``jit/utils.dtype_map``)
FLASHINFER_DTYPES = ("float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def check_dtypes(q_dtype: Any, kv_dtype: Any) -> None:
    """``ValueError`` for element types FlashInfer's JIT has no kernels for (float32
    among them), named by torch or numpy dtype or string."""
    for what, dt in (("q", q_dtype), ("K/V", kv_dtype)):
        name = str(dt).removeprefix("torch.")
        if name not in FLASHINFER_DTYPES:
            raise ValueError(f"FlashInfer decode has no {name} kernels ({what}); it takes "
                             f"{', '.join(FLASHINFER_DTYPES)}")


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


# ---------------------------------------------------------------------------- imports
def _torch() -> Any:
    import torch
    return torch


def _import_flashinfer() -> Any:
    """Import FlashInfer with its JIT cache under ``DEFAULT_JIT_BASE`` unless the caller
    chose one (FlashInfer reads ``FLASHINFER_WORKSPACE_BASE`` at import)."""
    if "flashinfer" not in sys.modules:
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", DEFAULT_JIT_BASE)
    import flashinfer
    return flashinfer


def _nvcc() -> str | None:
    """The nvcc FlashInfer's JIT would use (torch's CUDA_HOME first, then PATH)."""
    cuda_home = None
    with contextlib.suppress(Exception):
        from torch.utils import cpp_extension
        cuda_home = cpp_extension.CUDA_HOME
    if cuda_home:
        path = os.path.join(cuda_home, "bin", "nvcc")
        if os.path.exists(path):
            return path
    return shutil.which("nvcc")


def available() -> tuple[bool, str]:
    """Whether the FlashInfer arms can run here: ``(True, "flashinfer X at PATH")`` or
    ``(False, reason)``. Checks torch with CUDA, a GPU, ``import flashinfer``, and the
    JIT tools (nvcc, ninja); imports nothing heavy when torch has no CUDA."""
    try:
        torch = _torch()
    except Exception as exc:
        return False, f"torch is not importable ({type(exc).__name__}: {exc})"
    try:
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} sees no CUDA GPU"
    except Exception as exc:
        return False, f"torch CUDA check failed ({type(exc).__name__}: {exc})"
    try:
        fi = _import_flashinfer()
    except Exception as exc:
        return False, (f"flashinfer is not importable ({type(exc).__name__}: {exc}); on the "
                       f"GPU machine run bench/device/flashinfer_setup.sh first")
    if _nvcc() is None:
        return False, "nvcc not found (FlashInfer JIT-compiles its kernels with it)"
    if shutil.which("ninja") is None:
        return False, "ninja not on PATH (FlashInfer's JIT build runs it)"
    version = getattr(fi, "__version__", "?")
    return True, f"flashinfer {version} at {os.path.dirname(getattr(fi, '__file__', '?'))}"


# ---------------------------------------------------------------------------- FlashInfer
def _host_i32(arr: Any, torch: Any) -> Any:
    # the table's arrays are read-only numpy; torch.from_numpy wants a writable copy
    return torch.from_numpy(np.array(arr, dtype=np.int32, copy=True))


def torch_and_flashinfer() -> tuple[Any, Any, str]:
    """torch, the imported ``flashinfer`` and its version (``RuntimeError`` when it does
    not import)."""
    torch = _torch()
    try:
        fi = _import_flashinfer()
    except Exception as exc:
        raise RuntimeError(f"flashinfer is not importable ({type(exc).__name__}: {exc})"
                           ) from exc
    return torch, fi, str(getattr(fi, "__version__", FLASHINFER_VERSION))


def check_cuda_tensors(q: Any, k_pages: Any, v_pages: Any) -> None:
    """``ValueError`` unless all three are CUDA torch tensors on q's device, contiguous in
    head_dim."""
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not getattr(t, "is_cuda", False):
            raise ValueError(f"{name} must be a CUDA torch tensor")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")


def make_flashinfer_decode(q: Any, k_pages: Any, v_pages: Any, table: PageTable, *,
                           sm_scale: float, use_tensor_cores: bool,
                           workspace_bytes: int = 128 << 20,
                           cuda_graph_mode: bool = False, window_left: int = -1,
                           logits_soft_cap: float | None = None, k_scale: float | None = None,
                           v_scale: float | None = None
                           ) -> tuple[Callable[[], Any], Any, str]:
    """FlashInfer batch decode over ``table``: returns ``(call, out, description)``.

    ``q [B, Hq, D]``, ``k_pages`` / ``v_pages [num_pages, P, Hkv, D]`` are CUDA torch
    tensors (NHD pools with identical strides). ``call()`` writes ``out [B, Hq, D]``
    (``q``'s dtype) and returns it; it allocates nothing and never synchronizes, so it can
    be captured in a CUDA graph (see the module doc for why the plain, non-CUDA-graph
    wrapper suffices when ``plan`` runs once). The first kernel build happens here (JIT).

    Raises ``ValueError`` for what FlashInfer cannot run (first-page offsets, empty
    requests, float32, a CUDA-core GQA group outside {1, 2, 3, 4, 8}, tensor cores at a
    ``k_scale * sm_scale`` its finite mask does not mask at), ``RuntimeError`` when
    FlashInfer is not importable, and FlashInfer's own errors unchanged.
    ``window_left`` and ``logits_soft_cap`` go to ``plan`` (FlashInfer's decode has both,
    with this package's meaning: the last ``W + 1`` tokens, ``c * tanh(s / c)``); with a
    window, ``plan`` gets the pages that hold the window's tokens (``window_pages``).
    fp8 pools (torch ``float8_e4m3fn`` / ``float8_e5m2``): ``k_scale`` and ``v_scale`` go
    to ``run`` (FlashInfer 0.3.1 folds ``k_scale`` into ``sm_scale`` and multiplies the
    output by ``v_scale`` afterwards, in place: the convention of ``docs/fp8.md``).
    """
    b, hq, hkv, d, p = check_shapes(tuple(q.shape), tuple(k_pages.shape),
                                    tuple(v_pages.shape), table)
    check_table_for_flashinfer(table)          # before any import: testable without torch
    check_dtypes(q.dtype, k_pages.dtype)
    if use_tensor_cores:       # the CUDA-core decode masks after scaling (flashinfer_mask)
        why = finite_mask_refusal(sm_scale, 1.0 if k_scale is None else float(k_scale),
                                  logits_soft_cap)
        if why is not None:
            raise ValueError(why)
    torch, fi, version = torch_and_flashinfer()
    check_group_size(hq, hkv, use_tensor_cores=use_tensor_cores, version=version)
    check_head_dim(d, use_tensor_cores=use_tensor_cores, version=version)
    check_cuda_tensors(q, k_pages, v_pages)
    if tuple(k_pages.stride()) != tuple(v_pages.stride()):
        raise ValueError("FlashInfer needs identical K and V pool strides, got "
                         f"{tuple(k_pages.stride())} and {tuple(v_pages.stride())}")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"K and V pools differ in dtype ({k_pages.dtype}, {v_pages.dtype})")

    table = window_pages(table, window_left)   # the pages an engine would plan on
    dev = q.device
    with torch.cuda.device(dev):
        # "Must be initialized to 0 for its first use" (FlashInfer's docstring)
        workspace = torch.zeros(int(workspace_bytes), dtype=torch.uint8, device=dev)
        indptr = _host_i32(table.indptr, torch)
        indices = _host_i32(table.indices, torch)
        last = _host_i32(table.last_page_len, torch)
        if cuda_graph_mode:
            # serving-engine mode: FlashInfer copies each plan's table into these fixed
            # device buffers and pads the split-KV grid so one graph survives re-plans
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                paged_kv_indptr_buffer=torch.empty(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(max(int(indices.numel()), 1),
                                                    dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(b, dtype=torch.int32, device=dev))
        else:
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=use_tensor_cores)
        wrapper.plan(indptr, indices, last, hq, hkv, d, p, pos_encoding_mode="NONE",
                     q_data_type=q.dtype, kv_data_type=k_pages.dtype,
                     sm_scale=float(sm_scale), window_left=int(window_left),
                     logits_soft_cap=logits_soft_cap)
        out = torch.empty_like(q)
        kv = (k_pages, v_pages)

        scales = {} if k_scale is None else {"k_scale": float(k_scale),
                                              "v_scale": float(v_scale or 1.0)}

        def call() -> Any:
            return wrapper.run(q, kv, out=out, **scales)

        call()                       # caches FlashInfer's lazy buffers; surfaces errors now
        torch.cuda.synchronize(dev)
    pdl = ""
    with contextlib.suppress(Exception):
        from flashinfer.utils import device_support_pdl
        pdl = ", PDL" if device_support_pdl(dev) else ""
    mode = ", cuda-graph mode" if cuda_graph_mode else ""
    cores = "tensor cores" if use_tensor_cores else "CUDA cores"
    return call, out, f"flashinfer {version} BatchDecode ({cores}{pdl}{mode})"


# ---------------------------------------------------------------------------- smoke test
def _reference(q: Any, k_pages: Any, v_pages: Any, table: PageTable, sm_scale: float) -> Any:
    """float32 attention per request (torch, on q's device), for the smoke test."""
    torch = _torch()
    b, hq, d = q.shape
    hkv = k_pages.shape[2]
    g = hq // hkv
    out = torch.empty((b, hq, d), dtype=torch.float32, device=q.device)
    for r in range(b):
        pages = torch.from_numpy(np.array(table.request_pages(r), dtype=np.int64)).to(q.device)
        off, n = int(table.first_page_offset[r]), int(table.visible_lens[r])
        k = k_pages.index_select(0, pages).reshape(-1, hkv, d)[off:off + n].float()
        v = v_pages.index_select(0, pages).reshape(-1, hkv, d)[off:off + n].float()
        qr = q[r].float().reshape(hkv, g, d)
        s = torch.einsum("hgd,nhd->hgn", qr, k) * sm_scale
        out[r] = torch.einsum("hgn,nhd->hgd", torch.softmax(s, -1), v).reshape(hq, d)
    return out


def _random_problem(b: int, length: int, p: int, hq: int, hkv: int, d: int, dtype: Any,
                    seed: int = 0) -> tuple[Any, Any, Any, PageTable]:
    torch = _torch()
    rng = np.random.default_rng(seed)
    per = -(-length // p)
    num_pages = b * per + 3
    perm = rng.permutation(num_pages)[: b * per].astype(np.int32)
    indptr = np.arange(b + 1, dtype=np.int64) * per
    last = np.full(b, length - (per - 1) * p, dtype=np.int32)
    table = PageTable.build(perm, indptr, last, page_size=p, num_pages=num_pages)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((b, hq, d), generator=gen, device="cuda").to(dtype)
    k = torch.randn((num_pages, p, hkv, d), generator=gen, device="cuda").to(dtype)
    v = torch.randn((num_pages, p, hkv, d), generator=gen, device="cuda").to(dtype)
    return q, k, v, table


def _captured(call: Callable[[], Any]) -> Any:
    """A torch CUDA graph of ``call``, run once on a side stream first (torch's rule for
    a capture's warm-up)."""
    torch = _torch()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        call()
    return graph


def smoke_start(tag: str, dtype_name: str) -> tuple[Any, float] | None:
    """A smoke test's start: prints whether the arms are available; ``None`` when not,
    else (the torch dtype, the max-rel tolerance, which catches garbage, not ulps)."""
    ok, why = available()
    print(f"[{tag}] available: {ok} ({why})", flush=True)
    if not ok:
        return None
    return getattr(_torch(), dtype_name), (3e-2 if dtype_name == "bfloat16" else 1e-2)


def smoke_report(tag: str, name: str, got: Any, ref: Any, tol: float, desc: str,
                 t0: float) -> bool:
    """Whether ``got`` is finite and within ``tol`` of ``ref`` by max-rel error; prints the
    smoke test's line for it (OK / FAIL, the error, seconds since ``t0``)."""
    torch = _torch()
    err = float((got.float() - ref).abs().max() / ref.abs().max())
    good = bool(torch.isfinite(got.float()).all()) and err <= tol
    print(f"[{tag}] {'OK  ' if good else 'FAIL'} {name:<14} max-rel {err:.2e} (tol {tol:.0e}) "
          f"{time.perf_counter() - t0:7.1f}s  {desc}", flush=True)
    return good


def smoke(dtype_name: str = "float16") -> int:
    """Build and check every arm on one small GQA-4 case (plus the GQA-7 refusal and a
    CUDA-graph replay); prints one line each, returns the number of failures."""
    start = smoke_start("flashinfer smoke", dtype_name)
    if start is None:
        return 1
    torch = _torch()
    dtype, tol = start
    failures = 0

    def report(name: str, got: Any, ref: Any, desc: str, t0: float) -> None:
        nonlocal failures
        failures += not smoke_report("flashinfer smoke", name, got, ref, tol, desc, t0)

    q, k, v, table = _random_problem(4, 1000, 16, 32, 8, 128, dtype)
    scale = 128 ** -0.5
    ref = _reference(q, k, v, table, scale)
    for name, tc in (("flashinfer", False), ("flashinfer-tc", True)):
        t0 = time.perf_counter()
        try:
            call, out, desc = make_flashinfer_decode(q, k, v, table, sm_scale=scale,
                                                     use_tensor_cores=tc)
            out.zero_()
            call()
            torch.cuda.synchronize()
            report(name, out, ref, desc, t0)
            graph = _captured(call)                         # capture + replay
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            report(name + " graph", out, ref, "CUDA-graph replay", t0)
        except Exception as exc:
            failures += 1
            print(f"[flashinfer smoke] FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    t0 = time.perf_counter()
    try:
        call, out, desc = make_contiguous_sdpa(q, k, v, table, sm_scale=scale)
        report("sdpa", call(), ref, desc, t0)
    except Exception as exc:
        failures += 1
        print(f"[flashinfer smoke] FAIL sdpa: {type(exc).__name__}: {exc}", flush=True)
    q7, k7, v7, t7 = _random_problem(2, 300, 16, 56, 8, 128, dtype, seed=1)
    try:
        make_flashinfer_decode(q7, k7, v7, t7, sm_scale=scale, use_tensor_cores=False)
        failures += 1
        print("[flashinfer smoke] FAIL gqa7 CUDA cores: expected a ValueError", flush=True)
    except ValueError as exc:
        print(f"[flashinfer smoke] OK   gqa7 CUDA cores refused: {exc}", flush=True)
    except Exception as exc:
        failures += 1
        print(f"[flashinfer smoke] FAIL gqa7 CUDA cores: {type(exc).__name__}: {exc}",
              flush=True)
    t0 = time.perf_counter()
    try:
        call, out, desc = make_flashinfer_decode(q7, k7, v7, t7, sm_scale=scale,
                                                 use_tensor_cores=True)
        report("gqa7 tc", out, _reference(q7, k7, v7, t7, scale), desc, t0)
    except Exception as exc:
        failures += 1
        print(f"[flashinfer smoke] FAIL gqa7 tc: {type(exc).__name__}: {exc}", flush=True)
    print(f"[flashinfer smoke] {'passed' if not failures else f'{failures} failure(s)'}",
          flush=True)
    return failures


if __name__ == "__main__":  # python -m paged_decode.bench.flashinfer_arm [--smoke] [dtype]
    args = [a for a in sys.argv[1:] if a != "--smoke"]
    sys.exit(1 if smoke(args[0] if args else "float16") else 0)
