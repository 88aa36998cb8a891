"""Exceptions and the one helper that formats input errors.

Every message names the function, the argument, what was expected and what came, e.g.
``decode: q must have shape [B, Hq, D] = [4, 32, 128], got [4, 32, 64]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import settings


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


def check_ndim(fn: str, name: str, actual: Sequence[int], ndim: int, dims: str,
               nonempty: str = "") -> None:
    """Raise unless ``actual`` has ``ndim`` axes; the axes named in ``nonempty`` (symbols of
    ``dims``, e.g. ``"Hq D"``) must also be >= 1 (a zero-size head axis is no geometry)."""
    if len(actual) != ndim:
        raise InvalidArgumentError(
            f"{fn}: {name} must be {ndim}-D {dims}, got shape {fmt_shape(actual)}"
        )
    symbols = dims.strip("[]").split(", ")
    for sym in nonempty.split():
        if int(actual[symbols.index(sym)]) < 1:
            raise InvalidArgumentError(
                f"{fn}: {name} must have {sym} >= 1 in {dims}, got shape {fmt_shape(actual)}"
            )


def is_int(value: Any) -> bool:
    """A Python or numpy integer, never a bool (``True`` is not a page size)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(fn: str, name: str, value: Any, minimum: int | None = 1,
              maximum: int | None = None, note: str = "",
              error: type[InvalidArgumentError] = InvalidArgumentError) -> int:
    """``value`` as an ``int``, or ``error`` unless it is an integer (not a bool) in
    ``[minimum, maximum]`` (either bound may be ``None``); ``note`` follows the
    expectation in the message (e.g. ``" or None"``)."""
    if is_int(value) and (minimum is None or value >= minimum) \
            and (maximum is None or value <= maximum):
        return int(value)
    if maximum is not None:
        want = f"an integer in [{minimum}, {maximum}]"
    else:
        want = {None: "an integer", 0: "a non-negative integer",
                1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
    raise error(f"{fn}: {name} must be {want}{note}, got {value!r}")


def as_int64(fn: str, name: str, arr: np.ndarray) -> np.ndarray:
    """Integer array ``arr`` as int64, or ``InvalidArgumentError`` where an unsigned value
    does not fit (a cast would wrap it negative, and checks on differences of unsigned
    values cannot see a decrease)."""
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgumentError(f"{fn}: {name} must hold values that fit int64, got "
                                   f"{int(arr.max())}")
    return arr.astype(np.int64)


def env_positive_int(env_name: str) -> int | None:
    """The positive integer in environment variable ``env_name`` (``None`` when unset or
    empty); anything else raises ``InvalidArgumentError`` naming the variable."""
    val = (settings.get(env_name) or "").strip()
    if not val:
        return None
    try:
        n = int(val)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgumentError(f"{env_name} must be a positive integer, got {val!r}")
    return n


def env_switch(env_name: str, fn: str | None = None) -> bool | None:
    """The 0/1 switch in environment variable ``env_name``, ``None`` when it is unset or
    empty (a tri-state: unset leaves the choice to a rule); anything but ``0`` / ``1``
    raises ``InvalidArgumentError`` naming the variable, after ``fn`` when given (``false``
    or ``no`` must not turn a switch on)."""
    val = (settings.get(env_name) or "").strip()
    if not val:
        return None
    if val not in ("0", "1"):
        where = f"{fn}: " if fn else ""
        raise InvalidArgumentError(f"{where}{env_name} must be 0 or 1, got {val!r}")
    return val == "1"


def env_flag(env_name: str, default: bool = False) -> bool:
    """``env_switch(env_name)``, ``default`` when the variable is unset or empty."""
    val = env_switch(env_name)
    return default if val is None else val


def finite_float(value: Any) -> float | None:
    """``value`` (a real number) as a finite ``float``, or ``None`` where it has none: NaN,
    an infinity, or an int too large for a double (``2**1030``)."""
    try:
        f = float(value)
    except (OverflowError, TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


_BOOLS = (bool, np.bool_)


def is_real(value: Any) -> bool:
    """Whether ``value`` may stand for a number argument: an int or float (numpy's too),
    not a bool, and not a string (``"0.1"`` is not a scale)."""
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, _BOOLS))


def real_float(value: Any) -> float | None:
    """``value`` as a finite ``float`` where ``is_real(value)``, else ``None``."""
    return finite_float(value) if is_real(value) else None


