"""The Metal dialect of the emulator on tiny kernels, negative controls on the Metal kernel
bodies (mutated bodies must fail; the oracle matrix for both dialects is in
``test_emulated_oracle.py``), and the generated ``metal_kernel`` signature pinned
against MLX's own output (MLX's Linux CPU wheel prints it through export tracing; that
test is skipped where ``mlx`` is not installed).

Nothing here runs on Apple hardware: the emulator executes the Metal text on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import mutant_fails
from mutants import Mutation, backend, control

import paged_decode as pd
from paged_decode.backends import availability, launches
from paged_decode.backends.metal_launches import (
    metal_call,
    metal_kernel,
    mlx_geometry,
)
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.emulator import (
    CompileError,
    DivergenceError,
    MisalignedError,
    OutOfBoundsError,
    RaceError,
)
from paged_decode.emulator.metal import (
    Dtype,
    InputDesc,
    groups,
    launch_metal,
    metal_source,
    rewrite_metal,
)
from paged_decode.problems import ProblemSpec, make_problem

pytestmark = pytest.mark.skipif(not availability("emulated-metal").ok,
                                reason=f"emulator unavailable: "
                                       f"{availability('emulated-metal').reason}")


@pytest.fixture(scope="module")
def emu():
    return pd.get_backend("emulated-metal")


# ----------------------------------------------------------------- the Metal dialect
def _run_tiny(src, inputs, outputs, grid, tg, template=(), header="", **kw):
    names = [f"in{i}" for i in range(len(inputs))]
    onames = [f"out{i}" for i in range(len(outputs))]
    src = src.replace("IN0", "in0").replace("OUT0", "out0").replace("OUT1", "out1")
    launch_metal("tiny", names, onames, src, header, inputs, outputs, grid, tg, template,
                 **kw)


def test_simd_collectives_and_barrier():
    src = """
  const uint t = thread_position_in_threadgroup.x;
  threadgroup float buf[64];
  buf[t] = IN0[thread_position_in_grid.x];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const float other = buf[63 - t];                 // written by another SIMD group
  OUT0[thread_position_in_grid.x] = simd_sum(other) + simd_max(other);
  OUT1[thread_position_in_grid.x] = simd_shuffle_xor(float(thread_index_in_simdgroup),
      ushort(5)) + 100.0f * simdgroup_index_in_threadgroup;
"""
    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    o0, o1 = np.full(128, np.nan, np.float32), np.full(128, np.nan, np.float32)
    _run_tiny(src, [x], [o0, o1], (128, 1, 1), (64, 1, 1))
    for b in range(2):
        blk = x[64 * b:64 * b + 64]
        for s in range(2):
            vals = blk[::-1][32 * s:32 * s + 32]
            np.testing.assert_allclose(o0[64 * b + 32 * s:64 * b + 32 * s + 32],
                                       vals.sum() + vals.max(), rtol=1e-6)
    lanes = np.arange(128) % 32
    np.testing.assert_array_equal(o1, (lanes ^ 5) + 100.0 * ((np.arange(128) % 64) // 32))


def test_missing_threadgroup_barrier_is_a_race():
    src = """
  const uint t = thread_position_in_threadgroup.x;
  threadgroup float buf[64];
  buf[t] = IN0[t];
  OUT0[t] = buf[63 - t];
