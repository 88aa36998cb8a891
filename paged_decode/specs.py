"""Kernel specializations: one frozen spec per compiled kernel, with a readable URI.

The URI spells every parameter the compiled code depends on (every dtype included: the
original project once shared one compiled kernel between an f16 and an f32 pool and
returned garbage). It names the compiled object, keys the in-process cache and is what
``PAGED_DECODE_ASSERT_NO_COMPILE`` reports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import PagedDecodeError

ASSERT_NO_COMPILE_ENV = "PAGED_DECODE_ASSERT_NO_COMPILE"

CUDA_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}

V2_NUM_WARPS = 4
V1_NUM_WARPS = 8
SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
MAX_PAGE_SIZE = 256


class UnexpectedCompileError(PagedDecodeError, RuntimeError):
    """A kernel had to be compiled while ``PAGED_DECODE_ASSERT_NO_COMPILE=1``."""


@dataclass(frozen=True)
class KernelSpec:
    """One specialization. ``kernel`` is ``"v2"``, ``"v1"``, ``"merge"``, ``"prefix"`` (the
    tensor-core level 0 of cascade decode: ``kv_dtype`` is its q/K/V dtype) or ``"append"``
    (the pool write: ``out_dtype`` is the pools' dtype); parameters a kernel does not use
    are left at 0 / ``""``."""

    kernel: str
    out_dtype: str
    head_dim: int
    q_dtype: str = ""
    kv_dtype: str = ""
    page_size: int = 0
    heads_per_cta: int = 0
    num_warps: int = 0
    stages: int = 0
    row_loads: int = 0           # v2: 16-byte loads per lane per K/V row (CUDA only)
    gather: bool = False         # merge: inputs read through a row index (CUDA only)
    tile_tokens: int = 0         # prefix: K/V tokens per shared-memory tile
    vector_bytes: int = 0        # append: bytes per access (kernels/append.py)

    @property
    def uri(self) -> str:
        parts = [f"pd_{self.kernel}"]
        if self.q_dtype:
            parts.append(f"q-{SHORT[self.q_dtype]}")
        if self.kv_dtype:
            parts.append(f"kv-{SHORT[self.kv_dtype]}")
        parts.append(f"o-{SHORT[self.out_dtype]}")
        if self.head_dim:
            parts.append(f"hd-{self.head_dim}")
        if self.page_size:
            parts.append(f"ps-{self.page_size}")
        if self.heads_per_cta:
            parts.append(f"qh-{self.heads_per_cta}")
        if self.num_warps:
            parts.append(f"w-{self.num_warps}")
        if self.stages:
            parts.append(f"st-{self.stages}")
        if self.row_loads:
            parts.append(f"ld-{self.row_loads}")
        if self.gather:
            parts.append("gather")
        if self.tile_tokens:
            parts.append(f"kt-{self.tile_tokens}")
        if self.vector_bytes:
            parts.append(f"vb-{self.vector_bytes}")
        return "_".join(parts)

    def cuda_name_expression(self) -> str:
        """The template instantiation CuPy compiles (the kernels' parameter order)."""
        t = CUDA_TYPES
        if self.kernel == "v2":
            args = [t[self.q_dtype], t[self.kv_dtype], t[self.out_dtype], self.head_dim,
                    self.page_size, self.heads_per_cta, self.num_warps, self.stages,
                    max(1, self.row_loads)]
            name = "pd_decode_v2_partial"
        elif self.kernel == "v1":
            args = [t[self.q_dtype], t[self.kv_dtype], t[self.out_dtype], self.head_dim,
                    self.page_size, self.num_warps, self.stages]
            name = "pd_decode_v1"
        elif self.kernel == "merge":
            args = [t[self.out_dtype], self.head_dim, "true" if self.gather else "false"]
            name = "pd_merge_states"
        elif self.kernel == "prefix":
            args = [t[self.kv_dtype], self.head_dim, self.page_size, self.num_warps,
                    self.tile_tokens]
            name = "pd_prefix_tc"
        elif self.kernel == "append":
            args, name = [self.vector_bytes], "pd_append"
        else:
            raise ValueError(f"unknown kernel {self.kernel!r}")
        return f"{name}<{', '.join(str(a) for a in args)}>"


    @property
    def dynamic_smem_bytes(self) -> int:
        """Bytes of the K/V staging ring (v2 and v1): per thread, STAGES x 4 tokens x
        (K, V) x the 16-byte pieces of its slice of a row."""
        if self.kernel == "prefix":
            from .kernels import prefix_tc
            return prefix_tc.dynamic_smem_bytes(self.head_dim, self.num_warps,
                                                self.tile_tokens)
        if self.kernel not in ("v2", "v1"):
            return 0
        return self.num_warps * 32 * self.stages * stage_bytes_per_thread(
            self.kv_dtype, self.head_dim, max(1, self.row_loads))


TOKENS_PER_STAGE = 4          # U in the kernels
RING_BUDGET = 96 * 1024       # staging bytes one CTA may take


def row_loads(kv_dtype: str, head_dim: int, requested: int = 1) -> int:
    """16-byte loads a lane makes per K/V row (the kernels' RowMap): enough for the row
    to fit in one warp, at least ``requested``."""
    per16 = 16 // {"float16": 2, "bfloat16": 2, "float32": 4}[kv_dtype]
    min_vec = -(-head_dim // 32)
    return max(-(-min_vec // per16), requested)


def stage_bytes_per_thread(kv_dtype: str, head_dim: int, requested_loads: int = 1) -> int:
    """Ring bytes per thread and stage: 16-byte loads per row x tokens x (K, V)."""
    return TOKENS_PER_STAGE * 2 * row_loads(kv_dtype, head_dim, requested_loads) * 16


def pipeline_stages(kv_dtype: str, head_dim: int, num_warps: int, preferred: int,
                    requested_loads: int = 1) -> int:
    """Deepest ring <= ``preferred`` (env ``PAGED_DECODE_STAGES`` overrides it) that fits
    ``RING_BUDGET``; at least 2."""
    env = os.environ.get(STAGES_ENV)
    want = int(env) if env else preferred
    per_stage = num_warps * 32 * stage_bytes_per_thread(kv_dtype, head_dim, requested_loads)
    return max(2, min(want, RING_BUDGET // per_stage))


def v2_row_loads(kv_dtype: str, head_dim: int, heads_per_cta: int) -> int:
    """Loads per lane per row of the v2 partial: ``PAGED_DECODE_V2_ROW_LOADS`` when set,
    else ``V2_ROW_LOADS`` (the minimum, 1, unless measured otherwise)."""
    env = os.environ.get(ROW_LOADS_ENV)
    want = int(env) if env else V2_ROW_LOADS
    if want < 1:
        raise ValueError(f"{ROW_LOADS_ENV} must be a positive integer, got {env!r}")
    return row_loads(kv_dtype, head_dim, want)


STAGES_ENV = "PAGED_DECODE_STAGES"
ROW_LOADS_ENV = "PAGED_DECODE_V2_ROW_LOADS"
V2_ROW_LOADS = 1
V2_STAGES = 2
V1_STAGES = 2


def v2_spec(q_dtype: str, kv_dtype: str, out_dtype: str, head_dim: int, page_size: int,
            heads_per_cta: int) -> KernelSpec:
    loads = v2_row_loads(kv_dtype, head_dim, heads_per_cta)
    return KernelSpec("v2", out_dtype, head_dim, q_dtype, kv_dtype, page_size, heads_per_cta,
                      V2_NUM_WARPS,
                      pipeline_stages(kv_dtype, head_dim, V2_NUM_WARPS, V2_STAGES, loads),
                      loads)


def v1_spec(q_dtype: str, kv_dtype: str, out_dtype: str, head_dim: int,
            page_size: int) -> KernelSpec:
    return KernelSpec("v1", out_dtype, head_dim, q_dtype, kv_dtype, page_size, 0, V1_NUM_WARPS,
                      pipeline_stages(kv_dtype, head_dim, V1_NUM_WARPS, V1_STAGES))


def merge_spec(out_dtype: str, head_dim: int, gather: bool = False) -> KernelSpec:
    return KernelSpec("merge", out_dtype, head_dim, gather=gather)


#: the tensor-core prefix kernel's dtypes (its operands are 16-bit; q must match the pools)
PREFIX_DTYPES = ("float16", "bfloat16")


def prefix_spec(kv_dtype: str, head_dim: int, page_size: int) -> KernelSpec:
    """The tensor-core level 0 of cascade decode (``kernels/prefix_tc.py``); it writes
    float32 partials."""
    from .kernels import prefix_tc
    return KernelSpec("prefix", "float32", head_dim, kv_dtype, kv_dtype, page_size, 0,
                      prefix_tc.NUM_WARPS, tile_tokens=prefix_tc.tokens_per_tile(head_dim))


def decode_specs(q_dtype: str, kv_dtype: str, out_dtype: str, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int) -> list[KernelSpec]:
    """Every specialization a decode of this problem can compile, over all paths: the v2
    partial writing float32 partials or the output directly, the merge, and v1."""
    from .plan import heads_per_cta
    qh = heads_per_cta(num_qo_heads, num_kv_heads)
    outs = sorted({"float32", out_dtype})
    return ([v2_spec(q_dtype, kv_dtype, o, head_dim, page_size, qh) for o in outs]
            + [merge_spec(out_dtype, head_dim),
               v1_spec(q_dtype, kv_dtype, out_dtype, head_dim, page_size)])


def append_spec(dtype: str, vector_bytes: int) -> KernelSpec:
    """The pool-append kernel (``kernels/append.py``) for pools of ``dtype``, moving words
    of ``vector_bytes``."""
    return KernelSpec("append", dtype, 0, vector_bytes=vector_bytes)


def cuda_source(kernel: str) -> str:
    """The complete CUDA source holding ``kernel``'s template."""
    from .kernels import append, decode_v1, decode_v2, merge, prefix_tc
    return {"v2": decode_v2.CUDA_SOURCE, "v1": decode_v1.CUDA_SOURCE,
            "merge": merge.CUDA_SOURCE, "prefix": prefix_tc.CUDA_SOURCE,
            "append": append.CUDA_SOURCE}[kernel]


def assert_compile_allowed(spec: KernelSpec) -> None:
    if os.environ.get(ASSERT_NO_COMPILE_ENV, "") not in ("", "0"):
        raise UnexpectedCompileError(
            f"kernel {spec.uri} needs compiling but {ASSERT_NO_COMPILE_ENV} is set "
            "(warm the kernels up before the measured region)")
