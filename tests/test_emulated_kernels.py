"""The real CUDA kernels on the ``emulated-cuda`` backend: negative controls (mutated
kernel sources must fail) and the launch packing shared with the CUDA backend. The
oracle matrix for both dialects is in ``test_emulated_oracle.py``.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from helpers import assert_matches_oracle, mutant_fails
from mutants import Mutation, backend, control

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.emulated import EmulatedCudaBackend
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.emulator import OutOfBoundsError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.specs import cuda_source

pytestmark = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                reason=f"emulator unavailable: "
                                       f"{availability('emulated-cuda').reason}")


@pytest.fixture(scope="module")
def emu():
    return pd.get_backend("emulated-cuda")


# ----------------------------------------------------------------- negative controls
SPEC_NEG = ProblemSpec(3, 60, 8, 2, 64, 16, seed=30)


def test_off_by_one_page_index_fails():
    bad = backend(Mutation("cuda", ("v2",), "page_ids[a / PAGE_SIZE]",
                           "page_ids[a / PAGE_SIZE + 1]"))
    with pytest.raises(OutOfBoundsError, match=r"pd_decode_v2_partial<.*'indices'"):
        pd.decode(*_problem_args(SPEC_NEG), path="v2", backend=bad)


def test_off_by_one_page_offset_fails():
    bad = backend(Mutation("cuda", ("v2",), "const int a = a_begin + i;",
                           "const int a = a_begin + i + 1;"))
    assert mutant_fails(bad, SPEC_NEG, ppc=1)


def test_removed_syncthreads_fails():
    bad = backend(Mutation("cuda", ("v2",), "  __syncthreads();\n", ""))
    why = mutant_fails(bad, SPEC_NEG)
    assert "differs between the forward and the reverse fiber schedule" in why, why


def test_merge_without_rescale_fails():
    bad = backend(Mutation("cuda", ("merge",), "if (s > -PD_INF) w = exp2f(s - mx);",
                           "if (s > -PD_INF) w = 1.f;"))
    assert mutant_fails(bad, SPEC_NEG, ppc=1)


@pytest.mark.parametrize("old, new, context", [
    # the first batch, read with the LSEs (4 partials per group: nothing after it)
    ("const long long ru = __shfl_sync(0xffffffffu, src_first, u);",
     "const long long ru = __shfl_sync(0xffffffffu, src_first, 0);", 60),
    # the later batches (13 partials per group)
    ("const long long ru = __shfl_sync(0xffffffffu, src, j + u);",
     "const long long ru = __shfl_sync(0xffffffffu, src, j);", 200)])
def test_merge_reading_the_wrong_row_fails(old, new, context):
    # the batched row reads: lane u's row taken for all UNROLL rows of a batch
    bad = backend(Mutation("cuda", ("merge",), old, new))
    assert mutant_fails(bad, dataclasses.replace(SPEC_NEG, context=context), ppc=1)


def test_merge_with_a_lane_local_denominator_fails():
    bad = backend(Mutation("cuda", ("merge",), "  den = pd::group_sum<32>(den);\n", ""))
    assert mutant_fails(bad, SPEC_NEG, ppc=1)


def test_reference_mutant_control_passes():
    # the harness itself: an identity "mutation" must pass
    ok = backend(control("cuda", ["v2"]))
    assert mutant_fails(ok, SPEC_NEG, ppc=1) == ""


def _problem_args(spec):
    pr = make_problem(spec)
    return pr.q, pr.k_pages, pr.v_pages, pr.table


# ----------------------------------------------------------------- launch packing
def test_launch_packing_matches_cuda_backend(monkeypatch):
    """The emulated backend launches with the CUDA backend's spec, grid, block, dynamic
    shared memory and arguments (CuPy faked out; cuda.py's own code builds the launch)."""
    from paged_decode.backends import cuda as cuda_mod
    calls = {"cuda": [], "emu": []}
    monkeypatch.setattr(cuda_mod, "cp", types.SimpleNamespace(ndarray=np.ndarray))
    cb = cuda_mod.CudaBackend()
    monkeypatch.setattr(cb, "check_pools", lambda *a: None)
    monkeypatch.setattr(cb, "upload", lambda a: a)
    monkeypatch.setattr(cb, "dtype_of", ReferenceBackend().dtype_of)
    monkeypatch.setattr(cb, "_run", lambda launch: calls["cuda"].append(launch))
    eb = EmulatedCudaBackend()
    # the merge's split rule reads the device (no CuPy here): the same one for both
    monkeypatch.setattr(cb, "device_info", lambda index=None: eb.device_info())
    monkeypatch.setattr(eb, "_run", lambda launch: calls["emu"].append(launch))
    spec = ProblemSpec(2, 50, 8, 2, 64, 16, seed=31)
    pr = make_problem(spec)
    plan = pd.plan_decode(pr.table, 8, 2, 64, pages_per_chunk=1)
    for be in (cb, eb):
        vo = np.zeros((plan.num_chunks, 8, 64), np.float32)
        lo = np.zeros((plan.num_chunks, 8), np.float32)
        be.partial(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, 0.125, vo, lo)
        be.merge(vo, lo, plan.o_indptr, np.zeros((2, 8, 64), np.float16),
                 np.zeros((2, 8), np.float32))
        be.decode_v1(pr.q, pr.k_pages, pr.v_pages, pr.table, 0.125,
                     np.zeros((2, 8, 64), np.float32), np.zeros((2, 8), np.float32))
    assert len(calls["cuda"]) == len(calls["emu"]) == 3
    for c, e in zip(calls["cuda"], calls["emu"]):
        assert (c.spec, c.grid, c.block, c.smem) == (e.spec, e.grid, e.block, e.smem)
        assert [(a.name, a.role) for a in c.args] == [(a.name, a.role) for a in e.args]
        for a, b in zip(c.args, e.args):
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


def test_source_is_the_cuda_backends(emu):
    """The emulator compiles the CUDA backend's source, after NVRTC's ``-D`` options for
    the spec as ``#define`` lines."""
    from paged_decode.specs import cuda_define_text, v2_spec
    spec = v2_spec("float16", "float16", "float32", 64, 16, 4)
    assert emu.kernel_source(spec) == cuda_define_text(spec) + cuda_source("v2")


def test_the_emulator_compiles_the_gpus_defines(emu):
    """So it runs the CTA order the GPU runs: chunks first over 128-byte rows, head slots
    first over 192-byte ones (``specs.heads_first``)."""
    from paged_decode.specs import v2_spec, v2tc_spec
    def defines(spec):   # the lines before the source's first #include
        return emu.kernel_source(spec).split("#include")[0].split()
    narrow = v2_spec("float16", "float16", "float32", 64, 16, 4)
    assert defines(narrow) == ["#define", "PD_L2_PREFETCH", "128"]
    wide = v2tc_spec("float16", "float32", 96, 16)
    assert defines(wide) == ["#define", "PD_L2_PREFETCH", "128", "#define", "PD_HEADS_FIRST", "1"]


ROW_LOAD_CASES = [
    # (id, spec): two 16-byte loads per lane per row (half the lanes per row of the default)
    ("d128-g4-f16", ProblemSpec(3, 150, 8, 2, 128, 16, seed=41)),
    ("d64-g8-bf16", ProblemSpec(2, 90, 8, 1, 64, 16, "bfloat16", "bfloat16", seed=42)),
    ("d256-g2-f32", ProblemSpec(2, 40, 4, 2, 256, 8, "float32", "float32", seed=43)),
]


@pytest.mark.parametrize("spec", [c[1] for c in ROW_LOAD_CASES],
                         ids=[c[0] for c in ROW_LOAD_CASES])
def test_v2_with_two_row_loads_matches_oracle(spec, monkeypatch):
    from paged_decode.reference import oracle_decode
    monkeypatch.setenv("PAGED_DECODE_V2_ROW_LOADS", "2")
    be = pd.get_backend("emulated-cuda")
    pr = make_problem(spec)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    for ppc in (None, 2):
        plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                              device=be.device_info(), pages_per_chunk=ppc)
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2",
                             return_lse=True, out_dtype="float32", backend=be)
        assert_matches_oracle(out, lse, ref, ref_lse, "float32", f"{spec.label} ld2 {ppc}")
    from paged_decode.specs import v2_spec
    assert v2_spec(spec.q_dtype, spec.kv_dtype, "float32", spec.head_dim, spec.page_size,
                   1).row_loads == 2
