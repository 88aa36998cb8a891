"""The signature MLX's ``mlx.core.fast.metal_kernel`` generates around a kernel body.

``metal_kernel`` takes only a kernel *body* and generates the rest; these are its rules
(MLX 0.32, ``mlx/backend/common/metal_kernel.cpp``), used by the ``metal`` backend (buffer
counts, ``mlx_kernels.check_launch``) and by the CPU emulator (``emulator.metal``), which
wraps bodies in the same signature:

- inputs in order, one ``[[buffer(i)]]`` each: a 0-d input is ``const constant T& name``,
  an input of fewer than 8 elements ``const constant T* name``, any other
  ``const device T* name``; after each input, ``name_shape`` (``const constant int*``),
  ``name_strides`` (``const constant int64_t*``) and ``name_ndim``
  (``const constant int&``) when that substring occurs in the body;
- outputs ``device T* name``;
- the thread attributes whose names occur in the body, in alphabetical order, as
  ``<type> name [[name]]``;
- template parameters (``typename`` for dtypes, ``int``, ``bool``) and the explicit
  instantiation under the name ``custom_kernel_<name>[_<template values>]_<input
  dtypes>_<output dtypes>`` (``s`` marks a 0-d input, ``c`` a constant-space one).

``metal_source`` is that text (what MLX prints with ``verbose=True``; pinned against
MLX's own output in the tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .kernels.kernel_def import Dtype, TemplateValue

#: the thread attributes MLX declares when the body mentions them, and their types
ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint",
    "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3",
    "grid_origin": "uint3",
    "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint",
    "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}

#: MLX's type names (``get_type_string``) by numpy dtype / MLX dtype name
TYPE_NAMES = {
    "bool": "bool", "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t",
    "uint64": "uint64_t", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t",
    "int64": "int64_t", "float16": "float16_t", "bfloat16": "bfloat16_t",
    "float32": "float",
    # fp8 pools: bytes (MLX has no fp8 dtype; the kernels take the format as KV_FP8)
    "float8_e4m3fn": "uint8_t", "float8_e5m2": "uint8_t",
}


@dataclass(frozen=True)
class InputDesc:
    """What the generated signature depends on for one input."""

    name: str
    dtype: str           # canonical dtype name
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class Param:
    decl: str            # as MLX prints it, without the attribute
    attribute: str       # e.g. "buffer(3)" or "thread_position_in_grid"
    emu_type: str        # the C++ type in the emulator's translation unit
    name: str
    kind: str            # "in", "scalar", "shape", "strides", "ndim", "out", "attr"
    input_index: int = -1


def metal_dtype_name(x: Any) -> str:
    """The canonical name of an array's (or dtype's) dtype, which must have a Metal type."""
    name = str(getattr(x, "dtype", x))
    name = name.replace("mlx.core.", "")
    if name not in TYPE_NAMES:
        raise ValueError(f"no Metal type for dtype {name!r}")
    return name


def template_value(v: TemplateValue, *, cxx: bool = False) -> str:
    """A template value as MLX spells it in names (``cxx``: as C++ source spells it)."""
    if isinstance(v, bool):
        return ("true" if v else "false") if cxx else str(int(v))
    if isinstance(v, Dtype):
        return TYPE_NAMES[v.name]
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    raise ValueError(f"invalid template argument {v!r}")


def kernel_name(name: str, inputs: Sequence[InputDesc], output_dtypes: Sequence[str],
                template: Sequence[tuple[str, TemplateValue]] = ()) -> str:
    """The host name MLX gives the kernel (see the module docstring)."""
    out = f"custom_kernel_{name}"
    if template:
        out += "_" + "".join(f"_{template_value(v)}" for _, v in template)
    for i in inputs:
        t = TYPE_NAMES[i.dtype]
        out += f"_{t}" + ("s" if not i.shape else ("c" if i.size < 8 else ""))
    for d in output_dtypes:
        out += f"_{TYPE_NAMES[d]}"
    return out


def parameters(source: str, inputs: Sequence[InputDesc], output_names: Sequence[str],
               output_dtypes: Sequence[str]) -> list[Param]:
    """The generated kernel's parameters, in MLX's order."""
    params: list[Param] = []
    slot = 0

    def add(decl: str, emu: str, name: str, kind: str, idx: int = -1) -> None:
        nonlocal slot
        params.append(Param(decl, f"buffer({slot})", emu, name, kind, idx))
        slot += 1

    for k, i in enumerate(inputs):
        t = TYPE_NAMES[i.dtype]
        if not i.shape:
            add(f"const constant {t}& {i.name}", f"const {t}&", i.name, "scalar", k)
        elif i.size < 8:
            add(f"const constant {t}* {i.name}", f"const {t}*", i.name, "in", k)
        else:
            add(f"const device {t}* {i.name}", f"const {t}*", i.name, "in", k)
        if f"{i.name}_shape" in source:
            add(f"const constant int* {i.name}_shape", "const int*", f"{i.name}_shape",
                "shape", k)
        if f"{i.name}_strides" in source:
            add(f"const constant int64_t* {i.name}_strides", "const int64_t*",
                f"{i.name}_strides", "strides", k)
        if f"{i.name}_ndim" in source:
            add(f"const constant int& {i.name}_ndim", "const int&", f"{i.name}_ndim", "ndim",
                k)
    for name, d in zip(output_names, output_dtypes):
        t = TYPE_NAMES[d]
        add(f"device {t}* {name}", f"{t}*", name, "out")
    for attr, t in ATTRIBUTES.items():
        if attr in source:
            params.append(Param(f"{t} {attr}", attr, t, attr, "attr"))
    return params


def template_decl(template: Sequence[tuple[str, TemplateValue]]) -> str:
    """The ``template <...>`` line of the generated kernel (empty without a template)."""
    kinds = []
    for n, v in template:
        kinds.append(f"typename {n}" if isinstance(v, Dtype) else
                     (f"bool {n}" if isinstance(v, bool) else f"int {n}"))
    return f"template <{', '.join(kinds)}>\n" if template else ""


def metal_source(name: str, inputs: Sequence[InputDesc], output_names: Sequence[str],
                 output_dtypes: Sequence[str], source: str, header: str = "",
                 template: Sequence[tuple[str, TemplateValue]] = ()) -> str:
    """The Metal source MLX generates for this call: exactly what ``verbose=True`` prints
    between its fences (minus one trailing newline); MLX compiles it after its
    ``#include`` lines."""
    kname = kernel_name(name, inputs, output_dtypes, template)
    params = parameters(source, inputs, output_names, output_dtypes)
    plist = ",\n".join(f"  {p.decl} [[{p.attribute}]]" for p in params)
    text = (f"{header}{template_decl(template)}[[kernel]] void {kname}(\n{plist}) {{\n"
            f"{source}\n}}\n")
    if template:
        vals = ", ".join(template_value(v) for _, v in template)
        text += (f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({kname}<{vals}>) '
                 f"{kname}<{vals}>;\n")
    return text


__all__ = ["ATTRIBUTES", "TYPE_NAMES", "Dtype", "InputDesc", "Param", "TemplateValue",
           "kernel_name", "metal_dtype_name", "metal_source", "parameters",
           "template_decl", "template_value"]
