"""The ``metal`` backend's MLX glue, exercised on MLX's CPU device up to the kernel call.

Three levels, none of which needs a Mac:

1. a spy in place of ``mx.fast.metal_kernel`` records the arguments of every kernel
   construction and call (names carrying every specialization parameter, inputs and
   their dtypes, packed scalars, MLX template arguments, grid and threadgroup, output
   shapes, dtypes and ``init_value``) and returns marker outputs, which must come back
   through the host layer by rebinding (the functional-output convention);
2. the recorded arguments are traced through the *real* ``metal_kernel`` of the
   installed MLX wheel (``mx.export_function``, which needs no Metal), so MLX accepts
   them and generates exactly the signature the emulator runs;
3. the same calls are executed by the CPU emulator in place of Metal, so decode (v2,
   v2+merge, v1, the tensor-core v2tc), the merge, cascade and sparse decode run end to
   end on MLX arrays against the float64 oracle.

``test_real_metal_*`` (marked ``metal``) run the kernels on an Apple GPU and skip where
Metal is absent; they have not run yet.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import assert_matches_oracle, require_mlx, tc_out_tol

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.metal_launches import metal_kernel
from paged_decode.backends.mlx import MetalBackend
from paged_decode.backends.mlx_kernels import (
    MATH_MODE,
    KernelCache,
    MlxLaunch,
    buffer_count,
    canonical,
    check_launch,
)
from paged_decode.dtypes import numpy_dtype
from paged_decode.emulator.metal import Dtype, InputDesc, kernel_name, launch_metal, metal_source
from paged_decode.errors import UnsupportedProblemError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import max_rel_error, oracle_decode
from paged_decode.specs import UnexpectedCompileError

mx = require_mlx()   # skips when mlx is missing or cannot load
LOG2E = 1.4426950408889634
SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


@pytest.fixture(autouse=True)
def _cpu_device(request):
    """MLX's CPU device (on a Mac too), except for the tests marked ``metal``."""
    if request.node.get_closest_marker("metal"):
        yield
        return
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def to_np(a):
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).view(numpy_dtype("bfloat16"))
    return np.array(a)


