"""The Apple GPU core count behind the metal backend's plan target: IORegistry parsing on
recorded sample output, the fallbacks in order, and the environment override. Nothing
here runs ``ioreg``: the command runner is replaced."""

from __future__ import annotations

import plistlib

import pytest

from paged_decode import apple_device as ad
from paged_decode.errors import InvalidArgumentError

# ``ioreg -r -d 1 -c AGXAccelerator -a``: a plist array of registry entries (trimmed)
PLIST = plistlib.dumps([{
    "IOClass": "AGXAcceleratorG14X", "IONameMatched": "gpu,t6020", "model": "Apple M2 Pro",
    "gpu-core-count": 19, "AGXParameterBufferMaxSize": 1073741824,
    "PerformanceStatistics": {"Device Utilization %": 0, "In use system memory": 123},
}])
# ``ioreg -r -c AGXAccelerator`` text form (trimmed)
TEXT = """+-o AGXAcceleratorG13G  <class AGXAcceleratorG13G, id 0x1000003ac, registered, \
matched, active, busy 0 (0 ms), retain 64>
  | {
  |   "IOClass" = "AGXAcceleratorG13G"
  |   "model" = "Apple M1"
  |   "AGXParameterBufferMaxSizeEverMemless" = 176160768
  |   "gpu-core-count" = 8
  |   "IOGLBundleName" = "AppleMetalOpenGLRenderer"
  | }
"""


def runner(outputs):
    """A fake ``run(cmd, timeout)``: the output recorded for each command, else None."""
    calls = []

    def run(cmd, timeout):
        calls.append(tuple(cmd))
        return outputs.get(tuple(cmd))
    run.calls = calls
    return run


def test_parse_plist_and_text():
    assert ad.parse_ioreg_plist(PLIST) == 19
    assert ad.parse_ioreg_plist(plistlib.dumps({"gpu-core-count": 40})) == 40  # one entry
    assert ad.parse_ioreg_text(TEXT) == 8


@pytest.mark.parametrize("data", [b"", b"not a plist", plistlib.dumps([{"model": "x"}]),
                                  plistlib.dumps([{"gpu-core-count": 0}]),
                                  plistlib.dumps([{"gpu-core-count": "10"}]),
                                  plistlib.dumps([{"gpu-core-count": True}]),
                                  plistlib.dumps("text")])
def test_parse_plist_rejects_garbage(data):
    assert ad.parse_ioreg_plist(data) is None


def test_parse_text_rejects_garbage():
    assert ad.parse_ioreg_text("") is None
    assert ad.parse_ioreg_text('"gpu-core-count" = 0\n') is None
    assert ad.parse_ioreg_text('"gpu-core-count-max" = 12\n"model" = "x"') is None


def test_plist_first_then_text():
    run = runner({ad.IOREG_PLIST: PLIST, ad.IOREG_TEXT: TEXT.encode()})
    assert ad.ioreg_core_count(run) == 19 and run.calls == [ad.IOREG_PLIST]
    run = runner({ad.IOREG_PLIST: b"garbage", ad.IOREG_TEXT: TEXT.encode()})
    assert ad.ioreg_core_count(run) == 8 and run.calls == [ad.IOREG_PLIST, ad.IOREG_TEXT]
    assert ad.ioreg_core_count(runner({})) is None         # no ioreg (Linux)


def test_real_runner_survives_a_missing_command():
    assert ad._run(("paged-decode-no-such-command",), 1.0) is None


def test_fallback_order(monkeypatch):
    monkeypatch.delenv(ad.CORES_ENV, raising=False)
    ioreg = runner({ad.IOREG_PLIST: PLIST})
    none = runner({})
    arch = {"architecture": "applegpu_g15s", "device_name": "Apple M3 Max"}
    assert ad.gpu_core_count(arch, ioreg) == (19, "IORegistry gpu-core-count")
    n, why = ad.gpu_core_count(arch, none)
    assert n == 20 and "estimated from architecture applegpu_g15s" in why
    assert ad.gpu_core_count({"architecture": "applegpu_g14d"}, none)[0] == 60
    assert ad.gpu_core_count({"architecture": "applegpu_g13g"}, none)[0] == 10
    n, why = ad.gpu_core_count({"architecture": "x86_64"}, none)
    assert n == ad.DEFAULT_GPU_CORES and why.startswith("default")
    assert ad.gpu_core_count(None, none)[0] == ad.DEFAULT_GPU_CORES
    monkeypatch.setenv(ad.CORES_ENV, "38")
    assert ad.gpu_core_count(arch, ioreg) == (38, f"{ad.CORES_ENV}=38")


@pytest.mark.parametrize("bad", ["0", "-3", "ten", "1.5"])
def test_env_override_must_be_positive(monkeypatch, bad):
    monkeypatch.setenv(ad.CORES_ENV, bad)
    with pytest.raises(InvalidArgumentError, match=f"{ad.CORES_ENV} must be a positive"):
        ad.gpu_core_count({}, runner({}))


def test_device_info_target(monkeypatch):
    monkeypatch.delenv(ad.CORES_ENV, raising=False)
    info = ad.apple_device_info("metal", {"device_name": "Apple M2 Pro",
                                          "architecture": "applegpu_g14s"},
                                runner({ad.IOREG_PLIST: PLIST}))
    assert (info.backend, info.name, info.compute_units) == ("metal", "Apple M2 Pro", 19)
    assert info.target_ctas() == 19 * ad.THREADGROUPS_PER_CORE
    assert "IORegistry" in info.detail and "applegpu_g14s" in info.detail
    monkeypatch.setenv("PAGED_DECODE_TARGET_CTAS", "7")   # the plan override still wins
    assert info.target_ctas() == 7
