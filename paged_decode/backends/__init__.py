"""Backend registry.

Policy: an explicit choice (the ``backend=`` argument or ``PAGED_DECODE_BACKEND``) is
strict: an unknown or unavailable name raises ``BackendUnavailableError`` listing the
names that are available. Automatic choice (``None`` / ``"auto"``) takes the first
available backend in ``AUTO_ORDER`` quietly; ``last_auto_choice()`` says which and why.
Backends are imported lazily, so importing the package never imports CuPy or MLX.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .. import settings
from ..errors import BackendUnavailableError, InvalidArgumentError
from .base import Backend, Problem, Support, c_contiguous, check_same_device

ENV = "PAGED_DECODE_BACKEND"


@dataclass(frozen=True)
class BackendEntry:
    name: str
    module: str
    cls: str
    description: str

    def load(self) -> type[Backend]:
        mod = importlib.import_module(self.module, __name__)
        return getattr(mod, self.cls)  # type: ignore[no-any-return]


REGISTRY: dict[str, BackendEntry] = {
    "cuda": BackendEntry("cuda", ".cuda", "CudaBackend", "NVIDIA GPUs through CuPy"),
    "emulated-cuda": BackendEntry("emulated-cuda", ".emulated", "EmulatedCudaBackend",
                                  "the CUDA kernels on the CPU emulator (tests; explicit "
                                  "choice only)"),
    "metal": BackendEntry("metal", ".mlx", "MetalBackend",
                          "Apple GPUs: the Metal kernels through MLX's metal_kernel (MLX "
                          "arrays; not yet run on Apple hardware)"),
    "mlx": BackendEntry("mlx", ".mlx", "MlxBackend",
                        "MLX arrays on any MLX device, MLX ops only: the gather arm and the "
                        "merge (Linux, or Macs as a baseline)"),
    "emulated-metal": BackendEntry("emulated-metal", ".emulated", "EmulatedMetalBackend",
                                   "the Metal kernels (MLX metal_kernel bodies) on the CPU "
                                   "emulator (tests; explicit choice only)"),
    "reference": BackendEntry("reference", ".reference", "ReferenceBackend",
                              "vectorized numpy on the CPU (float32 accumulation)"),
}
AUTO_ORDER = ("cuda", "reference")

_instances: dict[str, Backend] = {}
_last_auto: list[str] = []


def availability(name: str) -> Support:
    """Whether backend ``name`` can run here (``Support.reason`` says why not)."""
    entry = REGISTRY.get(name)
    if entry is None:
        return Support(False, f"unknown backend {name!r}")
    try:
        cls = entry.load()
    except Exception as exc:  # an optional dependency that fails to import
        return Support(False, f"import failed: {type(exc).__name__}: {exc}")
    try:
        return cls.available()
    except Exception as exc:
        return Support(False, f"availability check failed: {type(exc).__name__}: {exc}")


def available_backends() -> list[str]:
    """Names of the registered backends that can run here (``availability``),
    in registry order."""
    return [n for n in REGISTRY if availability(n).ok]


def register(entry: BackendEntry) -> None:
    """Add a backend (used by the emulated backends and by tests)."""
    REGISTRY[entry.name] = entry
    _instances.pop(entry.name, None)


def get_backend(name: str | Backend | None = None, *, fn: str = "get_backend") -> Backend:
    """The backend to run on (see the module docstring for the policy); errors name
    ``fn``, the public function that was asked for the backend."""
    if isinstance(name, Backend):
        return name
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"{fn}: backend must be a backend name, a Backend or "
                                   f"None, got {type(name).__name__} {name!r}")
    explicit = name if name not in (None, "auto") else settings.get(ENV) or None
    if explicit is not None and explicit != "auto":
        if explicit in _instances:
            return _instances[explicit]
        sup = availability(explicit)
        if not sup.ok:
            raise BackendUnavailableError(
                f"{fn}: backend {explicit!r} is not usable here ({sup.reason}); available: "
                f"{', '.join(available_backends()) or 'none'}; known: {', '.join(REGISTRY)}")
        inst = REGISTRY[explicit].load()()
        _instances[explicit] = inst
        return inst
    reasons: list[str] = []
    for cand in AUTO_ORDER:
        if cand in _instances:
            _last_auto[:] = [cand, "cached"]
            return _instances[cand]
        sup = availability(cand)
        if sup.ok:
            inst = REGISTRY[cand].load()()
            _instances[cand] = inst
            _last_auto[:] = [cand, "; ".join(reasons) or "first available"]
            return inst
        reasons.append(f"{cand}: {sup.reason}")
    raise BackendUnavailableError(f"{fn}: no backend is available: " + "; ".join(reasons))


def array_kind(x: object) -> str:
    """``"numpy"``, ``"cupy"``, ``"torch"``, ``"mlx"`` or ``"other"`` (by the type's module)."""
    mod = type(x).__module__.split(".")[0]
    return mod if mod in ("numpy", "cupy", "torch", "mlx") else "other"


def backend_for(name: str | Backend | None, x: object, *, fn: str = "get_backend") -> Backend:
    """The backend for a call on arrays like ``x``.

    An explicit ``name`` (or ``PAGED_DECODE_BACKEND``) wins, strictly. Otherwise the
    array kind decides: numpy -> reference, CuPy or CUDA torch tensors -> cuda, MLX arrays
    -> metal where Metal is available and mlx (the gather arm) elsewhere (the best
    available backend for other kinds).
    """
    if isinstance(name, Backend):
        return name
    if name not in (None, "auto") or (settings.get(ENV) or "auto") != "auto":
        return get_backend(name, fn=fn)
    kind = array_kind(x)
    if kind == "numpy":
        return get_backend("reference", fn=fn)
    if kind == "cupy" or (kind == "torch" and getattr(x, "is_cuda", False)):
        return get_backend("cuda", fn=fn)
    if kind == "mlx":
        return get_backend("metal" if "metal" in _instances or availability("metal").ok
                           else "mlx", fn=fn)
    return get_backend(None, fn=fn)


def last_auto_choice() -> tuple[str, str] | None:
    """(name, why) of the last automatic choice, or ``None``."""
    return (_last_auto[0], _last_auto[1]) if _last_auto else None


__all__ = ["Backend", "BackendEntry", "Problem", "Support", "c_contiguous", "REGISTRY",
           "check_same_device",
           "available_backends", "availability", "get_backend", "backend_for", "array_kind",
           "register", "last_auto_choice"]
