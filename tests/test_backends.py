"""Backend registry: strict explicit choice, quiet automatic fallback, array-kind routing."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import assert_matches_oracle

import paged_decode.backends as backends
from paged_decode import BackendUnavailableError, PagePool, decode, get_backend
from paged_decode.backends import (
    BackendEntry,
    Problem,
    Support,
    array_kind,
    availability,
    available_backends,
    backend_for,
    last_auto_choice,
)
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode

UNPLUGGED = "the fake device is unplugged"


class Unplugged(ReferenceBackend):
    """A backend that is never available here."""

    name = "unplugged"

    @classmethod
    def available(cls) -> Support:
        return Support(False, UNPLUGGED)


class FakeGpu(ReferenceBackend):
    """A backend that is always available (stands in for a GPU backend)."""

    name = "fakegpu"


class Exploding(ReferenceBackend):
    name = "exploding"

    @classmethod
    def available(cls) -> Support:
        raise RuntimeError("driver crashed")


@pytest.fixture
def fake_registry(monkeypatch):
    """Register fake backends (this module) and start from an empty instance cache."""
    for name, cls in (("unplugged", "Unplugged"), ("exploding", "Exploding"),
                      ("fakegpu", "FakeGpu")):
        monkeypatch.setitem(backends.REGISTRY, name, BackendEntry(name, __name__, cls, "fake"))
    monkeypatch.setitem(backends.REGISTRY, "broken",
                        BackendEntry("broken", ".no_such_module", "Nope", "fake"))
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(backends, "_last_auto", [])


def small_problem():
    return make_problem(ProblemSpec(2, 20, 4, 2, 16, 4, seed=3))


# ---------------------------------------------------------------------------- explicit
def test_explicit_unknown_name_lists_available_backends():
    with pytest.raises(BackendUnavailableError,
                       match=r"backend 'nope' is not usable here \(unknown backend 'nope'\); "
                             r"available: [^;]*\breference\b"):
        get_backend("nope")


def test_reference_is_available_and_cached(backend):
    assert "reference" in available_backends()
    assert availability("reference").ok
    assert backend.name == "reference" and isinstance(backend, ReferenceBackend)
    assert get_backend("reference") is backend
    assert get_backend(backend) is backend


def test_env_selects_reference(monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_BACKEND", "reference")
    assert get_backend().name == "reference"
    assert get_backend("auto").name == "reference"
    assert backend_for(None, np.zeros(3)).name == "reference"


def test_env_choice_is_strict(monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_BACKEND", "nope")
    with pytest.raises(BackendUnavailableError, match=r"backend 'nope' is not usable here"):
        get_backend()
    with pytest.raises(BackendUnavailableError, match=r"backend 'nope'"):
        backend_for(None, np.zeros(3))          # even for numpy arrays
    pr = small_problem()
    with pytest.raises(BackendUnavailableError, match=r"backend 'nope'"):
        decode(pr.q, pr.k_pages, pr.v_pages, pr.table)


def test_explicit_argument_beats_env(monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_BACKEND", "nope")
    assert get_backend("reference").name == "reference"
    assert backend_for("reference", np.zeros(3)).name == "reference"


def test_explicit_unavailable_backend_raises_with_reason(fake_registry):
    with pytest.raises(BackendUnavailableError,
                       match=rf"backend 'unplugged' is not usable here \({UNPLUGGED}\); "
                             r"available: [^;]*\breference\b"):
        get_backend("unplugged")
    with pytest.raises(BackendUnavailableError, match=r"backend 'broken' is not usable here "
                                                      r"\(import failed: ModuleNotFoundError"):
        get_backend("broken")
    with pytest.raises(BackendUnavailableError, match=r"availability check failed: "
                                                      r"RuntimeError: driver crashed"):
        get_backend("exploding")
    assert set(available_backends()).isdisjoint({"unplugged", "broken", "exploding"})
    with pytest.raises(BackendUnavailableError, match=UNPLUGGED):
        PagePool(4, 4, 1, 8, backend="unplugged")
    pr = small_problem()
    with pytest.raises(BackendUnavailableError, match=UNPLUGGED):
        decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend="unplugged")


@pytest.mark.skipif(availability("cuda").ok, reason="a usable CUDA backend is present here")
def test_explicit_cuda_without_gpu_raises_with_reason():
    reason = availability("cuda").reason
    assert reason
    with pytest.raises(BackendUnavailableError, match=r"backend 'cuda' is not usable here \("):
        get_backend("cuda")
    try:
        get_backend("cuda")
    except BackendUnavailableError as exc:
        assert reason in str(exc) and "reference" in str(exc)


# ---------------------------------------------------------------------------- automatic
def test_auto_choice_falls_back_quietly(fake_registry, monkeypatch):
    monkeypatch.setattr(backends, "AUTO_ORDER", ("unplugged", "broken", "exploding",
                                                 "reference"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be = get_backend()
    assert be.name == "reference"
    name, why = last_auto_choice()
    assert name == "reference"
    assert f"unplugged: {UNPLUGGED}" in why and "broken: import failed" in why
    assert get_backend(None) is be and get_backend("auto") is be


def test_auto_choice_with_nothing_available(fake_registry, monkeypatch):
    monkeypatch.setattr(backends, "AUTO_ORDER", ("unplugged", "broken"))
    with pytest.raises(BackendUnavailableError, match=rf"no backend is available: "
                                                      rf"unplugged: {UNPLUGGED}; broken: "):
        get_backend()


def test_auto_on_this_machine_is_usable():
    be = get_backend()
    assert be.name in available_backends()


# ---------------------------------------------------------------------------- routing
def test_backend_for_picks_reference_for_numpy(fake_registry, monkeypatch):
    # even when a better-ranked backend is available, numpy arrays stay on the CPU
    monkeypatch.setattr(backends, "AUTO_ORDER", ("fakegpu", "reference"))
    assert get_backend().name == "fakegpu"
    assert backend_for(None, np.zeros((2, 2), np.float16)).name == "reference"
    assert backend_for("auto", np.zeros(2)).name == "reference"
    assert backend_for(None, [1.0, 2.0]).name == "fakegpu"    # other kinds: automatic
    inst = Unplugged()
    assert backend_for(inst, np.zeros(2)) is inst


def test_array_kind():
    assert array_kind(np.zeros(1)) == "numpy"
    assert array_kind([1, 2]) == "other"


@pytest.mark.usefixtures("any_geometry")   # head_dim 16
def test_decode_accepts_a_backend_instance():
    pr = small_problem()
    out = decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=ReferenceBackend())
    want, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, None, want, None, "float16", "a backend instance")


def test_reference_supports_every_problem(backend):
    for path in ("v2", "v1", "gather"):
        for dt in ("float16", "bfloat16", "float32"):
            assert backend.supports(Problem(dt, dt, 12, 4, 96, 7, path)).ok


def test_reference_device_target_is_fixed(backend):
    info = backend.device_info()
    assert info.backend == "reference" and info.default_target_ctas == 32
