"""The engine suite's FlashInfer arms on the CPU: the vectorized host page table against
a per-sequence model of the same engine loop, and the whole loop (both arms) driven
through ``paged_decode.compat.flashinfer`` (FlashInfer's API) on CPU torch tensors, so
the harness's bookkeeping, appends and verification are checked before any GPU runs it
with FlashInfer itself."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.bench.engine_case import EngineCase, prompts
from paged_decode.bench.engine_flashinfer import HostPages, run_loop


def model_steps(lens, p, steps):
    """The loop one request at a time: page lists, lengths, refcounts, copies in order."""
    b, half = len(lens), len(lens) // 2
    nxt, ref, pages, length = 0, {}, [], []
    for i, n in enumerate(lens):
        if i > half and i % 2 == 0:
            pages.append(list(pages[0]))
            length.append(length[0])
            for pg in pages[0]:
                ref[pg] += 1
            continue
        own = list(range(nxt, nxt + -(-n // p)))
        nxt += len(own)
        for pg in own:
            ref[pg] = 1
        pages.append(own)
        length.append(n)
    out = []
    for _ in range(steps):
        copies = []
        for r in range(b):
            if length[r] % p == 0:
                pages[r].append(nxt)
                ref[nxt] = 1
                nxt += 1
            elif ref[pages[r][-1]] > 1:
                ref[pages[r][-1]] -= 1
                copies.append((pages[r][-1], nxt))
                pages[r][-1] = nxt
                ref[nxt] = 1
                nxt += 1
            length[r] += 1
        out.append(([list(x) for x in pages], list(length), copies))
    return out


@pytest.mark.parametrize("batch, context, p", [(8, 40, 16), (13, 7, 4), (2, 16, 16),
                                               (32, 100, 1)])
def test_host_pages_follow_the_per_request_model(batch, context, p):
    case = EngineCase(batch, context=context, steps=20, page_size=p)
    lens = prompts(case, 3)
    host = HostPages(lens, p, case.steps)
    for it, (pages, length, copies) in enumerate(model_steps(lens, p, case.steps)):
        t = host.step()
        got = [t.indices[t.indptr[r]:t.indptr[r + 1]].tolist() for r in range(batch)]
        assert got == pages, it
        assert t.last_page_len.tolist() == [(n - 1) % p + 1 for n in length]
        assert t.positions.tolist() == [n - 1 for n in length]
        assert sorted(zip(t.copy_src.tolist(), t.copy_dst.tolist())) == sorted(copies), it
    assert host.next <= host.num_pages


@pytest.mark.parametrize("kv_dtype", ["", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("arm", ["flashinfer", "flashinfer-captured"])
def test_the_flashinfer_loop_runs_and_verifies_through_the_drop_in(arm, kv_dtype):
    """16-bit and fp8 caches (the new rows quantized by the arm, the run given the
    layer's scales, the oracle reading the cache's bytes with them). e5m2 with the
    finite-mask guard off: the drop-in masks with -inf after scaling (the guard's
    refusal is the next test)."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    case = EngineCase(6, context=24, layers=2, steps=4, page_size=4, num_qo_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="float16", kv_dtype=kv_dtype)
    res = run_loop(shim, torch, torch.device("cpu"), case, arm,
                   mask_guard=kv_dtype != "float8_e5m2")
    assert res.ran and len(res.errors) == 6 and res.verified, res
    assert np.isnan(res.gpu_us) and res.step_us > 0
    assert res.kv_dtype == kv_dtype
    n = case.layers if kv_dtype else 0
    assert len(res.k_scale) == len(res.v_scale) == n and all(x > 0 for x in res.k_scale)
    assert (f"{kv_dtype} cache" in res.note) == bool(kv_dtype)


def _fp8_case(layers=1, kv_dtype="float8_e4m3fn"):
    return EngineCase(4, context=24, layers=layers, steps=3, page_size=4, num_qo_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="float16", kv_dtype=kv_dtype)


@pytest.mark.parametrize("arm", ["flashinfer", "flashinfer-captured"])
def test_an_e5m2_cache_flashinfer_s_finite_mask_cannot_mask_is_refused(arm, monkeypatch):
    """An amax-calibrated e5m2 cache (k_scale about 7e-5 at sm_scale 1/8): FlashInfer
    0.3.1's tensor-core decode would leave its padded slots unmasked
    (tests/test_fi_finite_mask.py), so the arm is reported not run with the guard's note
    (value and fix), the scales it would have used recorded, and nothing is planned or
    run; the same loop over e4m3 runs (the guard passes its scales)."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    from paged_decode.bench.flashinfer_mask import finite_mask_refusal
    cls = shim.BatchDecodeWithPagedKVCacheWrapper

    def never(self, *args, **kw):
        raise AssertionError("a refused arm plans or runs nothing")

    with monkeypatch.context() as m:
        m.setattr(cls, "plan", never)
        m.setattr(cls, "run", never)
        res = run_loop(shim, torch, torch.device("cpu"), _fp8_case(2, "float8_e5m2"), arm)
    assert not res.ran and not res.verified and res.errors == [], res
    assert res.kv_dtype == "float8_e5m2" and len(res.k_scale) == len(res.v_scale) == 2
    assert res.note == finite_mask_refusal(64 ** -0.5, min(res.k_scale)), res.note
    assert "finite -5e4" in res.note and "larger k_scale" in res.note
    ok = run_loop(shim, torch, torch.device("cpu"), _fp8_case(2), arm)
    assert ok.ran and ok.verified, ok


def test_k_and_v_differ_in_rows_and_scales():
    """K and V prompt rows are drawn separately, V at V_SIGMA: each layer's V scale is
    about half its K scale (a K/V swap anywhere moves the output about 2x)."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    from paged_decode.bench.engine_case import V_SIGMA
    res = run_loop(shim, torch, torch.device("cpu"), _fp8_case(3), "flashinfer")
    ratio = np.array(res.v_scale) / np.array(res.k_scale)
    assert np.all(np.abs(ratio - V_SIGMA) < 0.2), ratio


