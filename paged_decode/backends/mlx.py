"""The MLX backends: ``metal`` (our Metal kernels through ``mx.fast.metal_kernel``) and
``mlx`` (MLX ops only: the gather arm and the merge, on any MLX device).

Arrays: ``mlx.core.array`` in and out (numpy inputs are converted; bfloat16 through its
bit pattern). MLX arrays are immutable values, so this is a *functional* backend
(``Backend.functional_outputs``): a kernel entry point delivers each output by
``out[...] = result``, which rebinds the given array object to the fresh result MLX
returned (no copy; see ``backends.base``). Consequently ``decode(..., out=o)`` leaves
the result in ``o`` (the same object) and returns it, but nothing was written into the
memory ``o`` had: ``out=`` saves no allocation on MLX, and an ``out`` that is not an MLX
array is refused. Pool writes return new arrays (scatter / slice updates); ``PagePool``
keeps the returned arrays, so read ``pool.k`` after appending. Results are lazy, as MLX
arrays are: ``mx.eval`` (or any read) computes them.

``metal`` is available where ``mx.metal.is_available()``; an MLX array is routed to it
there and to ``mlx`` elsewhere (``backends.backend_for``). On ``mlx``, ``path="auto"``
takes the gather arm and records why; ``v2``/``v1`` raise ``UnsupportedProblemError``.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..dtypes import dtype_name, itemsize, numpy_dtype
from ..errors import InvalidArgumentError, InvalidDtypeError, UnsupportedProblemError
from ..fp8 import FP8_DTYPES, is_fp8, quantize_rows
from ..kernels import append as append_kernel
from ..kernels.append import AppendWrite
from ..kernels.table_update import apply_delta
from ..page_table import PageTable
from ..plan import DecodePlan
from ..specs import assert_compile_allowed
from ..step_table import StepTable
from . import launches
from .base import Backend, Problem, Support, poison_enabled
from .launching import LaunchingBackend
from .metal_launches import metal_call
from .mlx_gather import gather_attention, merge_ops
from .mlx_kernels import KernelCache, check_launch, mlx_launch, mx_dtype

INSTALL = "pip install 'paged-decode[metal]' on a Mac, or 'mlx[cpu]' on Linux"

try:  # imported lazily by the registry; a failure here marks the backends unavailable
    import mlx.core as mx
    _MISSING = ""
except ModuleNotFoundError:  # pragma: no cover - exercised only where MLX is missing
    mx = None  # type: ignore[assignment]
    _MISSING = f"MLX is not installed ({INSTALL})"
except Exception as exc:  # installed but not loadable, e.g. libmlx.so missing on Linux
    mx = None  # type: ignore[assignment]
    _MISSING = (f"MLX is installed but cannot be imported ({type(exc).__name__}: {exc}); "
                f"reinstall it ({INSTALL})")


def metal_status() -> Support:
    """Whether MLX can launch Metal kernels here, with the reason when not."""
    if mx is None:
        return Support(False, _MISSING)
    if not mx.metal.is_available():
        return Support(False, f"MLX {_version()} is installed but Metal is not available "
                              "(mx.metal.is_available() is False: Metal needs an Apple-"
                              "silicon Mac); MLX arrays run on the 'mlx' backend (gather arm)")
    return Support(True)


class MlxNumpy:
    """``mlx.core`` with the numpy spellings the host layer uses (``asarray``,
    ``ascontiguousarray``); every other name resolves to ``mlx.core``'s."""

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    @staticmethod
    def asarray(x: Any, dtype: Any = None) -> Any:
        a = x if isinstance(x, mx.array) else _to_mx(np.asarray(x))
        return a if dtype is None else a.astype(dtype)

    @staticmethod
    def ascontiguousarray(x: Any) -> Any:
        return mx.contiguous(MlxNumpy.asarray(x))


