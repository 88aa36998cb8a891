"""The protocol every backend honours (reference, cuda, metal, emulated).

The host layer (``decode``, ``merge``, ``pool``, ``cascade``) validates arguments,
plans, allocates outputs and workspaces through ``empty`` and then calls the kernel
entry points below, which write *every* element of their outputs (tests poison fresh
allocations with NaN). Shapes are row-major; B requests, C chunks, Hq query heads, Hkv
KV heads, D head dim, P page size. LSEs are base 2 everywhere.

How results reach the caller: an entry point delivers each output as ``out[...] =
result`` would, so after the call the object passed as ``out`` holds the result. On
numpy and CuPy that writes the buffer (a view of a larger array writes through to it).
MLX arrays are immutable values (``metal_kernel`` returns fresh outputs and cannot write
an input): there, item assignment *rebinds* the given array object to the result, at no
cost, and nothing else changes. Backends like that set ``functional_outputs = True``, and
the host layer then never relies on a write reaching an array through a slice or a
reshape: it passes whole arrays it owns, or reads the result back from the object it
passed (``cascade.run_cascade``, ``sparse_decode``).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..errors import InvalidArgumentError, PagedDecodeError, UnsupportedProblemError, env_flag
from ..kernels.append import AppendWrite
from ..kernels.table_update import apply_delta
from ..page_table import PageTable
from ..plan import DecodePlan
from ..specs import KernelSpec
from ..step_table import StepTable

POISON_ENV = "PAGED_DECODE_POISON"


@dataclass(frozen=True)
class Problem:
    """What a decode call asks of a backend (for ``Backend.supports``)."""

    q_dtype: str
    kv_dtype: str
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    path: str = "v2"   # a decode path, or "merge" (a merge alone)
    pool_pages: int = 0   # pages in k_pages (0: not known; some kernels address rows in 32 bits)


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def c_contiguous(arr: Any) -> bool:
    """Whether a backend array is C-contiguous (row-major; arrays without ``flags``, e.g.
    MLX's, count as contiguous): kernels read raw pointers, so strided inputs are refused."""
    flags = getattr(arr, "flags", None)
    if flags is None:
        return True
    return bool(flags["C_CONTIGUOUS"] if not hasattr(flags, "c_contiguous")
                else flags.c_contiguous)


def poison_enabled() -> bool:
    """``PAGED_DECODE_POISON=1`` fills every fresh output and workspace with NaN."""
    return env_flag(POISON_ENV)


class Backend(ABC):
    """A compute backend. Arrays passed to kernel entry points are the backend's own."""

    name: str = "?"
    #: results are delivered by rebinding the given output objects (MLX), not by writing
    #: their memory; see the module docstring
    functional_outputs: bool = False
    #: ``merge`` reads its inputs through a row index itself (``rows=``), without a copy
    merge_gathers: bool = False
    #: the v2 / v1 kernels read a ``StepTable``'s device buffers (else: its host view)
    reads_step_tables: bool = False
    #: runs the tensor-core v2 partial (``partial_tc``, ``path="v2tc"``): ``mma.sync`` in
    #: the CUDA dialect, ``simdgroup_matrix`` in the Metal dialect
    tensor_core_decode: bool = False
    #: ``capture_graph`` records device work that a replay repeats without the host code
    #: (so host work inside a capture is not repeated); else it runs ``run`` once and
    #: the caller runs it again per replay
    records_graphs: bool = False
    #: ``precompile`` compiles a kernel specialization before its first launch (the CUDA
    #: dialect's backends: ``compile_ahead``); the others compile at first use (MLX has no
    #: compile-only call) or run no kernels of this package
    compiles_ahead: bool = False

    # ----------------------------------------------------------- availability
    @classmethod
    @abstractmethod
    def available(cls) -> Support:
        """Whether this backend can run on this machine (with the reason if not)."""

    @abstractmethod
    def device_info(self) -> DeviceInfo: ...

    def supports(self, problem: Problem) -> Support:
        """Whether this backend runs ``problem``; the reason when it does not."""
        return Support(True)

    def runs_clusters(self) -> bool:
        """Whether this backend runs thread-block clusters (CUDA sm_90+); no by default."""
        return False

    def precompile(self, spec: KernelSpec) -> None:
        """Compile ``spec`` now, so that its first launch compiles nothing (nothing to do
        when this process has it already); only where ``compiles_ahead``."""
        raise UnsupportedProblemError(f"backend {self.name!r} compiles its kernels at first "
                                      "use: there is nothing to compile ahead")

    def describe(self) -> dict[str, Any]:
        """Versions and device facts for ``paged-decode info`` and bench headers."""
        return {"backend": self.name}

    def auto_path(self) -> tuple[str, str] | None:
        """The one path ``decode(path="auto")`` must take on this backend and why, for a
        backend that runs a single arm (MLX without Metal: gather); ``None`` otherwise."""
        return None

    def synchronize(self, *arrays: Any) -> None:
        """Wait until ``arrays`` (and the work queued before them) are computed, for host
        timers. Default: nothing, which is right for numpy; MLX evaluates its lazy graph,
        and a backend with asynchronous launches overrides it."""
        return None

    # ----------------------------------------------------------- arrays
    @abstractmethod
    def owns(self, x: Any) -> bool:
        """Whether ``x`` is an array this backend computes on without conversion."""

    @abstractmethod
    def asarray(self, x: Any) -> Any:
        """``x`` as this backend's array (zero-copy where the kinds allow)."""

    def array_arg(self, fn: str, name: str, x: Any) -> Any:
        """Argument ``name`` of ``fn`` as this backend's array (``asarray``); anything that
        is not an array this backend can use raises ``InvalidArgumentError`` naming both."""
        try:
            arr = self.asarray(x)
            arr.shape, arr.dtype  # noqa: B018 - what every caller reads first
        except PagedDecodeError:
            raise
        except Exception as exc:
            raise InvalidArgumentError(f"{fn}: {name} must be an array the {self.name} "
                                       f"backend can use, got {type(x).__name__}") from exc
        return arr

    def device_of(self, x: Any) -> int | None:
        """The device ordinal holding array ``x`` (``None``: a backend with one device,
        or not an array of this backend)."""
        return None

    def current_device(self) -> int | None:
        """The device launches go to now (inside a launch context: the call's)."""
        return None

    @abstractmethod
    def to_numpy(self, x: Any) -> Any: ...

    @abstractmethod
    def dtype_of(self, x: Any) -> str:
        """Canonical dtype name of a backend array (see ``paged_decode.dtypes``)."""

    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A fresh array; NaN-filled when ``PAGED_DECODE_POISON`` is set (float dtypes)."""

    @abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any: ...

    @abstractmethod
    def array_module(self) -> Any:
        """numpy-like module for glue ops on backend arrays (numpy, cupy, mlx.core)."""

    def launch_context(self, like: Any) -> contextlib.AbstractContextManager[Any]:
        """Context for allocations and launches of a call on arrays like ``like`` (the
        device and stream they belong to); nothing by default."""
        return contextlib.nullcontext()

    def wrap_result(self, x: Any, like: Any) -> Any:
        """Return ``x`` in the array kind of the caller's ``like`` (identity by default)."""
        return x

    def scratch(self, owner: Any, tag: str, shape: tuple[int, ...], dtype: str) -> Any:
        """A workspace array belonging to ``owner`` (a plan object) under ``tag``. A fresh
        array by default; the CUDA backend keeps one per (owner, tag, device, stream)
        while ``owner`` lives, so that a call allocates nothing after its first on a
        stream (CUDA-graph capture). Its content is whatever the last call left."""
        return self.empty(shape, dtype)

    def workspace(self, plan: DecodePlan) -> tuple[Any, Any]:
        """The merge workspace of ``plan``: ``v [C, Hq, D]`` and ``lse [C, Hq]``, float32
        (base-2 LSEs), from ``scratch``."""
        return (self.scratch(plan, "v", (plan.num_chunks, plan.num_qo_heads, plan.head_dim),
                             "float32"),
                self.scratch(plan, "lse", (plan.num_chunks, plan.num_qo_heads), "float32"))

    def stream_key(self, like: Any) -> int:
        """An identifier of the stream a call on arrays like ``like`` launches on now (0
        for backends without streams); part of ``decode``'s fast-path key."""
        return 0

    def capturing(self) -> bool:
        """Whether launches now go into a CUDA-graph capture (inside a launch context;
        then nothing may be copied back to the host). ``False`` without graphs."""
        return False

    def compile_launches(self, run: Callable[[], Any], like: Any) -> Callable[[], Any]:
        """A callable repeating the kernel launches ``run`` makes, for a prepared call
        (``prepare_decode``) on arrays like ``like``. ``run`` may only launch kernels
        through this backend's kernel entry points on fixed arrays. By default the
        callable is ``run`` itself; the CUDA backend records the launches once and
        replays them with pre-packed arguments."""
        return run

    # ----------------------------------------------------------- pool writes
    @abstractmethod
    def append_rows(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: AppendWrite, fp8: tuple[str, Any, Any] | None = None
                    ) -> tuple[Any, Any]:
        """The K/V writes of a pool append, as ``kernels/append.py`` states them: new rows
        into their (page, slot) destinations and the copy-on-write copies; returns the
        pools (``k_pages``, ``v_pages`` written in place; new arrays on MLX).

        ``k_pages, v_pages [L?, num_pages, P, Hkv, D]`` C-contiguous (the pool's);
        ``k_rows, v_rows [row_layers, N, Hkv, D]``, or ``[N, Hkv, D]`` for one layer, of
        any supported float dtype (converted to the pools'). The pool calls it only when
        the write touches at least one page.

        fp8 pools: ``fp8 = (format, k_scale, v_scale)``, the scales float32 ``[L]`` arrays
        of this backend (one per pool layer); each row element ``x`` written to layer
        ``l`` is stored as ``saturate(round_ne(x / scale[l]))`` (``fp8.quantize``; the
        copies move stored bytes), on the kernel backends by ``kernels/append_fp8.py``.
        """

    # ----------------------------------------------------------- step tables
    def table_buffer(self, host: np.ndarray) -> Any:
        """A writable int32 array of this backend holding a copy of ``host`` (a step
        table's buffer, ``kernels/table_update.py``). Default: a numpy copy."""
        return np.array(host, np.int32)

    def staging_buffer(self, words: int) -> Any:
        """A fixed int32 device buffer of ``words`` words for a step's one upload
        (``step_upload.StepUpload``), or ``None`` where the step keeps host arrays (the
        default: the array-op backends, the Metal dialect)."""
        return None

    def stage_int32(self, dst: Any, *parts: np.ndarray) -> None:
        """``parts`` (int32, C-contiguous) one after the other into the start of the
        staging buffer ``dst`` with one host-to-device copy on the current stream."""
        at = 0
        for p in parts:
            dst[at:at + p.size] = p.reshape(-1)
            at += p.size

    def replay_graph(self, graph: Any, like: Any) -> None:
        """Launch a graph of ``capture_graph`` on the current stream of ``like``'s
        framework (after the work queued there: a step's upload)."""
        raise NotImplementedError(f"{self.name} backend has no graphs")

    def capture_graph(self, run: Callable[[], Any],
                      prologue: Callable[[], Any] | None = None) -> tuple[Any, Any]:
        """``(graph, stream)``: a graph replaying the device work of ``prologue`` (if
        given) then ``run`` (a CUDA graph on the ``cuda`` backend, after one eager run of
        ``run`` alone; ``replay_graph`` launches it on the caller's stream) and the stream
        it was captured on, to keep alive with it; ``(None, None)`` where there are no
        graphs: ``run`` ran once, and the caller runs it again per replay (``prologue``
        is then the caller's to run: a step's table update runs eagerly there)."""
        run()
        return None, None

    def update_table(self, buf: Any, delta: np.ndarray, cap: int, page_cap: int, *,
                     scratch: Any) -> Any:
        """Apply a step-table ``delta`` (int32, ``kernels/table_update.py``: a host array,
        or the device view ``StepUpload.delta`` where there is staging) to the table
        buffer ``buf`` on the current stream; returns the buffer holding the new table
        (``buf`` itself where it is updated in place). ``scratch`` is a buffer like ``buf``
        the update may overwrite. Default: the array-op contract, in place."""
        buf[...] = apply_delta(np.asarray(buf), delta, cap)
        return buf

    # ----------------------------------------------------------- kernels
    @abstractmethod
    def partial(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
                soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        """The v2 partial: one normalized (V, LSE) state per (chunk, query head).

        ``q [B, Hq, D]``; ``k_pages, v_pages [num_pages, P, Hkv, D]``;
        ``v_out [C, Hq, D]`` (float32, or the output dtype when the plan needs no merge);
        ``lse_out [C, Hq]`` float32, log2 units. An empty chunk writes zeros and -inf.
        ``sm_scale`` is the natural-units softmax scale (the backend folds in log2(e)).
        ``soft_cap``: scores ``s`` become ``c * tanh(s / c)`` (natural units). ``sinks``
        (``[Hq]`` float32, natural units) join each row's denominator: only for a partial
        that writes the output (no merge follows), never for merged partials
        (``paged_decode.variants``). fp8 pools (``paged_decode/fp8.py``): ``kv_dtype``
        names their format (their arrays may be ``uint8``), ``sm_scale`` already holds the
        K scale and ``v_scale`` multiplies every row (merged partials too: the merge is
        linear in V); 1 for other pools.
        """

    def partial_tc(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                   plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
                   soft_cap: float | None = None, sinks: Any = None,
                   kv_dtype: str | None = None, v_scale: float = 1.0) -> None:
        """The tensor-core v2 partial (``kernels/decode_v2_tc.py``): ``partial``'s arrays
        and contract (``soft_cap`` and ``sinks`` included: sinks only for a partial that
        writes the output), for ``q`` float16 / bfloat16 with pools in its dtype or fp8
        (``kv_dtype`` and ``v_scale`` as for ``partial``) and a GQA group of at most 32;
        only where ``tensor_core_decode`` (this default raises)."""
        raise UnsupportedProblemError(f"backend {self.name!r} has no tensor-core decode "
                                      "partial (path 'v2tc' runs on 'cuda', "
                                      "'emulated-cuda', 'metal' and 'emulated-metal')")

    def fuses_merge(self, plan: DecodePlan, kv_dtype: str) -> bool:
        """Whether ``partial_tc_merged`` fuses the merge into the partial for ``plan`` over
        pools of ``kv_dtype`` (the CUDA dialect: ``PAGED_DECODE_FUSED_MERGE`` ``1``, or
        unset where ``launches.fused_merge_pays`` or where the merge runs in clusters,
        ``cluster_merge``); ``False`` by default."""
        return False

    def partial_tc_merged(self, q: Any, k_pages: Any, v_pages: Any,
                          table: PageTable | StepTable, plan: DecodePlan, sm_scale: float,
                          v_part: Any, lse_part: Any, out: Any, lse_out: Any, *,
                          soft_cap: float | None = None, sinks: Any = None,
                          kv_dtype: str | None = None, v_scale: float = 1.0) -> None:
        """``partial_tc`` into the workspace ``v_part [C, Hq, D]`` / ``lse_part [C, Hq]``
        (float32, ``workspace(plan)``) followed by ``merge`` into ``out [B, Hq, D]`` /
        ``lse_out [B, Hq]`` (float32, base 2), in one launch where ``fuses_merge``: each
        request's last CTA merges its partials. ``sinks`` are the merge's. This default
        makes the two calls."""
        self.partial_tc(q, k_pages, v_pages, table, plan, sm_scale, v_part, lse_part,
                        soft_cap=soft_cap, kv_dtype=kv_dtype, v_scale=v_scale)
        self.merge(v_part, lse_part, plan.o_indptr, out, lse_out, sinks=sinks)

    @abstractmethod
    def merge(self, v: Any, lse: Any, o_indptr: Any, v_out: Any, lse_out: Any, *,
              sinks: Any = None, inputs: int | None = None) -> None:
        """Variable-length merge: ``v [N, H, D]`` f32, ``lse [N, H]`` f32 (log2),
        ``o_indptr`` host ``int32 [M+1]`` -> ``v_out [M, H, D]``, ``lse_out [M, H]``.
        ``o_indptr`` may be a device ``int32 [M+1]`` array of this backend when
        ``inputs`` is given: a bound on its last entry (the partials merged), which kernel
        backends size the launch by instead of reading it back (a synchronization, and
        refused inside a graph capture; FlashInfer graph mode rewrites it between replays).
        Backends with ``merge_gathers`` also take ``rows=`` (device ``int32
        [o_indptr[M]]``): merge input ``i`` is then row ``rows[i]`` of ``v`` / ``lse``.
        ``sinks`` (``[H]`` float32, natural units): each group takes one more state, LSE
        ``sink * log2(e)`` and value 0."""

    @abstractmethod
    def decode_v1(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                  sm_scale: float, out: Any, lse_out: Any, *,
                  soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        """The v1 arm: one CTA per (request, query head) over the whole KV range;
        ``soft_cap`` and ``sinks`` as for ``partial`` (v1 writes the output)."""

    def prefix_partial(self, q: Any, k_pages: Any, v_pages: Any, level0: PageTable,
                       plan0: DecodePlan, members: Any, row_tiles: int, sm_scale: float,
                       v_out: Any, lse_out: Any) -> bool:
        """Cascade level 0 on the tensor-core prefix kernel, where this backend has it
        (``DeviceInfo.prefix_tile_rows > 0``) and the dtypes fit (``q`` and pools both
        float16 or both bfloat16); returns whether it ran (``False``: the caller runs
        level 0 on the v2 partial instead).

        ``q [B, Hq, D]`` (unstacked); ``level0`` the one-request table of the shared pages
        and ``plan0`` its plan (``M * Hq`` heads, ``C0`` chunks); ``members`` a device
        ``int32 [M]``; ``v_out [M * C0, Hq, D]`` float32 and ``lse_out [M * C0, Hq]``
        float32 (log2), member-major (row ``m * C0 + c``).

        This default has no prefix kernel; ``LaunchingBackend`` runs it where the device
        reports one.
        """
        return False

    @abstractmethod
    def gather_sdpa(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                    sm_scale: float, out: Any, lse_out: Any, *, soft_cap: float | None = None,
                    sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        """The gather arm: gather visible K/V contiguously, then dense attention
        (``soft_cap`` and ``sinks`` as for ``decode_v1``).

        ``lse_out`` may be ``None`` (the caller does not want the LSE)."""


def check_same_device(fn: str, be: Backend, named: tuple[tuple[str, Any], ...]) -> None:
    """Raise unless every array of ``named`` ((name, array) pairs) is on one device (a
    kernel launched on one device must not be handed another's memory)."""
    devs = [(n, be.device_of(x)) for n, x in named]
    first = next(((n, d) for n, d in devs if d is not None), None)
    if first is None:
        return
    for n, d in devs:
        if d is not None and d != first[1]:
            raise InvalidArgumentError(f"{fn}: {n} is on device {d}, but {first[0]} is on "
                                       f"device {first[1]}: every array of a call must be "
                                       "on one device")
