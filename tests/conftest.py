"""Pytest hooks and fixtures only; what tests share otherwise is in ``helpers.py``.

Every test runs with ``PAGED_DECODE_POISON=1``: each fresh output and workspace the
backend allocates is NaN-filled, so an element a kernel forgets to write shows up as NaN
(and ``max_rel_error`` turns any NaN into ``inf``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import WORST

from paged_decode import get_backend
from paged_decode.backends.reference import ANY_GEOMETRY_ENV


# ---------------------------------------------------------------------------- reporting
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """With ``-v``: the worst errors against the oracle this session (``helpers.WORST``)."""
    if WORST and config.getoption("verbose") > 0:
        parts = ", ".join(f"{k} {v:.2e}" for k, v in sorted(WORST.items()))
        terminalreporter.write_line(f"paged-decode worst errors vs oracle: {parts}")


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _poison_and_clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN-poison fresh buffers; keep the caller's backend/target overrides out of tests."""
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    monkeypatch.delenv("PAGED_DECODE_BACKEND", raising=False)
    monkeypatch.delenv("PAGED_DECODE_TARGET_CTAS", raising=False)
    monkeypatch.delenv(ANY_GEOMETRY_ENV, raising=False)


@pytest.fixture
def any_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the reference backend run head dims and page sizes no kernel has (by default
    it refuses them, as the kernel backends do), for tests that use it on small shapes."""
    monkeypatch.setenv(ANY_GEOMETRY_ENV, "1")


@pytest.fixture
def backend():
    """The numpy reference backend."""
    return get_backend("reference")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------- mutants
def pytest_configure(config) -> None:
    """Under ``tests/mutants.py`` (``$PAGED_DECODE_MUTANT``): every emulated backend of
    this process runs that mutant."""
    name = os.environ.get("PAGED_DECODE_MUTANT")
    if name:
        import mutants
        mutants.install(mutants.by_name(name))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under the mutant runner: one JSON line per test phase (outcome, exception type), so
    a failure from a kernel that does not compile is not taken for a kill."""
    outcome = yield
    path = os.environ.get("PAGED_DECODE_MUTANT_REPORT")
    if not path:
        return
    rep = outcome.get_result()
    exc = call.excinfo.type.__name__ if call.excinfo is not None else ""
    msg = str(call.excinfo.value)[:300] if call.excinfo is not None else ""
    with open(path, "a") as f:
        f.write(json.dumps({"nodeid": item.nodeid, "when": rep.when, "outcome": rep.outcome,
                            "exc": exc, "msg": msg}) + "\n")