def _to_mx(a: np.ndarray) -> Any:
    # a C-ordered copy where needed (mx.array takes no negative strides); np.require keeps
    # a 0-d array 0-d (np.ascontiguousarray would make it [1])
    c = np.require(a, requirements="C")
    if a.dtype == numpy_dtype("bfloat16"):
        return mx.array(c.view(np.uint16)).view(mx.bfloat16)
    if a.dtype.name in FP8_DTYPES:   # MLX has no fp8 dtype: the bytes; the call reads the
        return mx.array(c.view(np.uint8))    # format off the caller's array
    return mx.array(c)


class MlxBackend(Backend):
    """``mlx``: MLX ops only (gather arm, merge), on MLX's default device."""

    name = "mlx"
    functional_outputs = True

    def __init__(self) -> None:
        self._uploads: dict[int, Any] = {}

    @classmethod
    def available(cls) -> Support:
        return Support(True) if mx is not None else Support(False, _MISSING)

    def device_info(self) -> DeviceInfo:
        # the gather arm uses no plan; a fixed target like the reference backend's
        return DeviceInfo(self.name, f"MLX {mx.default_device()}", compute_units=8,
                          ctas_per_unit=4, detail="MLX ops (gather arm, merge); fixed "
                          "target 32")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "mlx": _version(),
                "device": str(mx.default_device()), "metal": metal_status().reason or "yes"}

    def supports(self, problem: Problem) -> Support:
        if problem.path in ("gather", "merge"):     # both are MLX ops here
            return Support(True)
        return Support(False, f"the {problem.path} kernel needs Metal ({metal_status().reason}"
                              "); path='gather' or 'auto' runs the gather arm")

    def auto_path(self) -> tuple[str, str] | None:
        return ("gather", f"auto: backend {self.name!r} runs MLX ops only (gather, then "
                          "mx.fast.scaled_dot_product_attention)")

    def synchronize(self, *arrays: Any) -> None:
        """Evaluate ``arrays`` (arrays or tuples of them, e.g. ``decode``'s result; ``None``
        is skipped), then wait for the default stream."""
        live = [a for a in arrays if a is not None]
        if live:
            mx.eval(*live)
        mx.synchronize()

    # ----------------------------------------------------------- arrays
    def owns(self, x: Any) -> bool:
        return isinstance(x, mx.array)

    def asarray(self, x: Any) -> Any:
        """``x`` as an MLX array (MLX arrays as they are; host arrays are copied)."""
        if isinstance(x, mx.array):
            return x
        try:
            a = np.asarray(x)
        except Exception as exc:  # e.g. a CuPy array (no implicit device-to-host copy)
            raise InvalidArgumentError(f"{self.name} backend: cannot use a "
                                       f"{type(x).__name__} as an MLX array (pass mlx.core "
                                       "arrays, or numpy)") from exc
        if a.dtype == object:
            raise InvalidArgumentError(f"{self.name} backend: cannot use a "
                                       f"{type(x).__name__} as an MLX array")
        return _to_mx(a)

    def to_numpy(self, x: Any) -> np.ndarray:
        a = self.asarray(x)
        if a.dtype == mx.bfloat16:
            return np.array(a.view(mx.uint16)).view(numpy_dtype("bfloat16"))
        return np.array(a)

    def dtype_of(self, x: Any) -> str:
        dt = self.asarray(x).dtype
        try:
            return dtype_name(dt)
        except InvalidDtypeError:
            return str(dt).replace("mlx.core.", "")

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A fresh (lazy) array: NaN with ``PAGED_DECODE_POISON``, zeros otherwise (MLX has
        no uninitialized allocation; an output that is rebound is never computed)."""
        fill = float("nan") if poison_enabled() else 0.0
        if is_fp8(dtype_name(dtype)):   # fp8 bytes: 0x7F is NaN in both formats
            fill = 0x7F if poison_enabled() else 0
        return mx.full(tuple(int(s) for s in shape), fill, mx_dtype(dtype_name(dtype)))

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return mx.zeros(tuple(int(s) for s in shape), mx_dtype(dtype_name(dtype)))

    def array_module(self) -> Any:
        return MlxNumpy()

    def upload(self, arr: np.ndarray) -> Any:
        """An MLX copy of a host index array (int32 when its values fit). Read-only arrays
        (every table and plan array) are memoised by identity while they live."""
        key = id(arr)
        got = self._uploads.get(key) if not arr.flags.writeable else None
        if got is not None:
            return got
        a = np.asarray(arr)
        if a.dtype.kind in "iu" and (a.size == 0 or (a.min() >= -2 ** 31 and a.max() < 2 ** 31)):
            a = a.astype(np.int32)
        got = mx.array(np.ascontiguousarray(a))
        if not arr.flags.writeable:
            self._uploads[key] = got
            weakref.finalize(arr, self._uploads.pop, key, None)
        return got

    # ----------------------------------------------------------- pool writes
    def append_rows(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: AppendWrite, fp8: tuple[str, Any, Any] | None = None
                    ) -> tuple[Any, Any]:
        """New pool arrays with the copies made and the rows scattered (MLX scatters on
        flat views; the given arrays are unchanged, and MLX reuses a buffer nothing else
        holds). fp8 pools (``uint8``): the rows are quantized on the host
        (``fp8.quantize``, each layer with its scale) and their bytes scattered."""
        shape = tuple(k_pages.shape)
        *lead, num_pages, page_size, hkv, d = shape
        c_dst, c_src, w_dst, w_src = (mx.array(a.astype(np.int32)) for a in write.flat_rows(
            lead[0] if lead else 1, num_pages, page_size))
        if fp8 is not None:
            k_rows, v_rows = (mx.array(quantize_rows(self.to_numpy(rows), write.row_layers,
                                                     write.layer0, fp8[0],
                                                     self.to_numpy(scale)).view(np.uint8))
                              for rows, scale in ((k_rows, fp8[1]), (v_rows, fp8[2])))
        out = []
        for pages, rows in ((k_pages, k_rows), (v_pages, v_rows)):
            flat = pages.reshape(-1, hkv * d)
            if c_dst.size:
                flat[c_dst] = flat[c_src]
            flat[w_dst] = self.asarray(rows).astype(pages.dtype).reshape(-1, hkv * d)[w_src]
            out.append(flat.reshape(shape))
        return out[0], out[1]

    # ----------------------------------------------------------- step tables
    def table_buffer(self, host: np.ndarray) -> Any:
        return mx.array(np.asarray(host, np.int32))

    def update_table(self, buf: Any, delta: np.ndarray, cap: int, page_cap: int, *,
                     scratch: Any) -> Any:
        """The array-op contract on a host copy (MLX arrays are rebound, not written)."""
        return mx.array(apply_delta(np.array(buf), delta, cap))

    # ----------------------------------------------------------- arms
    def gather_sdpa(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                    sm_scale: float, out: Any, lse_out: Any, *, soft_cap: float | None = None,
                    sinks: Any = None, kv_dtype: str | None = None,
                    v_scale: float = 1.0) -> None:
        o, lse = gather_attention(q, k_pages, v_pages, table, sm_scale, lse_out is not None,
                                  rows=self.gather_rows(table), soft_cap=soft_cap,
                                  sinks=sinks, kv_dtype=kv_dtype, v_scale=v_scale)
        out[...] = o.astype(out.dtype)
        if lse_out is not None:
            lse_out[...] = lse

    def gather_rows(self, table: PageTable) -> Any:
        """The gather index of ``table`` (``None``: the memoised one; a test hook)."""
        return None

    def merge(self, v: Any, lse: Any, o_indptr: Any, v_out: Any, lse_out: Any, *,
              sinks: Any = None, inputs: int | None = None) -> None:
        vo, lo = merge_ops(v, lse, o_indptr, sinks=sinks)
        v_out[...] = vo.astype(v_out.dtype)
        lse_out[...] = lo

    def partial(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
                soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        raise UnsupportedProblemError(f"{self.name} backend: the v2 kernel needs Metal "
                                      f"({metal_status().reason})")

    def decode_v1(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                  sm_scale: float, out: Any, lse_out: Any, *,
                  soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        raise UnsupportedProblemError(f"{self.name} backend: the v1 kernel needs Metal "
                                      f"({metal_status().reason})")


class MetalBackend(LaunchingBackend, MlxBackend):
    """``metal``: the Metal kernels (``kernels/<name>.py``) launched through
    ``mx.fast.metal_kernel``; entry points from ``LaunchingBackend``, launch descriptions
    converted by ``metal_launches`` and ``mlx_kernels``; the append returns new pools.
    Not yet run on Apple hardware."""

    name = "metal"
    in_place_append = False
    tensor_core_decode = True    # on simdgroup_matrix (never run on Apple hardware)
    metal_dialect = True

    def __init__(self, kernel_factory: Any = None) -> None:
        super().__init__()
        #: builds kernel objects (``mx.fast.metal_kernel``; tests pass a spy)
        self.kernels = KernelCache(kernel_factory or _metal_kernel_factory)

    @classmethod
    def available(cls) -> Support:
        return metal_status()

    def device_info(self) -> DeviceInfo:
        return _apple_info()

    def describe(self) -> dict[str, Any]:
        info = self.device_info()
        return {"backend": self.name, "mlx": _version(), "device": info.name,
                "gpu_cores": info.compute_units, "detail": info.detail}

    def supports(self, problem: Problem) -> Support:
        if problem.path == "gather":
            return Support(True)
        return launches.support(problem, tensor_cores=True, metal=True)

    def auto_path(self) -> tuple[str, str] | None:
        return None

    # ----------------------------------------------------------- launching hooks
    def index_array(self, arr: Any) -> Any:
        """A kernel's index input: int32, at least one element (an empty CSR array still
        binds a buffer)."""
        if isinstance(arr, mx.array):
            return arr
        arr = np.asarray(arr)
        return self.upload(arr) if arr.size else mx.zeros((1,), mx.int32)

    def append_row_arrays(self, k_pages: Any, k_rows: Any, v_rows: Any) -> tuple[Any, Any]:
        kr, vr = (self.asarray(r).astype(k_pages.dtype) for r in (k_rows, v_rows))
        return kr, vr

    def append_vector_bytes(self, k_pages: Any, v_pages: Any, k_rows: Any,
                            v_rows: Any) -> int:
        shape = tuple(k_pages.shape)
        return append_kernel.vector_bytes(int(np.prod(shape[-2:]))
                                          * itemsize(self.dtype_of(k_pages)))

    def append_fallback(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                        write: AppendWrite) -> tuple[Any, Any]:
        """K/V inputs of fewer than 8 elements (MLX would pass them in the constant space,
        which the kernel's word accesses cannot read) take the MLX-ops path."""
        return MlxBackend.append_rows(self, k_pages, v_pages, k_rows, v_rows, write)

    def _run(self, lc: launches.Launch) -> None:
        """The one place a launch becomes a ``metal_kernel`` call; the fresh outputs are
        delivered by rebinding the given output arrays (``out[...] = result``)."""
        if lc.empty:
            return
        call = metal_call(lc, self.dtype_of)
        launch = mlx_launch(call, poison=poison_enabled())
        check_launch(launch)
        if launch.name not in self.kernels:
            # MLX compiles at the first call (and again for a new constant-space variant
            # of the same kernel, when a small input crosses 8 elements)
            assert_compile_allowed(lc.spec)
        results = self.kernels.get(launch)(**launch.call_kwargs())
        for given, res in zip(call.outputs, results):
            given[...] = res


def _version() -> str:
    return str(getattr(mx, "__version__", "?"))


def _metal_kernel_factory(**kwargs: Any) -> Any:
    return mx.fast.metal_kernel(**kwargs)


@functools.cache
def _apple_info() -> DeviceInfo:
    """The Mac's GPU as the planner sees it, read once per process (``apple_device``)."""
    from ..apple_device import apple_device_info
    try:
        info = dict(mx.device_info())
    except Exception:
        info = {}
    return apple_device_info("metal", info)


__all__ = ["MetalBackend", "MlxBackend", "MlxNumpy", "metal_status"]