def to_mx(a):
    if a.dtype == numpy_dtype("bfloat16"):
        return mx.array(np.ascontiguousarray(a).view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


class Spy:
    """Stands in for ``mx.fast.metal_kernel``: records constructions and calls; a call
    returns outputs filled with ``10 + output index`` (or runs ``execute``)."""

    def __init__(self, execute=None):
        self.built, self.calls, self.execute = [], [], execute

    def __call__(self, **kernel_kwargs):
        self.built.append(kernel_kwargs)

        def kernel(**call_kwargs):
            self.calls.append((kernel_kwargs, call_kwargs))
            if self.execute is not None:
                return self.execute(kernel_kwargs, call_kwargs)
            return [mx.full(tuple(s), 10.0 + i, d) for i, (s, d) in
                    enumerate(zip(call_kwargs["output_shapes"], call_kwargs["output_dtypes"]))]
        return kernel


def emulate(kernel_kwargs, call_kwargs):
    """Run one ``metal_kernel`` call on the CPU emulator, as Metal would."""
    c, k = call_kwargs, kernel_kwargs
    fill = np.nan if c["init_value"] is not None and math.isnan(c["init_value"]) else 0.0
    outs = [np.full(tuple(s), fill, numpy_dtype(canonical(d)))
            for s, d in zip(c["output_shapes"], c["output_dtypes"])]
    tmpl = [(n, Dtype(canonical(v)) if isinstance(v, mx.Dtype) else v) for n, v in c["template"]]
    launch_metal(k["name"], k["input_names"], k["output_names"], k["source"], k["header"],
                 [to_np(x) for x in c["inputs"]], outs, c["grid"], c["threadgroup"], tmpl,
                 output_dtypes=[canonical(d) for d in c["output_dtypes"]])
    return [to_mx(o) for o in outs]


def _problem(spec, **kw):
    pr = make_problem(spec, **kw)
    return pr, (to_mx(pr.q), to_mx(pr.k_pages), to_mx(pr.v_pages))


# ---------------------------------------------------------------------------- 1. the spy
SPEC = ProblemSpec(3, 70, 8, 2, 64, 16, seed=21)


def _check_common(kw, call, kernel):
    mk = metal_kernel(kernel)
    assert kw["compile_options"] == {"math_mode": "safe"} == {"math_mode": MATH_MODE}
    assert kw["ensure_row_contiguous"] is True and kw["atomic_outputs"] is False
    assert kw["input_names"] == list(mk.inputs) and kw["output_names"] == list(mk.outputs)
    assert (kw["source"], kw["header"]) == (mk.source, mk.header)
    (kw["source"] + kw["header"]).encode("ascii")
    assert [n for n, _ in call["template"]] == list(mk.template)
    for _, v in call["template"]:
        assert isinstance(v, (mx.Dtype, int)) and not isinstance(v, np.integer)
    assert len(call["inputs"]) == len(mk.inputs)
    assert all(isinstance(x, mx.array) for x in call["inputs"])
    grid, tg = call["grid"], call["threadgroup"]
    assert len(grid) == len(tg) == 3 and all(g % t == 0 for g, t in zip(grid, tg))
    assert math.prod(tg) <= 1024
    assert call["init_value"] is not None and math.isnan(call["init_value"])  # poisoned
    launch = MlxLaunch(kw["name"], tuple(kw["input_names"]), tuple(kw["output_names"]),
                       kw["source"], kw["header"], tuple(call["inputs"]),
                       tuple(call["template"]), grid, tg,
                       tuple(tuple(s) for s in call["output_shapes"]),
                       tuple(call["output_dtypes"]), call["init_value"])
    assert buffer_count(launch) <= 31
    return dict(zip(mk.inputs, call["inputs"]))


def test_v2_and_merge_arguments_and_rebound_outputs():
    spy = Spy()
    be = MetalBackend(spy)
    pr, (q, k, v) = _problem(SPEC)
    plan = pd.plan_decode(pr.table, 8, 2, 64, target_ctas=32, pages_per_chunk=1)
    out, lse = pd.decode(q, k, v, pr.table, plan, path="v2", return_lse=True, backend=be,
                         sm_scale=0.3)
    assert pd.last_outcome().path == "v2+merge"
    (kw2, c2), (kwm, cm) = spy.calls
    # v2 partial
    assert kw2["name"] == "pd_v2_qf16_kvf16_of32_hd64_ps16_qh4_w4"
    ins = _check_common(kw2, c2, "v2")
    assert ins["q"] is q and ins["k_pages"] is k and ins["v_pages"] is v
    for name in ("indices", "indptr", "last_page_len", "first_page_offset",
                 "request_indices", "kv_tile_indices"):
        assert ins[name].dtype == mx.int32 and ins[name].ndim == 1
    np.testing.assert_array_equal(np.array(ins["indices"]), pr.table.indices)
    np.testing.assert_array_equal(np.array(ins["request_indices"]), plan.request_indices)
    scalars = {n: ins[n] for n in ("num_qo_heads", "num_kv_heads", "q_groups",
                                   "pages_per_chunk", "scale_log2")}
    assert all(s.ndim == 0 for s in scalars.values())
    assert [s.dtype for s in scalars.values()] == [mx.int32] * 4 + [mx.float32]
    assert [s.item() for s in list(scalars.values())[:4]] == [8, 2, plan.q_groups, 1]
    assert scalars["scale_log2"].item() == float(np.float32(0.3 * LOG2E))
    assert c2["template"] == [("TQ", mx.float16), ("TKV", mx.float16), ("TO", mx.float32),
                              ("HEAD_DIM", 64), ("PAGE_SIZE", 16), ("QH", 4),
                              ("NUM_WARPS", 4), ("SOFT_CAP", False), ("SINK", False),
                              ("KV_FP8", 0)]
    assert c2["threadgroup"] == (128, 1, 1)
    assert c2["grid"] == (plan.num_chunks * 128, 2 * plan.q_groups, 1)
    assert c2["output_shapes"] == [[plan.num_chunks, 8, 64], [plan.num_chunks, 8]]
    assert c2["output_dtypes"] == [mx.float32, mx.float32]
    # merge: its inputs are the partial's (rebound) outputs
    assert kwm["name"] == "pd_merge_of16_hd64"
    ins = _check_common(kwm, cm, "merge")
    assert float(ins["v"][0, 0, 0].item()) == 10.0 and float(ins["lse"][0, 0].item()) == 11.0
    np.testing.assert_array_equal(np.array(ins["o_indptr"]), plan.o_indptr)
    assert ins["num_heads"].item() == 8 and ins["num_out"].item() == 3
    assert cm["template"] == [("TO", mx.float16), ("HEAD_DIM", 64), ("SINK", False)]
    assert cm["grid"] == (-(-3 * 8 // 4) * 128, 1, 1) and cm["threadgroup"] == (128, 1, 1)
    assert cm["output_shapes"] == [[3, 8, 64], [3, 8]]
    assert cm["output_dtypes"] == [mx.float16, mx.float32]
    # the merge's fresh outputs reached the caller
    assert (to_np(out) == 10).all() and (to_np(lse) == 11).all()
    assert out.dtype == mx.float16


def test_v1_arguments_and_out_argument():
    spy = Spy()
    be = MetalBackend(spy)
    pr, (q, k, v) = _problem(ProblemSpec(2, 40, 8, 2, 128, 32, "bfloat16", "bfloat16", seed=3))
    out = mx.zeros((2, 8, 128), mx.float32)
    got = pd.decode(q, k, v, pr.table, path="v1", out=out, out_dtype="float32", backend=be)
    assert got is out and (to_np(out) == 10).all()
    ((kw, c),) = spy.calls
    assert kw["name"] == "pd_v1_qbf16_kvbf16_of32_hd128_ps32_w8"
    ins = _check_common(kw, c, "v1")
    assert [ins[n].item() for n in ("num_qo_heads", "num_kv_heads")] == [8, 2]
    assert c["template"] == [("TQ", mx.bfloat16), ("TKV", mx.bfloat16), ("TO", mx.float32),
                             ("HEAD_DIM", 128), ("PAGE_SIZE", 32), ("NUM_WARPS", 8),
                             ("SOFT_CAP", False), ("SINK", False), ("KV_FP8", 0)]
    assert c["grid"] == (2 * 8 * 256, 1, 1) and c["threadgroup"] == (256, 1, 1)
    assert c["output_shapes"] == [[2, 8, 128], [2, 8]]


def test_v2tc_arguments_rows_and_simdgroups():
    # the tensor-core partial's Metal dialect: the v2 partial's inputs with row_tiles, its
    # rows per threadgroup (8, or 16 above 8 heads per KV head) and SIMD groups (what 32 KB
    # of threadgroup memory holds at its head_dim) in the name and the template; the grid
    # is CUDA's (C, Hkv * ceil(G / 16))
    spy = Spy()
    be = MetalBackend(spy)
    for hq, hkv, d, dt, rows, sgs, tiles in [(8, 2, 64, "float16", 8, 4, 1),
                                             (24, 1, 128, "bfloat16", 16, 3, 2)]:
        pr, (q, k, v) = _problem(ProblemSpec(3, 70, hq, hkv, d, 16, dt, dt, seed=21))
        plan = pd.plan_decode(pr.table, hq, hkv, d, target_ctas=32, pages_per_chunk=1)
        pd.decode(q, k, v, pr.table, plan, path="v2tc", backend=be, sm_scale=0.3)
        assert pd.last_outcome().path == "v2tc+merge"
        kw, c = spy.calls[-2]
        assert kw["name"] == f"pd_v2tc_q{SHORT[dt]}_kv{SHORT[dt]}_of32_hd{d}_ps16_qh{rows}_w{sgs}"
        ins = _check_common(kw, c, "v2tc")
        assert ins["q"] is q and ins["k_pages"] is k and ins["v_pages"] is v
        assert [ins[n].item() for n in ("num_qo_heads", "num_kv_heads", "row_tiles",
                                        "pages_per_chunk")] == [hq, hkv, tiles, 1]
        assert ins["scale_log2"].item() == float(np.float32(0.3 * LOG2E))
        mdt = mx.float16 if dt == "float16" else mx.bfloat16
        assert ins["v_scale"].item() == 1.0
        assert c["template"] == [("T", mdt), ("TO", mx.float32), ("HEAD_DIM", d),
                                 ("PAGE_SIZE", 16), ("NUM_WARPS", sgs), ("SOFT_CAP", False),
                                 ("SINK", False), ("ROWS", rows), ("KV_FP8", 0)]
        assert c["threadgroup"] == (32 * sgs, 1, 1)
        assert c["grid"] == (plan.num_chunks * 32 * sgs, hkv * tiles, 1)
        assert c["output_shapes"] == [[plan.num_chunks, hq, d], [plan.num_chunks, hq]]


def test_names_carry_every_specialization_parameter_and_build_once():
    spy = Spy()
    be = MetalBackend(spy)
    names = set()
    for qd, kvd, d, p, hkv, g in [("float16", "float16", 64, 16, 2, 4),
                                  ("bfloat16", "float16", 64, 16, 2, 4),
                                  ("float16", "float32", 64, 16, 2, 4),
                                  ("float16", "float16", 128, 16, 2, 4),
                                  ("float16", "float16", 64, 8, 2, 4),
                                  ("float16", "float16", 64, 16, 4, 1)]:
        pr, arrays = _problem(ProblemSpec(2, 30, hkv * g, hkv, d, p, qd, kvd, seed=1))
        plan = pd.plan_decode(pr.table, hkv * g, hkv, d, target_ctas=4, pages_per_chunk=64)
        for _ in range(2):
            pd.decode(*arrays, pr.table, plan, path="v2", out_dtype="float32", backend=be)
        kw = spy.built[-1]
        assert (f"_q{SHORT[qd]}_kv{SHORT[kvd]}_of32_hd{d}_ps{p}_qh{min(g, 8)}_w4"
                in kw["name"]), kw["name"]
        names.add(kw["name"])
    assert len(names) == 6 == len(spy.built) == len(be.kernels)   # once per name
    assert len(spy.calls) == 12


def test_no_compile_assertion_covers_new_kernels(monkeypatch):
    be = MetalBackend(Spy())
    pr, arrays = _problem(SPEC)
    pd.decode(*arrays, pr.table, path="v1", backend=be)             # warm
    monkeypatch.setenv("PAGED_DECODE_ASSERT_NO_COMPILE", "1")
    pd.decode(*arrays, pr.table, path="v1", backend=be)             # built: fine
    with pytest.raises(UnexpectedCompileError, match="pd_v1_q-f16_kv-f16_o-f32"):
        pd.decode(*arrays, pr.table, path="v1", out_dtype="float32", backend=be)


def test_poison_off_leaves_outputs_uninitialized(monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "0")
    spy = Spy()
    pr, arrays = _problem(SPEC)
    pd.decode(*arrays, pr.table, path="v1", backend=MetalBackend(spy))
    assert spy.calls[0][1]["init_value"] is None


def _recorded_launch(spy):
    """The ``MlxLaunch`` of the spy's first recorded call."""
    kw, c = spy.calls[0]
    return MlxLaunch(kw["name"], tuple(kw["input_names"]), tuple(kw["output_names"]),
                     kw["source"], kw["header"], tuple(c["inputs"]), tuple(c["template"]),
                     c["grid"], c["threadgroup"], tuple(tuple(s) for s in c["output_shapes"]),
                     tuple(c["output_dtypes"]), None)


def test_check_launch_limits():
    spy = Spy()
    pr, arrays = _problem(SPEC)
    pd.decode(*arrays, pr.table, path="v1", backend=MetalBackend(spy))
    base = _recorded_launch(spy)
    check_launch(base)
    bad = [dataclasses.replace(base, threadgroup=(2048, 1, 1), grid=(2048, 1, 1)),
           dataclasses.replace(base, grid=(base.grid[0] + 32, 1, 1)),
           dataclasses.replace(base, source=base.source + "// \u00e9\n"),
           dataclasses.replace(base, source=base.source + "".join(
               f"// q_shape q_strides k_pages_shape v_pages_shape {n}_shape {n}_strides\n"
               for n in base.input_names))]
    for b, why in zip(bad, ("1..1024 threads", "whole number of threadgroups", "ASCII",
                            "buffer arguments")):
        with pytest.raises(UnsupportedProblemError, match=why):
            check_launch(b)


def test_a_changed_body_needs_its_own_name():
    cache = KernelCache(Spy())
    spy = Spy()
    pr, arrays = _problem(SPEC)
    pd.decode(*arrays, pr.table, path="v1", backend=MetalBackend(spy))
    launch = _recorded_launch(spy)
    assert cache.get(launch) is cache.get(launch)
    with pytest.raises(ValueError, match="built from another body"):
        cache.get(dataclasses.replace(launch, source=launch.source + "\n"))


# ---------------------------------------------------------------------------- 2. real MLX
@pytest.mark.skipif(not hasattr(mx, "export_function"), reason="no mx.export_function")
def test_recorded_calls_trace_through_the_real_metal_kernel(tmp_path, capfd):
    """MLX's own metal_kernel accepts the backend's exact arguments (constructor and call)
    and generates the signature the emulator reproduces, for the inputs as the backend
    packs them (int32 index arrays, 0-d scalars, small arrays in constant space)."""
    spy = Spy()
    be = MetalBackend(spy)
    pr, arrays = _problem(ProblemSpec(2, 40, 8, 2, 64, 16, seed=9))
    plan = pd.plan_decode(pr.table, 8, 2, 64, target_ctas=32, pages_per_chunk=1)
    pd.decode(*arrays, pr.table, plan, path="v2", backend=be)
    pd.decode(*arrays, pr.table, path="v1", backend=be)
    pool = pd.PagePool(8, 4, 2, 8, "float16", num_layers=2, backend=be)   # the append
    seq = pool.new_sequence()
    pool.append(seq, mx.zeros((2, 1, 2, 8), mx.float16), mx.zeros((2, 1, 2, 8), mx.float16))
    assert len(spy.calls) == 4
    _trace_through_metal_kernel(spy, tmp_path, capfd)


def test_recorded_v2tc_calls_trace_through_the_real_metal_kernel(tmp_path, capfd):
    if not hasattr(mx, "export_function"):
        pytest.skip("no mx.export_function")
    spy = Spy()
    be = MetalBackend(spy)
    for dt in ("float16", "bfloat16"):
        pr, arrays = _problem(ProblemSpec(2, 40, 16, 2, 64, 16, dt, dt, seed=9))
        pd.decode(*arrays, pr.table, path="v2tc", out_dtype="float32", backend=be)
    assert sum(kw["name"].startswith("pd_v2tc") for kw, _ in spy.calls) == 2
    _trace_through_metal_kernel(spy, tmp_path, capfd)


def _trace_through_metal_kernel(spy, tmp_path, capfd):
    """Each recorded call built and exported by MLX's own ``metal_kernel``: the source it
    prints equals the emulator's."""
    for i, (kw, call) in enumerate(spy.calls):
        kern = mx.fast.metal_kernel(**kw)
        descs = [InputDesc(n, canonical(a.dtype), tuple(a.shape))
                 for n, a in zip(kw["input_names"], call["inputs"])]
        odt = [canonical(d) for d in call["output_dtypes"]]
        tmpl = [(n, Dtype(canonical(v)) if isinstance(v, mx.Dtype) else v)
                for n, v in call["template"]]

        def f(*ins, kern=kern, call=call):
            return kern(**{**call, "inputs": list(ins), "verbose": True})

        capfd.readouterr()
        mx.export_function(str(tmp_path / f"k{i}.mlxfn"), f, *call["inputs"])
        printed = capfd.readouterr().out
        theirs = printed.split("```\n", 1)[1].rsplit("```", 1)[0]
        mine = metal_source(kw["name"], descs, kw["output_names"], odt, kw["source"],
                            kw["header"], tmpl)
        assert theirs == mine + "\n", kw["name"]
        assert kernel_name(kw["name"], descs, odt, tmpl) in theirs


def test_the_real_factory_builds_kernels_without_metal():
    be = MetalBackend()
    pr, arrays = _problem(SPEC)
    if mx.metal.is_available():
        pytest.skip("Metal is available: the kernels run (test_real_metal_*)")
    with pytest.raises(Exception, match="(?i)metal"):   # built, then refused at the call
        pd.decode(*arrays, pr.table, path="v1", backend=be)
    assert len(be.kernels) == 1


# ---------------------------------------------------------------------------- 3. emulated
needs_emulator = pytest.mark.skipif(not availability("emulated-metal").ok,
                                    reason="the CPU emulator is unavailable")


@pytest.fixture(scope="module")
def emu_be():
    return MetalBackend(Spy(execute=emulate))


CASES = [  # (spec, lengths, offsets, paths: (path, pages_per_chunk))
    (ProblemSpec(4, 60, 8, 2, 64, 16, seed=41), [60, 0, 17, 33], [0, 0, 5, 15],
     [("v2", 1), ("v2", 64), ("v1", None), ("gather", None), ("v2tc", 1), ("v2tc", 64)]),
    (ProblemSpec(2, 50, 8, 1, 128, 16, "bfloat16", "bfloat16", seed=42), None, None,
     [("v2", 1), ("v1", None), ("v2tc", 1)]),
    (ProblemSpec(2, 30, 4, 4, 64, 16, "float32", "float32", seed=43), [30, 1], [3, 0],
     [("v2", 1)]),
]


@needs_emulator
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].label)
def test_emulated_metal_kernels_on_mlx_arrays_match_oracle(emu_be, case):
    spec, lengths, offsets, paths = case
    pr, arrays = _problem(spec, lengths=lengths, offsets=offsets)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    for path, ppc in paths:
        plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                              target_ctas=16, pages_per_chunk=ppc)
        out, lse = pd.decode(*arrays, pr.table, plan, path=path, return_lse=True,
                             out_dtype="float32", backend=emu_be)
        ran = pd.last_outcome().path
        assert ran.split("+")[0] == path and ran.endswith("merge") == (
            path in ("v2", "v2tc") and plan.needs_merge)
        # v2tc rounds P to the pools' dtype for P V (tc_out_tol)
        tol = tc_out_tol(spec.kv_dtype, "float32") if path == "v2tc" else None
        assert_matches_oracle(to_np(out), to_np(lse), ref, ref_lse, "float32",
                              f"{spec.label} {path} ppc={ppc}", tol=tol)


