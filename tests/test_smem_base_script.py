"""bench/device/smem_base.py's kernel under the CPU emulator: it must report where the
emulator puts dynamic shared memory (16 bytes past a 128-byte boundary under the schedules
that start it at its lower guard, the only alignment CUDA promises, so that a kernel
assuming more fails on the CPU too) whatever static shared memory the kernel holds. On
the GPU the same kernel says where the device puts it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from paged_decode import emulator
from paged_decode.emulator.launch import Buffer, launch

pytestmark = pytest.mark.skipif(not emulator.available()[0],
                                reason=f"emulator unavailable: {emulator.available()[1]}")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "device" / "smem_base.py"


def _script():
    spec = importlib.util.spec_from_file_location("smem_base", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)                 # imports CuPy only when run
    return mod


@pytest.mark.parametrize("static_bytes", [0, 48, 1024])
@pytest.mark.parametrize("schedule", ["reverse", "runahead"])
def test_the_emulators_dynamic_base_is_16_off_128(static_bytes, schedule):
    """Where the dynamic region starts at its lower guard (the reverse and runahead
    schedules, which every default launch runs)."""
    src = f"#define STATIC_BYTES {static_bytes}\n" + _script().SOURCE
    out = np.full(1, 0xDEADBEEF, np.uint32)
    launch(src, "base_mod", 1, 128, [Buffer("out", out, True)], shared_mem=4096,
           schedules=(schedule,))
    assert out[0] == 16


@pytest.mark.parametrize("schedule", ["forward", "random"])
def test_the_emulators_dynamic_region_ends_at_its_guard(schedule):
    """Where it ends at its upper guard instead: 4096 - 16 bytes leave the base 16 bytes
    past a 128-byte boundary, 4096 + 48 bytes 48 bytes before one."""
    for shared_mem, want in ((4096 - 16, 16), (4096 + 48, 128 - 48)):
        src = "#define STATIC_BYTES 0\n" + _script().SOURCE
        out = np.full(1, 0xDEADBEEF, np.uint32)
        launch(src, "base_mod", 1, 128, [Buffer("out", out, True)], shared_mem=shared_mem,
               schedules=(schedule,))
        assert out[0] == want, (shared_mem, int(out[0]))
