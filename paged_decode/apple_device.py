"""How many GPU cores an Apple-silicon Mac has, for the plan target of the ``metal`` backend.

The plan aims for ``cores x THREADGROUPS_PER_CORE`` v2 threadgroups. The core count is
resolved in this order, and the source is recorded in ``DeviceInfo.detail``:

1. ``PAGED_DECODE_GPU_CORES`` (a positive integer): an explicit override;
2. the IORegistry: the ``gpu-core-count`` property of the ``AGXAccelerator`` entry, read
   with ``ioreg -r -d 1 -c AGXAccelerator -a`` (a plist) and, should that fail to parse,
   the text form of ``ioreg -r -c AGXAccelerator``; the exact count, binned parts
   included;
3. an estimate from the last letter of MLX's ``architecture`` (e.g. ``applegpu_g15s``):
   ``g`` -> 10, ``s`` -> 20, ``d`` -> 60 cores (``mx.device_info()`` has no core count,
   and the letter does not separate Pro from Max parts, hence only an estimate);
4. ``DEFAULT_GPU_CORES`` (10, a base M-series chip).

``PAGED_DECODE_TARGET_CTAS`` still overrides the resulting target (``paged_decode.device``).
Nothing here has run on a Mac: the parsers are tested on recorded sample output.
"""

from __future__ import annotations

import plistlib
import re
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from .device import DeviceInfo
from .errors import env_positive_int

CORES_ENV = "PAGED_DECODE_GPU_CORES"
#: v2 threadgroups (128 threads each) per GPU core the plan aims for: the CUDA backend's
#: CTAs per SM, not yet measured on Apple hardware (``PAGED_DECODE_TARGET_CTAS`` overrides)
THREADGROUPS_PER_CORE = 4
DEFAULT_GPU_CORES = 10
#: rough core counts by the last letter of MLX's architecture string (an estimate only)
SUFFIX_CORES = {"g": 10, "s": 20, "d": 60}
IOREG_PLIST = ("ioreg", "-r", "-d", "1", "-c", "AGXAccelerator", "-a")
IOREG_TEXT = ("ioreg", "-r", "-c", "AGXAccelerator")
KEY = "gpu-core-count"
_TEXT_KEY = re.compile(r'"gpu-core-count"\s*=\s*(\d+)')


def parse_ioreg_plist(data: bytes) -> int | None:
    """The first positive ``gpu-core-count`` in ``ioreg -a`` output (a plist holding a list
    of registry entries, or one entry); ``None`` when absent or unparsable."""
    try:
        root = plistlib.loads(data)
    except Exception:
        return None
    entries = root if isinstance(root, list) else [root]
    for entry in entries:
        if isinstance(entry, dict):
            val = entry.get(KEY)
            if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                return val
    return None


def parse_ioreg_text(text: str) -> int | None:
    """The first positive ``"gpu-core-count" = N`` in ``ioreg`` text output, or ``None``."""
    for m in _TEXT_KEY.finditer(text):
        n = int(m.group(1))
        if n > 0:
            return n
    return None


def _run(cmd: Sequence[str], timeout: float) -> bytes | None:
    try:
        res = subprocess.run(list(cmd), capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def ioreg_core_count(run: Callable[[Sequence[str], float], bytes | None] = _run,
                     timeout: float = 3.0) -> int | None:
    """The GPU core count from the IORegistry, or ``None`` (not a Mac, no ``ioreg``, no
    such key). ``run(cmd, timeout)`` returns a command's stdout or ``None`` (a test hook)."""
    out = run(IOREG_PLIST, timeout)
    n = parse_ioreg_plist(out) if out else None
    if n is None:
        out = run(IOREG_TEXT, timeout)
        n = parse_ioreg_text(out.decode("utf-8", "replace")) if out else None
    return n


def estimate_from_architecture(arch: str) -> int | None:
    """Rough cores from an ``applegpu_g<gen><letter>`` architecture string, or ``None``."""
    m = re.fullmatch(r"applegpu_g\d+([a-z])", arch.strip())
    return SUFFIX_CORES.get(m.group(1)) if m else None


def env_core_count() -> int | None:
    return env_positive_int(CORES_ENV)


def gpu_core_count(mlx_info: dict[str, Any] | None = None,
                   run: Callable[[Sequence[str], float], bytes | None] = _run
                   ) -> tuple[int, str]:
    """``(cores, where the number came from)`` in the order of the module docstring.
    ``mlx_info``: ``mx.device_info()`` of the GPU (for the architecture estimate)."""
    n = env_core_count()
    if n is not None:
        return n, f"{CORES_ENV}={n}"
    n = ioreg_core_count(run)
    if n is not None:
        return n, "IORegistry gpu-core-count"
    arch = str((mlx_info or {}).get("architecture", ""))
    n = estimate_from_architecture(arch)
    if n is not None:
        return n, f"estimated from architecture {arch} (no gpu-core-count in the IORegistry)"
    return DEFAULT_GPU_CORES, "default (no gpu-core-count, no known architecture)"


def apple_device_info(backend: str, mlx_info: dict[str, Any] | None = None,
                      run: Callable[[Sequence[str], float], bytes | None] = _run
                      ) -> DeviceInfo:
    """The planner's view of the Mac's GPU: cores x ``THREADGROUPS_PER_CORE``."""
    info = mlx_info or {}
    cores, source = gpu_core_count(info, run)
    name = str(info.get("device_name") or "Apple GPU")
    arch = info.get("architecture")
    detail = f"{cores} GPU cores ({source})" + (f"; {arch}" if arch else "")
    return DeviceInfo(backend, name, cores, THREADGROUPS_PER_CORE, detail=detail)


__all__ = ["CORES_ENV", "DEFAULT_GPU_CORES", "THREADGROUPS_PER_CORE", "apple_device_info",
           "estimate_from_architecture", "gpu_core_count", "ioreg_core_count",
           "parse_ioreg_plist", "parse_ioreg_text"]