@needs_emulator
def test_v2tc_variants_on_mlx_arrays():
    """v2tc with window, soft cap and sinks through MLX's ``metal_kernel`` signature: the
    sinks array and ``soft_cap_log2`` reach the kernel by name, the template carries
    SOFT_CAP and SINK (the sink only in a partial that writes the output), and the
    emulated result matches the oracle, one chunk and split."""
    from paged_decode.variants import LOG2E
    spy = Spy(execute=emulate)
    be = MetalBackend(spy)
    pr, arrays = _problem(SPEC)
    sk = (np.random.default_rng(3).standard_normal(8) * 2).astype(np.float32)
    kw = {"window_left": 37, "logits_soft_cap": 2.0}
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, sinks=sk, **kw)
    for ppc, sink in ((64, True), (1, False)):
        plan = pd.plan_decode(pr.table, 8, 2, 64, target_ctas=16, pages_per_chunk=ppc,
                              window_left=37)
        assert plan.needs_merge != sink
        out, lse = pd.decode(*arrays, pr.table, plan, path="v2tc", return_lse=True,
                             out_dtype="float32", backend=be, sinks=mx.array(sk), **kw)
        assert pd.last_outcome().path == ("v2tc" if sink else "v2tc+merge")
        assert_matches_oracle(to_np(out), to_np(lse), ref, ref_lse, "float32",
                              f"v2tc variants ppc={ppc}", tol=tc_out_tol("float16", "float32"))
        kwk, call = next(c for c in reversed(spy.calls) if c[0]["name"].startswith("pd_v2tc"))
        ins = _check_common(kwk, call, "v2tc")
        assert kwk["name"].endswith("_softcap_sink" if sink else "_softcap"), kwk["name"]
        assert dict(call["template"])["SOFT_CAP"] is True
        assert dict(call["template"])["SINK"] is sink
        assert ins["soft_cap_log2"].item() == float(np.float32(2.0 * LOG2E))
        if sink:
            np.testing.assert_array_equal(to_np(ins["sinks"]), sk)


