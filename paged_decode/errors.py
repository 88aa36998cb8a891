"""Exceptions and the one helper that formats input errors.

Every message names the function, the argument, what was expected and what came, e.g.
``decode: q must have shape [B, Hq, D] = [4, 32, 128], got [4, 32, 64]``.
"""

from __future__ import annotations

from collections.abc import Sequence


class PagedDecodeError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidArgumentError(PagedDecodeError, ValueError):
    """An argument has the wrong shape, value or layout."""


class InvalidDtypeError(PagedDecodeError, TypeError):
    """An argument has a dtype the function does not accept."""


class PageTableError(InvalidArgumentError):
    """A page table breaks one of its invariants (see ``PageTable.validate``)."""


class PoolExhaustedError(PagedDecodeError, MemoryError):
    """The page pool has too few free pages; the pool was left unchanged."""


class PlanMismatchError(InvalidArgumentError):
    """A plan was used with a table or geometry it was not made for."""


class BackendUnavailableError(PagedDecodeError, RuntimeError):
    """An explicitly requested backend is unknown or cannot run here."""


class UnsupportedProblemError(PagedDecodeError, NotImplementedError):
    """The selected backend cannot run this problem (the message says why)."""


def fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_shape(fn: str, name: str, actual: Sequence[int], expected: Sequence[int],
                dims: str) -> None:
    """Raise ``InvalidArgumentError`` unless ``actual == expected``.

    ``dims`` spells the symbolic shape, e.g. ``"[B, Hq, D]"``.
    """
    if tuple(int(a) for a in actual) != tuple(int(e) for e in expected):
        raise InvalidArgumentError(
            f"{fn}: {name} must have shape {dims} = {fmt_shape(expected)}, "
            f"got {fmt_shape(actual)}"
        )


def check_ndim(fn: str, name: str, actual: Sequence[int], ndim: int, dims: str) -> None:
    if len(actual) != ndim:
        raise InvalidArgumentError(
            f"{fn}: {name} must be {ndim}-D {dims}, got shape {fmt_shape(actual)}"
        )


def fail(fn: str, message: str) -> InvalidArgumentError:
    """Build (not raise) an ``InvalidArgumentError`` prefixed with the function name."""
    return InvalidArgumentError(f"{fn}: {message}")