@pytest.mark.parametrize("swap", ["scales", "caches"])
def test_a_run_with_k_and_v_swapped_fails_the_flashinfer_loop_s_verification(swap,
                                                                             monkeypatch):
    """Negative control: ``run`` given ``k_scale`` and ``v_scale`` swapped, or the V cache
    as K and K as V, must fail the oracle (the arm writes K and V from their own rows and
    calibrates each on its own)."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    cls = shim.BatchDecodeWithPagedKVCacheWrapper
    real = cls.run

    def swapped(self, q, cache, *args, **kw):
        if swap == "scales":
            kw["k_scale"], kw["v_scale"] = kw["v_scale"], kw["k_scale"]
        else:
            cache = (cache[1], cache[0])
        return real(self, q, cache, *args, **kw)

    monkeypatch.setattr(cls, "run", swapped)
    res = run_loop(shim, torch, torch.device("cpu"), _fp8_case(), "flashinfer")
    assert res.ran and not res.verified, res


def test_an_fp8_run_given_another_v_scale_fails_the_flashinfer_loop_s_verification(
        monkeypatch):
    """Negative control: the cache holds codes of the calibrated scales; a ``run`` that
    reads them with a v_scale 10% off must fail the oracle."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    cls = shim.BatchDecodeWithPagedKVCacheWrapper
    real = cls.run

    def off(self, q, cache, *args, **kw):
        kw["v_scale"] = kw["v_scale"] * 1.1
        return real(self, q, cache, *args, **kw)

    monkeypatch.setattr(cls, "run", off)
    res = run_loop(shim, torch, torch.device("cpu"), _fp8_case(), "flashinfer")
    assert res.ran and not res.verified


def test_the_flashinfer_loop_s_oracle_reads_the_scales_it_was_written_with(monkeypatch):
    """Negative control: the check must dequantize with the layer's scales; with a K
    scale twice too large it fails."""
    torch = pytest.importorskip("torch")
    import paged_decode.bench.engine_flashinfer as efi
    import paged_decode.compat.flashinfer as shim
    real = efi.oracle_decode

    def wrong(*args, **kw):
        kw["k_scale"] = kw["k_scale"] * 2
        return real(*args, **kw)

    monkeypatch.setattr(efi, "oracle_decode", wrong)
    res = run_loop(shim, torch, torch.device("cpu"), _fp8_case(), "flashinfer-captured")
    assert res.ran and not res.verified


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_arm_s_torch_quantization_is_the_pools_convention(fmt):
    """``_quantizer`` (the FlashInfer arm's torch ops) gives the codes of ``fp8.quantize``
    (float32 ``x / scale``, saturated, round to nearest even): normals, values past the
    largest finite one (which torch's bare cast would not saturate), NaN (any NaN code:
    torch's e5m2 NaN is 0x7F, ml_dtypes' 0x7E)."""
    torch = pytest.importorskip("torch")
    from paged_decode import fp8
    from paged_decode.bench.engine_flashinfer import _quantizer
    x = (np.random.default_rng(0).standard_normal((64, 2, 8)) * 3).astype(np.float16)
    x[0, 0, :4] = [60000.0, -60000.0, np.inf, np.nan]
    scale = 0.37 if fmt == "float8_e4m3fn" else 0.5
    got = _quantizer(torch, getattr(torch, fmt), fmt)(torch.from_numpy(x), scale)
    assert got.dtype == getattr(torch, fmt)
    want = fp8.quantize(x, fmt, scale)
    np.testing.assert_array_equal(fp8.dequantize(got.view(torch.uint8).numpy(), fmt),
                                  fp8.dequantize(want, fmt))     # NaN matches NaN


def test_a_plan_over_a_wrong_page_fails_the_flashinfer_loop_s_verification(monkeypatch):
    """Negative control: a plan that reads another request's page in place of request 0's
    first (the appends still go where the engine's table says) must fail the oracle."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    cls = shim.BatchDecodeWithPagedKVCacheWrapper
    real = cls.plan

    def wrong_page(self, indptr, indices, *args, **kw):
        indices = indices.clone()
        indices[0] = indices[-1]
        return real(self, indptr, indices, *args, **kw)

    monkeypatch.setattr(cls, "plan", wrong_page)
    case = EngineCase(4, context=24, layers=1, steps=3, page_size=4, num_qo_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="float16")
    res = run_loop(shim, torch, torch.device("cpu"), case, "flashinfer")
    assert res.ran and not res.verified
