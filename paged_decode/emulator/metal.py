"""The Metal dialect: MLX ``metal_kernel`` bodies, wrapped and run on the CPU emulator.

MLX's signature rules (``metal_signature.py``) say what ``metal_kernel``
generates around a body. ``wrap_metal`` is the translation unit the emulator
compiles: the same parameters without the Metal attributes, address-space qualifiers
removed where they qualify a declaration, ``threadgroup`` arrays turned into arena
storage, and a launcher that feeds each thread its attribute values. ``launch_metal``
runs a call with MLX's arguments: ``grid`` counts threads (as in MLX), and must be a
whole number of threadgroups.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

# the signature rules (shared with the metal backend); re-exported for the emulator's callers
from ..metal_signature import (  # noqa: F401
    ATTRIBUTES,
    TYPE_NAMES,
    Dtype,
    InputDesc,
    TemplateValue,
    kernel_name,
    metal_dtype_name,
    metal_source,
    parameters,
    template_decl,
    template_value,
)
from .errors import EmulatorError
from .launch import Buffer, run_wrapped
from .rewrite import rewrite_casts


def _dtype_name(x: Any) -> str:
    try:
        return metal_dtype_name(x)
    except ValueError as exc:
        raise EmulatorError(str(exc)) from None


# ------------------------------------------------------------------ emulator rewriting
_TYPE = r"[A-Za-z_][\w:]*(?:\s*<[^<>;{}()]*>)?"
_TG_ARRAY = re.compile(
    rf"(?<![\w.])threadgroup\s+(?P<type>{_TYPE})\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"(?P<dims>(?:\[[^\];]+\]\s*)+);")
_QUALIFIER = re.compile(
    rf"(?<![\w.])(?:device|constant|threadgroup|thread)\s+(?=(?:const\s+)?{_TYPE}\s*"
    r"(?:const\s*)?\(?\s*[*&])")
_CONSTANT_VAR = re.compile(
    rf"(?<![\w.])constant\s+(?=(?:const\s+)?{_TYPE}\s+[A-Za-z_]\w*\s*(?:=|\[|\{{))")


def rewrite_metal(src: str, site_prefix: str = "s") -> str:
    """``src`` with address-space qualifiers removed where they qualify a pointer or
    reference declaration (a reference to an array, ``thread float (&a)[N]``, too),
    ``constant`` variables made ``static const``, each ``threadgroup T name[N]...;``
    turned into arena storage and pointer casts checked (``rewrite.rewrite_casts``)."""
    out: list[str] = []
    last = 0
    for i, m in enumerate(_TG_ARRAY.finditer(src)):
        t, name, dims = m["type"].strip(), m["name"], re.sub(r"\s+", "", m["dims"])
        site = f"pd_tg_{site_prefix}{i}"
        out.append(src[last:m.start()])
        out.append(f"struct {site} {{}}; using {site}_t = {t}{dims}; "
                   f"{site}_t& {name} = pd_metal::tg_var<{site}_t, {site}>(\"{name}\");")
        last = m.end()
    out.append(src[last:])
    text = rewrite_casts(_QUALIFIER.sub("", "".join(out)))
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
    targs = f"<{', '.join(template_value(v, cxx=True) for _, v in template)}>" if template else ""
    args = ",\n        ".join(call)
    return (
        '#include "pd_emu_metal.h"\n'
        '#line 1 "header.metal"\n'
        f"{rewrite_metal(header, 'h')}\n"
        "// ---- the signature MLX generates (attributes and address spaces removed)\n"
        f"{template_decl(template)}void {kname}(\n{plist}) {{\n"
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


def _check_constant_inputs(source: str, params: Sequence[Any]) -> None:
    """MLX passes an input of fewer than 8 elements as ``const constant T*``; the body
    must not bind it to a ``device`` pointer (Metal rejects the address-space change,
    and the emulator, which drops address spaces, would not notice otherwise)."""
    for p in params:
        if p.kind != "in" or not p.decl.startswith("const constant"):
            continue
        bad = re.search(rf"\bdevice\s+(?:const\s+)?\w+\s*\*\s*\w+\s*=\s*{p.name}\b",
                        source)
        if bad:
            raise EmulatorError(
                f"emulator: input '{p.name}' has fewer than 8 elements, so MLX passes it in "
                f"the constant address space, but the body binds it to a device pointer "
                f"('{bad.group(0)}'): Metal refuses the conversion")


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
    _check_constant_inputs(source, params)
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