"""
    with pytest.raises(RaceError, match="out0"):
        _run_tiny(src, [np.arange(64, dtype=np.float32)], [np.zeros(64, np.float32)],
                  (64, 1, 1), (64, 1, 1))


def test_out_of_bounds_and_divergence_reported():
    with pytest.raises(OutOfBoundsError, match="'out0' at element 64"):
        _run_tiny("  OUT0[thread_position_in_grid.x + 1] = 1.0f;",
                  [np.zeros(64, np.float32)], [np.zeros(64, np.float32)], (64, 1, 1),
                  (64, 1, 1))
    with pytest.raises(DivergenceError):
        _run_tiny("  if (thread_position_in_grid.x < 32) "
                  "threadgroup_barrier(mem_flags::mem_threadgroup);\n  OUT0[0] = IN0[0];",
                  [np.zeros(64, np.float32)], [np.zeros(1, np.float32)], (64, 1, 1),
                  (64, 1, 1))


def test_a_small_input_bound_to_a_device_pointer_is_refused():
    """MLX passes an input of fewer than 8 elements in the constant address space; binding
    it to a device pointer does not compile on a Mac, so the emulator refuses it (it
    erases address spaces); 8 elements, or a pointer of the input's own type, are fine."""
    src = "  device const float* p = IN0 + 1;\n  OUT0[0] = p[0];"
    out = np.zeros(1, np.float32)
    with pytest.raises(Exception, match="input 'in0' has fewer than 8 elements, so MLX "
                       "passes it in the constant address space"):
        _run_tiny(src, [np.arange(7, dtype=np.float32)], [out], (1, 1, 1), (1, 1, 1))
    _run_tiny(src, [np.arange(8, dtype=np.float32)], [out], (1, 1, 1), (1, 1, 1))
    _run_tiny("  auto p = IN0 + 1;\n  OUT0[0] = p[0];", [np.arange(7, dtype=np.float32)],
              [out], (1, 1, 1), (1, 1, 1))
    assert out[0] == 1


def test_bfloat_converts_only_explicitly():
    """MSL's bfloat takes no implicit conversion (Apple's compiler refuses `bfloat b =
    1.0f;`); the emulator's prelude neither, so such a kernel fails here too."""
    out = np.zeros(1, np.float32)
    with pytest.raises(CompileError):
        _run_tiny("  bfloat b = IN0[0];\n  OUT0[0] = float(b);",
                  [np.ones(8, np.float32)], [out], (1, 1, 1), (1, 1, 1))
    _run_tiny("  bfloat b = bfloat(IN0[0]);\n  OUT0[0] = float(b);",
              [np.ones(8, np.float32)], [out], (1, 1, 1), (1, 1, 1))
    assert out[0] == 1


def test_threadgroup_memory_limit_and_templates():
    src = """
  threadgroup float big[N];
  big[thread_position_in_threadgroup.x] = 1.0f;
  OUT0[0] = static_cast<T>(big[0]);
"""
    out = np.zeros(1, np.float16)
    _run_tiny(src, [np.zeros(8, np.float32)], [out], (1, 1, 1), (1, 1, 1),
              [("T", Dtype("float16")), ("N", 8192)])
    assert out[0] == 1
    with pytest.raises(Exception, match="threadgroup memory exceeds"):
        _run_tiny(src, [np.zeros(8, np.float32)], [out], (1, 1, 1), (1, 1, 1),
                  [("T", Dtype("float16")), ("N", 8193)])


def test_qualifiers_rewritten_only_in_declarations():
    src = """
  const device float* p = IN0;
  threadgroup float tg[4];
  threadgroup float* tp = tg;
  int device = 2, constant = 3;                    // identifiers spelled like qualifiers
  tp[0] = p[0] * device + constant;
  OUT0[0] = tg[0];
"""
    out = np.zeros(1, np.float32)
    _run_tiny(src, [np.full(8, 5.0, np.float32)], [out], (1, 1, 1), (1, 1, 1))
    assert out[0] == 13.0
    assert "device" not in rewrite_metal("const device float* a; device half4* b;")


def test_vector_casts_must_be_aligned_to_the_vector():
    """A half4 read through a cast device pointer must be 8-byte aligned (MSL aligns a
    vector to its size); a threadgroup float4 16-byte aligned. An aligned cast passes."""
    src = """
  threadgroup float tg[12];
  const float4 v = float4(*reinterpret_cast<const device half4*>(IN0 + A));
  *reinterpret_cast<threadgroup float4*>(tg + B) = v;
  OUT0[0] = tg[B] + tg[B + 1] + tg[B + 2] + tg[B + 3];
"""
    x = np.arange(16, dtype=np.float16)
    out = np.zeros(1, np.float32)
    _run_tiny(src, [x], [out], (1, 1, 1), (1, 1, 1), [("A", 4), ("B", 8)])
    assert out[0] == 4 + 5 + 6 + 7
    with pytest.raises(MisalignedError, match=r"misaligned 8-byte access through a cast to "
                       r"const pd_metal::vec<_Float16, 4>\*: buffer 'in0' byte offset 4"):
        _run_tiny(src, [x], [out], (1, 1, 1), (1, 1, 1), [("A", 2), ("B", 8)])
    with pytest.raises(MisalignedError, match=r"misaligned 16-byte access through a cast to "
                       r"pd_metal::vec<float, 4>\*: static shared byte offset \d+ is not a "
                       r"multiple of 16"):
        _run_tiny(src, [x], [out], (1, 1, 1), (1, 1, 1), [("A", 4), ("B", 2)])


