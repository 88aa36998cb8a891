"""What one kernel is: ``KernelDef``, the single object each ``kernels/<name>.py`` exports.

A definition holds both dialects' sources, the template parameters by name (in the CUDA
declaration's order, written once), how a ``KernelSpec`` becomes a named mapping of
template arguments (the CUDA name expression and the Metal template list both read it),
the threads per block and the dynamic shared memory. Kernel modules import only this
module and ``common``, so the registry over them can be imported from anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


class KernelSpec(Protocol):
    """What a kernel definition reads of a specialization (``specs.KernelSpec`` is the
    concrete one; kernels depend on this interface, not on ``specs``)."""

    @property
    def kernel(self) -> str: ...
    @property
    def out_dtype(self) -> str: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def q_dtype(self) -> str: ...
    @property
    def kv_dtype(self) -> str: ...
    @property
    def page_size(self) -> int: ...
    @property
    def heads_per_cta(self) -> int: ...
    @property
    def num_warps(self) -> int: ...
    @property
    def stages(self) -> int: ...
    @property
    def row_loads(self) -> int: ...
    @property
    def gather(self) -> bool: ...
    @property
    def tile_tokens(self) -> int: ...
    @property
    def vector_bytes(self) -> int: ...
    @property
    def soft_cap(self) -> bool: ...
    @property
    def sink(self) -> bool: ...
    @property
    def merged_dtype(self) -> str: ...

#: CUDA spelling of a dtype template argument
CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
              "float8_e4m3fn": "pd::fp8_e4m3", "float8_e5m2": "pd::fp8_e5m2"}
#: the Metal dialect's KV_FP8 template value of a pool dtype (MLX passes fp8 pools as
#: uint8_t, so the format travels as a number: 0 not fp8, 1 e4m3fn, 2 e5m2)
METAL_FP8_FORMATS = {"float8_e4m3fn": 1, "float8_e5m2": 2}


def metal_fp8(kv_dtype: str) -> int:
    """The ``KV_FP8`` template argument of the Metal dialect for pools of ``kv_dtype``."""
    return METAL_FP8_FORMATS.get(kv_dtype, 0)


@dataclass(frozen=True)
class Dtype:
    """A dtype template argument, by canonical name (``"float16"``, ``"bfloat16"``, ...)."""

    name: str


TemplateValue = bool | int | Dtype


@dataclass(frozen=True)
class MetalKernel:
    """A kernel's MLX ``metal_kernel`` text and interface: ``header`` and body
    (``source``), input and output names in call order, template parameter names."""

    header: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    template: tuple[str, ...] = ()


def _no_smem(spec: KernelSpec) -> int:
    return 0


def cuda_template_value(v: TemplateValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Dtype):
        return CUDA_TYPES[v.name]
    return str(int(v))


@dataclass(frozen=True)
class KernelDef:
    """One kernel. ``kernel`` is its ``KernelSpec.kernel`` key; ``cuda_name`` the
    ``__global__`` template's name in ``cuda_source``; ``template`` its template
    parameters in declaration order; ``arguments(spec)`` the value of each (a ``Dtype``
    for a ``typename``); ``threads(spec)`` the threads per block (threadgroup on Metal);
    ``dynamic_smem(spec)`` the dynamic shared memory bytes (CUDA). ``metal`` is the Metal
    dialect (its ``template`` left empty: it is ``template`` less ``cuda_only``, the
    parameters only the CUDA dialect has, plus ``metal_only``, the ones only Metal has:
    they follow the others), ``None`` where there is none."""

    kernel: str
    cuda_name: str
    cuda_source: str
    template: tuple[str, ...]
    arguments: Callable[[KernelSpec], Mapping[str, TemplateValue]]
    threads: Callable[[KernelSpec], int]
    dynamic_smem: Callable[[KernelSpec], int] = _no_smem
    metal: MetalKernel | None = None
    cuda_only: tuple[str, ...] = ()
    metal_only: tuple[str, ...] = ()

    def template_arguments(self, spec: KernelSpec) -> list[tuple[str, TemplateValue]]:
        """(name, value) in declaration order (the CUDA parameters; ``metal_only`` ones
        are ``metal_template``'s); the mapping must name every parameter."""
        named = self.arguments(spec)
        if set(named) != set(self.template) | set(self.metal_only):
            raise ValueError(f"{self.kernel}: template arguments {sorted(named)} do not match "
                             f"the parameters {list(self.template)}")
        return [(n, named[n]) for n in self.template]

    def cuda_name_expression(self, spec: KernelSpec) -> str:
        """The template instantiation CuPy / NVRTC compile, e.g. ``pd_merge_states<float,
        128, false>``."""
        args = ", ".join(cuda_template_value(v) for _, v in self.template_arguments(spec))
        return f"{self.cuda_name}<{args}>"

    @property
    def metal_kernel(self) -> MetalKernel:
        """The Metal dialect with its template parameter names."""
        if self.metal is None:
            raise ValueError(f"kernel {self.kernel!r} has no Metal dialect")
        names = tuple(n for n in self.template if n not in self.cuda_only) + self.metal_only
        return MetalKernel(self.metal.header, self.metal.source, self.metal.inputs,
                           self.metal.outputs, names)

    def metal_template(self, spec: KernelSpec) -> list[tuple[str, TemplateValue]]:
        """MLX template arguments as (name, value), in the Metal dialect's order."""
        named = self.arguments(spec)
        return ([(n, v) for n, v in self.template_arguments(spec) if n not in self.cuda_only]
                + [(n, named[n]) for n in self.metal_only])


__all__ = ["CUDA_TYPES", "METAL_FP8_FORMATS", "metal_fp8", "Dtype", "KernelDef", "MetalKernel", "TemplateValue"]
