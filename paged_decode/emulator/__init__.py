"""A test-time emulator that runs our CUDA kernel strings and Metal (MLX ``metal_kernel``)
bodies on the CPU with GPU semantics (``metal.py`` for the Metal dialect).

Every thread of a block is a cooperative fiber (a hand-written x86_64 context switch);
warps of 32 lanes meet in shuffles, blocks in ``__syncthreads``; buffers sit between
guard pages; each launch runs under several fiber schedules (forward, reverse, random,
one warp running ahead) whose outputs must agree, with ``cp.async`` copies in flight until
their wait. See docs/emulator.md for what is and is not modeled.
"""

from __future__ import annotations

import platform

from .compiler import cache_dir, compiler
from .errors import (
    CompileError,
    DivergenceError,
    EmulatorError,
    ExitedPeerError,
    InFlightWriteError,
    KernelFault,
    KernelTimeoutError,
    MisalignedError,
    OutOfBoundsError,
    RaceError,
)
from .launch import Buffer, launch


def available() -> tuple[bool, str]:
    """Whether the emulator can run here, and why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"needs Linux on x86_64, this is {platform.system()} {platform.machine()}"
    if compiler() is None:
        return False, "no C++ compiler (g++) on PATH"
    return True, ""


__all__ = ["Buffer", "CompileError", "DivergenceError", "EmulatorError", "ExitedPeerError",
           "InFlightWriteError", "KernelFault", "KernelTimeoutError", "MisalignedError",
           "OutOfBoundsError", "RaceError", "available", "cache_dir", "launch"]