def check_merge(be):
    rng = np.random.default_rng(6)
    v = rng.standard_normal((7, 4, 64)).astype(np.float32)
    lse = (rng.standard_normal((7, 4)) * 3).astype(np.float32)
    lse[3] = -np.inf
    v[3] = 0
    ip = np.array([0, 2, 2, 3, 4, 7])
    got_v, got_l = pd.merge_states(mx.array(v), mx.array(lse), ip, backend=be)
    ref_v, ref_l = pd.merge_states(v, lse, ip, backend="reference")
    np.testing.assert_allclose(to_np(got_v), ref_v, rtol=1e-5, atol=1e-6)
    fin = np.isfinite(ref_l)
    assert (np.isneginf(to_np(got_l)) == ~fin).all()
    np.testing.assert_allclose(to_np(got_l)[fin], ref_l[fin], rtol=1e-6, atol=1e-6)


def check_cascade(be):
    """Cascade's level-1 partial writes a slice of the workspace on numpy; on MLX the
    rebound slice is written back (``functional_outputs``)."""
    rng = np.random.default_rng(8)
    pool = pd.PagePool(64, 16, 2, 64, "float16", backend="reference")
    base = pool.new_sequence()
    kv = rng.standard_normal((40, 2, 64)).astype(np.float16)
    pool.append(base, kv, -kv)
    seqs = []
    for n in (5, 20, 9):
        s = pool.fork(base)
        x = rng.standard_normal((n, 2, 64)).astype(np.float16)
        pool.append(s, x, x)
        seqs.append(s)
    solo = pool.new_sequence()
    pool.append(solo, kv[:7], kv[:7])
    seqs.insert(1, solo)
    table = pool.page_table(seqs)
    q = rng.standard_normal((4, 8, 64)).astype(np.float16)
    ref, ref_lse = oracle_decode(q, pool.k, pool.v, table)
    cplan = pd.detect_shared_prefix(table, min_shared_pages=1)
    assert cplan is not None and cplan.num_members == 3
    out, lse = pd.cascade_decode(to_mx(q), to_mx(pool.k), to_mx(pool.v), table,
                                 return_lse=True, cascade_plan=cplan, backend=be)
    assert pd.last_outcome().path == "cascade"
    assert_matches_oracle(to_np(out), to_np(lse), ref, ref_lse, "float16", "mlx cascade")


