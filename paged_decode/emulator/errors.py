"""Errors the emulator raises: each message names the kernel and, where it applies, the
block, thread, buffer and element."""

from __future__ import annotations

from ..errors import PagedDecodeError


class EmulatorError(PagedDecodeError, RuntimeError):
    """A kernel could not be built or run under the emulator."""


class CompileError(EmulatorError):
    """The C++ compiler rejected the wrapped kernel source (the message holds its output)."""


class KernelFault(EmulatorError):
    """The kernel failed while running: an out-of-bounds access, a divergent barrier or
    warp collective, a fiber stack overflow."""


class OutOfBoundsError(KernelFault):
    """A read or write outside a launch buffer or the block's shared memory (caught by
    guard pages or red zones), or an index past a fixed-size array's bound (g++'s bounds
    checks)."""


class MisalignedError(KernelFault):
    """A ``cp.async`` copy, an ``ldmatrix`` row, an ``__ldg`` or a pointer cast whose
    address is not aligned to its size where the bytes would sit on a GPU."""


class DivergenceError(KernelFault):
    """A barrier or warp collective that not every thread (lane) reaches."""


class KernelTimeoutError(KernelFault):
    """A schedule's run of the launch took longer than its timeout
    (``PAGED_DECODE_EMULATOR_TIMEOUT``): the kernel loops without end or waits for a
    value no thread writes, which hangs a GPU. The watchdog names a thread it stopped."""


class RaceError(EmulatorError):
    """Two fiber schedules produced different outputs: the kernel communicates through
    shared memory without a barrier in between, or reads a ``cp.async`` destination
    before the wait that lands it."""


class InFlightWriteError(KernelFault, RaceError):
    """Shared memory written while a ``cp.async`` into it was in flight (found when the
    copy lands): on a GPU the copy and the write race."""


class ExitedPeerError(KernelFault, RaceError):
    """A CTA of a thread-block cluster read another CTA's shared memory after that CTA had
    exited: on a GPU its shared memory is gone (a cluster barrier before the exit is
    missing)."""
