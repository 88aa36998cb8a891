"""MLX's side of a Metal kernel launch, up to the kernel call.

``metal_launches.metal_call`` turns a launch description into a ``MetalCall`` (kernel name
carrying every specialization parameter, body, inputs with scalars packed as 0-d
``int32`` / ``float32``, template arguments, grid in threads). ``mlx_launch`` turns that
into an ``MlxLaunch``: exactly the keyword arguments of ``mx.fast.metal_kernel(...)``
(``kernel_kwargs``) and of the callable it returns (``call_kwargs``), with template
dtypes as ``mx.Dtype``, output shapes and dtypes, and ``init_value`` NaN when
``PAGED_DECODE_POISON`` is set (MLX outputs are otherwise uninitialized).
``check_launch`` enforces the limits a Metal launch must respect before MLX sees it.
``KernelCache`` builds each kernel object once per name.

The tests check these arguments on MLX's CPU device and trace them through the real
``metal_kernel`` (export tracing); no call has run on an Apple GPU.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import dtype_name
from ..errors import UnsupportedProblemError
from ..fp8 import is_fp8
from ..metal_signature import Dtype, InputDesc, parameters
from .metal_launches import MetalCall

#: Metal math mode: "safe" keeps IEEE specials, so exp2(-inf) == 0 (masked logits) and
#: comparisons with -INFINITY hold; MLX 0.32 defaults to it, we pass it explicitly
MATH_MODE = "safe"
MAX_THREADS_PER_THREADGROUP = 1024   # Metal's bound; a pipeline may allow fewer
MAX_BUFFERS = 31                     # buffer-argument slots of one Metal kernel


def mx_dtype(name: str) -> Any:
    """The ``mx.Dtype`` of a canonical dtype name (``"float16"``, ``"int32"``, ...; fp8
    formats are ``uint8``: MLX has no fp8 dtype)."""
    import mlx.core as mx
    return mx.uint8 if is_fp8(name) else getattr(mx, name)


def canonical(dt: Any) -> str:
    """Canonical name of an MLX (or numpy) dtype, index types included."""
    name = str(dt).replace("mlx.core.", "")
    if name in ("int32", "uint32", "int64", "bool"):
        return name
    return dtype_name(dt)


@dataclass(frozen=True)
class MlxLaunch:
    """One ``metal_kernel`` construction and call, as MLX receives them."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    inputs: tuple[Any, ...]                      # mx arrays; scalars are 0-d
    template: tuple[tuple[str, Any], ...]        # (name, mx.Dtype | int | bool)
    grid: tuple[int, int, int]                   # threads, as MLX counts them
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple[Any, ...]               # mx.Dtype
    init_value: float | None

    def kernel_kwargs(self) -> dict[str, Any]:
        """Arguments of ``mx.fast.metal_kernel``."""
        return {"name": self.name, "input_names": list(self.input_names),
                "output_names": list(self.output_names), "source": self.source,
                "header": self.header, "ensure_row_contiguous": True,
                "atomic_outputs": False, "compile_options": {"math_mode": MATH_MODE}}

    def call_kwargs(self) -> dict[str, Any]:
        """Arguments of the kernel object's call (which returns the fresh outputs)."""
        return {"inputs": list(self.inputs), "template": list(self.template),
                "grid": self.grid, "threadgroup": self.threadgroup,
                "output_shapes": [list(s) for s in self.output_shapes],
                "output_dtypes": list(self.output_dtypes), "init_value": self.init_value}


def _mx_input(x: Any) -> Any:
    """An input as an MLX array: arrays as they are, scalars (0-d numpy ``int32`` /
    ``float32`` from ``metal_call``) as 0-d MLX arrays of the same dtype."""
    import mlx.core as mx
    if isinstance(x, mx.array):
        return x
    a = np.asarray(x)
    if a.ndim != 0 or a.dtype not in (np.int32, np.float32):
        raise TypeError(f"metal: a kernel input must be an MLX array or a 0-d int32/float32 "
                        f"scalar, got {type(x).__name__} {a.dtype} {list(a.shape)}")
    return mx.array(a)


