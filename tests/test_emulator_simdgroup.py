"""Metal's SIMD-group matrices on the CPU emulator (``emulator/metal_simdgroup.py``).

Small MLX-style Metal bodies run through ``emulator.metal.launch_metal``: products of
8 x 8 matrices loaded from device and threadgroup memory (float, half and bfloat
operands, float accumulators; with and without ``transpose``, a non-zero
``matrix_origin`` and row strides) against numpy in float64 within the float32
accumulation bound of ``helpers.f32_dot_bound``; the documented rounding of a 16-bit
accumulator bit for bit; the ``thread_elements()`` lane mapping (MLX's); negative
controls (a body that forgets a transpose, a body with a wrong lane mapping) that must
fail the same checks; divergence (a lane that skips an operation, exits before it,
passes another pointer, a SIMD group of fewer than 32 threads) reported as the
emulator's error; and the ``metal_kernel`` signature of such a body pinned against
MLX's Linux CPU build (skipped without ``mlx``).

Nothing here runs on Apple hardware: the emulator executes the Metal text on the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import f32_dot_bound

from paged_decode.backends import availability
from paged_decode.dtypes import numpy_dtype
from paged_decode.emulator import DivergenceError, OutOfBoundsError, RaceError
from paged_decode.emulator.metal import Dtype, InputDesc, launch_metal, metal_source

pytestmark = pytest.mark.skipif(not availability("emulated-metal").ok,
                                reason=f"emulator unavailable: "
                                       f"{availability('emulated-metal').reason}")

DTYPES = ("float32", "float16", "bfloat16")


def _run(src, inputs, outputs, threads=32, template=(), header="", **kw):
    launch_metal("sg", [f"in{i}" for i in range(len(inputs))],
                 [f"out{i}" for i in range(len(outputs))], src, header, inputs, outputs,
                 (threads, 1, 1), (threads, 1, 1), template, **kw)


def _nan(shape, dtype="float32"):
    return np.full(shape, np.nan, numpy_dtype(dtype))


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(numpy_dtype(dtype))


def _f64(x):
    return np.asarray(x).astype(np.float32).astype(np.float64)


def mlx_coord(lane: int) -> tuple[int, int]:
    """(row, first column) of a lane's two elements: MLX's ``BaseMMAFrag<T, 8, 8>::
    get_coord`` (``mlx/backend/metal/kernels/steel/attn/mma.h``)."""
    q = lane // 4
    return (q & 4) + (lane // 2) % 4, (q & 2) * 2 + (lane % 2) * 2


# ----------------------------------------------------------------- products
# SIMD group 0 multiplies its A tile from device memory, SIMD group 1 the next 8 rows of
# A from a threadgroup copy; B from the same memory as A, transposed when TB; C (when
# ACC) added from device memory; D stored (transposed when TS) to device memory by group
# 0 and through threadgroup memory by group 1.
PRODUCT = """
  const uint s = simdgroup_index_in_threadgroup;
  const uint t = thread_index_in_threadgroup;
  threadgroup T ta[NA];
  threadgroup T tb[NB];
  threadgroup float td[128];
  for (uint i = t; i < NA; i += 64) ta[i] = in0[i];
  for (uint i = t; i < NB; i += 64) tb[i] = in1[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<T, 8, 8> a, b;
  if (s == 0) {
    simdgroup_load(a, in0, LDA, ulong2(AX, AY), false);
    simdgroup_load(b, in1, LDB, ulong2(BX, BY), TB);
  } else {
    simdgroup_load(a, ta, LDA, ulong2(AX, AY + 8), false);
    simdgroup_load(b, tb, LDB, ulong2(BX, BY), TB);
  }
  simdgroup_float8x8 d;
  if (ACC) {
    simdgroup_float8x8 c;
    simdgroup_load(c, in2, 8, ulong2(0, 8 * s));
    simdgroup_multiply_accumulate(d, a, b, c);
  } else {
    simdgroup_multiply(d, a, b);
  }
  if (s == 0) simdgroup_store(d, out0, 8, 0, TS);
  else simdgroup_store(d, td, 8, ulong2(0, 8), TS);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (s == 1) for (uint i = t - 32; i < 64; i += 32) out0[64 + i] = td[64 + i];
"""

#: (row stride, origin x, origin y) of A and of B, B transposed, C added, D transposed
CASES = {
    "ab": dict(lda=8, ax=0, ay=0, ldb=8, bx=0, by=0, tb=False, acc=False, ts=False),
    "abt-acc-origin-stride": dict(lda=13, ax=3, ay=2, ldb=11, bx=1, by=2, tb=True, acc=True,
                                  ts=True),
}


def _product(dtype, case, *, body_tb=None, seed=0):
    """Run PRODUCT for ``case``; returns (output [16, 8], float64 reference, bound).
    ``body_tb`` overrides the body's transpose of B (the negative control)."""
    c = CASES[case]
    rng = np.random.default_rng(seed)
    a = _rand(rng, (c["ay"] + 16, c["lda"]), dtype)
    b = _rand(rng, (c["by"] + 8, c["ldb"]), dtype)
    acc = _rand(rng, (16, 8), "float32")
    out = _nan((16, 8))
    tb = c["tb"] if body_tb is None else body_tb
    tmpl = [("T", Dtype(dtype)), ("LDA", c["lda"]), ("AX", c["ax"]), ("AY", c["ay"]),
            ("LDB", c["ldb"]), ("BX", c["bx"]), ("BY", c["by"]), ("TB", tb),
            ("ACC", c["acc"]), ("TS", c["ts"]), ("NA", a.size), ("NB", b.size)]
    _run(PRODUCT, [a, b, acc], [out], 64, tmpl)
    bt = _f64(b)[c["by"]:c["by"] + 8, c["bx"]:c["bx"] + 8]
    bm = bt.T if c["tb"] else bt
    ref, terms = np.zeros((16, 8)), np.zeros((16, 8))
    for s in range(2):
        at = _f64(a)[c["ay"] + 8 * s:c["ay"] + 8 * s + 8, c["ax"]:c["ax"] + 8]
        cs = _f64(acc)[8 * s:8 * s + 8] if c["acc"] else np.zeros((8, 8))
        d, t = at @ bm + cs, np.abs(at) @ np.abs(bm) + np.abs(cs)
        ref[8 * s:8 * s + 8], terms[8 * s:8 * s + 8] = (d.T, t.T) if c["ts"] else (d, t)
    return out, ref, f32_dot_bound(terms, 8)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_product_matches_float64(dtype, case):
    out, ref, bound = _product(dtype, case)
    assert np.isfinite(out).all(), "an element of D was never written"
    err = np.abs(out.astype(np.float64) - ref)
    assert (err <= bound).all(), f"max error / bound {np.max(err / bound):.3g}"
    assert np.abs(ref).max() > 1.0        # the check compares real values


def test_forgotten_transpose_fails_the_check():
    """Negative control: the body loads B without the transpose the case asks for."""
    out, ref, bound = _product("float16", "abt-acc-origin-stride", body_tb=False)
    assert np.isfinite(out).all()
    assert (np.abs(out.astype(np.float64) - ref) > 100 * bound).any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_accumulator_rounds_once(dtype):
    """All-16-bit D = A B + C: c, then the 8 products in order of k, in float32 fused
    multiply-adds (the products of 16-bit values are exact in float32), rounded once to
    the 16-bit type (the documented choice) -- bit for bit."""
    src = """
  simdgroup_matrix<T, 8, 8> a, b, c, d;
  simdgroup_load(a, in0);
  simdgroup_load(b, in1);
  simdgroup_load(c, in2);
  simdgroup_multiply_accumulate(d, a, b, c);
  simdgroup_store(d, out0);
"""
    rng = np.random.default_rng(3)
    a, b, c = (_rand(rng, (8, 8), dtype) for _ in range(3))
    out = _nan((8, 8), dtype)
    _run(src, [a, b, c], [out], template=[("T", Dtype(dtype))])
    af, bf = a.astype(np.float32), b.astype(np.float32)
    model = c.astype(np.float32)
    for k in range(8):
        model = model + af[:, k:k + 1] * bf[k:k + 1, :]     # exact products, one rounding
    np.testing.assert_array_equal(out.view(np.uint16),
                                  model.astype(numpy_dtype(dtype)).view(np.uint16))
    ref = _f64(a) @ _f64(b) + _f64(c)
    bound = f32_dot_bound(np.abs(_f64(a)) @ np.abs(_f64(b)) + np.abs(_f64(c)), 8, dtype,
                          ref)
    assert (np.abs(_f64(out) - ref) <= bound).all()


def test_operator_and_aliasing_and_fills():
    """``a * b``; d aliasing an operand (c = a c + c); the diagonal constructor,
    ``make_filled_simdgroup_matrix`` and a value-initialized array tail (zeros)."""
    src = """
  simdgroup_float8x8 a, c;
  simdgroup_load(a, in0);
  simdgroup_load(c, in1);
  simdgroup_float8x8 p = a * c;
  simdgroup_multiply_accumulate(c, a, c, c);
  simdgroup_store(p, out0);
  simdgroup_store(c, out0 + 64);
  simdgroup_float8x8 r[2] = {simdgroup_float8x8(2.5f)};
  simdgroup_store(r[0], out1);
  simdgroup_store(r[1], out1 + 64);
  simdgroup_half8x8 h = make_filled_simdgroup_matrix<half, 8>(1.5f);
  simdgroup_store(h, out2);
"""
    rng = np.random.default_rng(4)
    a, c = _rand(rng, (8, 8), "float32"), _rand(rng, (8, 8), "float32")
    o0, o1, o2 = _nan((2, 8, 8)), _nan((2, 8, 8)), _nan((8, 8), "float16")
    _run(src, [a, c], [o0, o1, o2])
    af, cf = _f64(a), _f64(c)
    bound = f32_dot_bound(np.abs(af) @ np.abs(cf) + np.abs(cf), 8)
    assert (np.abs(o0[0] - af @ cf) <= bound).all()
    assert (np.abs(o0[1] - (af @ cf + cf)) <= bound).all()
    np.testing.assert_array_equal(o1[0], 2.5 * np.eye(8))
    np.testing.assert_array_equal(o1[1], np.zeros((8, 8)))
    np.testing.assert_array_equal(o2, np.full((8, 8), 1.5))


# ----------------------------------------------------------------- the lane mapping
MAPPING = """
  const uint l = thread_index_in_simdgroup;
  simdgroup_float8x8 m;
  m.thread_elements()[0] = float(2 * l);
  m.thread_elements()[1] = float(2 * l + 1);
  simdgroup_store(m, out0);                    // where each lane's elements land
  simdgroup_float8x8 x;
  simdgroup_load(x, in0);
  out1[2 * l] = x.thread_elements()[0];       // which elements each lane holds
  out1[2 * l + 1] = x.thread_elements()[1];
  // MLX's use (steel BlockMMA): elements placed by get_coord, multiplied, read back
  const short qid = l / 4;
  const short sm = (qid & 4) + (l / 2) % 4;
  const short sn = (qid & 2) * 2 + (l % 2) * 2;
  simdgroup_float8x8 a, b, d;
  a.thread_elements()[0] = in0[(ROW_MAJOR ? sm * 8 + sn : sn * 8 + sm)];
  a.thread_elements()[1] = in0[(ROW_MAJOR ? sm * 8 + sn + 1 : (sn + 1) * 8 + sm)];
  simdgroup_load(b, in1);
  simdgroup_multiply(d, a, b);
  out2[sm * 8 + sn] = d.thread_elements()[0];
  out2[sm * 8 + sn + 1] = d.thread_elements()[1];
"""


def _mapping(row_major: bool):
    rng = np.random.default_rng(5)
    x, b = _rand(rng, (8, 8), "float32"), _rand(rng, (8, 8), "float32")
    o0, o1, o2 = _nan((8, 8)), _nan(64), _nan((8, 8))
    _run(MAPPING, [x, b], [o0, o1, o2], template=[("ROW_MAJOR", row_major)])
    return x, b, o0, o1, o2


def test_thread_elements_follow_mlx_mapping():
    x, b, placed, held, product = _mapping(True)
    want = np.full((8, 8), -1.0)
    for lane in range(32):
        r, c = mlx_coord(lane)
        want[r, c], want[r, c + 1] = 2 * lane, 2 * lane + 1
        assert (held[2 * lane], held[2 * lane + 1]) == (x[r, c], x[r, c + 1])
    np.testing.assert_array_equal(placed, want)            # a bijection: every slot set
    bound = f32_dot_bound(np.abs(_f64(x)) @ np.abs(_f64(b)), 8)
    assert (np.abs(product - _f64(x) @ _f64(b)) <= bound).all()


def test_wrong_lane_mapping_fails_the_check():
    """Negative control: elements placed with rows and columns swapped multiply x^T."""
    x, b, _, _, product = _mapping(False)
    bound = f32_dot_bound(np.abs(_f64(x)) @ np.abs(_f64(b)), 8)
    assert (np.abs(product - _f64(x) @ _f64(b)) > 100 * bound).any()


# ----------------------------------------------------------------- what is reported
BASE = """
  simdgroup_float8x8 a, b, c;
  simdgroup_load(a, in0 + OFF);
  simdgroup_load(b, in0);
  if (thread_index_in_simdgroup != SKIP_LANE) {          // 32: no lane skips
    simdgroup_multiply(c, a, b);
  }
  if (thread_index_in_simdgroup == EXIT_LANE) return;     // 32: no lane exits
  simdgroup_float8x8 e;
  simdgroup_multiply(e, c, b);
  simdgroup_store(e, out0);
"""


def _base(skip=32, exit_=32, off="0", threads=32, n=64):
    src = BASE.replace("OFF", off)
    tmpl = [("SKIP_LANE", skip), ("EXIT_LANE", exit_)]
    _run(src, [np.ones(n, np.float32)], [_nan(64)], threads, tmpl)


def test_control_body_runs():
    _base()


def test_lane_skipping_a_multiply_is_divergence():
    with pytest.raises(DivergenceError, match=r"different collectives \(lane 0: "
                                              r"simdgroup_multiply at line 6 of the body.*"
                                              r"lane 5: simdgroup_multiply at line 10"):
        _base(skip=5)


def test_lane_exiting_before_a_multiply_is_divergence():
    with pytest.raises(DivergenceError, match=r"31 of 32 lanes of warp 0 wait in "
                                              r"simdgroup_multiply at line 10 of the body "
                                              r"while 1 lanes exited"):
        _base(exit_=31)


def test_lane_dependent_pointer_is_divergence():
    with pytest.raises(DivergenceError, match=r"simdgroup_load: lanes \d+ and \d+ of SIMD "
                                              r"group 0 pass different arguments"):
        _base(off="(thread_index_in_simdgroup == 3 ? 8 : 0)", n=72)


def test_partial_simd_group_is_refused():
    with pytest.raises(DivergenceError, match=r"simdgroup_load needs a full SIMD group of "
                                              r"32 threads; SIMD group 0 has 16"):
        _base(threads=16)


def test_load_past_the_buffer_is_out_of_bounds():
    with pytest.raises(OutOfBoundsError, match=r"read of buffer 'in0' at element 64"):
        _base(off="1")


def test_threadgroup_matrix_handoff_needs_its_barrier():
    """SIMD group 0 stores a matrix to threadgroup memory, group 1 loads it: with the
    barrier the copy arrives; without it group 1 reads the poisoned arena (NaN) in every
    schedule (its load meets fewer times before reading than group 0's load and store
    before writing), so the output shows the missing barrier."""
    src = """
  threadgroup float buf[64];
  simdgroup_float8x8 m;
  if (simdgroup_index_in_threadgroup == 0) {
    simdgroup_load(m, in0);
    simdgroup_store(m, buf);
  }
  BARRIER
  if (simdgroup_index_in_threadgroup == 1) {
    simdgroup_load(m, buf);
    simdgroup_store(m, out0);
  }
"""
    x = np.arange(64, dtype=np.float32)
    out = _nan(64)
    _run(src.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);"), [x],
         [out], 64)
    np.testing.assert_array_equal(out, x)
    out = np.zeros(64, np.float32)
    try:
        _run(src.replace("BARRIER", ""), [x], [out], 64)
    except RaceError:
        return
    assert np.isnan(out).all(), out


