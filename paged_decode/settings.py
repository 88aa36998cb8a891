"""Every ``PAGED_DECODE_*`` setting, and the one place that reads them.

A call resolves the settings once (``snapshot()``, one read of each variable) and binds
that value for its duration (``bound(s)``): every module that asks ``get(NAME)`` during
the call sees the same snapshot, and the snapshot is part of ``decode``'s fast-path key,
so a prepared call can never replay launches made under other settings. Outside a bound
call ``get`` reads the environment directly (module-level tools, tests).

The variables (see the README for what each does):
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass

#: name -> what it steers; the module docstring's table is built from this
VARIABLES: dict[str, str] = {
    "PAGED_DECODE_BACKEND": "backend chosen when none is passed",
    "PAGED_DECODE_TARGET_CTAS": "the plan's CTA target",
    "PAGED_DECODE_MIN_CHUNK_TOKENS": "the plan's shortest chunk",
    "PAGED_DECODE_RAGGED_SPLIT": "the plan's ragged-batch chunk, as a fraction of the mean",
    "PAGED_DECODE_WAVE_PLAN": "0: plan the tensor-core partial by the CTA target, not its waves",
    "PAGED_DECODE_CASCADE": "cascade forced on (1) / off (0)",
    "PAGED_DECODE_CROSSOVER": "crossover table file for path='auto'",
    "PAGED_DECODE_STAGES": "CUDA v2/v1/v2tc pipeline depth (experiments)",
    "PAGED_DECODE_V2_ROW_LOADS": "CUDA v2 loads per lane per row (experiments)",
    "PAGED_DECODE_TC_WARPS": "CUDA v2tc warps per CTA, 2 / 4 / 8 (experiments)",
    "PAGED_DECODE_L2_PREFETCH": "CUDA cp.async L2 prefetch hint, 0 / 64 / 128 / 256 bytes, "
                                "or rows: the most that divides each kernel's K/V row "
                                "(experiments)",
    "PAGED_DECODE_GRID_ORDER": "CUDA flat decode CTAs numbered heads / chunks first; unset: "
                               "heads first where the L2 prefetch runs past a K/V row "
                               "and over fp8 rows up to it (experiments)",
    "PAGED_DECODE_TIMELINE": "CUDA kernels compiled with per-CTA timeline stamps, 0 / 1 "
                             "(diagnostics: bench/device/timeline.py)",
    "PAGED_DECODE_PREFIX_TILE": "cascade prefix-kernel tile (experiments)",
    "PAGED_DECODE_PREFIX_CTAS_PER_SM": "cascade prefix-kernel residency (experiments)",
    "PAGED_DECODE_FUSED_MERGE": "the CUDA tensor-core partial's merge fused into it: unset "
                                "where it pays (GQA 1-4, head_dim <= 128; any GQA where it "
                                "runs in clusters), 1 always, 0 never",
    "PAGED_DECODE_CLUSTER_MERGE": "the CUDA fused merge within thread-block clusters (sm_90+, "
                                  "every request in the same 2-8 chunks): unset where it "
                                  "pays (launches.cluster_merge_pays), 1 wherever the plan "
                                  "allows it, 0 never",
    "PAGED_DECODE_MERGE_SPLIT": "CUDA merge warps per (row, head): unset, the rule "
                                "(launches.merge_split); 1, 2, 4, 8 or 16 forces it",
    "PAGED_DECODE_PDL": "CUDA merge launched as the partial's programmatic dependent "
                        "(sm_90+): unset, for packed launches only (prepared calls, "
                        "engine step, graphs); 1 eager calls too; 0 never",
    "PAGED_DECODE_ASSERT_NO_COMPILE": "any kernel compile raises on cuda and emulated-cuda "
                                      "(benchmarks, compile_ahead checks)",
    "PAGED_DECODE_POISON": "NaN-fill fresh outputs and workspaces (tests)",
    "PAGED_DECODE_REFERENCE_ANY_GEOMETRY": "reference backend runs any geometry (oracle use)",
    "PAGED_DECODE_GPU_CORES": "Apple GPU core count when the IORegistry is not read",
    "PAGED_DECODE_EMULATOR_CACHE": "emulator build cache folder",
    "PAGED_DECODE_EMULATOR_CXX": "emulator C++ compiler",
    "PAGED_DECODE_EMULATOR_THREADS": "emulator OS threads",
    "PAGED_DECODE_EMULATOR_RACES": "emulator schedule comparison on (1) / off (0)",
    "PAGED_DECODE_EMULATOR_SCHEDULES": "emulator fiber schedules",
    "PAGED_DECODE_EMULATOR_CP_ASYNC": "emulator cp.async model",
    "PAGED_DECODE_EMULATOR_TIMEOUT": "emulator watchdog: seconds a launch's schedule may run",
}
__doc__ = (__doc__ or "") + "\n".join(f"- ``{k}``: {v}" for k, v in VARIABLES.items()) + "\n"
_NAMES = tuple(VARIABLES)


@dataclass(frozen=True)
class Settings:
    """The values of every variable in ``VARIABLES`` (``None``: unset), hashable."""

    values: tuple[str | None, ...]

    def get(self, name: str) -> str | None:
        return self.values[_INDEX[name]]


_INDEX = {n: i for i, n in enumerate(_NAMES)}
_bound: contextvars.ContextVar[Settings | None] = contextvars.ContextVar(
    "paged_decode_settings", default=None)


def snapshot() -> Settings:
    """The current settings (one read of each variable; the bound ones inside a call)."""
    s = _bound.get()
    if s is not None:
        return s
    env = os.environ
    return Settings(tuple(env.get(n) for n in _NAMES))


def get(name: str, default: str | None = None) -> str | None:
    """The value of ``name`` for the running call (``default`` when unset)."""
    if name not in _INDEX:
        raise KeyError(f"{name} is not a paged-decode setting (see settings.VARIABLES)")
    s = _bound.get()
    val = s.get(name) if s is not None else os.environ.get(name)
    return default if val is None else val


def active() -> dict[str, str]:
    """The variables of ``VARIABLES`` set now (name -> value), for a run's record: a bench
    report says which experiment switches its times were taken under."""
    return {n: v for n, v in zip(_NAMES, snapshot().values) if v is not None}


@contextlib.contextmanager
def bound(s: Settings) -> Iterator[Settings]:
    """Run the body under ``s`` (nested calls keep the outer snapshot)."""
    if _bound.get() is not None:
        yield s
        return
    token = _bound.set(s)
    try:
        yield s
    finally:
        _bound.reset(token)


__all__ = ["VARIABLES", "Settings", "active", "bound", "get", "snapshot"]