def mlx_launch(call: MetalCall, *, poison: bool) -> MlxLaunch:
    """The MLX arguments of ``call`` (see the module docstring)."""
    mk = call.kernel
    tmpl = tuple((n, mx_dtype(v.name) if isinstance(v, Dtype) else
                  (v if isinstance(v, bool) else int(v))) for n, v in call.template)
    return MlxLaunch(call.name, mk.inputs, mk.outputs, mk.source, mk.header,
                     tuple(_mx_input(x) for x in call.inputs), tmpl,
                     tuple(int(g) for g in call.grid),  # type: ignore[arg-type]
                     tuple(int(t) for t in call.threadgroup),  # type: ignore[arg-type]
                     tuple(tuple(int(s) for s in o.shape) for o in call.outputs),
                     tuple(mx_dtype(d) for d in call.output_dtypes),
                     float("nan") if poison else None)


def buffer_count(launch: MlxLaunch) -> int:
    """Buffer slots of the generated kernel: inputs, their ``_shape`` / ``_strides`` /
    ``_ndim`` arrays where the body names them, outputs (MLX's rule; see
    ``metal_signature.parameters``)."""
    descs = [InputDesc(n, canonical(a.dtype), tuple(a.shape))
             for n, a in zip(launch.input_names, launch.inputs)]
    params = parameters(launch.source, descs, launch.output_names,
                        [canonical(d) for d in launch.output_dtypes])
    return sum(p.kind != "attr" for p in params)


def check_launch(launch: MlxLaunch) -> None:
    """Raise ``UnsupportedProblemError`` unless the launch respects Metal's limits: at most
    1024 threads per threadgroup, a grid that is a whole number of threadgroups on every
    axis, at most 31 buffers, ASCII sources (MLX passes them as ASCII)."""
    where = f"metal: kernel {launch.name}"
    tg, grid = launch.threadgroup, launch.grid
    if int(np.prod(tg)) > MAX_THREADS_PER_THREADGROUP or min(tg) < 1:
        raise UnsupportedProblemError(f"{where}: threadgroup must hold 1..1024 threads, got "
                                      f"{list(tg)}")
    if any(g % t for g, t in zip(grid, tg)):
        raise UnsupportedProblemError(f"{where}: grid {list(grid)} (threads) must be a whole "
                                      f"number of threadgroups {list(tg)}")
    n = buffer_count(launch)
    if n > MAX_BUFFERS:
        raise UnsupportedProblemError(f"{where}: {n} buffer arguments, Metal allows "
                                      f"{MAX_BUFFERS}")
    for what, text in (("source", launch.source), ("header", launch.header)):
        if not text.isascii():
            raise UnsupportedProblemError(f"{where}: the {what} must be ASCII")


class KernelCache:
    """Kernel objects by name, each built once with ``factory(**kernel_kwargs)``.

    A name stands for one specialization and one body: asking for a name already built
    from another body raises (MLX itself would key its library by name and source hash;
    we keep a name unambiguous instead)."""

    def __init__(self, factory: Callable[..., Any]) -> None:
        self.factory = factory
        self._kernels: dict[str, tuple[str, Any]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kernels)

    def __contains__(self, name: object) -> bool:
        return name in self._kernels

    def get(self, launch: MlxLaunch) -> Any:
        digest = hashlib.sha256(f"{launch.header}\0{launch.source}".encode()).hexdigest()
        with self._lock:
            got = self._kernels.get(launch.name)
            if got is None:
                got = (digest, self.factory(**launch.kernel_kwargs()))
                self._kernels[launch.name] = got
        if got[0] != digest:
            raise ValueError(f"metal: kernel {launch.name} was built from another body; a "
                             "changed body needs a name of its own")
        return got[1]


__all__ = ["MATH_MODE", "MAX_BUFFERS", "MAX_THREADS_PER_THREADGROUP", "KernelCache",
           "MlxLaunch", "buffer_count", "canonical", "check_launch", "mlx_launch",
           "mx_dtype"]