def test_metal_headers_include():
    src = "  simdgroup_float8x8 m;\n  simdgroup_load(m, in0);\n  simdgroup_store(m, out0);\n"
    x = np.arange(64, dtype=np.float32)
    out = _nan(64)
    _run(src, [x], [out], header="#include <metal_stdlib>\n#include <metal_simdgroup_matrix>"
                                 "\nusing namespace metal;\n")
    np.testing.assert_array_equal(out, x)


# ----------------------------------------------------------------- MLX's signature
def test_simdgroup_body_signature_matches_mlx(tmp_path, capfd):
    """MLX's Linux CPU build cannot compile Metal, but traces the call and prints the
    source it would compile: the emulator's signature for a body using SIMD-group
    matrices (attributes, address spaces, templates) must be that text."""
    mx = pytest.importorskip("mlx.core")
    if not hasattr(mx, "export_function"):
        pytest.skip("this mlx has no export_function")
    tmpl = [("T", Dtype("float16")), ("LDA", 8), ("AX", 0), ("AY", 0), ("LDB", 8),
            ("BX", 0), ("BY", 0), ("TB", True), ("ACC", True), ("TS", False), ("NA", 128),
            ("NB", 64)]
    descs = [InputDesc("in0", "float16", (16, 8)), InputDesc("in1", "float16", (8, 8)),
             InputDesc("in2", "float32", (16, 8))]
    mine = metal_source("sg", descs, ["out0"], ["float32"], PRODUCT, "", tmpl)
    kern = mx.fast.metal_kernel(name="sg", input_names=["in0", "in1", "in2"],
                                output_names=["out0"], source=PRODUCT, header="")
    mxt = [(n, mx.float16 if isinstance(v, Dtype) else v) for n, v in tmpl]

    def f(a, b, c):
        return kern(inputs=[a, b, c], output_shapes=[(16, 8)], output_dtypes=[mx.float32],
                    grid=(64, 1, 1), threadgroup=(64, 1, 1), template=mxt, verbose=True)

    capfd.readouterr()
    mx.export_function(str(tmp_path / "sg.mlxfn"), f, mx.zeros((16, 8), mx.float16),
                       mx.zeros((8, 8), mx.float16), mx.zeros((16, 8), mx.float32))
    printed = capfd.readouterr().out
    assert "```\n" in printed, printed[-2000:]
    assert printed.split("```\n", 1)[1].rsplit("```", 1)[0] == mine + "\n"