def test_geometry_counts_threads():
    assert mlx_geometry((5, 3), 128) == ((640, 3, 1), (128, 1, 1))
    assert groups((640, 3, 1), (128, 1, 1)) == ((5, 3, 1), (128, 1, 1))
    assert groups((32, 1, 1), (128, 1, 1)) == ((1, 1, 1), (32, 1, 1))   # min(tg, grid)
    with pytest.raises(Exception, match="non-uniform"):
        groups((130, 1, 1), (128, 1, 1))


# ----------------------------------------------------------------- negative controls
SPEC_NEG = ProblemSpec(3, 60, 8, 2, 64, 16, seed=30)


def test_metal_off_by_one_page_index_fails():
    bad = backend(Mutation("metal", ("v2",), "page_ids[a / PAGE_SIZE]",
                           "page_ids[a / PAGE_SIZE + 1]"))
    assert "out-of-bounds read of buffer 'indices'" in mutant_fails(bad, SPEC_NEG)


def test_metal_removed_threadgroup_barrier_fails():
    bad = backend(Mutation("metal", ("v2",),
                           "    threadgroup_barrier(mem_flags::mem_threadgroup);\n", ""))
    why = mutant_fails(bad, SPEC_NEG)
    assert "differs between the forward and the reverse fiber schedule" in why, why


def test_metal_removed_round_barrier_fails():
    """The barrier between combine rounds (head_dim 256, 8 heads per threadgroup)."""
    bad = backend(Mutation("metal", ("v2",),
                           "    if (g0 > 0) threadgroup_barrier(mem_flags::mem_threadgroup);", ""))
    why = mutant_fails(bad, ProblemSpec(1, 40, 8, 1, 256, 16, seed=33))
    assert "differs between the forward and the reverse fiber schedule" in why, why


# The per-token reduction: head-transposed at power-of-two QH (QH 4 here), one butterfly
# per (token, head) otherwise (QH 7). Each mutation breaks one of the two paths. Chunks of
# 8 pages (128 tokens) take two steps of 64 tokens (16 sub-groups x U 4) with several
# tokens per sub-group, so the broadcast alpha and p matter (at one page per chunk a
# sub-group sees one token and p is 1 for every head).
SPEC_RED = ProblemSpec(2, 200, 8, 2, 64, 16, seed=31)
REDUCTION_MUTANTS = [
    ("transpose-keep-give", SPEC_RED,
     "const float keep = up ? s[h + hn][u] : s[h][u];",
     "const float keep = up ? s[h][u] : s[h + hn][u];"),
    ("transpose-p-lane", SPEC_RED,
     "simd_shuffle(s[0][u], ushort(sub0 + g * HLANES))", "simd_shuffle(s[0][u], ushort(sub0))"),
    ("transpose-alpha-lane", SPEC_RED,
     "simd_shuffle(alpha, ushort(sub0 + g * HLANES))", "simd_shuffle(alpha, ushort(sub0))"),
    ("transpose-final-m-lane", SPEC_RED,
     "m[g] = simd_shuffle(m_h, ushort(sub0 + g * HLANES));",
     "m[g] = simd_shuffle(m_h, ushort(sub0));"),
    ("butterfly-qh7", ProblemSpec(2, 200, 7, 1, 64, 16, seed=35),
     "const float x = group_sum<TPR>(s[g][u]);", "const float x = s[g][u];"),
]


@pytest.mark.parametrize("spec,old,new", [m[1:] for m in REDUCTION_MUTANTS],
                         ids=[m[0] for m in REDUCTION_MUTANTS])
def test_metal_reduction_mutants_fail(spec, old, new):
    bad = backend(Mutation("metal", ("v2",), old, new))
    assert mutant_fails(bad, spec, ppc=8)


