"""Planted kernel bugs: the one mechanism that runs a kernel with a single-point change,
the fixed list behind ``make mutants``, and its runner.

A ``Mutation`` replaces the one occurrence of a string in the kernel sources of one
dialect: ``"cuda"`` (``specs.cuda_source(kernel)``, what the CUDA and emulated-cuda
backends compile) or ``"metal"`` (the MLX header and body of
``metal_launches.metal_kernel(kernel)``). It names every kernel whose source holds the
changed text (v1 compiles v2's ``attend_range``): it must occur exactly once in each, or
``StaleMutation`` is raised (a ``RuntimeError``, never an ``AssertionError``, so a
mutation that no longer applies can never count as detected). ``backend(mutation)`` is an
emulated backend running it; ``install(mutations)`` makes every emulated backend of the
process run them (the runner's subprocesses, through ``conftest.py``). The ``"python"``
dialect plants a bug in host code instead (the call layer's variant rules, the window
table, the plan): ``kernels`` names one module of the package, whose source is changed and
re-executed by ``install``, and every function it defines replaces the original wherever
the package imported it.

``MUTANTS`` pairs each named, realistic mutation with the pytest node ids that must kill
it. The runner (``python tests/mutants.py``, ``make mutants``) first checks that every
mutation applies, then runs each mutant's tests in a subprocess with
``PAGED_DECODE_MUTANT=<name>`` and fails listing any survivor; a test that fails because
the mutated kernel does not compile is not a kill. An unmutated control (every kernel
source with a comment appended, through the same hook) runs the union of the selections
and must pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):      # run as a script: the repository's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged_decode.backends.emulated import (
    RACES_ENV,
    EmulatedCudaBackend,
    EmulatedMetalBackend,
)
from paged_decode.backends.metal_launches import MetalKernel
from paged_decode.emulator.launch import (
    CP_ASYNC_ENV,
    DEFAULT_SCHEDULES,
    LEGACY_SCHEDULES,
    SCHEDULES_ENV,
    TIMEOUT_ENV,
)
from paged_decode.specs import KernelSpec

MUTANT_ENV = "PAGED_DECODE_MUTANT"            # the mutant a test process runs
REPORT_ENV = "PAGED_DECODE_MUTANT_REPORT"     # where conftest.py writes test outcomes
MUTANT_TIMEOUT_S = "10"                       # the emulator watchdog's limit per launch
CONTROL = "control"                           # the unmutated control's name
KERNELS = ("v2", "v2tc", "v1", "merge", "prefix", "append", "append_fp8", "table_update")
METAL_KERNELS = ("v2", "v2tc", "v1", "merge", "append", "append_fp8", "table_update")
#: exception types whose failure says nothing about the kernel's behaviour
NOT_A_KILL = ("CompileError", "StaleMutation")


class StaleMutation(RuntimeError):
    """A mutation whose text does not occur exactly once in a kernel it names."""


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` by ``new`` in the ``dialect`` sources of ``kernels``. ``control``:
    change nothing but append a comment (the kernels compile from the mutated path)."""

    dialect: str
    kernels: tuple[str, ...]
    old: str = ""
    new: str = ""
    control: bool = False

    def apply(self, text: str, where: str) -> str:
        if self.control:
            return text + "\n// unmutated control\n"
        n = text.count(self.old)
        if n != 1:
            raise StaleMutation(f"{where}: the mutated text occurs {n} times (exactly once "
                                f"expected): {self.old!r}")
        return text.replace(self.old, self.new)

    def check(self) -> None:
        """Raise ``StaleMutation`` unless the mutation applies to every kernel it names."""
        for k in self.kernels:
            if self.dialect == "python":
                self.apply(_module_source(k), f"python {k}")
            elif self.dialect == "cuda":
                from paged_decode.specs import cuda_source
                self.apply(cuda_source(k), f"cuda {k}")
            else:
                from paged_decode.backends.metal_launches import metal_kernel
                mk = metal_kernel(k)
                self.apply(mk.header + mk.source, f"metal {k}")


def control(dialect: str, kernels: Sequence[str] | None = None) -> Mutation:
    """The identity mutation of ``kernels`` (default: every kernel of the dialect)."""
    ks = tuple(kernels) if kernels else (KERNELS if dialect == "cuda" else METAL_KERNELS)
    return Mutation(dialect, ks, control=True)


def mutate_cuda(mutations: Sequence[Mutation], spec: KernelSpec, src: str) -> str:
    """``src`` (the CUDA source of ``spec``) with every cuda mutation naming its kernel."""
    return mutate_cuda_kernel(mutations, spec.kernel, src)


def mutate_cuda_kernel(mutations: Sequence[Mutation], kernel: str, src: str) -> str:
    """``src`` (the CUDA source of ``kernel``) with every cuda mutation naming it."""
    for m in mutations:
        if m.dialect == "cuda" and kernel in m.kernels:
            src = m.apply(src, f"cuda {kernel}")
    return src


def mutate_metal(mutations: Sequence[Mutation], spec: KernelSpec,
                 mk: MetalKernel) -> MetalKernel:
    """``mk`` (a ``MetalKernel``) with every metal mutation naming ``spec``'s kernel applied
    to whichever of its header and body holds the text."""
    for m in mutations:
        if m.dialect != "metal" or spec.kernel not in m.kernels:
            continue
        where = f"metal {spec.kernel}"
        if m.control:
            mk = replace(mk, header=m.apply(mk.header, where))
            continue
        m.apply(mk.header + mk.source, where)          # exactly once in the two
        if m.old in mk.header:
            mk = replace(mk, header=m.apply(mk.header, where))
        else:
            mk = replace(mk, source=m.apply(mk.source, where))
    return mk


class _Mutated:
    def __init__(self, mutations: Sequence[Mutation], **kw: Any) -> None:
        super().__init__(**kw)
        self.mutations = tuple(mutations)


class _MutatedCuda(_Mutated, EmulatedCudaBackend):
    def kernel_source(self, spec: KernelSpec) -> str:
        return mutate_cuda(self.mutations, spec, super().kernel_source(spec))


class _MutatedMetal(_Mutated, EmulatedMetalBackend):
    def metal_kernel(self, spec: KernelSpec) -> MetalKernel:
        return mutate_metal(self.mutations, spec, super().metal_kernel(spec))


def backend(mutation: Mutation, **kw: Any) -> EmulatedCudaBackend:
    """An emulated backend of ``mutation``'s dialect running it (the real sources
    otherwise); ``kw`` as for ``EmulatedCudaBackend`` (``check_races``, ``schedules``,
    ``cp_async``). Raises ``StaleMutation`` at once when the mutation does not apply."""
    mutation.check()
    cls = _MutatedMetal if mutation.dialect == "metal" else _MutatedCuda
    return cls([mutation], **kw)


def _module_source(name: str) -> str:
    import importlib
    import inspect
    return inspect.getsource(importlib.import_module(name))


def install_python(mutation: Mutation) -> None:
    """Re-execute the mutated module and rebind each function it defines in every loaded
    module of the package that holds the original (``from .m import f`` copies); the
    methods of its classes are set on the original classes, so subclasses made from them
    elsewhere (the emulated backends of ``LaunchingBackend``) run the mutated ones."""
    import importlib
    import inspect
    for name in mutation.kernels:
        mod = importlib.import_module(name)
        src = mutation.apply(_module_source(name), f"python {name}")
        ns: dict[str, Any] = {"__name__": name, "__package__": mod.__package__,
                              "__file__": mod.__file__}
        exec(compile(src, f"{mod.__file__} (mutant)", "exec"), ns)
        for k, old in vars(mod).items():
            if isinstance(old, type) and old.__module__ == name and isinstance(ns.get(k), type):
                for attr, fn in vars(ns[k]).items():
                    if inspect.isfunction(fn) and attr in vars(old):
                        setattr(old, attr, fn)
        swaps = {id(old): ns[k] for k, old in vars(mod).items()
                 if callable(old) and getattr(old, "__module__", None) == name and k in ns}
        for other in list(sys.modules.values()):
            if other is None or not getattr(other, "__name__", "").startswith("paged_decode"):
                continue
            for k, val in list(vars(other).items()):
                if id(val) in swaps:
                    setattr(other, k, swaps[id(val)])
        # functions held by the kernels' definitions (``dynamic_smem=ring_smem_bytes``)
        from paged_decode.kernels.registry import KERNELS
        for kdef in KERNELS.values():
            for f in fields(kdef):
                if id(getattr(kdef, f.name)) in swaps:
                    object.__setattr__(kdef, f.name, swaps[id(getattr(kdef, f.name))])


def install(mutations: Sequence[Mutation]) -> None:
    """Make every emulated backend of this process run ``mutations`` (test subprocesses of
    the runner): the same ``mutate_cuda`` / ``mutate_metal`` as ``backend``; ``"python"``
    mutations are planted in the package at once (``install_python``)."""
    for m in mutations:
        m.check()
        if m.dialect == "python":
            install_python(m)
    cuda_src, metal_mk = EmulatedCudaBackend.kernel_source, EmulatedMetalBackend.metal_kernel
    muts = tuple(mutations)
    EmulatedCudaBackend.kernel_source = (  # type: ignore[method-assign]
        lambda self, spec: mutate_cuda(muts, spec, cuda_src(self, spec)))
    # the compile-level tests (tests/test_cuda_compile.py: NVRTC or nvcc, ptxas's registers)
    from paged_decode import cuda_compile
    compile_src = cuda_compile.cuda_source
    cuda_compile.cuda_source = (  # type: ignore[assignment]
        lambda kernel: mutate_cuda_kernel(muts, kernel, compile_src(kernel)))
    EmulatedMetalBackend.metal_kernel = (  # type: ignore[method-assign]
        lambda self, spec: mutate_metal(muts, spec, metal_mk(self, spec)))


# ---------------------------------------------------------------------------- the list
@dataclass(frozen=True)
class Mutant:
    """A named mutation, why it is a realistic bug, and the node ids that must kill it."""

    name: str
    mutation: Mutation
    tests: tuple[str, ...]
    why: str


def _m(name: str, dialect: str, kernels: tuple[str, ...], old: str, new: str,
       tests: Sequence[str], why: str) -> Mutant:
    return Mutant(name, Mutation(dialect, kernels, old, new), tuple(tests), why)


#: the planted bugs of the GPU modules' negative controls (tests/test_cuda_gpu.py), which
#: compile a mutated source with CuPy on the GPU: tests/test_mutants.py checks on the CPU
#: that each still applies exactly once, so a kernel edit cannot leave one stale until a
#: device run (as S10-R2 met)
GPU_NEGATIVE_CONTROLS: dict[str, Mutation] = {
    # the v2 partial reads page t // P of the pool instead of indices[indptr[r] + t // P]
    "v2-ignores-indices": Mutation("cuda", ("v2",), "page_ids[a / PAGE_SIZE]",
                                   "(a / PAGE_SIZE)"),
    # the v2 partial forgets first_page_offset (odd requests start mid-page)
    "v2-drops-first-page-offset": Mutation("cuda", ("v2",),
                                           "const int a_begin = (int)(fpo + t_begin)",
                                           "const int a_begin = (int)(t_begin)"),
    # the tensor-core partial's token rows take page t // P of the pool
    "v2tc-ignores-indices": Mutation("cuda", ("v2tc",), "? page_ids[a / PAGE_SIZE] :",
                                     "? (int)(a / PAGE_SIZE) :"),
}


# the killing tests, by node id (parametrizations of tests/test_emulated_oracle.py etc.)
ORACLE = "tests/test_emulated_oracle.py::"
LANES = ORACLE + "test_every_lane_geometry"
LONG = ORACLE + "test_long_context_accumulates_in_float32"
CASE = ORACLE + "test_kernels_match_oracle"
MERGE = ORACLE + "test_merge_large_groups_wide_lse_range"
PREFIX = "tests/test_prefix_tc.py::"
PREFIX_LONG = PREFIX + "test_prefix_kernel_long_chunk_every_schedule"
APPEND = "tests/test_append_batch.py::"
V2TC = "tests/test_v2tc.py::"
V2TC_CASE = V2TC + "test_v2tc_matches_oracle"
V2TC_BATCHES = V2TC + "test_v2tc_request_entries_at_every_batch_size"
V2TC_LONG = V2TC + "test_v2tc_long_chunk_every_schedule[64]"
V2TC_SKEWED_Q = V2TC + "test_v2tc_reads_a_q_off_16_byte_alignment[f16]"
V2TC_METAL = V2TC + "test_v2tc_metal_matches_oracle"
V2TC_METAL_LONG = V2TC + "test_v2tc_metal_long_chunk_every_schedule[64]"
TCVAR = "tests/test_v2tc_variants.py::"
FUSED = "tests/test_fused_merge.py::"
CLUSTER = "tests/test_cluster_merge.py::"
AHEAD = "tests/test_compile_ahead.py::"
SPLIT_MERGE = "tests/test_merge.py::test_split_merge_kernel_matches_closed_form"
MERGE_KERNEL_NAN = "tests/test_merge.py::test_merge_kernel_large_groups_nan_rows_and_gather[False]"
TCVAR_ONE = TCVAR + "test_each_variant_alone_and_combined"
V2TC_FP8 = "tests/test_v2tc_fp8.py::"
V2TC_FP8_CASE = V2TC_FP8 + "test_v2tc_fp8_matches_oracle"
V2TC_FP8_E4 = V2TC_FP8_CASE + "[d64-g1-ps16-e4m3-f16-emulated-cuda]"
V2TC_FP8_E5 = V2TC_FP8_CASE + "[d128-g4-ps3-e5m2-bf16-emulated-cuda]"
V2TC_FP8_METAL = V2TC_FP8_CASE + "[d64-g1-ps16-e4m3-f16-emulated-metal]"
NAN_METAL = ("tests/test_nan_semantics.py::test_non_finite_inputs_poison_their_heads_on_every_path"
             "[float16-emulated-metal]")
NAN = "tests/test_nan_semantics.py::"
VAR = "tests/test_variants.py::"
VAR_ORACLE = VAR + "test_variants_match_oracle"
VAR_NAN = VAR + "test_non_finite_rules_hold_with_variants"
STEP = "tests/test_step_table.py::"
COVER = "tests/test_emulated_coverage.py::"
STEADY = "tests/test_steady_step.py::"
UPLOAD = "tests/test_step_upload.py::"
MT = "tests/test_multitoken.py::"
TOKSTEP = "tests/test_engine_step_tokens.py::"
FP8 = "tests/test_fp8.py::"
FP8_ORACLE = FP8 + "test_fp8_decode_matches_oracle"
FP8_APPEND = FP8 + "test_append_quantizes_like_ml_dtypes"

MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------ v2 / v1, CUDA
    _m("cuda-acc-rounded-to-kv-type", "cuda", ("v2", "v1"),
       "acc[g][i] = fmaf(p, vf[i], acc[g][i]);",
       "acc[g][i] = to_float(from_float<TKV>(fmaf(p, vf[i], acc[g][i])));",
       [LONG + "[emulated-cuda-float16-v2]"],
       "the output accumulated in the K/V element type instead of float32"),
    _m("cuda-no-cp-async-wait", "cuda", ("v2", "v1"),
       "    cp_async_wait<STAGES - 1>();                 // this thread's copies of `step`",
       "    // (wait removed)", [CASE + "[emulated-cuda-d64-g1-ps16-f16]"],
       "a ring slot read before its cp.async group landed"),
    _m("cuda-wait-one-group-short", "cuda", ("v2", "v1"),
       "cp_async_wait<STAGES - 1>();", "cp_async_wait<STAGES>();",
       [CASE + "[emulated-cuda-d64-g1-ps16-f16]"],
       "wait_group leaves the group about to be read in flight"),
    _m("cuda-butterfly-half-width", "cuda", ("v2", "v1"),
       "const float x = group_sum<TPR>(s[g][u]);", "const float x = group_sum<TPR / 2>(s[g][u]);",
       [LANES + "[emulated-cuda-float16-d64-qh3]"],
       "per-head dot products summed over half a row (QH 3, 5, 6, 7)"),
    _m("cuda-transpose-keep-give", "cuda", ("v2", "v1"),
       "const float keep = up ? s[h + half][u] : s[h][u];",
       "const float keep = up ? s[h][u] : s[h + half][u];",
       [LANES + "[emulated-cuda-float16-d64-qh4]"],
       "a head transposition level keeps the half it should hand over"),
    _m("cuda-transpose-p-lane", "cuda", ("v2", "v1"),
       "if constexpr (TRANSPOSE) return __shfl_sync(0xffffffffu, s[0][u], sub0 + g * HLANES);",
       "if constexpr (TRANSPOSE) return __shfl_sync(0xffffffffu, s[0][u], sub0);",
       [LANES + "[emulated-cuda-float16-d64-qh4]"],
       "every head takes head 0's softmax weights"),
    _m("cuda-subwarp-combine-short", "cuda", ("v2", "v1"),
       "  for (int off = TPR; off < 32; off <<= 1) {",
       "  for (int off = TPR; off < 16; off <<= 1) {",
       [LANES + "[emulated-cuda-float16-d64-qh1]"],
       "the sub-warp states of a warp combined one level short"),
    _m("cuda-q-group-offset-dropped", "cuda", ("v2", "v1"),
       "const int h0 = kvh * (num_qo_heads / num_kv_heads) + qg * QH;",
       "const int h0 = kvh * (num_qo_heads / num_kv_heads);",
       [CASE + "[emulated-cuda-d64-g16-ps16-f16]"],
       "both CTAs of a KV head with more than 8 query heads serve the first 8"),
    _m("cuda-first-page-offset-dropped", "cuda", ("v2", "v1"),
       "const int a_begin = (int)(fpo + t_begin), n_tok",
       "const int a_begin = (int)t_begin, n_tok",
       [ORACLE + "test_one_page_requests[emulated-cuda]"],
       "tokens read from the page start of a request that starts mid-page"),
    _m("cuda-chunk-start-ignores-offset", "cuda", ("v2", "v1"),
       "long long t_begin = page_begin * PAGE_SIZE - fpo;",
       "long long t_begin = page_begin * PAGE_SIZE;",
       [CASE + "[emulated-cuda-d64-g1-ps16-f16]"],
       "chunks after the first shifted by the first page's offset"),
    _m("cuda-v1-kv-head", "cuda", ("v1",),
       "  const int kvh = h / (num_qo_heads / num_kv_heads);\n  const long long pb",
       "  const int kvh = h % num_kv_heads;\n  const long long pb",
       [CASE + "[emulated-cuda-d128-g4-ps16-bf16]"],
       "v1 maps query heads to KV heads round-robin instead of in groups"),
    _m("cuda-v1-last-token-dropped", "cuda", ("v1",),
       "fpo, 0, seq, r, kvh, h, num_qo_heads, num_kv_heads,",
       "fpo, 0, seq - 1, r, kvh, h, num_qo_heads, num_kv_heads,",
       [CASE + "[emulated-cuda-d64-g1-ps16-f16]"],
       "v1 stops one token early"),
    # ------------------------------------------------------------ v2 / v1, Metal
    # ------------------------------------------------------------ variants (#14)
    _m("cuda-soft-cap-in-natural-units", "cuda", ("v2", "v1"),
       "if constexpr (SOFT_CAP) x = cap * tanh_fast(x * (1.f / cap));",
       "if constexpr (SOFT_CAP) x = cap / PD_LOG2E * tanh_fast(x * (PD_LOG2E / cap));",
       [VAR_ORACLE + "[emulated-cuda-cap-v2-one]"],
       "the cap in natural units applied to scores already scaled by log2(e)"),
    _m("cuda-tanh-series-too-far", "cuda", ("v2", "v1"),
       "return a < 0.125f ? small : copysignf(big, y);",
       "return a < 2.f ? small : copysignf(big, y);",
       [VAR_ORACLE + "[emulated-cuda-cap-v2-one]"],
       "tanh's odd series used up to |y| = 2, where it is 0.5% off"),
    _m("cuda-tanh-sign-dropped", "cuda", ("v2", "v1"),
       "return a < 0.125f ? small : copysignf(big, y);", "return a < 0.125f ? small : big;",
       [VAR_ORACLE + "[emulated-cuda-cap-v2-one]"],
       "a capped negative score comes out positive"),
    _m("cuda-soft-cap-before-nonfinite", "cuda", ("v2", "v1"),
       "  x = finite_or_nan(x);\n  if constexpr (SOFT_CAP) x = cap * tanh_fast(x * (1.f / cap));\n"
       "  return x;",
       "  if constexpr (SOFT_CAP) x = cap * tanh_fast(x * (1.f / cap));\n"
       "  return finite_or_nan(x);",
       [VAR_NAN + "[emulated-cuda]"],
       "tanh turns an infinite score into a finite one before the poison check"),
    _m("cuda-sink-left-out-of-store", "cuda", ("v2", "v1"),
       "float num = 0.f, den = SINK ? exp2f(sk - ref) : 0.f;", "float num = 0.f, den = 0.f;",
       [VAR_ORACLE + "[emulated-cuda-sinks-v2-one]"],
       "the sink raises the max but never joins the denominator of a one-chunk request"),
    _m("cuda-merge-sink-left-out-of-lse", "cuda", ("merge",),
       "  if (SINK && mx > -PD_INF) den += exp2f(sk - mx);\n  const bool live = den > 0.f;",
       "  const bool live = den > 0.f;",
       [VAR_ORACLE + "[emulated-cuda-sinks-v2-split]"],
       "the merge of a split request leaves its sink out of the denominator and the LSE"),
    _m("metal-soft-cap-in-natural-units", "metal", ("v2", "v1"),
       "if (SOFT_CAP) x = cap * precise::tanh(x / cap);",
       "if (SOFT_CAP) x = cap / PD_LOG2E * precise::tanh(x / (cap / PD_LOG2E));",
       [VAR_ORACLE + "[emulated-metal-cap-v2-one]"],
       "the cap in natural units applied to scores already scaled by log2(e)"),
    _m("metal-sink-left-out-of-store", "metal", ("v2", "v1"),
       "float num = 0.0f, den = SINK ? exp2(sk - ref) : 0.0f;",
       "float num = 0.0f, den = 0.0f;",
       [VAR_ORACLE + "[emulated-metal-sinks-v1]"],
       "the sink raises the max but never joins the denominator (v1's store)"),
    _m("metal-merge-sink-left-out-of-lse", "metal", ("merge",),
       "  if (SINK && mx > -INFINITY) den += exp2(sk - mx);\n", "",
       [VAR_ORACLE + "[emulated-metal-sinks-v2-split]"],
       "the merge of a split request leaves its sink out of the denominator and the LSE"),
    _m("py-steady-slot-off-by-one", "python", ("paged_decode.append_lookahead",),
       "        lo = (lpl + steps[:k]) % P                      # the slot each append writes",
       "        lo = (lpl + steps[:k] - 1) % P",
       [STEADY + "test_steady_begins_equal_general_ones_through_outside_changes[reference]"],
       "a fresh page's first token goes to its last slot"),
    _m("py-steady-pages-out-of-order", "python", ("paged_decode.append_lookahead",),
       "        taken = pool._free[pool._nfree - m:pool._nfree][::-1].copy()",
       "        taken = pool._free[pool._nfree - m:pool._nfree].copy()",
       [STEADY + "test_steady_begins_equal_general_ones_through_outside_changes[reference]"],
       "fresh pages leave the free stack in another order than the general path's"),
    _m("py-steady-refcount-not-set", "python", ("paged_decode.append_lookahead",),
       "            pool._ref[taken] = 1\n", "",
       [STEADY + "test_steady_begins_equal_general_ones_through_outside_changes[reference]"],
       "a fresh page is handed out with refcount 0 (a later free would double-release it)"),
    _m("py-steady-ignores-the-pool-version", "python", ("paged_decode.steady_step",),
       "        if (pool._version != ahead.version or table.layout",
       "        if (False or table.layout",
       [STEADY + "test_steady_begins_equal_general_ones_through_outside_changes[reference]"],
       "a fork made outside the step is missed: the next token lands in a shared page"),
    _m("py-steady-keeps-the-new-pages", "python", ("paged_decode.steady_step",),
       "        delta[:, 5 * cap + 1:6 * cap + 1] = tp[:-1]",
       "        delta[:, 5 * cap + 1:6 * cap + 1] = tp[1:]",
       [STEADY + "test_steady_begins_equal_general_ones_through_outside_changes[emulated-cuda]"],
       "the device table keeps a fresh page's slot from the old table instead of the new id"),
    _m("py-steady-lookahead-past-the-free-stack", "python", ("paged_decode.append_lookahead",),
       "        k = int(np.searchsorted(total, min(pool._nfree, limit)",
       "        k = int(np.searchsorted(total, min(pool._nfree + 1, limit)",
       [STEADY + "test_exhaustion_falls_back_and_changes_nothing"],
       "the lookahead plans one page more than the free stack holds"),
    _m("py-steady-stale-last-page", "python", ("paged_decode.append_lookahead",),
       "            latest >= 0, got[np.maximum(latest, 0), np.arange(n)], last)])",
       "            latest > 0, got[np.maximum(latest, 0), np.arange(n)], last)])",
       [STEADY + "test_steady_begins_equal_general_ones_through_outside_changes[reference]"],
       "a page taken at the lookahead's first begin is forgotten: later tokens go to the old one"),
    _m("py-steady-room-spent-per-begin", "python", ("paged_decode.append_lookahead",),
       "            self.cols_left -= int((self.npg[k0] - self.npg[0]).max())",
       "            self.cols_left -= int(np.count_nonzero(self.new))",
       [STEADY + "test_a_long_steady_loop_takes_one_general_begin"],
       "the lookahead spends a page-list entry per begin, not per fresh page: the loop "
       "falls back to the general path every few dozen begins"),
    _m("py-steady-arms-on-a-shared-page", "python", ("paged_decode.append_lookahead",),
       "        if not (pool._ref[last] == 1).all():\n            return None\n", "",
       [STEADY + "test_arming_refuses_what_is_not_the_steady_case"],
       "the steady state is armed while a last page is shared (copy-on-write would be skipped)"),
    _m("py-paged-batch-stale-q", "python", ("paged_decode.integrations.paged_batch",),
       '        self._fill(fn, "q", qb, q)\n', "",
       ["tests/test_paged_batch.py::test_step_engine_decode_steps_match_the_plain_path_and_the_oracle"],
       "the engine step's decode reads its q buffer without this layer's queries"),
    _m("py-step-append-recorded-on-the-backend-view", "python", ("paged_decode.engine_step",),
       "compile_launches(run, like=k)", "compile_launches(run, like=kb)",
       ["tests/test_engine_step.py::test_recorded_launches_follow_the_caller_s_arrays_not_the_"
        "backend_s_views"],
       "the recorded append takes CuPy's stream, not the torch caller's (a torch graph "
       "misses it)"),
    _m("py-step-record-update-records-nothing", "python", ("paged_decode.engine_step",),
       "            self.table.record_update()\n", "            pass\n",
       ["tests/test_engine_step.py::test_a_step_in_the_caller_s_own_graph_replays_each_"
        "begin_s_update"],
       "a step in the caller's graph replays without its begin's table update"),
    _m("py-paged-batch-capture-without-the-update", "python",
       ("paged_decode.integrations.paged_batch",),
       "        e.record_update(like=self._buffers()[2])\n", "",
       ["tests/test_paged_batch.py::test_a_recorded_decode_forward_replays_each_begin_s_"
        "slots_and_table"],
       "a captured decode forward replays the capture step's table and slots"),
    _m("py-auto-fp8-by-the-16-bit-table", "python", ("paged_decode.call",),
       '    if kv_dtype is not None and is_fp8(kv_dtype) and "v2tc" in allowed:\n',
       '    if False:\n',
       ["tests/test_crossover.py::test_auto_takes_v2tc_over_fp8_pools_wherever_it_runs",
        "tests/test_engine_step.py::test_auto_takes_v2tc_for_an_fp8_pool"],
       "path='auto' over fp8 pools follows the 16-bit table to v2, 2-3x slower there"),
    _m("py-step-auto-chosen-once", "python", ("paged_decode.engine_step",),
       '        if self.requested_path == "auto":\n            self.path, self.path_reason',
       '        if self.requested_path == "auto" and hint is None:\n'
       '            self.path, self.path_reason',
       ["tests/test_engine_step.py::test_auto_takes_the_crossover_table_s_path_and_chooses_"
        "again_at_each_replan"],
       "a step on path='auto' keeps its first choice through replans"),
    _m("py-step-auto-ignores-support", "python", ("paged_decode.call",),
       "    return tuple(p for p in LAUNCH_PATHS if be.supports(Problem(",
       "    return tuple(p for p in LAUNCH_PATHS if True or be.supports(Problem(",
       ["tests/test_engine_step.py::test_auto_runs_only_what_the_backend_supports"],
       "a step on path='auto' takes a path its backend cannot run"),
    _m("py-table-view-skips-the-pending-update", "python", ("paged_decode.step_table",),
       "        if self.pending:\n            self.flush()\n",
       "        if self._dirty:\n            self.flush()\n",
       [UPLOAD + "test_the_pending_update_is_applied_before_every_reader[reference-page_table]",
        UPLOAD + "test_the_pending_update_is_applied_before_every_reader"
                 "[emulated-cuda-device_arrays]"],
       "the table's readers (page_table, device_arrays) only follow host changes: a sent "
       "delta is never applied for them"),
    _m("py-captured-step-without-the-update", "python", ("paged_decode.engine_step",),
       "                run, table.record_update if table.upload.staged else None)",
       "                run, None)",
       [UPLOAD + "test_a_captured_replay_equals_the_eager_step_and_the_oracle[emulated-cuda]"],
       "the graph leaves out the table update: every replay decodes the capture's table"),
    _m("py-moving-delta-applied-twice", "python", ("paged_decode.step_table",),
       "        if not self._staged_idem and self.upload.staged:",
       "        if False:",
       [UPLOAD + "test_a_replay_after_an_eager_read_of_a_moving_delta"],
       "a trim's delta, applied by a reader and then again by the graph, trims twice"),
    _m("py-pinned-buffer-rewritten-while-read", "python",
       ("paged_decode.backends.cuda_staging",),
       "            done.synchronize()            # the last copy from this buffer has read it",
       "            pass",
       [UPLOAD + "test_pinned_buffers_are_not_rewritten_before_their_copy_ran"],
       "the host rewrites a pinned buffer an earlier asynchronous copy has not read yet"),
    _m("py-plan-tokens-left-off-by-one", "python", ("paged_decode.plan",),
       "        room += np.where(pages > 0, P - np.asarray(table.last_page_len, np.int64), 0)",
       "        room += np.where(pages > 0, P + 1 - np.asarray(table.last_page_len, np.int64), 0)",
       ["tests/test_engine_step.py::test_the_plan_serves_the_table_after_every_begin"],
       "the step skips one plan check too many: a request outgrows its chunks unchecked"),
    _m("py-plan-chunks-left-uneven", "python", ("paged_decode.plan",),
       "    return min(ppc, max(lower, even + even // BALANCE_SLACK))",
       "    return ppc",
       ["tests/test_plan.py::test_balanced_chunks_of_a_batch_of_17",
        "tests/test_plan.py::test_balanced_chunks_keep_the_counts_and_shorten_the_longest_chunk"],
       "the searched size is kept: a request split into a full chunk and a sliver"),
    _m("py-plan-even-chunk-one-page-short", "python", ("paged_decode.plan",),
       "    even = int((-(-p // counts)).max())",
       "    even = int((-(-p // counts)).max()) - 1",
       ["tests/test_plan.py::test_balanced_chunks_keep_the_counts_and_shorten_the_longest_chunk"],
       "the even size one page too small: some request gets one chunk more than planned"),
    _m("py-plan-even-chunks-below-the-floor", "python", ("paged_decode.plan",),
       "    return min(ppc, max(lower, even + even // BALANCE_SLACK))",
       "    return min(ppc, even + even // BALANCE_SLACK)",
       ["tests/test_plan.py::test_balancing_keeps_the_chunk_floor"],
       "balancing cuts chunks shorter than the device's chunk floor"),
    _m("py-waves-busiest-sm-rounds-down", "python", ("paged_decode.waves",),
       "    k = -(-rest // units)                         # CTAs on the busiest SM of the tail",
       "    k = rest // units + 0 * units",
       ["tests/test_waves.py::test_the_model_picks_near_the_fastest_measured_chunking"],
       "the wave model counts the busiest SM's CTAs rounded down: uneven grids look even"),
    _m("py-waves-ties-ignore-the-target-rule", "python", ("paged_decode.waves",),
       "    if prefer is not None and bool(tied[sizes == prefer].any()):",
       "    if False:",
       ["tests/test_waves.py::test_ties_keep_the_target_rules_plan[32-2-6-3000-64]"],
       "a tie drops the target rule's size: 192-token chunks (a third stage) at GQA 16 6 x 3K"),
    _m("py-waves-ties-take-the-fewest-ctas", "python", ("paged_decode.waves",),
       "    within = tied & (ctas <= fill)",
       "    within = tied & (ctas < 0)",
       ["tests/test_waves.py::test_one_wave_ties_take_the_most_ctas_within_the_target"
        "[gqa16-8x8K]"],
       "one-wave ties take the fewest CTAs: 224 where 256 was 5% faster (S37-R6, H100)"),
    _m("py-v2tc-plans-without-slots", "python", ("paged_decode.specs",),
       '            "slots_per_unit": v2tc_slots_per_unit(head_dim, kv, device) if waves else 0}',
       '            "slots_per_unit": 0}',
       ["tests/test_waves.py::test_plan_decode_for_v2tc_fills_the_waves[12-16384-384]"],
       "plans for the tensor-core partial keep the CTA-target rule (288 CTAs at 12 x 16K)"),
    _m("py-v2tc-slots-without-register-cap", "python", ("paged_decode.specs",),
       "    return max(1, min(by_smem, decode_v2_tc.register_ctas(head_dim, warps)))",
       "    return max(1, by_smem)",
       ["tests/test_waves.py::test_slots_follow_the_rings_shared_memory"],
       "the wave rule counts 6 CTAs per SM at head_dim 64, where the registers allow 5"),
    _m("py-row-prefetch-ignores-the-row", "python", ("paged_decode.specs",),
       "    return next((b for b in (128, 64) if b <= L2_PREFETCH and row % b == 0), 0)",
       "    return L2_PREFETCH",
       ["tests/test_cuda_compile.py::test_the_row_rule_hints_no_neighbouring_heads_bytes"],
       "PAGED_DECODE_L2_PREFETCH=rows hints 128 bytes over 192-byte rows (head_dim 96), "
       "fetching a third of a neighbouring head's row"),
    _m("py-waves-override-a-ragged-split", "python", ("paged_decode.plan",),
       "        by_waves = by_waves and ppc == searched",
       "        by_waves = by_waves",
       ["tests/test_waves.py::test_a_ragged_split_keeps_the_target_rules_plan"],
       "the wave rule replaces the ragged rule's split (one chunk per request, 2.5% slower)"),
    _m("py-auto-plans-for-v2", "python", ("paged_decode.call",),
       "            plan = resolve_plan(fn, be, a, None, chosen)",
       "            plan = resolve_plan(fn, be, a, None)",
       ["tests/test_crossover.py::test_auto_without_a_plan_plans_for_the_path_it_takes"],
       "path='auto' plans for v2's CTAs and runs v2tc on that plan: half its CTAs at GQA 16"),
    _m("py-multitoken-auto-plans-for-v2", "python", ("paged_decode.multitoken_call",),
       "                         **plan_geometry(chosen, a.hq, a.hkv, a.d, a.kv_dt, device,",
       "                         **plan_geometry(path, a.hq, a.hkv, a.d, a.kv_dt, device,",
       ["tests/test_crossover.py::test_multitoken_auto_without_a_plan_plans_for_the_path_it_takes"],
       "a multi-token path='auto' call plans for v2's CTAs and runs v2tc on that plan"),
    _m("py-crossover-no-borrowed-table", "python", ("paged_decode.crossover",),
       "              + _candidates_by_arch(arch, str(SHIPPED))):",
       "              + ()):",
       ["tests/test_crossover.py::test_a_device_without_a_table_borrows_its_architectures"],
       "an H800 with no table of its own runs v2 at GQA 7-16, where v2tc took 0.31-0.63x "
       "of v2's time in the H200's cells"),
    _m("py-crossover-no-shipped-device-table", "python", ("paged_decode.crossover",),
       '                                       os.path.join(shipped, f"{slug}.json"))',
       "                                       )",
       ["tests/test_crossover.py::test_the_h100_reads_its_own_shipped_table"],
       "a device's own shipped table is skipped: the H100 borrows the H200's, which sends "
       "GQA 16 1 x 1K to v2 (1.30x v2tc's time there, S36-R4)"),
    _m("py-crossover-borrowed-table-unflagged", "python", ("paged_decode.crossover",),
       "    return device_slug(table.device) != device_slug(device_name)",
       "    return False",
       ["tests/test_crossover.py::test_auto_on_a_borrowed_table_says_where_it_was_measured"],
       "a choice from a table measured on another GPU is reported as if measured here"),
    _m("py-step-table-append-marks-the-first-rows", "python", ("paged_decode.step_table",),
       "            t, fc = self._live_rows[0], first_changed   # (a freed row leaves a hole)",
       "            t, fc = np.arange(ids.size), first_changed",
       ["tests/test_engine_model.py::test_step_follows_the_pool_through_random_engine_events"
        "[reference-0]"],
       "after a freed middle row, a begin's new page ids go to the wrong rows of the delta"),
    _m("py-prepared-call-ignores-its-step-table", "python", ("paged_decode.prepared",),
       "        if f is not None and f.behind():", "        if False:",
       ["tests/test_prepared_follow.py::test_a_prepared_call_over_a_step_table_follows_the_"
        "pool[emulated-cuda]"],
       "a prepared call over a step table launches on the table and plan it was made for"),
    _m("py-fast-path-keys-without-types", "python", ("paged_decode.decode",),
       "    return type(x), x\n", "    return 0, x\n",
       ["tests/test_prepared_follow.py::test_the_fast_path_refuses_what_the_checks_refuse"],
       "decode's cache takes window_left=True after window_left=1 (the checks refuse it)"),
    _m("py-layouts-ignore-moved-data", "python", ("paged_decode.prepared",),
       "            strides, ptr = x.stride(), x.data_ptr()",
       "            strides, ptr = x.stride(), None",
       ["tests/test_prepared_follow.py::test_the_fast_path_follows_a_torch_tensor_whose_data_"
        "moved[emulated-cuda]"],
       "decode's cache replays on a torch tensor's old storage after set_"),
    _m("py-cascade-keyed-on-the-layout", "python", ("paged_decode.decode",),
       "                              and not isinstance(cascade, CascadeDecodePlan)\n", "",
       ["tests/test_prepared_follow.py::test_decode_does_not_replay_a_cascade_of_an_older_"
        "table[emulated-cuda]"],
       "decode's cache replays a cascade whose level tables are of an older step table"),
    _m("py-sparse-masked-counts-a-duplicate-once", "python", ("paged_decode.sparse",),
       "        if times.max(initial=0) > 1 else None", "        if False else None",
       ["tests/test_sparse.py::test_a_duplicate_counts_as_often_as_it_is_selected[1000000000.0]"],
       "the dense masked path weighs a position selected c times once"),
    _m("py-fp8-append-narrows-v-to-k", "python", ("paged_decode.backends.launching",),
       "            if self.dtype_of(like) != self.dtype_of(self.asarray(v_rows)):",
       "            if False:",
       ["tests/test_fp8.py::test_k_and_v_rows_of_different_dtypes_are_each_quantized_from_"
        "their_own[emulated-cuda-float8_e4m3fn]"],
       "a quantizing append casts float32 V rows to K's float16 first (inf, double rounding)"),
    _m("py-table-lets-a-request-wrap-the-entry-index", "python", ("paged_decode.page_table",),
       "            (has & (ends > MAX_ENTRIES), lambda r: (",
       "            (has & (ends > 2**40), lambda r: (",
       ["tests/test_page_table.py::test_a_request_past_the_kernels_32_bit_entry_index_is_"
        "refused"],
       "a request past 2^31 entries reaches the kernels, whose int entry index wraps"),
    _m("py-fi-graph-drops-v-scale", "python", ("paged_decode.compat.fi_decode",),
       "                   v_scale=v_scale)",
       "                   v_scale=1.0)",
       ["tests/test_fi_fp8.py::test_q_and_k_scales_multiply_the_softmax_scale_and_v_scale_"
        "the_output"],
       "the FlashInfer shim's graph mode ignores run's v_scale"),
    _m("py-fi-16-bit-cache-drops-k-scale", "python", ("paged_decode.compat.fi_decode",),
       "            scale = st[\"scale\"] * q_scale * (1.0 if fp8 else k_scale)",
       "            scale = st[\"scale\"] * q_scale",
       ["tests/test_fi_fp8.py::test_q_and_k_scales_multiply_the_softmax_scale_and_v_scale_"
        "the_output"],
       "the FlashInfer shim ignores k_scale over a 16-bit cache (FlashInfer applies it)"),
    _m("py-fi-fp8-scales-swapped", "python", ("paged_decode.compat.fi_decode",),
       "\"k_scale\": k_scale, \"v_scale\": v_scale} if fp8",
       "\"k_scale\": v_scale, \"v_scale\": k_scale} if fp8",
       ["tests/test_fi_fp8.py::test_fp8_caches_match_the_oracle_on_the_dequantized_values"],
       "the FlashInfer shim passes an fp8 cache's K scale as its V scale and back"),
    _m("py-sink-counted-per-partial", "python", ("paged_decode.variants",),
       "        if final and self.sinks is not None:", "        if self.sinks is not None:",
       [VAR_ORACLE + "[reference-sinks-v2-split]"],
       "every merged partial takes the sink, so a split request counts it once per chunk"),
    _m("py-window-off-by-one", "python", ("paged_decode.variants",),
       "    return np.maximum(0, vis - 1 - int(window_left))",
       "    return np.maximum(0, vis - int(window_left))",
       [VAR_ORACLE + "[emulated-cuda-w5-v2-split]"],
       "the window keeps W tokens instead of W + 1"),
    # ------------------------------------------------------------ the split merge (#17)
    _m("cuda-split-merge-drops-last-warp", "cuda", ("merge",),
       "    for (int p = 0; p < SPLIT; ++p) {\n      den += red->den[p];",
       "    for (int p = 0; p < SPLIT - 1; ++p) {\n      den += red->den[p];",
       [SPLIT_MERGE + "[4-128-True-False]"],
       "the combine of a split merge leaves out the last warp's share of the partials"),
    _m("cuda-split-merge-own-warp-max", "cuda", ("merge",),
       "mx = fmaxf(mx, red->mx[p]); bad", "bad",
       [SPLIT_MERGE + "[2-64-False-False]"],
       "each warp of a split merge weighs its partials by its own max, not the group's"),
    _m("cuda-split-merge-no-barrier-before-combine", "cuda", ("merge",),
       "    if (lane == 0) red->den[part] = den;\n    __syncthreads();\n",
       "    if (lane == 0) red->den[part] = den;\n",
       [SPLIT_MERGE + "[8-128-False-True]"],
       "warp 0 adds the other warps' sums before they are stored"),
    _m("cuda-split-merge-every-run", "cuda", ("merge",),
       "base += (long long)run * SPLIT) {\n      const long long i = base + lane;\n      float w",
       "base += (long long)run) {\n      const long long i = base + lane;\n      float w",
       [SPLIT_MERGE + "[8-256-True-True]"],
       "every warp of a split merge weighs every run from its first on, counting rows of "
       "other warps again"),
    _m("cuda-merge-acc-one-past", "cuda", ("merge",),
       "float4 acc[PER_LANE];\n#pragma unroll\n  for (int j = 0; j < PER_LANE; ++j)",
       "float4 acc[PER_LANE];\n#pragma unroll\n  for (int j = 0; j <= PER_LANE; ++j)",
       [SPLIT_MERGE + "[4-128-True-False]"],
       "the merge zeroes one float4 accumulator past its local array (on a GPU over "
       "whatever local memory follows; g++'s bounds checks take the store through the "
       "struct's assignment for an address one past the end, its object-size checks do not)"),
    _m("cuda-merge-uses-unweighted-first-rows", "cuda", ("merge",),
       "          if (wu[u] > 0.f) {                                 // warp-uniform",
       "          {", [MERGE_KERNEL_NAN],
       "the rows read before their weights are known are added even at weight 0, so an "
       "empty chunk's NaN row poisons its group"),
    _m("cuda-merge-first-run-lse-reused", "cuda", ("merge",),
       "        if (base != base0) {",
       "        if (false) {",
       [SPLIT_MERGE + "[4-128-True-False]", MERGE],
       "pass 2 weighs every run of a warp by the LSEs pass 1 kept for its first run"),
    # ------------------------------------------------------------ grid order (v2, v2tc)
    _m("cuda-heads-first-numbers-by-chunks", "cuda", ("v2", "v2tc"),
       "const unsigned chunk = (unsigned)(l / gridDim.y), slot = (unsigned)(l % gridDim.y);",
       "const unsigned chunk = (unsigned)(l / gridDim.x), slot = (unsigned)(l % gridDim.x);",
       [V2TC + "test_v2tc_matches_oracle[d96-g4-ps16-f16]",
        LANES + "[emulated-cuda-float16-d96-qh1]"],
       "heads-first numbering divides by the chunk count instead of the head slots' "
       "(each CTA gets another's chunk and head, some past the grid)"),
    _m("py-heads-first-never", "python", ("paged_decode.specs",),
       "    return hint > 0 and (row % hint != 0 or (spec.kv_dtype in FORMATS and row <= hint))",
       "    return False",
       ["tests/test_cuda_compile.py::test_heads_first_where_the_prefetch_runs_past_a_row"],
       "head_dim 96 numbers its CTAs chunks first, so the 128-byte prefetch's bytes past a "
       "row are evicted before the neighbouring head's CTA runs (Phi-3-mini 64 x 8K: v2tc "
       "2553 against 2188 us, S33-R4)"),
    _m("py-heads-first-not-for-fp8-rows", "python", ("paged_decode.specs",),
       "    return hint > 0 and (row % hint != 0 or (spec.kv_dtype in FORMATS and row <= hint))",
       "    return hint > 0 and row % hint != 0",
       ["tests/test_cuda_compile.py::test_heads_first_where_the_prefetch_runs_past_a_row"],
       "fp8 head_dim 128 numbers its CTAs chunks first again (Llama-3-8B 32 x 32K over "
       "e4m3fn: v2tc 747 against 713 us, S34-R1)"),
    _m("py-heads-first-not-compiled-in", "python", ("paged_decode.specs",),
       "    order = (\"-DPD_HEADS_FIRST=1\",) if spec is not None and heads_first(spec, prefetch) "
       "else ()",
       "    order = ()",
       ["tests/test_cuda_compile.py::test_heads_first_where_the_prefetch_runs_past_a_row",
        "tests/test_emulated_kernels.py::test_the_emulator_compiles_the_gpus_defines"],
       "the rule is computed but the kernels compile without PD_HEADS_FIRST"),
    _m("py-suite-model-ignored", "python", ("paged_decode.bench.suites",),
       "        cases = [with_model(c, model) for c in cases]",
       "        pass",
       ["tests/test_cli.py::test_the_cascade_and_forks_suites_take_a_models_layouts_heads"],
       "bench --suite forks --model phi3-mini times Llama-3-8B's heads under Phi-3's name"),
    _m("py-row-hint-v2-short-chunks", "python", ("paged_decode.specs",),
       "                                        and chunk_tokens >= ROW_HINT_TOKENS)",
       "                                        )",
       ["tests/test_cuda_compile.py::test_the_row_hint_where_a_plan_streams_long_past_a_16_"
        "bit_row"],
       "the v2 partial hints 64 bytes from 512 CTAs of any length: Phi-3-mini 16 x 4K's v2 "
       "takes 286.6 against 281.3 us (S34-R5)"),
    _m("py-row-hint-v2tc-at-16k", "python", ("paged_decode.specs",),
       "        return chunk_tokens >= ROW_HINT_TC_TOKENS or (",
       "        return chunk_tokens >= ROW_HINT_TOKENS or (",
       ["tests/test_cuda_compile.py::test_the_row_hint_where_a_plan_streams_long_past_a_16_"
        "bit_row"],
       "the tensor-core partial hints 64 bytes from 16K-token chunks of any grid (S34-R8, "
       "before the swizzled 192-byte rows: Phi-3-mini 16 x 16K's v2tc took 1366.8 against "
       "1339.6 us)"),
    _m("py-row-hint-v2tc-short-chunks", "python", ("paged_decode.specs",),
       "            many and chunk_tokens >= ROW_HINT_TC_MIN_TOKENS)",
       "            many)",
       ["tests/test_cuda_compile.py::test_the_row_hint_where_a_plan_streams_long_past_a_16_"
        "bit_row"],
       "the tensor-core partial hints 64 bytes from 1024 CTAs of 4K-token chunks: Phi-3-mini "
       "64 x 4K's v2tc takes 1171.7 against 1140.5 us (S35-R8)"),
    _m("py-row-hint-not-compiled-in", "python", ("paged_decode.specs",),
       "        return row_l2_prefetch(spec) if spec is not None and spec.row_hint else "
       "L2_PREFETCH",
       "        return L2_PREFETCH",
       ["tests/test_cuda_compile.py::test_the_row_hint_where_a_plan_streams_long_past_a_16_"
        "bit_row",
        "tests/test_v2tc.py::test_both_flat_partials_match_the_oracle_under_the_row_hint[v2]"],
       "the launches pick the row-hint specialization, but it compiles with 128 bytes and "
       "head slots first (Phi-3-mini 64 x 32K: v2 11297 against 9340 us, S34-R3)"),
    _m("py-pdl-packed-default-off", "python", ("paged_decode.backends.cuda_pdl",),
       "    return env_flag(PDL_ENV, default=packed)",
       "    return env_flag(PDL_ENV, default=False)",
       ["tests/test_pdl.py::test_enabled_by_default_for_packed_launches_only_on_sm90_with_"
        "the_driver_entry"],
       "prepared calls and the engine step launch the merge plainly again (Qwen2-7B's captured "
       "step at 8 x 1K: 538 against 500 us, S34-R2)"),
    # ------------------------------------------------------------ v2tc's fused merge (#17)
    _m("v2tc-fused-merge-one-cta-early", "cuda", ("v2tc",),
       "      sm_last = done == parts;", "      sm_last = done == parts - 1;",
       [FUSED + "test_fused_equals_two_launches_and_the_oracle[g4-d96-ps16]"],
       "the next-to-last CTA of a request merges, before the last partial is written"),
    _m("v2tc-fused-merge-no-release-fence", "cuda", ("v2tc",),
       "    __shared__ int sm_last;\n    __threadfence();\n",
       "    __shared__ int sm_last;\n",
       [FUSED + "test_fused_equals_two_launches_and_the_oracle[g4-d96-ps16]"],
       "the count published before the partial rows are ordered: on a GPU the merging CTA "
       "can read another's rows stale, rarely (the emulator checks the release instead)"),
    _m("v2tc-fused-merge-no-acquire-fence", "cuda", ("v2tc",),
       "    __threadfence();                 // then read the other CTAs' rows, through L2\n",
       "", [FUSED + "test_fused_equals_two_launches_and_the_oracle[g4-d96-ps16]"],
       "the merging CTA reads the others' rows with no fence after the count that told it "
       "they are published: on a GPU it can read them stale, rarely (the emulator checks "
       "the acquire at each __ldcg)"),
    _m("v2tc-fused-counter-not-reset", "cuda", ("v2tc",),
       "      if (done == parts) merge_counters[slot] = 0;   // all of the slot counted\n",
       "", [FUSED + "test_counters_are_left_zero_for_the_next_call"],
       "the counters keep their count, so the next launch (a graph replay) merges early"),
    _m("v2tc-cluster-merge-no-first-barrier", "cuda", ("v2tc",),
       "  cluster_sync();                                   // every CTA's rows are in place\n",
       "", [CLUSTER + "test_cluster_merge_equals_the_other_merges_and_the_oracle[g4-d64-k2]"],
       "the cluster merge reads its peers' rows before they are written (on a GPU: a race "
       "its outcome hides most of the time)"),
    _m("v2tc-cluster-merge-no-last-barrier", "cuda", ("v2tc",),
       "  cluster_sync();                                   // no CTA leaves while read\n",
       "", [CLUSTER + "test_cluster_merge_equals_the_other_merges_and_the_oracle[g4-d64-k2]"],
       "a CTA leaves while a peer still reads its shared memory (undefined on a GPU)"),
    _m("v2tc-cluster-merge-lse-of-the-next-peer", "cuda", ("v2tc",),
       "      s[k] = *cluster_map(lse + i, (unsigned)k);",
       "      s[k] = *cluster_map(lse + i, (unsigned)((k + 1) % K));",
       [CLUSTER + "test_cluster_merge_equals_the_other_merges_and_the_oracle[g4-d64-k3-offsets]"],
       "each partial row weighed by the next partial's LSE"),
    _m("v2tc-cluster-merge-nan-partial-unpoisoned", "cuda", ("v2tc",),
       "      bad = s[k] < PD_INF ? bad : 1.f;\n", "",
       [CLUSTER + "test_non_finite_and_empty_partials[nan-k]"],
       "a partial with a NaN LSE weighs nothing instead of poisoning its head (a NaN score "
       "hidden as a zero output)"),
    _m("v2tc-cluster-merge-sink-left-out", "cuda", ("v2tc",),
       "    const float sk = SINK ? sinks[h] * PD_LOG2E : -PD_INF;\n    if (SINK) {\n"
       "      mx = fmaxf(mx, sk);\n      bad = sk < PD_INF ? bad : 1.f;\n    }\n"
       "    constexpr int P = next_pow2(K);",
       "    const float sk = -PD_INF;\n    constexpr int P = next_pow2(K);",
       [CLUSTER + "test_cluster_merge_equals_the_other_merges_and_the_oracle[g4-sinks-softcap-k4]"],
       "the cluster merge leaves the sinks out (the partials never hold them)"),
    _m("v2tc-cluster-heads-first-slot-of-the-cta", "cuda", ("v2tc",),
       "  const unsigned slot = (unsigned)(cl % gridDim.y);",
       "  const unsigned slot = (unsigned)(l % gridDim.y);",
       [CLUSTER + "test_both_grid_orders[heads]"],
       "heads first numbers CTAs, not clusters, head slots first: a cluster's CTAs are "
       "different heads' chunks"),
    _m("py-cluster-merge-takes-uneven-plans", "python", ("paged_decode.plan",),
       "        return k if bool((counts == k).all()) else 0",
       "        return k",
       [CLUSTER + "test_plans_a_cluster_cannot_take"],
       "a plan whose requests have different chunk counts takes clusters of the first's"),
    _m("py-cluster-rule-chunk-bound-exclusive", "python", ("paged_decode.backends.launches",),
       "plan.pages_per_chunk * plan.page_size <= CLUSTER_MERGE_MAX_CHUNK_TOKENS",
       "plan.pages_per_chunk * plan.page_size < CLUSTER_MERGE_MAX_CHUNK_TOKENS",
       [CLUSTER + "test_where_clusters_are_the_default"],
       "chunks of exactly the measured bound lose their clusters"),
    _m("py-cluster-rule-two-chunks-at-any-batch", "python", ("paged_decode.backends.launches",),
       "(k == 2 and plan.batch_size >= CLUSTER_MERGE_TWO_CHUNK_BATCH)", "(k == 2)",
       [CLUSTER + "test_where_clusters_are_the_default"],
       "two long chunks take clusters at small batches, where they were not measured"),
    _m("py-cluster-rule-over-fp8-pools", "python", ("paged_decode.backends.launches",),
       "    if not k or kv_dtype in V2TC_FP8 or plan.head_dim != 128:",
       "    if not k or plan.head_dim != 128:",
       [CLUSTER + "test_where_clusters_are_the_default"],
       "fp8 pools take clusters by default, where they measured slower"),
    _m("v2tc-cluster-merge-skips-every-other-pass", "cuda", ("v2tc",),
       "e < rows * NV4; e += K * THREADS) {", "e < rows * NV4; e += 2 * K * THREADS) {",
       [CLUSTER + "test_cluster_merge_equals_the_other_merges_and_the_oracle"],
       "where a cluster's threads merge more than one float4 column each (16 rows at head_dim "
       "128 over 2 CTAs), every other pass is skipped, leaving those columns unwritten"),
    _m("v2tc-cluster-merge-stride-by-rank", "cuda", ("v2tc",),
       "e < rows * NV4; e += K * THREADS) {", "e < rows * NV4; e += me * THREADS) {",
       [CLUSTER + "test_cluster_merge_equals_the_other_merges_and_the_oracle"],
       "the merge loop strides by the CTA's rank instead of the cluster's size: rank 0 "
       "never leaves it, a hang on a GPU (the emulator's watchdog stops it; the runner "
       "gives each test process a 10 s limit per launch)"),
    _m("v2tc-cluster-merge-first-weight-uninitialized", "cuda", ("v2tc",),
       "    for (int k = 0; k < P; ++k) w[k] = 0.f;",
       "    for (int k = 1; k < P; ++k) w[k] = 0.f;",
       [CLUSTER + "test_non_finite_and_empty_partials"],
       "the first partial's weight is left uninitialized, read where that partial is empty "
       "(a GPU's leftover register; the emulator's locals start as a non-zero pattern)"),
    _m("py-fused-merge-ignores-clusters", "python", ("paged_decode.backends.launching",),
       "        if forced or k or launches.fused_merge_pays(",
       "        if forced or launches.fused_merge_pays(",
       [CLUSTER + "test_by_default_a_cluster_merge_fuses_at_any_gqa[gqa16]"],
       "the fused-merge default ignores clusters: at GQA 7-16 a plan the cluster merge "
       "takes runs two launches (0.7-2.4 us slower at GQA 8 / 16, S46-R1)"),
    _m("py-compile-ahead-no-clusters", "python", ("paged_decode.specs",),
       "for h in hints for k in ((0, *CLUSTER_SIZES) if clusters else (0,))]",
       "for h in hints for k in (0,)]",
       [AHEAD + "test_every_decode_launch_is_listed[32-8x128-p16-float16]"],
       "compile_ahead leaves out the cluster merge's specializations: a serving loop "
       "compiles one at the first plan whose requests all have 2-8 chunks"),
    _m("py-compile-ahead-no-merge-splits", "python", ("paged_decode.specs",),
       "for s in (merge.SPLITS if merge_splits else (1,))",
       "for s in (1,)",
       [AHEAD + "test_every_decode_launch_is_listed[32-8x128-p16-float16]"],
       "compile_ahead leaves out the split merges, which a batch-1 call over many chunks "
       "takes"),
    _m("py-compile-ahead-partials-with-sinks", "python", ("paged_decode.specs",),
       'ends = (("float32", False), (out_dtype, sinks))',
       'ends = (("float32", sinks), (out_dtype, sinks))',
       [AHEAD + "test_every_decode_launch_is_listed[32-2x96-p16-bfloat16]"],
       "compile_ahead lists the float32 partials with the sink, which they never hold: a "
       "split call with sinks compiles its partial at first use"),
    _m("py-trim-back-keeps-every-page", "python", ("paged_decode.pool",),
       "keep = np.where(empty, 0, -(-filled // p))",
       "keep = npg = S.npages[rows]",
       [TOKSTEP + "test_trim_back_releases_pages_and_keeps_positions"],
       "trim_back leaves the emptied pages in the sequence: the next append writes past them "
       "and a decode attends to the retired tokens"),
    _m("py-trim-back-frees-shared-pages", "python", ("paged_decode.pool",),
       "            self._release(pages, distinct=False)     # forks may drop the same page",
       "            self._release(pages)     # forks may drop the same page",
       [TOKSTEP + "test_trim_back_of_forks_sharing_pages"],
       "two forks retiring the same shared page in one batch drop one reference, not two: "
       "the page is never freed (a leak) or, mirrored, freed under a live holder"),
    _m("py-step-table-ignores-trim-back", "python", ("paged_decode.step_table",),
       "        if self._find(ids)[1].any():\n            self._dirty = True",
       "        return",
       [TOKSTEP + "test_step_tables_follow_trim_back"],
       "a device step table keeps the lengths from before a trim_back: the kernels attend to "
       "the rejected drafts"),
    _m("py-step-tokens-padding-not-filled", "python", ("paged_decode.engine_step",),
       "where = np.full(self.capacity, rows.size, np.int32)     # padding: the fill row",
       "where = np.zeros(self.capacity, np.int32)",
       [TOKSTEP + "test_token_steps_match_the_oracle[v2-emulated-cuda]"],
       "a multi-token step's padding rows take the first live row's output instead of zeros"),
    _m("py-step-replays-over-a-token-begin", "python", ("paged_decode.engine_step",),
       "        s._current(fn)\n        if s._tokens > 1:\n"
       "            raise s._one_slot_only(fn)\n",
       "        s._current(fn)\n",
       [TOKSTEP + "test_a_captured_one_token_step_is_not_replayed_over_a_token_begin"
        "[emulated-cuda]"],
       "a captured one-token step replays after begin(tokens=T): it writes one of the T "
       "slots per sequence, and the others are attended to unwritten"),
    _m("py-compile-ahead-multitoken-one-fold", "python", ("paged_decode.compile_ahead",),
       "for fold in range(1, query_tokens + 1):",
       "for fold in (1,):",
       [AHEAD + "test_multitoken_launches_are_listed[32-8x128-float16]"],
       "compile_ahead lists a multi-token decode's passes at the model's group only: the "
       "common pass folds T tokens into the group, a wider CTA that compiles at first use"),
    _m("py-compile-ahead-cascade-one-width", "python", ("paged_decode.compile_ahead",),
       "for m in range(1, 841):            # 840 = lcm(1..8): every width there is",
       "for m in (1,):",
       [AHEAD + "test_cascade_launches_are_listed[28-4x64-float8_e4m3fn]"],
       "compile_ahead lists cascade's level 0 at one member's width: stacked members widen "
       "the v2 partial's CTA, and the first cascade of 2+ members compiles it"),
    _m("py-compile-ahead-sparse-sinks-in-out-dtype", "python", ("paged_decode.compile_ahead",),
       'specs += decode_specs(q, kv, "float32" if with_sinks else out,',
       "specs += decode_specs(q, kv, out,",
       [AHEAD + "test_sparse_launches_are_listed[28-4x64-float8_e4m3fn]"],
       "compile_ahead lists sparse decode's partials in the output dtype where sinks keep "
       "them in float32 until they join"),
    _m("py-emulator-never-asserts-no-compile", "python", ("paged_decode.backends.emulated",),
       "        assert_compile_allowed(spec)\n        kernel_library(",
       "        kernel_library(",
       [AHEAD + "test_compiled_ahead_nothing_compiles_later"],
       "the emulated backend compiles under PAGED_DECODE_ASSERT_NO_COMPILE without a word, "
       "so the CPU tests could not see a kernel compile_ahead missed"),
    _m("py-cluster-rule-wide-past-the-target", "python", ("paged_decode.backends.launches",),
       "k > CLUSTER_MERGE_WIDE_ABOVE and plan.num_ctas > plan.target_ctas",
       "k > CLUSTER_MERGE_WIDE_ABOVE and plan.num_ctas > 2 * plan.target_ctas",
       [CLUSTER + "test_wide_clusters_only_within_the_cta_target"],
       "clusters of 6-8 CTAs on grids past the CTA target, where they measured slower"),
    _m("v2tc-fused-merge-drops-sinks", "cuda", ("v2tc",),
       "merge_group<TF, D, false, SINK, true, 1, MERGE_ROWS>(",
       "merge_group<TF, D, false, false, true, 1, MERGE_ROWS>(",
       [FUSED + "test_fused_with_variants[sinks]"],
       "the fused merge leaves the sinks out, as the partial does for merged partials"),
    _m("v2tc-fused-merge-8-rows-at-once", "cuda", ("v2tc",),
       "constexpr int MERGE_ROWS = D >= 128 ? 8 : 4;", "constexpr int MERGE_ROWS = 8;",
       ["tests/test_cuda_compile.py::test_v2tc_registers_allow_what_the_ring_allows"
        "[64-float16]"],
       "the fused merge loads 8 partial rows at once at head_dim 64 too: 128 registers "
       "(NVRTC 13.0), 4 CTAs per SM where the ring and the wave rule take 5 (session 29)"),
    # ------------------------------------------------------------ variants on v2tc (#14)
    _m("v2tc-soft-cap-dropped", "cuda", ("v2tc",),
       "softmax_tile<NT, DT, SOFT_CAP>(", "softmax_tile<NT, DT, false>(",
       [TCVAR_ONE + "[emulated-cuda-cap-one]"],
       "the decode partial calls the tile phase without its cap (the prefix kernel's default)"),
    _m("v2tc-soft-cap-in-natural-units", "cuda", ("v2tc",),
       "if constexpr (SOFT_CAP) x = cap * tanh_fast(x * (1.f / cap));",
       "if constexpr (SOFT_CAP) x = cap / PD_LOG2E * tanh_fast(x * (PD_LOG2E / cap));",
       [TCVAR_ONE + "[emulated-cuda-cap-one]"],
       "the cap in natural units applied to scores already scaled by log2(e)"),
    _m("v2tc-soft-cap-before-scaling", "cuda", ("v2tc",),
       "logit<SOFT_CAP>(s[n][e] * scale_log2, cap_log2)",
       "logit<SOFT_CAP>(s[n][e], cap_log2) * scale_log2",
       [TCVAR_ONE + "[emulated-cuda-cap-one]"],
       "the cap applied to the raw q.k, before sm_scale * log2(e)"),
    _m("v2tc-sink-left-out-of-store", "cuda", ("v2tc",),
       "den = SINK && !MERGE ? exp2f(sk - ref) : 0.f;",
       "den = 0.f;",
       [TCVAR_ONE + "[emulated-cuda-sinks-one]"],
       "the sink raises the max but never joins the denominator of a one-chunk request"),
    _m("v2tc-sink-per-warp", "cuda", ("v2tc",),
       "      den = fmaf(wt, sm_l[w][i], den);\n",
       "      den = fmaf(wt, sm_l[w][i], den) + (SINK ? exp2f(sk - ref) : 0.f);\n",
       [TCVAR_ONE + "[emulated-cuda-sinks-one]"],
       "the sink joined once per warp state of the combine instead of once per row"),
    _m("v2tc-sink-missing-from-lse", "cuda", ("v2tc",),
       "const float lse = live ? mx + log2f(den) : -PD_INF;",
       "const float lse = live ? mx + log2f(den - (SINK ? exp2f(sk - ref) : 0.f)) : -PD_INF;",
       [TCVAR_ONE + "[emulated-cuda-sinks-one]"],
       "the output's denominator holds the sink, the returned LSE does not"),
    _m("metal-v2tc-soft-cap-dropped", "metal", ("v2tc",),
       "pd::attend_tile<T, HEAD_DIM, LD, SOFT_CAP>(", "pd::attend_tile<T, HEAD_DIM, LD, false>(",
       [TCVAR_ONE + "[emulated-metal-cap-one]"], "the tile runs without its cap"),
    _m("metal-v2tc-soft-cap-in-natural-units", "metal", ("v2tc",),
       "if (SOFT_CAP) x = cap * precise::tanh(x / cap);",
       "if (SOFT_CAP) x = cap / PD_LOG2E * precise::tanh(x / (cap / PD_LOG2E));",
       [TCVAR_ONE + "[emulated-metal-cap-one]"],
       "the cap in natural units applied to scores already scaled by log2(e)"),
    _m("metal-v2tc-soft-cap-before-scaling", "metal", ("v2tc",),
       "logit<SOFT_CAP>(se[e] * scale_log2, cap_log2)",
       "logit<SOFT_CAP>(se[e], cap_log2) * scale_log2",
       [TCVAR_ONE + "[emulated-metal-cap-one]"],
       "the cap applied to the raw q.k, before sm_scale * log2(e)"),
    _m("metal-v2tc-sink-left-out-of-store", "metal", ("v2tc",),
       "float num = 0.0f, den = SINK ? exp2(sk - ref) : 0.0f;", "float num = 0.0f, den = 0.0f;",
       [TCVAR_ONE + "[emulated-metal-sinks-one]"],
       "the sink raises the max but never joins the denominator of a one-chunk request"),
    _m("metal-v2tc-sink-per-simdgroup", "metal", ("v2tc",),
       "      den = fma(wt, sm_l[w * ROWS + i], den);\n",
       "      den = fma(wt, sm_l[w * ROWS + i], den) + (SINK ? exp2(sk - ref) : 0.0f);\n",
       [TCVAR_ONE + "[emulated-metal-sinks-one]"],
       "the sink joined once per SIMD group's state instead of once per row"),
    _m("metal-v2tc-sink-missing-from-lse", "metal", ("v2tc",),
       "if (d == 0) lse_out[out_row] = live ? mx + log2(den) : -INFINITY;",
       "if (d == 0) lse_out[out_row] = live ? mx + log2(den - (SINK ? exp2(sk - ref) : 0.0f))"
       " : -INFINITY;",
       [TCVAR_ONE + "[emulated-metal-sinks-one]"],
       "the output's denominator holds the sink, the returned LSE does not"),
    _m("py-v2tc-sink-counted-per-chunk", "python", ("paged_decode.variants",),
       "        if final and self.sinks is not None:", "        if self.sinks is not None:",
       [TCVAR_ONE + "[emulated-cuda-sinks-split]", TCVAR_ONE + "[emulated-metal-sinks-split]"],
       "v2tc's merged partials take the sink, so a split request counts it once per chunk "
       "(and once more in the merge)"),
    _m("py-v2tc-window-off-by-one", "python", ("paged_decode.variants",),
       "    return np.maximum(0, vis - 1 - int(window_left))",
       "    return np.maximum(0, vis - int(window_left))",
       [TCVAR + "test_window_that_cuts_mid_page_reads_only_its_pages[emulated-cuda]"],
       "the window keeps W tokens instead of W + 1 (v2tc's window table)"),
    # ------------------------------------------------------------ fp8 K/V (#14 item 1)
    _m("cuda-fp8-missing-v-scale", "cuda", ("v2", "v1"),
       "from_float<TO>(live ? num / den * v_scale : 0.f)",
       "from_float<TO>(live ? num / den : 0.f)",
       [FP8_ORACLE + "[emulated-cuda-float8_e4m3fn-v2-one]",
        FP8_ORACLE + "[emulated-cuda-float8_e4m3fn-v1]"],
       "the V scale left out of the store: outputs in stored units"),
    _m("metal-fp8-missing-v-scale", "metal", ("v2", "v1"),
       "from_float<TO>(live ? num / den * v_scale : 0.0f)",
       "from_float<TO>(live ? num / den : 0.0f)",
       [FP8_ORACLE + "[emulated-metal-float8_e4m3fn-v2-one]"],
       "the V scale left out of the store (Metal)"),
    _m("py-fp8-missing-k-scale", "python", ("paged_decode.variants",),
       "        return sm_scale if self.kv is None else sm_scale * self.kv.k_scale",
       "        return sm_scale",
       [FP8_ORACLE + "[reference-float8_e4m3fn-v2-one]",
        FP8_ORACLE + "[emulated-cuda-float8_e4m3fn-v2-split]"],
       "the K scale never folded into the softmax scale"),
    _m("cuda-fp8-exponent-bias", "cuda", ("v2", "v1"),
       "__uint_as_float(((e + 127u - (unsigned)FP8<T>::BIAS) << 23)",
       "__uint_as_float(((e + 128u - (unsigned)FP8<T>::BIAS) << 23)",
       [FP8_ORACLE + "[emulated-cuda-float8_e4m3fn-v2-one]",
        FP8_ORACLE + "[emulated-cuda-float8_e5m2-v2-one]"],
       "the widen's exponent rebiased off by one: every normal value doubled"),
    _m("metal-fp8-exponent-bias", "metal", ("v2", "v1"),
       "as_type<float>(((e + 127u - uint(BIAS)) << 23)",
       "as_type<float>(((e + 128u - uint(BIAS)) << 23)",
       [FP8_ORACLE + "[emulated-metal-float8_e4m3fn-v2-one]"],
       "the widen's exponent rebiased off by one (Metal)"),
    _m("cuda-fp8-shared-piece-one-half", "cuda", ("v2", "v1"),
       "const unsigned w[2] = {(sel & 1) ? u.z : u.x, (sel & 1) ? u.w : u.y};",
       "const unsigned w[2] = {u.x, u.y};",
       [FP8_ORACLE + "[emulated-cuda-float8_e4m3fn-v2-one]"],
       "both lanes sharing a 16-byte fp8 piece widen its first half"),
    _m("cuda-fp8-e4m3-nan-as-value", "cuda", ("v2", "v1"),
       "    if (e == EMAX && m == MMAX) mag = PD_NAN;\n", "",
       [FP8 + "test_fp8_nan_code_poisons[emulated-cuda]"],
       "e4m3fn's NaN code widened as 480, so a NaN in the cache no longer poisons"),
    _m("cuda-fp8-no-saturation", "cuda", ("append_fp8",),
       "fminf(__uint_as_float(u & 0x7fffffffu), FP8<T>::max_finite())",
       "__uint_as_float(u & 0x7fffffffu)",
       [FP8_APPEND + "[emulated-cuda-float8_e4m3fn]", FP8_APPEND + "[emulated-cuda-float8_e5m2]"],
       "the append quantizes without saturating: overflow wraps into NaN / garbage codes"),
    _m("metal-fp8-no-saturation", "metal", ("append_fp8",),
       "fmin(as_type<float>(u & 0x7fffffffu), max_finite)", "as_type<float>(u & 0x7fffffffu)",
       [FP8_APPEND + "[emulated-metal-float8_e4m3fn]"],
       "the append quantizes without saturating (Metal)"),
    _m("cuda-fp8-ties-away", "cuda", ("append_fp8",),
       "const unsigned r = bits + ((1u << (DROP - 1)) - 1u) + ((bits >> DROP) & 1u);",
       "const unsigned r = bits + (1u << (DROP - 1));",
       [FP8_APPEND + "[emulated-cuda-float8_e4m3fn]"],
       "ties rounded away from zero instead of to even"),
    _m("cuda-fp8-append-without-scale", "cuda", ("append_fp8",),
       "pd::fp8_from_float<TKV>(pd::to_float(k_rows[b.row_base + i]) / ks)",
       "pd::fp8_from_float<TKV>(pd::to_float(k_rows[b.row_base + i]))",
       [FP8_APPEND + "[emulated-cuda-float8_e4m3fn]"],
       "K rows stored unscaled"),
    _m("py-fp8-metal-formats-swapped", "python", ("paged_decode.kernels.kernel_def",),
       'METAL_FP8_FORMATS = {"float8_e4m3fn": 1, "float8_e5m2": 2}',
       'METAL_FP8_FORMATS = {"float8_e4m3fn": 2, "float8_e5m2": 1}',
       [FP8_ORACLE + "[emulated-metal-float8_e4m3fn-v2-one]"],
       "the Metal kernels told the other fp8 format"),
    _m("py-plan-ignores-window", "python", ("paged_decode.plan",),
       "    table = window_table(table, window_left)\n    max_chunks",
       "    max_chunks",
       [VAR + "test_plan_covers_only_the_window_pages"],
       "the plan's chunks cover the whole context: pages outside the window are launched"),
    _m("metal-acc-in-kv-type", "metal", ("v2", "v1"),
       "  float m[QH], l[QH], acc[QH][VEC];\n",
       "  float m[QH], l[QH];\n  TKV acc[QH][VEC];\n",
       [LONG + "[emulated-metal-float16-v2]"],
       "the output accumulated in the K/V element type instead of float32"),
    _m("metal-k-stride-d256-f32", "metal", ("v2", "v1"),
       "load4kv<FP8>(k_pages + kv_off[u] + 4 * j)",
       "load4kv<FP8>(k_pages + kv_off[u] + 4 * j * (VEC * int(sizeof(*k_pages)) / 16))",
       [LANES + "[emulated-metal-float32-d256-qh1]"],
       "a K vector load strided by 16-byte pieces (wrong only with two pieces per lane: "
       "head_dim 256, float32)"),
    _m("metal-group-sum-16-as-simd-sum", "metal", ("v2", "v1", "merge"),
       "  if (WIDTH == 32) return simd_sum(x);", "  if (WIDTH >= 16) return simd_sum(x);",
       [LANES + "[emulated-metal-float16-d128-qh3]"],
       "16-lane group sums taken over the whole SIMD group (head_dim 128 f16/bf16 or 64 "
       "f32 at 3, 5, 6, 7 heads per threadgroup)"),
    _m("metal-transpose-alpha-lane", "metal", ("v2", "v1"),
       "simd_shuffle(alpha, ushort(sub0 + g * HLANES))", "simd_shuffle(alpha, ushort(sub0))",
       [LANES + "[emulated-metal-float16-d64-qh4]"],
       "every head rescaled by head 0's correction"),
    _m("metal-subgroup-combine-short", "metal", ("v2", "v1"),
       "  for (ushort off = TPR; off < 32; off <<= 1) {",
       "  for (ushort off = TPR; off < 16; off <<= 1) {",
       [LANES + "[emulated-metal-float16-d64-qh1]"],
       "the sub-group states of a SIMD group combined one level short"),
    _m("metal-token-past-the-end", "metal", ("v2", "v1"),
       "    ok[u] = t < t_end;", "    ok[u] = t <= t_end;",
       [LANES + "[emulated-metal-float16-d64-qh2]"],
       "one token past the visible range attended"),
    _m("metal-query-unscaled", "metal", ("v2", "v1"),
       "to_float(q[(long(r) * num_qo_heads + h0 + g) * HEAD_DIM + d0 + i]) * scale_log2",
       "to_float(q[(long(r) * num_qo_heads + h0 + g) * HEAD_DIM + d0 + i])",
       [LANES + "[emulated-metal-float16-d64-qh2]"],
       "scores without the softmax scale"),
    _m("metal-v1-kv-head", "metal", ("v1",),
       "  const int kvh = h / (num_qo_heads / num_kv_heads);\n  const long pb",
       "  const int kvh = h % num_kv_heads;\n  const long pb",
       [CASE + "[emulated-metal-d128-g4-ps16-bf16]"],
       "v1 maps query heads to KV heads round-robin instead of in groups"),
    # ------------------------------------------------------------ merge
    _m("cuda-merge-no-32-row-cap", "cuda", ("merge",),
       "const int count = end - base < run ? (int)(end - base) : run;",
       "const int count = (int)(end - base);",
       [MERGE + "[emulated-cuda]"],
       "a pass over more than 32 rows: row weights shuffled in from lanes that wrap"),
    _m("cuda-merge-gather-max-wrong-row", "cuda", ("merge",),
       "(GATHER ? (long long)rows[base0 + lane] : base0 + lane)", "(base0 + lane)",
       [ORACLE + "test_gathering_merge_large_groups_wide_lse_range"],
       "the gathering merge's first pass (its max, and the LSEs kept for the first run) "
       "reads the rows in storage order"),
    _m("cuda-merge-row-stride", "cuda", ("merge",),
       "reinterpret_cast<const float4*>(v + (r * num_heads + h) * HEAD_DIM)",
       "reinterpret_cast<const float4*>(v + (r + h) * HEAD_DIM)",
       [MERGE + "[emulated-cuda]"],
       "a partial's row addressed without the head stride"),
    _m("cuda-merge-lane-columns", "cuda", ("merge",),
       "  const auto col = [lane](int k) { return lane + 32 * k; };",
       "  const auto col = [lane](int k) { return lane * PER_LANE + k; };",
       [CASE + "[emulated-cuda-d256-g8-ps16-f16]"],
       "lanes read blocked columns but write strided ones (two float4 per lane: head_dim 256)"),
    _m("metal-merge-lane-local-max", "metal", ("merge",),
       "  mx = simd_max(mx);\n", "",
       [MERGE + "[emulated-metal]"],
       "each lane weighs every row against its own rows' max (exact until exp2 overflows)"),
    # ------------------------------------------------------------ prefix_tc (CUDA)
    _m("prefix-no-barrier-before-refill", "cuda", ("prefix",),
       "    __syncthreads();                              // buffer `buf` is refilled next round\n",
       "", [PREFIX_LONG + "[64]"],
       "the K/V double buffer refilled (next round's issue) while other warps still read it"),
    _m("prefix-no-cp-async-wait", "cuda", ("prefix",),
       "      cp_async_wait<1>();\n", "", [PREFIX_LONG + "[64]"],
       "a tile read before its cp.async group landed"),
    _m("prefix-wait-one-group-short", "cuda", ("prefix",),
       "      cp_async_wait<1>();\n", "      cp_async_wait<2>();\n", [PREFIX_LONG + "[64]"],
       "wait_group leaves the tile about to be read in flight"),
    _m("prefix-issue-other-buffer", "cuda", ("prefix",),
       "// with the ids fetched for this tile\n    const int buf = tile & 1;",
       "// with the ids fetched for this tile\n    const int buf = (tile + 1) & 1;",
       [PREFIX_LONG + "[64]"],
       "a tile copied into the buffer that is being read"),
    _m("prefix-row-sum-one-level", "cuda", ("prefix",),
       "    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);\n", "",
       [PREFIX + "test_prefix_kernel_matches_oracle[64-float16]"],
       "a row's softmax sum collected from two of its four lanes"),
    _m("prefix-rescale-wrong-row", "cuda", ("prefix",),
       "    o[j][2] *= alpha[1]; o[j][3] *= alpha[1];",
       "    o[j][2] *= alpha[0]; o[j][3] *= alpha[0];",
       [PREFIX + "test_prefix_kernel_matches_oracle[64-float16]"],
       "rows grp + 8 rescaled by row grp's correction"),
    _m("prefix-chunk-and-row-tile-swapped", "cuda", ("prefix",),
       "const int c = blockIdx.x / row_tiles, rt = blockIdx.x % row_tiles;",
       "const int c = blockIdx.x % row_tiles, rt = blockIdx.x / row_tiles;",
       [PREFIX + "test_prefix_kernel_row_tiles[24-3-1]"],
       "the grid's chunk and row-tile coordinates swapped"),
    # ------------------------------------------------------------ v2tc (CUDA; the mma.py
    # phases it shares with the prefix kernel: both kernels mutated, v2tc's tests kill)
    _m("v2tc-no-cp-async-wait", "cuda", ("v2tc",),
       "    cp_async_wait<STAGES - 2>();                 // this thread's copies of `stage` "
       "landed\n",
       "", [V2TC_LONG], "a ring slot read before its cp.async group landed"),
    _m("v2tc-wait-one-group-short", "cuda", ("v2tc",),
       "cp_async_wait<STAGES - 2>();", "cp_async_wait<STAGES - 1>();", [V2TC_LONG],
       "wait_group leaves the stage about to be read in flight"),
    _m("v2tc-no-barrier-before-refill", "cuda", ("v2tc",),
       "    __syncthreads();\n    issue(stage + STAGES - 1);", "    issue(stage + STAGES - 1);",
       [V2TC_LONG], "a ring slot refilled while other warps still read it (and other "
                    "threads' copies read before they landed)"),
    _m("v2tc-page-ids-into-the-slot-being-read", "cuda", ("v2tc",),
       "sm_rows[(stage + STAGES - 1) % STAGES][tid] = row_of(",
       "sm_rows[stage % STAGES][tid] = row_of(", [V2TC_LONG],
       "the prefetched token rows stored over the slot of the stage being issued"),
    _m("v2tc-page-boundary-off-by-one", "cuda", ("v2tc",),
       "? page_ids[a / PAGE_SIZE] :", "? page_ids[(int)(a - 1) / PAGE_SIZE] :",
       [V2TC_CASE + "[d128-g2-ps3-bf16]"],
       "the first token of every page looked up in the page before"),
    _m("v2tc-first-page-offset-dropped", "cuda", ("v2tc",),
       "const int a_begin = (int)(fpo + range.t_begin)", "const int a_begin = (int)range.t_begin",
       [V2TC + "test_v2tc_ragged_batch_with_empty_requests[emulated-cuda]"],
       "tokens read from the page start of a request that starts mid-page"),
    _m("tc-accumulator-not-rescaled", "cuda", ("prefix", "v2tc"),
       "      o[j][0] *= alpha[0]; o[j][1] *= alpha[0];\n"
       "      o[j][2] *= alpha[1]; o[j][3] *= alpha[1];\n",
       "", [V2TC_LONG], "O accumulated across tiles without the online-softmax rescale"),
    _m("tc-rescale-only-when-every-lane-grew", "cuda", ("prefix", "v2tc"),
       "if (__any_sync(0xffffffffu, grew)) {", "if (__all_sync(0xffffffffu, grew)) {",
       [V2TC_LONG], "the skipped rescale taken for the whole warp when one lane's rows "
                    "did not grow"),
    _m("tc-rescale-skipped-for-small-growth", "cuda", ("prefix", "v2tc"),
       "grew |= m_new > m_run[h];", "grew |= m_new > m_run[h] + 1.f;", [V2TC_LONG],
       "O left at a stale scale when a row's max grows by less than one (log2 units)"),
    _m("v2tc-token-row-entry-dropped", "cuda", ("v2tc",),
       "* PAGE_SIZE + a % PAGE_SIZE : 0u;", "* PAGE_SIZE : 0u;", [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "every token of a page read from the page's first row"),
    _m("v2tc-token-row-of-the-next-stage", "cuda", ("v2tc",),
       "row_of(stage + STAGES - 1, next_page)", "row_of(stage + STAGES, next_page)",
       [V2TC_LONG],
       "a prefetched page id made into a row with the entry and range of the stage after it"),
    _m("v2tc-copy-row-batch-index", "cuda", ("v2tc",),
       "(unsigned long long)row[j] * row_bytes", "(unsigned long long)row[0] * row_bytes",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "every copy of a batch reading the first copy's token row"),
    _m("tc-q-fragment-rows-swapped", "cuda", ("prefix", "v2tc"),
       "ldsm_x4<false>(a, qw + (lrow + 8 * lhi) * LD + kk * 16 + 8 * lq);",
       "ldsm_x4<false>(a, qw + (lrow + 8 * lq) * LD + kk * 16 + 8 * lhi);",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "a wrong A fragment: rows 8-15 and columns +8 swapped in the Q ldmatrix addresses"),
    _m("v2tc-c-fragment-columns", "cuda", ("v2tc",),
       "*reinterpret_cast<float2*>(row + j * 8 + 2 * tig) =",
       "*reinterpret_cast<float2*>(row + j * 8 + tig) =", [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "the accumulator fragment stored with the A-operand column mapping of one element "
       "per lane"),
    _m("v2tc-padded-rows-written", "cuda", ("v2tc",),
       "const int rows = min(16, group - g0);", "const int rows = 16;",
       [V2TC_CASE + "[d64-g7-ps64-f16]"],
       "the zero rows padding a group of 7 to the M tile loaded and written as heads"),
    _m("v2tc-row-tile-offset-dropped", "cuda", ("v2tc",),
       "const int g0 = rt * 16;", "const int g0 = 0;", [V2TC_CASE + "[d128-g32-ps256-f16]"],
       "both row tiles of a 32-head group serve the first 16 heads"),
    _m("v2tc-tail-tokens-dropped", "cuda", ("v2tc",),
       "if (tok0 < n_tok) {", "if (tok0 + 16 <= n_tok) {", [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "a warp whose 16 tokens run past the range skips the live ones too"),
    _m("v2tc-lse-base-e", "cuda", ("v2tc",),
       "live ? mx + log2f(den) : -PD_INF;", "live ? (mx + log2f(den)) * 0.6931472f : -PD_INF;",
       [V2TC_CASE + "[d64-g1-ps16-f16]"], "a natural-log LSE"),
    _m("v2tc-combine-weights-base-e", "cuda", ("v2tc",),
       "const float wt = exp2f(sm_m[w][i] - ref);", "const float wt = expf(sm_m[w][i] - ref);",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "the warps' states weighted by exp of base-2 maxima"),
    _m("v2tc-request-entries-from-the-next-lane", "cuda", ("v2tc",),
       "p_begin = __shfl_sync(0xffffffffu, b, r & 31);",
       "p_begin = __shfl_sync(0xffffffffu, b, (r + 1) & 31);",
       [V2TC_BATCHES + "[31]"], "each request starts at its neighbour's indptr entry"),
    _m("v2tc-request-entries-first-register-only", "cuda", ("v2tc",),
       "if (j == r / 32) { b = ip; l = lp; f = fo; }", "if (j == 0) { b = ip; l = lp; f = fo; }",
       [V2TC_BATCHES + "[127]"], "requests past lane 31 read the entries of request r % 32"),
    _m("v2tc-request-entries-end-from-the-start-register", "cuda", ("v2tc",),
       "if (j == (r + 1) / 32) e = ip;", "if (j == r / 32) e = ip;",
       [V2TC_BATCHES + "[127]"],
       "indptr[r + 1] of requests 31, 63, 95 taken from the register of indptr[r]"),
    _m("v2tc-request-entries-last-indptr-missing", "cuda", ("v2tc",),
       "const int ip = t <= batch_size ? indptr[t] : 0;",
       "const int ip = t < batch_size ? indptr[t] : 0;",
       [V2TC_BATCHES + "[31]"], "indptr[B], the last request's end, left at 0"),
    _m("v2tc-request-entries-spread-at-128", "cuda", ("v2tc",),
       "if (batch_size < 32 * SPEC) {", "if (batch_size <= 32 * SPEC) {",
       [V2TC_BATCHES + "[128]"],
       "128 requests spread over 4 registers of 32 lanes: indptr[128] is in none of them"),
    _m("v2tc-combine-row-stride", "cuda", ("v2tc",),
       "comb + (w * 16 + i) * CLD + d", "comb + (w * 16 + i) * D + d",
       [V2TC_CASE + "[d64-g7-ps64-f16]"],
       "the combine reads the warps' rows at the unpadded stride they are no longer stored at"),
    _m("v2tc-combine-column-group", "cuda", ("v2tc",),
       "const int i = e / Q4, d = e % Q4 * 4;", "const int i = e / Q4, d = e % Q4;",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "a thread's 4 columns taken at 1-column steps: overlapping groups, the row's tail "
       "unwritten"),
    # ------------------------------------------------------------ v2tc over fp8 pools
    _m("v2tc-fp8-q-columns-in-order", "cuda", ("v2tc",),
       "w[k] = qw[j][FP8 ? q_column(2 * k) / 2 : k];", "w[k] = qw[j][k];",
       [V2TC_FP8_E4], "the Q tile in natural column order against K's permuted pairs"),
    _m("v2tc-q-unaligned-pairs-swapped", "cuda", ("v2tc",),
       "qw[j][k] = h[2 * k] | (unsigned)h[2 * k + 1] << 16;",
       "qw[j][k] = h[2 * k + 1] | (unsigned)h[2 * k] << 16;",
       [V2TC_SKEWED_Q],
       "an unaligned q's 16-bit loads packed with the two columns of a pair swapped"),
    _m("v2tc-q-alignment-unchecked", "cuda", ("v2tc",),
       "const bool q_vec = ((unsigned long long)q & 15) == 0;", "const bool q_vec = true;",
       [V2TC_SKEWED_Q],
       "16-byte loads of a q that is not 16-byte aligned (a misaligned-address fault on a GPU; "
       "the emulator checks the alignment of the cast that makes their pointer)"),
    _m("v2tc-q-second-piece-dropped", "cuda", ("v2tc",),
       "qw[j][4] = b.x; qw[j][5] = b.y; qw[j][6] = b.z; qw[j][7] = b.w;", "",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "the second 16-byte piece of each Q chunk left at zero"),
    _m("v2tc-first-pages-of-the-next-stage", "cuda", ("v2tc",),
       "for (int s = 0; s < STAGES; ++s) first_page[s] = page_of(s);",
       "for (int s = 0; s < STAGES; ++s) first_page[s] = page_of(s + 1);", [V2TC_LONG],
       "the page ids loaded ahead of Q taken one stage late"),
    _m("v2tc-first-pages-one-past", "cuda", ("v2tc",),
       "for (int s = 0; s < STAGES; ++s) first_page[s] = page_of(s);",
       "for (int s = 0; s <= STAGES; ++s) first_page[s] = page_of(s);", [V2TC_LONG],
       "the prologue loads one stage's page ids too many, writing past its local array "
       "(on a GPU over whatever local memory follows; the emulator compiles with g++'s "
       "array bounds checks)"),
    _m("v2tc-fp8-v-codes-not-regrouped", "cuda", ("v2tc",),
       "  return __byte_perm(w, 0u, 0x3120u);",
       "  return w;", [V2TC_FP8_E4],
       "V's transposed codes widened as they load: pairs of columns, not of tokens"),
    _m("v2tc-fp8-v-codes-regrouped-wrong", "cuda", ("v2tc",),
       "  return __byte_perm(w, 0u, 0x3120u);",
       "  return __byte_perm(w, 0u, 0x2031u);", [V2TC_FP8_E4],
       "V's regrouped codes with the two columns' halves swapped"),
    _m("v2tc-fp8-k-chunks-swapped", "cuda", ("v2tc",),
       "tile_at<ROWB, GRP>((lm >> 1) * 8 + lrow, lm & 1);",
       "tile_at<ROWB, GRP>((lm & 1) * 8 + lrow, lm >> 1);",
       [V2TC_FP8_E4], "K's ldmatrix matrices in V's order: tokens and chunks swapped"),
    _m("v2tc-fp8-o-columns-in-order", "cuda", ("v2tc",),
       "              make_float4(o[2 * c16][2 * h], o[2 * c16 + 1][2 * h], "
       "o[2 * c16][2 * h + 1],\n                          o[2 * c16 + 1][2 * h + 1]);",
       "              make_float4(o[2 * c16][2 * h], o[2 * c16][2 * h + 1], "
       "o[2 * c16 + 1][2 * h],\n                          o[2 * c16 + 1][2 * h + 1]);",
       [V2TC_FP8_E4], "the even / odd output tiles combined as if in column order"),
    _m("v2tc-fp8-v-scale-dropped", "cuda", ("v2tc",),
       "from_float<TO>(live ? num[u] / den * v_scale : 0.f)",
       "from_float<TO>(live ? num[u] / den : 0.f)",
       [V2TC_FP8_E4, V2TC_FP8 + "test_v2tc_fp8_scales_are_applied[emulated-cuda]"],
       "the V scale left out of v2tc's store: outputs in stored units"),
    _m("v2tc-ring-copy-unswizzled", "cuda", ("v2tc",),
       "const int at = tile_at<ROWB, GRP>(slot * KT + tok, piece);",
       "const int at = (slot * KT + tok) * ROWB + (piece << 4);",
       [V2TC_CASE + "[d64-g1-ps16-f16]", V2TC_FP8_E5],
       "K/V pieces copied into the ring in row order while the tile phases read it swizzled"),
    _m("tile-group4-swizzle-by-row", "cuda", ("v2tc",),
       "((chunk ^ (GROUP == 8 ? row & 7 : (row >> 1) & 3)) << 4)",
       "((chunk ^ (GROUP == 8 ? row & 7 : row & 3)) << 4)",
       ["tests/test_tile_swizzle.py::test_tile_rows_are_unpadded_swizzled_conflict_free_and_"
        "keep_sectors_whole[192]"],
       "192-byte rows swizzled by row % 4: rows 0 and 4 of an ldmatrix matrix share a bank "
       "slot (correct results, a 2-way conflict the oracle cannot see)"),
    _m("tc-chunk-addr-group-of-8", "cuda", ("v2tc",),
       "((even / GROUP) * 16 * GROUP)", "((even / 8) * 128)",
       [V2TC_CASE + "[d96-g4-ps16-f16]"],
       "chunk_addr steps 128 bytes per swizzle group on 192-byte rows, whose groups are 64"),
    _m("cuda-grid-cell-signed-division", "cuda", ("v2", "v2tc"),
       "  return {chunk, slot, slot / per_head, slot % per_head};",
       "  return {chunk, slot, (unsigned)((int)slot / (int)per_head),\n"
       "          (unsigned)((int)slot % (int)per_head)};",
       ["tests/test_cuda_compile.py::test_grid_cell_compiles_to_the_code_blockidx_did"],
       "the CTA's slot divided signed: right results, 296 more SASS instructions for the "
       "tensor-core partial with its fused merge (its index arithmetic) and more for v2, "
       "which only a compile-size check sees"),
    _m("v2tc-ring-not-aligned", "cuda", ("v2tc",),
       "unsigned char* ks = align_smem(reinterpret_cast<unsigned char*>(qs + 16 * LD));",
       "unsigned char* ks = reinterpret_cast<unsigned char*>(qs + 16 * LD);",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "the swizzled ring left where the dynamic base puts it (16-byte aligned only): its "
       "XORed ldmatrix addresses miss their chunks"),
    _m("prefix-tile-not-aligned", "cuda", ("prefix",),
       "unsigned char* ks = align_smem(reinterpret_cast<unsigned char*>(qs + ROWS * LD));",
       "unsigned char* ks = reinterpret_cast<unsigned char*>(qs + ROWS * LD);",
       ["tests/test_prefix_tc.py::test_prefix_kernel_matches_oracle"],
       "the prefix kernel's swizzled K/V tiles left 16-byte aligned only"),
    _m("v2tc-row-table-one-past", "cuda", ("v2tc",),
       "    if (tid < KT) sm_rows[(stage + STAGES - 1) % STAGES][tid]",
       "    if (tid <= KT) sm_rows[(stage + STAGES - 1) % STAGES][tid]",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "one thread too many stores a row offset: in the last slot it lands past the static "
       "row table (red zone), in the others on the next slot's first entry"),
    _m("v2tc-combine-rows-not-16-byte-strided", "cuda", ("v2tc",),
       "constexpr int CLD = D + 8;", "constexpr int CLD = D + 2;",
       [V2TC_CASE + "[d64-g7-ps64-f16]"],
       "the combine's rows padded by 2 floats: its float4 reads of odd rows sit 8 bytes off "
       "16 (a misaligned-address fault on a GPU, right answers on a CPU; the emulator checks "
       "the alignment of every pointer cast)"),
    _m("tc-k-fragment-unswizzled", "cuda", ("v2tc",),
       "chunk_addr<KGRP>(k_lane + n * 8 * KROWB, 2 * kk)",
       "(k_lane + n * 8 * KROWB + (2 * kk << 4))",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "16-bit K read from a swizzled ring at its unswizzled places"),
    _m("tc-v-fragment-unswizzled", "cuda", ("v2tc",),
       "chunk_addr<VGRP>(v_lane + kk * 16 * VROWB, j)",
       "(v_lane + kk * 16 * VROWB + (j << 4))",
       [V2TC_CASE + "[d64-g1-ps16-f16]"],
       "16-bit V read from a swizzled ring at its unswizzled places"),
    _m("v2tc-fp8-v-unswizzled", "cuda", ("v2tc",),
       "ldsm_x4_at<true>(vr, chunk_addr<GRP>(v_lane, 2 * cc));",
       "ldsm_x4_at<true>(vr, v_lane + (2 * cc << 4));",
       [V2TC_FP8_E5], "fp8 V read from a swizzled ring at its unswizzled places"),
    _m("v2tc-fp8-exponent-bias", "cuda", ("v2tc",),
       "__uint_as_float(((e + 127u - (unsigned)FP8<T>::BIAS) << 23)",
       "__uint_as_float(((e + 128u - (unsigned)FP8<T>::BIAS) << 23)",
       [V2TC_FP8_E4, V2TC_FP8_E5],
       "v2tc's widen (the emulator's bit path) rebiased off by one: every normal value doubled"),
    _m("py-v2tc-fp8-launch-without-v-scale", "python", ("paged_decode.backends.launches",),
       '    args.append(Arg("v_scale", np.float32(v_scale), "scalar"))',
       '    args.append(Arg("v_scale", np.float32(1.0), "scalar"))',
       [V2TC_FP8_E4, V2TC_FP8_METAL],
       "the host launches v2tc with a V scale of 1 (both dialects)"),
    _m("metal-v2tc-fp8-v-scale-dropped", "metal", ("v2tc",),
       "pd::from_float<TO>(live ? num / den * v_scale : 0.0f)",
       "pd::from_float<TO>(live ? num / den : 0.0f)",
       [V2TC_FP8_METAL, V2TC_FP8 + "test_v2tc_fp8_scales_are_applied[emulated-metal]"],
       "the V scale left out of v2tc's store (Metal)"),
    _m("metal-v2tc-fp8-exponent-bias", "metal", ("v2tc",),
       "as_type<float>(((e + 127u - uint(BIAS)) << 23)",
       "as_type<float>(((e + 128u - uint(BIAS)) << 23)", [V2TC_FP8_METAL],
       "v2tc's widen rebiased off by one (Metal)"),
    _m("metal-v2tc-fp8-elements-reversed", "metal", ("v2tc",),
       "          kd[j] = T(kf[j]);", "          kd[j] = T(kf[3 - j]);", [V2TC_FP8_METAL],
       "the four widened K codes of a load stored in reverse order"),
    # ------------------------------------------------------------ v2tc (Metal, simdgroup_matrix)
    _m("metal-v2tc-no-barrier-before-refill", "metal", ("v2tc",),
       "    threadgroup_barrier(mem_flags::mem_threadgroup);\n    if (stage + 1 < n_stages)",
       "    if (stage + 1 < n_stages)", [V2TC_METAL_LONG],
       "a buffer of the double buffer refilled while other SIMD groups still read it (and "
       "a stage read before every thread's copies landed)"),
    _m("metal-v2tc-combine-barrier-dropped", "metal", ("v2tc",),
       "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  for (int mt = 0; mt < MT; ++mt) {\n"
       "    const int i",
       "  for (int mt = 0; mt < MT; ++mt) {\n    const int i", [V2TC_METAL_LONG],
       "the combine's accumulators stored over the double buffer while a SIMD group still "
       "reads its last stage"),
    _m("metal-v2tc-accumulator-not-rescaled", "metal", ("v2tc",),
       "    oe[0] *= alpha;\n    oe[1] *= alpha;\n", "", [V2TC_METAL_LONG],
       "O accumulated across stages without the online-softmax rescale"),
    _m("metal-v2tc-thread-elements-columns", "metal", ("v2tc",),
       "(lane / 4 & 2) * 2 + (lane % 2) * 2); }", "(lane / 4 & 2) * 2 + (lane % 2)); }",
       [V2TC_METAL + "[d64-g1-ps16-f16]"],
       "a wrong thread_elements() mapping: each lane's two scores masked (and its row "
       "states stored) as if it held columns 2 l and 2 l + 1 of the A-operand layout"),
    _m("metal-v2tc-thread-elements-rows", "metal", ("v2tc",),
       "(lane / 4 & 4) + (lane / 2) % 4); }", "(lane / 4 & 4) + lane % 4); }",
       [V2TC_METAL + "[d64-g1-ps16-f16]"],
       "a wrong thread_elements() row: the SIMD groups' row states stored under other rows"),
    _m("metal-v2tc-row-max-over-wrong-lanes", "metal", ("v2tc",),
       "mx = fmax(mx, simd_shuffle_xor(mx, ushort(8)));",
       "mx = fmax(mx, simd_shuffle_xor(mx, ushort(2)));", [V2TC_METAL + "[d64-g1-ps16-f16]"],
       "a row's max reduced with a lane of another row instead of its fourth column pair"),
    _m("metal-v2tc-row-sum-over-wrong-lanes", "metal", ("v2tc",),
       "l_run[mt] += simd_shuffle_xor(l_run[mt], ushort(8));",
       "l_run[mt] += simd_shuffle_xor(l_run[mt], ushort(4));", [V2TC_METAL + "[d64-g1-ps16-f16]"],
       "a row's softmax sum collected from lanes of another row"),
    _m("metal-v2tc-k-not-transposed", "metal", ("v2tc",),
       "simdgroup_load(kb, kt + kk * 8, LD, 0, true);", "simdgroup_load(kb, kt + kk * 8, LD);",
       [V2TC_METAL + "[d64-g1-ps16-f16]"], "S = Q K instead of Q K^T"),
    _m("metal-v2tc-tail-tokens-dropped", "metal", ("v2tc",),
       "const int n_stages = (n_tok + KT - 1) / KT;", "const int n_stages = n_tok / KT;",
       [V2TC_METAL + "[d64-g1-ps16-f16]"], "a chunk's last partial stage never computed"),
    _m("metal-v2tc-tail-simdgroup-skips-live-tokens", "metal", ("v2tc",),
       "if (tok0 < n_tok) {", "if (tok0 + 8 <= n_tok) {", [V2TC_METAL + "[d64-g1-ps16-f16]"],
       "a SIMD group whose 8 tokens run past the range skips the live ones too"),
    _m("metal-v2tc-page-boundary-off-by-one", "metal", ("v2tc",),
       "long(page_ids[a / PAGE_SIZE])", "long(page_ids[(a - 1) / PAGE_SIZE])",
       [V2TC_METAL + "[d128-g2-ps3-bf16]"],
       "the first token of every page looked up in the page before"),
    _m("metal-v2tc-first-page-offset-dropped", "metal", ("v2tc",),
       "const long a_begin = fpo + range.t_begin;", "const long a_begin = range.t_begin;",
       [V2TC + "test_v2tc_ragged_batch_with_empty_requests[emulated-metal]"],
       "tokens read from the page start of a request that starts mid-page"),
    _m("metal-v2tc-padded-rows-written", "metal", ("v2tc",),
       "const int rows = group - g0 < ROWS ? group - g0 : ROWS;", "const int rows = ROWS;",
       [V2TC_METAL + "[d64-g7-ps64-f16]"],
       "the zero rows padding a group of 7 to the 8-row tile loaded and written as heads"),
    _m("metal-v2tc-row-tile-offset-dropped", "metal", ("v2tc",),
       "const int g0 = rt * ROWS;", "const int g0 = 0;", [V2TC_METAL + "[d128-g32-ps256-f16]"],
       "both row tiles of a 32-head group serve the first 16 heads"),
    _m("metal-v2tc-second-row-tile-skipped", "metal", ("v2tc",),
       "if (mt * 8 < rows)", "if (mt * 8 + 8 <= rows)", [V2TC_METAL + "[d256-g12-ps16-f16]"],
       "a partial 8-row tile (heads 8-11 of 12) taken for padding"),
    _m("metal-v2tc-lse-base-e", "metal", ("v2tc",),
       "live ? mx + log2(den) : -INFINITY;", "live ? (mx + log2(den)) * 0.6931472f : -INFINITY;",
       [V2TC_METAL + "[d64-g1-ps16-f16]"], "a natural-log LSE"),
    _m("metal-v2tc-combine-weights-base-e", "metal", ("v2tc",),
       "const float wt = exp2(sm_m[w * ROWS + i] - ref);",
       "const float wt = exp(sm_m[w * ROWS + i] - ref);", [V2TC_METAL + "[d64-g1-ps16-f16]"],
       "the SIMD groups' states weighted by exp of base-2 maxima"),
    _m("metal-v2tc-poisoned-sum-taken-for-empty", "metal", ("v2tc",),
       "    const bool live = !(den <= 0.0f);", "    const bool live = den > 0.0f;",
       [NAN_METAL], "a NaN row sum written as the empty answer (zeros, -inf)"),
    _m("metal-v2tc-nonfinite-score-kept", "metal", ("v2tc",),
       "  x = finite_or_nan(x);\n  if (SOFT_CAP)", "  if (SOFT_CAP)", [NAN_METAL],
       "a -inf score (+inf in K against a negative q) passes for a masked token"),
    # ------------------------------------------------------------ non-finite semantics
    _m("cuda-nonfinite-score-kept", "cuda", ("v2", "v1"),
       "  x = finite_or_nan(x);\n  if constexpr (SOFT_CAP)",
       "  if constexpr (SOFT_CAP)",
       [NAN + "test_non_finite_inputs_poison_their_heads_on_every_path[float16-emulated-cuda]"],
       "a -inf score (+inf in K against a negative q) passes for a masked token"),
    _m("cuda-poisoned-sum-taken-for-empty", "cuda", ("v2", "v1"),
       "    const bool live = !(den <= 0.f);", "    const bool live = den > 0.f;",
       [NAN + "test_non_finite_inputs_poison_their_heads_on_every_path[float16-emulated-cuda]"],
       "a NaN row sum written as the empty answer (zeros, -inf)"),
    _m("cuda-merge-nan-partial-dropped", "cuda", ("merge",),
       "  float den = 0.f;                                  // this lane's rows' weights\n"
       "  if (mx > -PD_INF && bad == 0.f) {",
       "  float den = 0.f;\n  bad = 0.f;\n  if (mx > -PD_INF) {",
       [NAN + "test_merge_poisons_on_nan_and_plus_inf_lse[emulated-cuda]"],
       "a NaN partial LSE given no weight instead of poisoning its group"),
    _m("metal-nonfinite-score-kept", "metal", ("v2", "v1"),
       "  x = finite_or_nan(x);\n  if (SOFT_CAP)",
       "  if (SOFT_CAP)",
       [NAN + "test_non_finite_inputs_poison_their_heads_on_every_path[float16-emulated-metal]"],
       "a -inf score (+inf in K against a negative q) passes for a masked token"),
    _m("metal-poisoned-sum-taken-for-empty", "metal", ("v2", "v1"),
       "      const bool live = !(den <= 0.0f);", "      const bool live = den > 0.0f;",
       [NAN + "test_non_finite_inputs_poison_their_heads_on_every_path[float16-emulated-metal]"],
       "a NaN row sum written as the empty answer (zeros, -inf)"),
    _m("prefix-poisoned-sum-taken-for-empty", "cuda", ("prefix",),
       "    const bool live = !(l_run[h] <= 0.f);", "    const bool live = l_run[h] > 0.f;",
       [NAN + "test_cascade_poisons_members_of_a_poisoned_prefix[auto-emulated-cuda]"],
       "a poisoned prefix row written as the empty answer"),
    _m("v2tc-poisoned-sum-taken-for-empty", "cuda", ("v2tc",),
       "    const bool live = !(den <= 0.f);", "    const bool live = den > 0.f;",
       [NAN + "test_non_finite_inputs_poison_their_heads_on_every_path[float16-emulated-cuda]"],
       "a NaN row sum written as the empty answer (zeros, -inf)"),
    _m("tc-nonfinite-score-kept", "cuda", ("prefix", "v2tc"),
       "s[n][e] = live ? logit<SOFT_CAP>(s[n][e] * scale_log2, cap_log2) : -PD_INF;",
       "s[n][e] = live ? s[n][e] * scale_log2 : -PD_INF;",
       [NAN + "test_non_finite_inputs_poison_their_heads_on_every_path[float16-emulated-cuda]"],
       "a -inf score (+inf in K against a negative q) passes for a masked token"),
    # ------------------------------------------------------------ append (both dialects)
    _m("cuda-append-slot-off-by-one", "cuda", ("append",),
       "b.first = copy ? 0 : (long long)lo * row_len;",
       "b.first = copy ? 0 : (long long)(lo + 1) * row_len;",
       [APPEND + "test_random_operations_match_the_model[f16-w16-layers3-emulated-cuda]"],
       "new rows land one slot late"),
    _m("cuda-append-no-cow-copy", "cuda", ("append",),
       "const bool copy = copy_cow != 0 && src != page;", "const bool copy = false;",
       [APPEND + "test_both_children_append_to_the_shared_partial_page_in_one_batch"
                 "[None-emulated-cuda]"],
       "a shared partial page's private copy is never filled"),
    _m("metal-append-page-search-off-by-one", "metal", ("append",),
       "if (desc[m] < page) a = m + 1;", "if (desc[m] <= page) a = m + 1;",
       [APPEND + "test_random_operations_match_the_model[f16-w16-layers3-emulated-metal]"],
       "a threadgroup finds the touched page after its own"),
    _m("metal-append-no-cow-source", "metal", ("append",),
       "if (copy_cow != 0) src = desc[num_touched + a];", "",
       [APPEND + "test_both_children_append_to_the_shared_partial_page_in_one_batch"
                 "[None-emulated-metal]"],
       "a copy-on-write page copied from itself (its old slots lost)"),
    # ------------------------------------------------------------ table update (both dialects)
    _m("cuda-table-update-keeps-one-page-too-many", "cuda", ("table_update",),
       "new_indices[begin + i] = i < keep ? old_indices[from + i]",
       "new_indices[begin + i] = i <= keep ? old_indices[from + i]",
       [STEP + "test_random_operations_keep_the_device_table_equal_to_the_pool"
               "[emulated-cuda]"],
       "the first changed page keeps its old id (a copy-on-write copy never read)"),
    _m("cuda-table-update-ignores-front-trim", "cuda", ("table_update",),
       "const int from = src >= 0 ? old_table[src] + d_skip[r] : 0;",
       "const int from = src >= 0 ? old_table[src] : 0;",
       [STEP + "test_random_operations_keep_the_device_table_equal_to_the_pool"
               "[emulated-cuda]"],
       "a sliding window's retired pages stay in the table"),
    _m("metal-table-update-stale-last-page-len", "metal", ("table_update",),
       "    new_table[cap + 1 + r] = d_lpl[r];", "",
       [STEP + "test_a_decode_step_uploads_only_what_changed[emulated-metal]"],
       "last_page_len never follows an append (the new token is not attended)"),
    # ------------------------------------------------------------ multi-token (#14)
    _m("py-multitoken-mask-off-by-one", "python", ("paged_decode.multitoken",),
       "    end = lens[req] - cnt[req] + t + 1 ", "    end = lens[req] - cnt[req] + t ",
       [MT + "test_ragged_counts_match_oracle[v2-one-emulated-cuda]"],
       "each token misses its own position (the causal bound taken as exclusive of it)"),
    _m("py-multitoken-window-from-last-token", "python", ("paged_decode.multitoken",),
       "    start = np.maximum(0, end - 1 - w) if w >= 0",
       "    start = np.maximum(0, lens[req] - 1 - w) if w >= 0",
       [MT + "test_variants_match_oracle[emulated-cuda-w9]"],
       "every token's window starts where the newest token's does"),
    _m("py-multitoken-token-rows-swapped", "python", ("paged_decode.multitoken",),
       "+ np.minimum(np.arange(fold)[None, :], cnt[:, None] - 1)",
       "+ cnt[:, None] - 1 - np.minimum(np.arange(fold)[None, :], cnt[:, None] - 1)",
       [MT + "test_uniform_tokens_match_oracle[emulated-cuda-4]"],
       "the folded query rows of a request in reverse token order"),
    _m("py-multitoken-auto-at-the-unfolded-group", "python",
       ("paged_decode.multitoken_call",),
       "    return choose_path_at(be, table, fold * a.hq // a.hkv,",
       "    return choose_path_at(be, table, a.hq // a.hkv,",
       [TCVAR + "test_auto_reads_the_folded_group_for_several_query_tokens"],
       "auto looks up the one-token group, not the common pass's T x G rows"),
    _m("py-multitoken-sink-in-the-pieces", "python", ("paged_decode.multitoken_call",),
       '                                     o_dt="float32", variant=passes, tokens=None)',
       '                                     o_dt="float32", variant=a.variant, tokens=None)',
       [MT + "test_variants_match_oracle[emulated-cuda-sinks]"],
       "the pieces pass keeps the call's sinks: a token's LSE counts its sink once per "
       "state it merges"),
    _m("cuda-table-update-no-stride", "cuda", ("table_update",),
       "for (int i = threadIdx.x; i < count; i += THREADS)",
       "for (int i = threadIdx.x; i < count && i < THREADS; i += THREADS)",
       [COVER + "test_table_update_row_of_more_than_128_pages[emulated-cuda]"],
       "a row of more than 128 pages keeps its old page ids past the block's first pass"),
    _m("metal-table-update-no-stride", "metal", ("table_update",),
       "for (int i = tid; i < count; i += n)",
       "for (int i = tid; i < count && i < n; i += n)",
       [COVER + "test_table_update_row_of_more_than_128_pages[emulated-metal]"],
       "a row of more than 128 pages keeps its old page ids past the group's first pass"),
    _m("cuda-v2-sink-of-the-first-q-group", "cuda", ("v2",),
       "d0, sinks, h0, v_scale, out_v",
       "d0, sinks, h0 - h0 % (num_qo_heads / num_kv_heads), v_scale, out_v",
       [COVER + "test_variants_with_two_q_groups[emulated-cuda]"],
       "past 8 query heads per KV head (two q-groups of a CTA) every group takes the first "
       "group's sinks"),
    _m("metal-v2-sink-of-the-first-q-group", "metal", ("v2",),
       "active, d0, sinks, h0, v_scale,",
       "active, d0, sinks, h0 - h0 % (num_qo_heads / num_kv_heads), v_scale,",
       [COVER + "test_variants_with_two_q_groups[emulated-metal]"],
       "past 8 query heads per KV head every q-group takes the first group's sinks"),
    _m("py-step-decodes-an-unwritten-slot", "python", ("paged_decode.engine_step",),
       "            if layer not in self._appended:",
       "            if False:",
       ["tests/test_engine_step.py::test_a_slot_begin_reserved_is_never_read_unwritten"
        "[emulated-cuda]"],
       "a decode of a layer not appended since begin() attends to its unwritten slot"),
    _m("py-step-capture-keeps-converted-rows", "python", ("paged_decode.engine_step",),
       "        if not recordable and (self._capturing or self.backend.capturing()):",
       "        if False:",
       ["tests/test_engine_step.py::test_a_capture_refuses_rows_it_would_replay_stale"
        "[float32]"],
       "a captured step replays the rows converted at capture, every step"),
    _m("py-step-table-replayed-unrecorded", "python", ("paged_decode.step_table",),
       "        if self._recorded is None or self._recorded != self.layout:",
       "        if False:",
       ["tests/test_engine_step.py::test_replayed_without_a_recorded_update_is_refused"
        "[emulated-cuda]"],
       "replayed() without a recorded update drops it: the device table stays behind"),
    _m("py-prepared-checks-the-buffer-before-the-update", "python", ("paged_decode.prepared",),
       "                if t.layout == self.layout:     # the launches' buffer is still "
       "the table's",
       "                if True:",
       ["tests/test_prepared_follow.py::test_a_prepared_call_follows_a_table_whose_update_"
        "grows_its_buffer[emulated-cuda]"],
       "a prepared call keeps its launches over the table's old buffer after the update grew it"),
    _m("py-multitoken-mlx-flat-results-dropped", "python", ("paged_decode.multitoken_call",),
       "        if be.functional_outputs and self.out_flat is not self.out:",
       "        if be.functional_outputs and self.out_flat.shape != self.out.shape:",
       ["tests/test_multitoken.py::test_flat_queries_on_mlx_match_the_oracle[qo1]"],
       "a flat multi-token q on MLX gets zeros: the merge's rebound results are dropped"),
    _m("py-fast-path-keeps-a-tensor-scale", "python", ("paged_decode.decode",),
       "    number_scales = (isinstance(variants[\"k_scale\"], _NUMBER_SCALE)",
       "    number_scales = True or (isinstance(variants[\"k_scale\"], _NUMBER_SCALE)",
       ["tests/test_input_limits.py::test_a_scale_tensor_changed_in_place_is_read_again"],
       "an fp8 scale given as a tensor and updated in place keeps its first value"),
    _m("py-v2tc-smem-without-slack", "python", ("paged_decode.kernels.decode_v2_tc",),
       "    return ROWS * _row_bytes(head_dim) + ALIGN_SLACK",
       "    return ROWS * _row_bytes(head_dim)",
       [V2TC_CASE + "[d64-g7-ps64-f16]"],
       "the tensor-core partial's launch sized without the 128 bytes its ring is aligned up "
       "in: the ring's end runs past the block's dynamic shared memory"),
    _m("py-prefix-smem-without-slack", "python", ("paged_decode.kernels.prefix_tc",),
       "    return (ROWS_PER_WARP * num_warps * q_row + ALIGN_SLACK",
       "    return (ROWS_PER_WARP * num_warps * q_row",
       [PREFIX + "test_prefix_kernel_matches_oracle"],
       "the prefix kernel's launch sized without its tiles' alignment slack"),
    _m("py-v2-ring-one-stage-short", "python", ("paged_decode.kernels.decode_v2",),
       "    return spec.num_warps * 32 * spec.stages * stage_bytes_per_thread(",
       "    return spec.num_warps * 32 * (spec.stages - 1) * stage_bytes_per_thread(",
       [CASE + "[emulated-cuda-d64-g1-ps16-f16]"],
       "v2's launch sized one ring stage short: its last stage is written past the block's "
       "dynamic shared memory"),
    _m("py-merge-split-ignores-shared-memory", "python", ("paged_decode.backends.launches",),
       "                and merge.split_fits(head_dim, split)):",
       "                and True):",
       ["tests/test_merge.py::test_merge_at_head_dims_beyond_the_kernels[768]"],
       "a split merge at head_dim 768 takes 16 warps, whose shared sums exceed CUDA's 48 KB "
       "of static shared memory (the kernel would not compile)"),
    _m("py-merge-indptr-unsigned-wraps", "python", ("paged_decode.merge",),
       '    ip = as_int64(fn, "indptr", ip)',
       "    ip = ip",
       ["tests/test_input_limits.py::test_merge_refuses_a_decreasing_indptr_of_any_integer_"
        "type[uint32-reference]"],
       "a decreasing unsigned indptr passes the monotonicity check and merges a row twice"),
    _m("py-fi-graph-buffers-unchecked", "python", ("paged_decode.compat.fi_graph",),
       "        if self.be.capturing():",
       "        if True:",
       ["tests/test_input_limits.py::test_fi_graph_run_checks_buffers_edited_after_plan"
        "[emulated-cuda]"],
       "an eager graph-mode run reads a page id edited past the cache out of bounds"),
    _m("py-fi-graph-merge-reads-the-device-indptr", "python", ("paged_decode.compat.fi_decode",),
       "lse_out, inputs=g.plan.num_chunks)",
       "lse_out)",
       ["tests/test_fi_decode.py::"
        "test_graph_mode_sizes_the_merge_without_reading_the_device_chunk_map"],
       "a graph-mode run reads the device chunk map back to size its merge: a "
       "synchronization, and a failed torch graph capture on the GPU (S25-R2)"),
    _m("py-step-ignores-its-table-s-new-batch", "python", ("paged_decode.engine_step",),
       "        if self.table.batches != self._table_batches:   # step.table.set_sequences",
       "        if False:",
       ["tests/test_engine_step.py::"
        "test_the_step_follows_its_table_s_own_set_sequences_between_steps[reference]"],
       "a step keeps its plan after step.table.set_sequences, and every decode of a "
       "larger batch raises a PlanMismatchError its caller cannot act on"),
    _m("py-step-decodes-over-an-unfollowed-batch", "python", ("paged_decode.engine_step",),
       "        if self._batch is not None and self.table.batches != self._table_batches:",
       "        if False:",
       ["tests/test_engine_step.py::"
        "test_the_step_follows_its_table_s_own_set_sequences_between_steps[reference]"],
       "after every layer's append, step.table.set_sequences lets the step's decodes run "
       "the begun batch's q rows over the new batch (max abs error 2.6)"),
    _m("py-step-table-second-batch-maps-host-rows", "python", ("paged_decode.step_table",),
       "        src = np.where(at >= 0, old_src[np.maximum(at, 0)], -1)",
       "        src = at",
       ["tests/test_step_table.py::"
        "test_several_batches_between_flushes_keep_the_device_table_right[reference]"],
       "a second set_sequences before a flush maps rows through the first's unsent order: "
       "moved rows get another row's pages (max-rel 1.2 on emulated-cuda)"),
    _m("py-step-captures-an-empty-batch", "python", ("paged_decode.engine_step",),
       "            if self._capturing or self.backend.capturing():",
       "            if False:",
       ["tests/test_engine_step.py::test_an_empty_batch_is_not_captured"],
       "a graph captured over an empty batch replays no append: later begins' slots are "
       "never written and decodes read stale K/V (max-rel 0.49 on emulated-cuda)"),
    _m("py-replay-after-a-partial-eager-step", "python", ("paged_decode.engine_step",),
       "        if s._appended & self._layers:",
       "        if False:",
       ["tests/test_engine_step.py::"
        "test_a_replay_after_an_eager_append_is_refused_before_it_writes[emulated-cuda]"],
       "a replay after one layer's eager append rewrites that layer's slot"),
    _m("py-free-outside-the-batch-strands-the-step", "python", ("paged_decode.pool",),
       "            step._batch.version = self._version",
       "            pass",
       ["tests/test_engine_step.py::"
        "test_a_free_outside_the_batch_leaves_the_step_going[reference]"],
       "a free of a sequence outside an open step's batch blocks the step for good"),
    _m("py-prepared-remake-rereads-array-scales", "python", ("paged_decode.prepared",),
       "            kw[name] = check_scale(fn, name, kw[name])",
       "            pass",
       ["tests/test_prepared_follow.py::"
        "test_a_prepared_call_keeps_the_array_scales_it_read_through_a_remake[reference]"],
       "a prepared call over a step table re-reads an array scale when the pool changes "
       "the batch: the scale switches at an unrelated event"),
    _m("py-prepared-multitoken-ignores-qo-edit", "python", ("paged_decode.prepared",),
       "        if qo is not None and counts_key(qo[0]) != qo[1]:",
       "        if False:",
       ["tests/test_prepared_follow.py::"
        "test_a_prepared_multi_token_call_refuses_an_edited_qo_indptr"],
       "a prepared multi-token call runs the old split after qo_indptr is edited in place "
       "(max-rel 1.7)"),
    _m("py-bench-preset-override-merges-shapes", "python", ("paged_decode.bench.cases",),
       "shape = tuple(v for k, v in dataclasses.asdict(c).items() if k not in axes)",
       "shape = (c.model, c.num_qo_heads, c.head_dim, c.dtype)",
       ["tests/test_cli.py::test_a_preset_s_axes_can_be_replaced_without_losing_its_shapes"],
       "--batch over the ragged preset times one of its two ragged shapes only"),
)


def mutant(name: str) -> Mutant:
    for mt in MUTANTS:
        if mt.name == name:
            return mt
    raise KeyError(f"no mutant named {name!r}")


def by_name(name: str) -> list[Mutation]:
    """The mutations a test process installs for ``$PAGED_DECODE_MUTANT``."""
    if name == CONTROL:
        return [control("cuda"), control("metal")]
    try:
        return [mutant(name).mutation]
    except KeyError:
        raise KeyError(f"{MUTANT_ENV}={name!r}: no such mutant") from None


# ---------------------------------------------------------------------------- runner
@dataclass
class Result:
    name: str
    status: str          # "killed", "SURVIVED", "INVALID" (passed for the control)
    detail: str
    seconds: float


def _run(name: str, tests: Sequence[str], env_extra: dict[str, str]) -> Result:
    """Run ``tests`` with mutant ``name`` installed; classify from the per-test report."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="pd-mutant-") as tmp:
        report = Path(tmp) / "report.jsonl"
        # a mutant that never ends is stopped by the emulator's watchdog: sooner than its
        # default, as our tests' launches take under half a second
        env = {TIMEOUT_ENV: MUTANT_TIMEOUT_S, **os.environ, MUTANT_ENV: name,
               REPORT_ENV: str(report), **env_extra}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-x", *tests], cwd=root, env=env, capture_output=True,
                              text=True)
        secs = time.perf_counter() - t0
        rows = [json.loads(line) for line in report.read_text().splitlines()] \
            if report.exists() else []
    calls = [r for r in rows if r["when"] == "call"]
    invalid = [r for r in rows if r["outcome"] == "failed" and r["exc"] in NOT_A_KILL]
    kills = [r for r in calls if r["outcome"] == "failed" and r["exc"] not in NOT_A_KILL]
    if invalid:
        r = invalid[0]
        first = (r["msg"].splitlines() or [""])[0]
        return Result(name, "INVALID", f"{r['nodeid']}: {r['exc']}: {first}", secs)
    if kills:
        r = kills[0]
        return Result(name, "killed", f"{r['nodeid']} ({r['exc']})", secs)
    ran = {r["nodeid"] for r in calls if r["outcome"] == "passed"}
    missing = [t for t in tests
               if not any(n == t or n.startswith((t + "[", t + "::")) for n in ran)]
    if proc.returncode not in (0, 1) or missing:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return Result(name, "INVALID", f"selection did not run: {missing or tests} "
                      f"(pytest exit {proc.returncode}: {' / '.join(tail)})", secs)
    return Result(name, "passed", f"{len(ran)} tests passed", secs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only these mutants (repeatable; no control)")
    ap.add_argument("--jobs", "-j", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--legacy", action="store_true",
                    help="run under the emulator's old model (forward and reverse "
                         "schedules, synchronous cp.async): shows what it misses; "
                         "survivors are reported, not failed")
    args = ap.parse_args(argv)
    if args.list:
        for mt in MUTANTS:
            print(f"{mt.name:<36} {mt.mutation.dialect:<5} {','.join(mt.mutation.kernels):<8} "
                  f"{mt.why}")
        return 0
    from paged_decode import emulator
    ok, why = emulator.available()
    if not ok:
        print(f"mutants need the CPU kernel emulator: {why}", file=sys.stderr)
        return 1
    names = {mt.name for mt in MUTANTS}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"unknown mutants: {', '.join(unknown)}", file=sys.stderr)
        return 2
    chosen = [mt for mt in MUTANTS if not args.only or mt.name in args.only]
    stale = []
    for mt in chosen:                       # before any test runs: no stale mutant counts
        try:
            mt.mutation.check()
        except StaleMutation as exc:
            stale.append(f"{mt.name}: {exc}")
    if stale:
        print("STALE mutations (update tests/mutants.py):\n  " + "\n  ".join(stale))
        return 1
    # the emulator model is pinned: a caller's narrower schedules must not let one survive
    schedules = LEGACY_SCHEDULES if args.legacy else DEFAULT_SCHEDULES
    extra = {SCHEDULES_ENV: ",".join(schedules), RACES_ENV: "1",
             CP_ASYNC_ENV: "sync" if args.legacy else "deferred"}
    jobs = [(mt.name, mt.tests) for mt in chosen]
    if not args.only:
        union = list(dict.fromkeys(t for mt in chosen for t in mt.tests))
        jobs.insert(0, (CONTROL, tuple(union)))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: _run(j[0], j[1], extra), jobs))
    bad = []
    for r in results:
        want = "passed" if r.name == CONTROL else "killed"
        ok = r.status == want or (args.legacy and r.status == "passed")
        shown = "SURVIVED" if r.name != CONTROL and r.status == "passed" else r.status
        print(f"{r.name:<36} {shown:<9} {r.seconds:6.1f} s  {r.detail}")
        if not ok:
            bad.append(r.name)
    print(f"{len(results)} runs in {time.perf_counter() - t0:.0f} s"
          + (" (legacy emulator model)" if args.legacy else ""))
    if bad:
        print(f"FAIL: {', '.join(bad)}")
        return 1
    print("PASS: every mutant killed, control passed" if not args.legacy else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
