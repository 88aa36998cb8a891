"""How the Metal kernels are called through ``mlx.core.fast.metal_kernel``, in one place.

A ``Launch`` from ``backends/launches.py`` (the CUDA description: grid in blocks, threads
per block, arguments tagged in/out/scalar) becomes a ``MetalCall``: the kernel name
(carrying every specialization parameter), input and output names, header and body, the
input values (scalars as 0-d ``int32`` / ``float32`` arrays, which MLX passes as
``constant`` references), the outputs, MLX template arguments (dtypes and geometry,
never formatted into the body) and the launch geometry in MLX's units. ``mlx_geometry``
is the one conversion from blocks to MLX's ``grid``, which counts threads.

Used by the ``emulated-metal`` backend (the CPU emulator) and by the ``metal`` backend,
whose ``mlx_kernels`` turns a ``MetalCall`` into the arguments of ``metal_kernel(...)`` and
of its call (``inputs=..., template=..., grid=..., threadgroup=...``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.kernel_def import MetalKernel
from ..kernels.registry import kernel_def
from ..specs import KernelSpec
from .launches import Launch


def metal_kernel(kernel: str) -> MetalKernel:
    """The Metal header, body and interface of ``kernel`` (``kernels/<name>.py``)."""
    return kernel_def(kernel).metal_kernel


def metal_name(spec: KernelSpec) -> str:
    """The ``metal_kernel`` name: the spec's URI without the CUDA-only pipeline depth and
    row loads (Metal has no staging ring and one row mapping) and with ``-`` dropped (it
    becomes a C++ identifier), e.g. ``pd_v2_qf16_kvf16_of32_hd64_ps16_qh4_w4``: one name
    per specialization."""
    return dataclasses.replace(spec, stages=0, row_loads=0).uri.replace("-", "")


def metal_template(spec: KernelSpec) -> list[tuple[str, Any]]:
    """MLX template arguments as (name, value): dtypes as ``Dtype`` (a canonical name; a
    real MLX call maps it to ``mx.Dtype``), geometry as ints."""
    return kernel_def(spec.kernel).metal_template(spec)


def mlx_geometry(grid_blocks: tuple[int, int], threads: int) -> tuple[tuple[int, int, int],
                                                                      tuple[int, int, int]]:
    """(grid, threadgroup) for ``metal_kernel``: ``grid`` counts threads, so NB blocks of
    T threads are ``grid = (NB * T, ...)``, ``threadgroup = (T, 1, 1)`` (an exact multiple:
    no ragged last threadgroup)."""
    return (grid_blocks[0] * threads, grid_blocks[1], 1), (threads, 1, 1)


@dataclass(frozen=True)
class MetalCall:
    name: str
    kernel: MetalKernel
    inputs: tuple[Any, ...]          # arrays; scalars as 0-d numpy arrays
    outputs: tuple[Any, ...]
    output_dtypes: tuple[str, ...]
    template: tuple[tuple[str, Any], ...]
    grid: tuple[int, int, int]       # threads
    threadgroup: tuple[int, int, int]

    @property
    def empty(self) -> bool:
        return 0 in self.grid


def metal_call(lc: Launch, dtype_of: Any) -> MetalCall:
    """The ``metal_kernel`` call for a launch description. ``dtype_of`` names an array's
    dtype (the calling backend's)."""
    mk = metal_kernel(lc.spec.kernel)
    by_name = {a.name: a for a in lc.args}
    missing = [n for n in (*mk.inputs, *mk.outputs) if n not in by_name]
    if missing:
        raise ValueError(f"{lc.spec.uri}: launch lacks Metal arguments {missing}")
    ins = tuple(np.asarray(by_name[n].value) if by_name[n].role == "scalar"
                else by_name[n].value for n in mk.inputs)
    outs = tuple(by_name[n].value for n in mk.outputs)
    grid, tg = mlx_geometry(lc.grid, lc.block)
    return MetalCall(metal_name(lc.spec), mk, ins, outs,
                     tuple(dtype_of(o) for o in outs), tuple(metal_template(lc.spec)),
                     grid, tg)


__all__ = ["MetalCall", "MetalKernel", "metal_call", "metal_kernel", "metal_name",
           "metal_template", "mlx_geometry"]