def test_metal_reduction_identity_passes():
    ok = backend(control("metal", ["v2"]))
    assert mutant_fails(ok, SPEC_RED, ppc=8) == ""


def test_metal_identity_mutant_passes():
    ok = backend(control("metal", ["v2"]))
    assert mutant_fails(ok, SPEC_NEG, ppc=1) == ""


def test_metal_sources_are_ascii_and_cuda_untouched():
    from paged_decode.specs import cuda_source
    for k in ("v2", "v1", "merge"):
        mk = metal_kernel(k)
        (mk.header + mk.source).encode("ascii")
        assert "__global__" in cuda_source(k) and "__global__" not in mk.source


def test_metal_v2_mirrors_cuda_reduction_rules():
    """The compile-time rules of the v2 reduction are spelled alike in both dialects (the
    results cannot show U, and both reduction paths give the same answer)."""
    from paged_decode.specs import cuda_source
    cuda, metal = cuda_source("v2"), metal_kernel("v2").header
    for line in ("constexpr int U = QH >= 8 ? 2 : 4;",
                 "constexpr bool TRANSPOSE = (QH & (QH - 1)) == 0 && QH <= TPR;",
                 "constexpr int HLANES = TRANSPOSE ? TPR / QH : TPR;"):
        assert line in cuda and line in metal, line


def test_metal_compile_error_is_reported():
    with pytest.raises(CompileError):
        _run_tiny("  OUT0[0] = undefined_name;", [np.zeros(8, np.float32)],
                  [np.zeros(1, np.float32)], (1, 1, 1), (1, 1, 1))