def check_sparse(be):
    """The fused sparse path writes reshaped outputs; on MLX they are read back."""
    rng = np.random.default_rng(9)
    b, hkv, cap, d, g = 2, 2, 48, 64, 4
    k = rng.standard_normal((b, hkv, cap, d)).astype(np.float16)
    v = rng.standard_normal((b, hkv, cap, d)).astype(np.float16)
    q = rng.standard_normal((b, hkv * g, d)).astype(np.float16)
    pos = np.stack([np.stack([rng.choice(40, 9, replace=False) for _ in range(hkv)])
                    for _ in range(b)]).astype(np.int32)
    live = np.array([40, 44])
    ref, ref_lse = pd.sparse_decode(q, k, v, pos, live_lens=live, min_sparsity=0,
                                    return_lse=True, backend="reference")
    out, lse, o = pd.sparse_decode(to_mx(q), to_mx(k), to_mx(v), pos, live_lens=live,
                                   min_sparsity=0, return_lse=True, return_outcome=True,
                                   backend=be)
    assert o.path == "sparse"
    assert max_rel_error(to_np(out), np.asarray(ref, np.float64)) < 2e-3
    np.testing.assert_allclose(to_np(lse), ref_lse, atol=5e-5)


@needs_emulator
def test_emulated_merge_kernel_on_mlx(emu_be):
    check_merge(emu_be)