def check_number(fn: str, name: str, value: Any, minimum: float | None = None) -> float:
    """``value`` as a finite ``float``: ``is_real``, and ``>= minimum`` when given."""
    if not is_real(value):
        raise InvalidArgumentError(f"{fn}: {name} must be a real number, got "
                                   f"{type(value).__name__} {value!r}")
    f = finite_float(value)
    if f is None:
        raise InvalidArgumentError(f"{fn}: {name} must be finite, got {value!r}")
    if minimum is not None and f < minimum:
        raise InvalidArgumentError(f"{fn}: {name} must be >= {minimum:g}, got {value!r}")
    return f


def check_bool(fn: str, name: str, value: Any) -> bool:
    """``value`` unless it is not a bool (``"yes"`` and ``1`` are refused)."""
    if not isinstance(value, _BOOLS):
        raise InvalidArgumentError(f"{fn}: {name} must be a bool, got {value!r}")
    return bool(value)


def check_choice(fn: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` unless it is not one of the strings ``choices``."""
    if not (isinstance(value, str) and value in choices):
        raise InvalidArgumentError(f"{fn}: {name} must be one of {', '.join(choices)}, "
                                   f"got {value!r}")
    return value


def check_type(fn: str, name: str, value: Any, cls: type | tuple[type, ...],
               what: str) -> None:
    """Raise unless ``value`` is an instance of ``cls`` (``what`` names it in words)."""
    if not isinstance(value, cls):
        raise InvalidArgumentError(f"{fn}: {name} must be {what}, got {type(value).__name__}")


def refuse_listed_bools(fn: str, name: str, x: Any,
                        error: type[PagedDecodeError] = InvalidArgumentError) -> None:
    """Raise ``error`` where a (nested) list or tuple of integers holds a bool: numpy makes
    ``[True, 1]`` int64, so the dtype check that refuses an all-bool list misses it."""
    if not isinstance(x, (list, tuple)):
        return
    stack = [(name, x)]
    while stack:
        where, seq = stack.pop()
        kinds = set(map(type, seq))             # one C-level pass over a flat list
        if any(issubclass(k, _BOOLS) for k in kinds):
            i = next(i for i, v in enumerate(seq) if isinstance(v, _BOOLS))
            raise error(f"{fn}: {where}[{i}] must be an integer, got {seq[i]!r}")
        if any(issubclass(k, (list, tuple)) for k in kinds):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(seq)
                      if isinstance(v, (list, tuple))]


def check_int_array(fn: str, name: str, x: Any, length: int | None = None,
                    minimum: int | None = None, maximum: int | None = None) -> np.ndarray:
    """Host integers ``x`` (a list or numpy array) as int64 ``[length]``, every value in
    ``[minimum, maximum]`` (either bound may be ``None``), or ``InvalidArgumentError``
    naming ``fn``, ``name`` and the first value out of range. Floats, strings, bools and
    ragged lists are refused, never truncated."""
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:   # ragged lists; a device array's implicit copy
        raise InvalidArgumentError(f"{fn}: {name} must be a 1-D array of host integers, got "
                                   f"a {type(x).__name__} that is not one") from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{fn}: {name} must be a 1-D array of integers, got shape "
                                   f"{fmt_shape(arr.shape)} dtype {arr.dtype}")
    refuse_listed_bools(fn, name, x)
    arr = as_int64(fn, name, arr)
    if length is not None and arr.size != length:
        raise InvalidArgumentError(f"{fn}: {name} must have {length} entries, got {arr.size}")
    bad = np.zeros(arr.size, bool)
    if minimum is not None:
        bad |= arr < minimum
    if maximum is not None:
        bad |= arr > maximum
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidArgumentError(f"{fn}: {name}[{i}] must be in [{minimum}, {maximum}], "
                                   f"got {int(arr[i])}")
    return arr


def check_writable(fn: str, name: str, arr: Any, why: str = "") -> None:
    """Raise unless ``arr`` may be written: a read-only numpy array (``flags.writeable``
    unset) is refused; other kinds carry no such flag. ``why`` follows in the message."""
    if not getattr(getattr(arr, "flags", None), "writeable", True):
        raise InvalidArgumentError(f"{fn}: {name} must be writable{why}, got a read-only "
                                   "array")


def fail(fn: str, message: str) -> InvalidArgumentError:
    """Build (not raise) an ``InvalidArgumentError`` prefixed with the function name."""
    return InvalidArgumentError(f"{fn}: {message}")
