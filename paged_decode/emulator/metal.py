"""The Metal dialect: MLX ``metal_kernel`` bodies, wrapped and run on the CPU emulator.

``mlx.core.fast.metal_kernel`` takes only a kernel *body* and generates the rest; this
module reproduces that generation (MLX 0.32, ``mlx/backend/common/metal_kernel.cpp``):

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
MLX's own output in the tests). ``wrap_metal`` is the translation unit the emulator
compiles: the same parameters without the Metal attributes, address-space qualifiers
removed where they qualify a declaration, ``threadgroup`` arrays turned into arena
storage, and a launcher that feeds each thread its attribute values. ``launch_metal``
runs a call with MLX's arguments: ``grid`` counts threads (as in MLX), and must be a
whole number of threadgroups.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import EmulatorError
from .launch import Buffer, run_wrapped

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
}


@dataclass(frozen=True)
class Dtype:
    """A dtype template argument, by canonical name (``"float16"``, ``"bfloat16"``, ...)."""

    name: str

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.name]


TemplateValue = bool | int | Dtype


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


def _dtype_name(x: Any) -> str:
    name = str(getattr(x, "dtype", x))
    name = name.replace("mlx.core.", "")
    if name not in TYPE_NAMES:
        raise EmulatorError(f"emulator: no Metal type for dtype {name!r}")
    return name


def _tval(v: TemplateValue, *, cxx: bool = False) -> str:
    if isinstance(v, bool):
        return ("true" if v else "false") if cxx else str(int(v))
    if isinstance(v, Dtype):
        return v.type_name
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    raise EmulatorError(f"emulator: invalid template argument {v!r}")


def kernel_name(name: str, inputs: Sequence[InputDesc], output_dtypes: Sequence[str],
                template: Sequence[tuple[str, TemplateValue]] = ()) -> str:
    """The host name MLX gives the kernel (see the module docstring)."""
    out = f"custom_kernel_{name}"
    if template:
        out += "_" + "".join(f"_{_tval(v)}" for _, v in template)
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


def _template_decl(template: Sequence[tuple[str, TemplateValue]]) -> str:
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
    text = (f"{header}{_template_decl(template)}[[kernel]] void {kname}(\n{plist}) {{\n"
            f"{source}\n}}\n")
    if template:
        vals = ", ".join(_tval(v) for _, v in template)
        text += (f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({kname}<{vals}>) '
                 f"{kname}<{vals}>;\n")
    return text


# ------------------------------------------------------------------ emulator rewriting
_TYPE = r"[A-Za-z_][\w:]*(?:\s*<[^<>;{}()]*>)?"
_TG_ARRAY = re.compile(
    rf"(?<![\w.])threadgroup\s+(?P<type>{_TYPE})\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\];]+\]\s*)+);")
_QUALIFIER = re.compile(
    rf"(?<![\w.])(?:device|constant|threadgroup|thread)\s+(?=(?:const\s+)?{_TYPE}\s*"
    r"(?:const\s*)?[*&])")
_CONSTANT_VAR = re.compile(
    rf"(?<![\w.])constant\s+(?=(?:const\s+)?{_TYPE}\s+[A-Za-z_]\w*\s*(?:=|\[|\{{))")


def rewrite_metal(src: str, site_prefix: str = "s") -> str:
    """``src`` with address-space qualifiers removed where they qualify a pointer or
    reference declaration, ``constant`` variables made ``static const`` and each
    ``threadgroup T name[N]...;`` turned into arena storage."""
    out: list[str] = []
    last = 0
    for i, m in enumerate(_TG_ARRAY.finditer(src)):
        t, name, dims = m["type"].strip(), m["name"], re.sub(r"\s+", "", m["dims"])
        site = f"pd_tg_{site_prefix}{i}"
        out.append(src[last:m.start()])
        out.append(f"struct {site} {{}}; using {site}_t = {t}{dims}; "
                   f"{site}_t& {name} = pd_metal::tg_var<{site}_t, {site}>();")
        last = m.end()
    out.append(src[last:])
    text = _QUALIFIER.sub("", "".join(out))
    return _CONSTANT_VAR.sub("static const ", text)


def wrap_metal(name: str, inputs: Sequence[InputDesc], output_names: Sequence[str],
               output_dtypes: Sequence[str], source: str, header: str = "",
               template: Sequence[tuple[str, TemplateValue]] = ()) -> str:
    """The translation unit the emulator compiles for this call."""
    kname = kernel_name(name, inputs, output_dtypes, template)
    params = parameters(source, inputs, output_names, output_dtypes)
    plist = ",\n".join(f"    {p.emu_type} {p.name}" for p in params)
    call = []
    bi = 0
    for p in params:
        if p.kind == "attr":
            call.append(f"pd_metal::attr_{p.name}()")
            continue
        if p.kind in ("scalar", "ndim"):
            base = p.emu_type[len("const "):-1]
            call.append(f"*reinterpret_cast<const {base}*>(a[{bi}])")
        else:
            call.append(f"*reinterpret_cast<{p.emu_type}*>(a[{bi}])")
        bi += 1
    targs = f"<{', '.join(_tval(v, cxx=True) for _, v in template)}>" if template else ""
    args = ",\n        ".join(call)
    return (
        '#include "pd_emu_metal.h"\n'
        '#line 1 "header.metal"\n'
        f"{rewrite_metal(header, 'h')}\n"
        "// ---- the signature MLX generates (attributes and address spaces removed)\n"
        f"{_template_decl(template)}void {kname}(\n{plist}) {{\n"
        '#line 1 "body.metal"\n'
        f"{rewrite_metal(source, 'b')}\n"
        "}\n"
        "// ---- emulator launcher\n"
        'extern "C" int pd_emu_launch(const pd_emu::LaunchDesc* d, void** args, char* err,\n'
        "                             std::size_t errlen) {\n"
        "  return pd_emu::run_launch(d, [](void** a) {\n"
        f"    {kname}{targs}(\n        {args});\n"
        "  }, args, &pd_emu::g_static_smem, err, errlen);\n"
        "}\n")


# ------------------------------------------------------------------ launching
_NP_SCALARS = {"bool": np.bool_, "int32": np.int32, "uint32": np.uint32, "int64": np.int64,
               "uint64": np.uint64, "float32": np.float32}


def groups(grid: Sequence[int], threadgroup: Sequence[int]) -> tuple[tuple[int, int, int],
                                                                       tuple[int, int, int]]:
    """MLX's dispatch: ``group = min(threadgroup, grid)`` per axis, ``grid`` in threads.
    Returns (threadgroups per axis, threads per threadgroup). A ragged grid (a smaller
    last threadgroup, which Metal's ``dispatchThreads`` allows) is not emulated."""
    g = tuple(int(x) for x in (*grid, 1, 1, 1)[:3])
    t = tuple(min(int(a), b) for a, b in zip((*threadgroup, 1, 1, 1)[:3], g))
    if any(x == 0 for x in g):
        return (0, 0, 0), (1, 1, 1)
    if any(a % b for a, b in zip(g, t)):
        raise EmulatorError(f"emulator: grid {g} (threads) is not a whole number of "
                            f"threadgroups {t}; non-uniform threadgroups are not emulated")
    return (g[0] // t[0], g[1] // t[1], g[2] // t[2]), (t[0], t[1], t[2])


def launch_metal(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str, inputs: Sequence[Any], outputs: Sequence[Any],
                 grid: Sequence[int], threadgroup: Sequence[int],
                 template: Sequence[tuple[str, TemplateValue]] = (), *,
                 output_dtypes: Sequence[str] | None = None, check_races: bool = True,
                 threads: int | None = None, schedules: Sequence[str] | None = None) -> None:
    """Run an MLX ``metal_kernel`` call on the emulator. ``inputs``: numpy arrays (a 0-d
    array or numpy scalar is a 0-d input); ``outputs``: C-contiguous numpy arrays the
    kernel writes (like MLX's fresh outputs they start uninitialized: their contents on
    entry are whatever the caller left). ``grid`` counts threads, as in MLX.
    ``schedules`` / ``check_races``: as in ``launch.launch``."""
    if len(input_names) != len(inputs) or len(output_names) != len(outputs):
        raise EmulatorError("emulator: input/output names and values differ in number")
    if len(outputs) == 0:
        raise EmulatorError("[metal_kernel] Must specify at least one output.")
    arrs = [np.asarray(x) for x in inputs]
    descs = [InputDesc(n, _dtype_name(a), tuple(a.shape)) for n, a in zip(input_names, arrs)]
    odt = list(output_dtypes) if output_dtypes is not None else [_dtype_name(o)
                                                                  for o in outputs]
    params = parameters(source, descs, output_names, odt)
    nbuf = sum(p.kind != "attr" for p in params)
    if nbuf > 31:
        raise EmulatorError(f"emulator: {nbuf} buffer arguments (Metal allows 31)")
    args: list[Any] = []
    outs = iter(outputs)
    for p in params:
        if p.kind == "attr":
            continue
        a = arrs[p.input_index] if p.input_index >= 0 else None
        if p.kind == "scalar":
            assert a is not None
            if a.dtype.name not in _NP_SCALARS or a.dtype == np.bool_:
                raise EmulatorError(f"emulator: 0-d input '{p.name}' of dtype {a.dtype}")
            args.append(a.reshape(()).astype(a.dtype)[()])
        elif p.kind == "in":
            assert a is not None
            args.append(Buffer(p.name, np.ascontiguousarray(a)))
        elif p.kind == "shape":
            assert a is not None
            args.append(Buffer(p.name, np.asarray(a.shape, np.int32)))
        elif p.kind == "strides":
            assert a is not None
            st = np.asarray([s // a.itemsize for s in np.ascontiguousarray(a).strides],
                            np.int64)
            args.append(Buffer(p.name, st))
        elif p.kind == "ndim":
            assert a is not None
            args.append(np.int32(a.ndim))
        else:
            o = next(outs)
            if not isinstance(o, np.ndarray) or not o.flags.c_contiguous:
                raise EmulatorError(f"emulator: output '{p.name}' must be a C-contiguous "
                                    "numpy array")
            args.append(Buffer(p.name, o, output=True))
    g, t = groups(grid, threadgroup)
    if 0 in g:
        return
    wrapped = wrap_metal(name, descs, output_names, odt, source, header, template)
    run_wrapped(wrapped, kernel_name(name, descs, odt, template), g, t, args, 0,
                check_races=check_races, threads=threads, schedules=schedules)


__all__ = ["ATTRIBUTES", "Dtype", "InputDesc", "groups", "kernel_name", "launch_metal",
           "metal_source", "parameters", "rewrite_metal", "wrap_metal"]