def test_metal_call_geometry_and_names():
    """Each launch converts to MLX units in one place; names carry every specialization."""
    calls, _ = _calls()
    v2, merge, v1 = calls
    assert v2.threadgroup == (128, 1, 1) and v2.grid[0] % 128 == 0 and v2.grid[2] == 1
    assert merge.threadgroup == (128, 1, 1) and merge.grid == (-(-3 * 8 // 4) * 128, 1, 1)
    assert v1.threadgroup == (256, 1, 1) and v1.grid == (3 * 8 * 256, 1, 1)
    assert v2.name == "pd_v2_qf16_kvf16_of32_hd64_ps16_qh4_w4"
    assert [v for _, v in v2.template] == [Dtype("float16"), Dtype("float16"),
                                           Dtype("float32"), 64, 16, 4, 4, False, False, 0]
    assert [n for n, _ in v1.template] == ["TQ", "TKV", "TO", "HEAD_DIM", "PAGE_SIZE",
                                           "NUM_WARPS", "SOFT_CAP", "SINK", "KV_FP8"]
    # every scalar is a 0-d input (a constant reference in the generated signature); the
    # unread sinks pointer of a merge without sinks is the lse input again
    assert [np.ndim(x) for x in merge.inputs] == [3, 2, 1, 2, 0, 0]


# ----------------------------------------------------------------- MLX's generated signature
MX_TYPES = ("float16", "bfloat16", "float32", "int32")


def _calls():
    """One launch of each kernel, as the emulated-metal backend builds them."""
    rb = ReferenceBackend()
    spec = ProblemSpec(3, 70, 8, 2, 64, 16, seed=21)
    pr = make_problem(spec)
    plan = pd.plan_decode(pr.table, 8, 2, 64, pages_per_chunk=1)
    vo = np.zeros((plan.num_chunks, 8, 64), np.float32)
    lo = np.zeros((plan.num_chunks, 8), np.float32)
    tab = tuple(np.asarray(getattr(pr.table, n), np.int32) for n in launches.TABLE_FIELDS)
    lcs = [
        launches.partial_launch(dtypes=("float16", "float16", "float32"), plan=plan,
                                sm_scale=0.125, q=pr.q, k_pages=pr.k_pages,
                                v_pages=pr.v_pages, table=tab,
                                request_indices=np.asarray(plan.request_indices, np.int32),
                                kv_tile_indices=np.asarray(plan.kv_tile_indices, np.int32),
                                v_out=vo, lse_out=lo),
        launches.merge_launch(out_dtype="bfloat16", shape=(3, 8, 64), v=vo, lse=lo,
                              o_indptr=np.asarray(plan.o_indptr, np.int32),
                              v_out=np.zeros((3, 8, 64), np.float32),
                              lse_out=np.zeros((3, 8), np.float32)),
        launches.v1_launch(dtypes=("float16", "float16", "float32"), shape=(3, 8, 64),
                           num_kv_heads=2, page_size=16, sm_scale=0.125, q=pr.q,
                           k_pages=pr.k_pages, v_pages=pr.v_pages, table=tab,
                           out=np.zeros((3, 8, 64), np.float32),
                           lse_out=np.zeros((3, 8), np.float32)),
    ]
    return [metal_call(lc, rb.dtype_of) for lc in lcs], rb


def test_metal_signature_matches_mlx(tmp_path, capfd):
    mx = pytest.importorskip("mlx.core")
    if not hasattr(mx, "export_function"):
        pytest.skip("this mlx has no export_function")
    calls, rb = _calls()
    mxd = {n: getattr(mx, n) for n in MX_TYPES}
    for i, call in enumerate(calls):
        mk = call.kernel
        ins = [np.asarray(x) for x in call.inputs]
        descs = [InputDesc(n, rb.dtype_of(a) if a.dtype.kind == "f" else "int32",
                           tuple(a.shape)) for n, a in zip(mk.inputs, ins)]
        mine = metal_source(call.name, descs, mk.outputs, call.output_dtypes, mk.source,
                            mk.header, call.template)
        kern = mx.fast.metal_kernel(name=call.name, input_names=list(mk.inputs),
                                    output_names=list(mk.outputs), source=mk.source,
                                    header=mk.header)
        tmpl = [(n, mxd[v.name] if isinstance(v, Dtype) else v) for n, v in call.template]
        out_shapes = [tuple(o.shape) for o in call.outputs]
        out_dtypes = [mxd[d] for d in call.output_dtypes]

        def f(*a, kern=kern, tmpl=tmpl, out_shapes=out_shapes, out_dtypes=out_dtypes,
              call=call):
            return kern(inputs=list(a), output_shapes=out_shapes, output_dtypes=out_dtypes,
                        grid=call.grid, threadgroup=call.threadgroup, template=tmpl,
                        verbose=True)

        args = [mx.array(a) for a in ins]
        capfd.readouterr()
        mx.export_function(str(tmp_path / f"k{i}.mlxfn"), f, *args)
        printed = capfd.readouterr().out
        assert "```\n" in printed, printed[-2000:]
        theirs = printed.split("```\n", 1)[1].rsplit("```", 1)[0]
        assert theirs == mine + "\n", call.name


def test_metal_signature_small_inputs_and_metadata(tmp_path, capfd):
    """Address spaces (0-d -> constant reference, < 8 elements -> constant pointer),
    metadata buffers and attributes by substring, bool/int/dtype templates."""
    mx = pytest.importorskip("mlx.core")
    src = ("  // thread_index_in_threadgroup threads_per_grid grid_size\n"
           "  out[0] = T(a[0] * s + b[0] + a_shape[0] + b_strides[0] + b_ndim);\n")
    descs = [InputDesc("a", "float16", (16, 8)), InputDesc("s", "float32", ()),
             InputDesc("b", "int32", (2, 3))]
    tmpl = [("T", Dtype("bfloat16")), ("N", 16), ("C", True)]
    mine = metal_source("probe", descs, ["out"], ["bfloat16"], src, "// hdr\n", tmpl)
    kern = mx.fast.metal_kernel(name="probe", input_names=["a", "s", "b"],
                                output_names=["out"], source=src, header="// hdr\n")

    def f(a, s, b):
        return kern(inputs=[a, s, b], output_shapes=[(1,)], output_dtypes=[mx.bfloat16],
                    grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    template=[("T", mx.bfloat16), ("N", 16), ("C", True)], verbose=True)

    capfd.readouterr()
    mx.export_function(str(tmp_path / "p.mlxfn"), f, mx.zeros((16, 8), mx.float16),
                       mx.array(np.float32(0.5)), mx.zeros((2, 3), mx.int32))
    theirs = capfd.readouterr().out.split("```\n", 1)[1].rsplit("```", 1)[0]
    assert theirs == mine + "\n"
