"""Every kernel, by its ``KernelSpec.kernel`` key: each module of this package that
exports a ``KERNEL`` (a ``KernelDef``) is one, so adding a kernel is adding its module."""

from __future__ import annotations

import importlib
import pkgutil

from . import __path__ as _package_path
from .kernel_def import KernelDef

_NOT_KERNELS = ("common", "kernel_def", "registry")


def _discover() -> dict[str, KernelDef]:
    found: dict[str, KernelDef] = {}
    for info in sorted(pkgutil.iter_modules(_package_path), key=lambda m: m.name):
        if info.name in _NOT_KERNELS:
            continue
        kdef = getattr(importlib.import_module(f"{__package__}.{info.name}"), "KERNEL", None)
        if isinstance(kdef, KernelDef):
            if kdef.kernel in found:
                raise RuntimeError(f"two kernel modules define kernel {kdef.kernel!r}")
            found[kdef.kernel] = kdef
    return found


KERNELS: dict[str, KernelDef] = _discover()


def kernel_def(kernel: str) -> KernelDef:
    """The definition of ``kernel`` (``"v2"``, ``"v1"``, ``"merge"``, ``"prefix"``,
    ``"append"``)."""
    try:
        return KERNELS[kernel]
    except KeyError:
        raise ValueError(f"unknown kernel {kernel!r}") from None


__all__ = ["KERNELS", "kernel_def"]
