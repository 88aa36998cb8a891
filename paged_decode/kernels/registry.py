"""Every kernel, by its ``KernelSpec.kernel`` key: each module of this package exports one
``KERNEL`` (a ``KernelDef``); adding a kernel is adding its module and its line below."""

from __future__ import annotations

from . import (
    append,
    append_fp8,
    decode_v1,
    decode_v2,
    decode_v2_tc,
    merge,
    prefix_tc,
    table_update,
)
from .kernel_def import KernelDef

#: listed by hand rather than discovered: "go to definition" follows every entry, and a
#: kernel module is registered by the one line that names it
_ALL = (decode_v2.KERNEL, decode_v2_tc.KERNEL, decode_v1.KERNEL, merge.KERNEL, prefix_tc.KERNEL,
        append.KERNEL, append_fp8.KERNEL, table_update.KERNEL)
KERNELS: dict[str, KernelDef] = {k.kernel: k for k in _ALL}
if len(KERNELS) != len(_ALL):
    raise RuntimeError("two kernel modules define the same kernel key")


def kernel_def(kernel: str) -> KernelDef:
    """The definition of ``kernel`` (``"v2"``, ``"v2tc"``, ``"v1"``, ``"merge"``,
    ``"prefix"``, ``"append"``, ``"append_fp8"``, ``"table_update"``)."""
    try:
        return KERNELS[kernel]
    except KeyError:
        raise ValueError(f"unknown kernel {kernel!r}") from None


__all__ = ["KERNELS", "kernel_def"]