@needs_emulator
def test_emulated_cascade_on_mlx_matches_oracle(emu_be):
    check_cascade(emu_be)


@needs_emulator
def test_emulated_sparse_fused_on_mlx_matches_reference(emu_be):
    check_sparse(emu_be)


# ---------------------------------------------------------------------------- real Metal
METAL = availability("metal")
needs_metal = pytest.mark.skipif(not METAL.ok, reason=f"no Metal: {METAL.reason}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.metal
@needs_metal
def test_real_metal_kernels_match_oracle(dtype, group, head_dim):
    be = pd.get_backend("metal")
    spec = ProblemSpec(4, 300, 2 * group, 2, head_dim, 16, dtype, dtype, seed=group)
    pr, arrays = _problem(spec, lengths=[300, 0, 17, 129], offsets=[0, 0, 5, 15])
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    tc = [("v2tc", None), ("v2tc", 1)] if dtype != "float32" else []   # 16-bit only
    for path, ppc in (("v2", None), ("v2", 1), ("v2", 64), ("v1", None), ("gather", None),
                      *tc):
        plan = pd.plan_decode(pr.table, 2 * group, 2, head_dim, device=be.device_info(),
                              pages_per_chunk=ppc)
        out, lse = pd.decode(*arrays, pr.table, plan, path=path, return_lse=True,
                             out_dtype="float32", backend=be)
        assert pd.last_outcome().path.split("+")[0] == path
        tol_dtype = "float32" if path != "gather" else dtype   # SDPA runs in the KV dtype
        tol = tc_out_tol(dtype, "float32") if path == "v2tc" else None
        assert_matches_oracle(to_np(out), to_np(lse), ref, ref_lse, tol_dtype,
                              f"metal {dtype} G{group} D{head_dim} {path} ppc={ppc}", tol=tol)
    out = pd.decode(*arrays, pr.table, backend=be)                  # auto, q's dtype
    assert_matches_oracle(to_np(out), None, ref, None, dtype, f"metal {dtype} auto")


@pytest.mark.metal
@needs_metal
def test_real_metal_merge_and_cascade():
    be = pd.get_backend("metal")
    check_merge(be)
    check_cascade(be)
    check_sparse(be)
