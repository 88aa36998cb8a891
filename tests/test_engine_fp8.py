"""The engine suite (``bench --suite engine``) over fp8 K/V pools on the CPU: our arms on
the reference backend and the CUDA kernels on the emulator (v2 and the tensor-core
partial, eager and captured), per-layer scales calibrated on the prompt blocks, the
outputs checked against the float64 oracle on the dequantized pools; negative controls:
a scale the oracle or the decode gets wrong fails the verification. The FlashInfer arms'
fp8 loop is in tests/test_engine_flashinfer.py, the command line in tests/test_cli.py, the
suite on a GPU in tests/test_engine_step_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

import paged_decode.bench.engine as engine_mod
from paged_decode import PagePool, fp8, get_backend
from paged_decode.bench.engine import run_engine, to_dict
from paged_decode.bench.engine_case import (
    FP8_SCALE_ROUNDING,
    TOLERANCE,
    EngineArm,
    EngineCase,
    prompts,
    tolerance,
)

OURS = ("eager", "captured", "eager-tc", "captured-tc")


def _case(kv_dtype="float8_e4m3fn", dtype="float16", **kw):
    return EngineCase(3, context=40, layers=2, steps=3, num_qo_heads=8, num_kv_heads=2,
                      head_dim=64, dtype=dtype, kv_dtype=kv_dtype, **kw)


@pytest.mark.parametrize("fmt", list(fp8.FORMATS))
@pytest.mark.parametrize("backend, arms", [("reference", OURS[:2]), ("emulated-cuda", OURS)])
def test_our_arms_run_and_verify_over_fp8_pools(backend, arms, fmt):
    case = _case(fmt)
    [(got_case, got)] = run_engine(get_backend(backend), [case], arms=arms)
    assert got_case.label.endswith(f"float16 kv {fmt}")
    for name in arms:
        a = got[name]
        assert a.ran and a.verified and len(a.errors) == 4, (name, a)
        assert a.kv_dtype == fmt and len(a.k_scale) == len(a.v_scale) == case.layers
    # the scales are the calibration's: each layer's amax over the format's largest value
    ks = np.array(got[arms[0]].k_scale)
    assert np.all(ks > 0) and np.all(ks * fp8.max_finite(fmt) < 10)    # N(0, 1) blocks
    data = to_dict([(got_case, got)])[0]
    assert data["case"]["kv_dtype"] == fmt
    assert data["arms"][arms[0]]["k_scale"] == got[arms[0]].k_scale


def test_the_pool_is_fp8_with_the_calibrated_scales(monkeypatch):
    """The arms' pool: fp8 codes, per-layer scales = amax / max_finite of the blocks the
    prompts come from, and the same scales in the results (no 16-bit fallback)."""
    made = []
    real = PagePool.__init__

    def spy(self, *args, **kw):
        real(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(PagePool, "__init__", spy)
    case = _case("float8_e5m2")
    [(_, got)] = run_engine(get_backend("reference"), [case], arms=("eager",))
    [pool] = made
    assert pool.dtype == "float8_e5m2" and pool.k.dtype == fp8.numpy_fp8("float8_e5m2")
    assert pool.k_scale.tolist() == got["eager"].k_scale
    assert pool.v_scale.tolist() == got["eager"].v_scale
    assert pool.k_scale[0] != pool.k_scale[1]            # per layer, not one number
    blocks = engine_mod._blocks(case, max(prompts(case, 0)), 0)
    for scale, block in zip((pool.k_scale, pool.v_scale), blocks):
        amax = np.abs(block.astype(np.float32)).max(axis=(1, 2, 3))
        np.testing.assert_array_equal(scale, amax / np.float32(fp8.max_finite("float8_e5m2")))


def test_a_path_that_refuses_fp8_reports_why_and_runs_nothing_else():
    """The tensor-core partial takes 16-bit queries only: with float32 queries over an fp8
    pool its arms are reported not run with the library's reason, never run over 16-bit
    pools instead."""
    case = _case(dtype="float32")
    [(_, got)] = run_engine(get_backend("emulated-cuda"), [case], arms=OURS)
    for name in ("eager-tc", "captured-tc"):
        a = got[name]
        assert not a.ran and "v2tc" in a.note and "float8_e4m3fn" in a.note, a
        assert a.kv_dtype == "float8_e4m3fn"
    assert got["eager"].verified and got["captured"].verified


@pytest.mark.parametrize("which, factor", [("v_scale", 1.1), ("k_scale", 2.0)])
def test_a_wrong_scale_given_to_the_oracle_fails_verification(monkeypatch, which, factor):
    """Negative control: the check must read the pools with the scales they were written
    with; another scale is an error the tolerance does not cover."""
    real = engine_mod.oracle_decode
    seen = []

    def wrong(*args, **kw):
        seen.append(kw.get("kv_dtype"))
        kw[which] = kw[which] * factor
        return real(*args, **kw)

    monkeypatch.setattr(engine_mod, "oracle_decode", wrong)
    [(_, got)] = run_engine(get_backend("reference"), [_case()], arms=OURS[:2])
    assert seen and set(seen) == {"float8_e4m3fn"}
    for a in got.values():
        assert a.ran and not a.verified, a


def test_a_decode_given_another_v_scale_fails_verification(monkeypatch):
    """Negative control on the other side: the appends quantize with the pool's scales,
    but the decode reads them back with a v_scale 10% off (the pool's ``decode_args``,
    which DecodeStep passes to every layer's launch): the oracle, on the calibrated
    scales, must see it."""
    real = PagePool.decode_args

    def off(self, layer=None):
        args = real(self, layer)
        return {**args, "v_scale": args["v_scale"] * 1.1} if args else args

    monkeypatch.setattr(PagePool, "decode_args", off)
    [(_, got)] = run_engine(get_backend("emulated-cuda"), [_case()],
                            arms=("captured", "eager-tc"))
    for a in got.values():
        assert a.ran and not a.verified, a


def test_the_fp8_bound_is_the_16_bit_one_plus_the_scales_roundings():
    assert tolerance("float16") == TOLERANCE["float16"]
    assert tolerance("float16", "float8_e5m2") == TOLERANCE["float16"] + FP8_SCALE_ROUNDING
    ok = EngineArm("eager", True, "float16", errors=[1e-3], kv_dtype="float8_e4m3fn")
    assert ok.verified
    assert not EngineArm("eager", True, "float16", errors=[0.09],
                         kv_dtype="float8_e4m3fn").verified


def test_blocks_too_large_for_the_host_are_one_line_naming_the_suite():
    """An fp8 pool's scales are drawn from the prompt blocks before the pool exists: a
    size the host cannot allocate is the suite's error, not numpy's."""
    from click.testing import CliRunner

    from paged_decode.cli import main
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--batch", "1", "--context", "64", "--steps", "2",
                                    "--layers", "100000000", "--kv-dtype", "float8_e4m3fn"])
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.exception
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("Error: bench --suite engine: the prompts' K and V blocks of "
                           "shape [100000000, 599, 2, 64]"), res.output
    assert "GiB of host memory" in last and "--layers" in last


def test_our_pools_k_and_v_differ_in_rows_and_scales():
    """``_pool``'s K and V come from separate blocks, V at V_SIGMA: each layer's V scale is
    about half its K scale, so a K/V swap is an error of about 2x (the next test)."""
    from paged_decode.bench.engine_case import V_SIGMA
    [(_, got)] = run_engine(get_backend("reference"), [_case("float8_e5m2")], arms=("eager",))
    ratio = np.array(got["eager"].v_scale) / np.array(got["eager"].k_scale)
    assert np.all(np.abs(ratio - V_SIGMA) < 0.15), ratio
    k, v = engine_mod._blocks(_case(), 50, 0)
    assert not np.array_equal(k, v)
    assert abs(float(np.std(v.astype(np.float32))) - V_SIGMA) < 0.02


def test_a_decode_with_k_and_v_scales_swapped_fails_verification(monkeypatch):
    """Negative control: a decode reading the pool with its K and V scales swapped must
    fail the oracle. (Where the appends put their rows is not this check's business: the
    oracle reads the pool as stored; tests/test_engine_step.py checks the appends.)"""
    real = PagePool.decode_args

    def swapped(self, layer=None):
        args = real(self, layer)
        return {**args, "k_scale": args["v_scale"], "v_scale": args["k_scale"]}

    monkeypatch.setattr(PagePool, "decode_args", swapped)
    [(_, got)] = run_engine(get_backend("emulated-cuda"), [_case()],
                            arms=("captured", "eager-tc"))
    for a in got.values():
        assert a.ran and not a.verified, a


@pytest.mark.parametrize("bad", ["float8_e4m3", "float16", "fp8", None, 8])
def test_engine_case_refuses_an_unknown_kv_dtype(bad):
    """A typo would otherwise run 16-bit FlashInfer caches labelled fp8."""
    from paged_decode.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError) as info:
        EngineCase(2, kv_dtype=bad)
    msg = str(info.value)
    assert "EngineCase.kv_dtype" in msg and repr(bad) in msg, msg
    assert "float8_e4m3fn" in msg and "float8_e5m2" in msg and "''" in msg, msg
    for ok in ("", *fp8.FP8_DTYPES):
        assert EngineCase(2, kv_dtype=ok).kv_dtype == ok


def _plot_results():
    ok = EngineArm("eager", True, "float16", step_us=100.0, errors=[1e-3])
    bad = EngineArm("flashinfer", True, "float16", step_us=80.0, errors=[0.19],
                    kv_dtype="float8_e5m2")
    off = EngineArm("flashinfer-captured", False, "float16", note="refused")
    return [(EngineCase(b, context=256, kv_dtype="float8_e5m2"),
             {"eager": ok, "flashinfer": bad, "flashinfer-captured": off}) for b in (8, 4)]


def test_the_engine_plot_draws_verified_arms_only_and_names_the_others():
    """An arm that ran and failed the oracle (the e5m2 FlashInfer arm of S27-R3) is not a
    line; it is named as left out; an arm that did not run is neither."""
    lines, left_out = engine_mod.plot_lines(_plot_results())
    assert lines == {("eager", 256): [(4, 100.0), (8, 100.0)]}
    assert left_out == ["flashinfer (ctx 256, B 8)", "flashinfer (ctx 256, B 4)"]


def test_the_engine_plot_writes_a_png_with_the_left_out_arms_named(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    texts = []
    real = matplotlib.figure.Figure.text

    def spy(self, x, y, s, *args, **kw):
        texts.append(s)
        return real(self, x, y, s, *args, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "text", spy)
        out = engine_mod.plot(_plot_results(), str(tmp_path / "e.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert texts == ["not verified, not plotted: flashinfer (ctx 256, B 8), flashinfer "
                     "(ctx 256, B 4)"]
    assert plt.get_fignums() == []
