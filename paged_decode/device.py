"""What the plan needs to know about the device: how many CTAs fill it.

The target CTA count is resolved in this order: an explicit argument to
``plan_decode(target_ctas=...)``, the environment variable ``PAGED_DECODE_TARGET_CTAS``,
then the backend's ``DeviceInfo.default_target_ctas`` (CUDA: SM count x CTAs per SM,
more over fp8 pools; Apple: GPU core count x threadgroups per core; reference: a fixed
value). The shortest
chunk a plan may cut resolves the same way (``min_chunk_tokens``,
``PAGED_DECODE_MIN_CHUNK_TOKENS``, ``DeviceInfo.min_chunk_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import settings
from .errors import InvalidArgumentError, check_int, check_type, env_positive_int, real_float
from .fp8 import is_fp8

TARGET_ENV = "PAGED_DECODE_TARGET_CTAS"
CHUNK_ENV = "PAGED_DECODE_MIN_CHUNK_TOKENS"
RAGGED_ENV = "PAGED_DECODE_RAGGED_SPLIT"


@dataclass(frozen=True)
class DeviceInfo:
    """A device as the planner sees it.

    ``compute_units``: SMs (CUDA), GPU cores (Apple) or CPU cores (reference).
    ``ctas_per_unit``: how many partial-kernel CTAs one unit should hold at once.
    ``min_chunk_tokens``: the plan never cuts a request into chunks shorter than this
    (a split costs a merge; tiny chunks cost more than they spread).
    ``prefix_tile_rows``: query rows per CTA of the backend's tensor-core level-0 kernel
    of cascade decode (``kernels/prefix_tc.py``), 0 when it has none (cascade then runs
    level 0 on the v2 partial); ``plan_cascade`` sizes level-0 chunks by it.
    ``shared_mem_per_unit``: shared memory bytes per SM (0: unknown), which bounds how
    many prefix-kernel CTAs an SM holds at once.
    ``ragged_split``: the plan's ragged-batch chunk as a fraction of the mean request
    (``plan.make_plan``'s ``ragged_split``; 0: the rule is off).
    ``fp8_ctas_per_unit``: ``ctas_per_unit`` for plans over fp8 pools (0: the same);
    an fp8 CTA streams half the bytes of a 16-bit one per token, so more of them in
    flight keep the memory system busy at small batches.
    ``arch``: the architecture, ``"major.minor"`` compute capability on CUDA (``""``:
    not known); ``path="auto"`` falls back to a crossover table measured on the same one
    when the device has none (``crossover.table_for``).
    """

    backend: str
    name: str
    compute_units: int
    ctas_per_unit: int
    index: int = 0
    detail: str = ""
    min_chunk_tokens: int = 1
    prefix_tile_rows: int = 0
    shared_mem_per_unit: int = 0
    ragged_split: float = 0.0
    fp8_ctas_per_unit: int = 0
    arch: str = ""

    def __post_init__(self) -> None:
        fn = "DeviceInfo"
        for name in ("backend", "name", "detail", "arch"):
            check_type(fn, name, getattr(self, name), str, "a str")
        for name, least in (("compute_units", 1), ("ctas_per_unit", 1), ("index", 0),
                            ("min_chunk_tokens", 1), ("prefix_tile_rows", 0),
                            ("shared_mem_per_unit", 0), ("fp8_ctas_per_unit", 0)):
            check_int(fn, name, getattr(self, name), least)
        check_ragged_split(fn, self.ragged_split)

    @property
    def default_target_ctas(self) -> int:
        """The device's own CTA target, ``compute_units * ctas_per_unit`` (at least
        1): ``target_ctas`` with no argument, environment or fp8 override."""
        return max(1, self.compute_units * self.ctas_per_unit)

    def target_ctas(self, override: int | None = None, *,
                    fn: str = "DeviceInfo.target_ctas", kv_dtype: str | None = None) -> int:
        """The CTA count a plan aims for (argument > environment > device default, which
        for fp8 pools, ``kv_dtype``, counts ``fp8_ctas_per_unit``); errors name ``fn``
        (``plan_decode`` passes its own name)."""
        default = self.default_target_ctas
        if self.fp8_ctas_per_unit and kv_dtype is not None and is_fp8(kv_dtype):
            default = self.compute_units * self.fp8_ctas_per_unit
        return _setting(fn, "target_ctas", override, TARGET_ENV, default)

    @staticmethod
    def target_from_env() -> bool:
        """Whether ``PAGED_DECODE_TARGET_CTAS`` sets the plans' CTA target."""
        return bool((settings.get(TARGET_ENV) or "").strip())

    def chunk_floor(self, override: int | None = None, *,
                    fn: str = "DeviceInfo.chunk_floor") -> int:
        """Shortest chunk, in tokens, a plan may cut (argument > environment > device)."""
        return _setting(fn, "min_chunk_tokens", override, CHUNK_ENV, self.min_chunk_tokens)


    def ragged_fraction(self, override: float | None = None, *,
                        fn: str = "DeviceInfo.ragged_fraction") -> float:
        """The plan's ragged-batch chunk as a fraction of the mean request (argument >
        environment > device; 0: the rule is off)."""
        if override is not None:
            return check_ragged_split(fn, override)
        env = (settings.get(RAGGED_ENV) or "").strip()
        if not env:
            return self.ragged_split
        try:
            value = float(env)
        except ValueError:
            raise InvalidArgumentError(f"{fn}: {RAGGED_ENV} must be a number, got "
                                       f"{env!r}") from None
        return check_ragged_split(f"{fn}: {RAGGED_ENV}", value)


def check_ragged_split(fn: str, value: object) -> float:
    """``value`` as a ragged-split fraction: a finite real number >= 0."""
    f = real_float(value)
    if f is None or not f >= 0:
        raise InvalidArgumentError(f"{fn}: ragged_split must be a finite number >= 0, "
                                   f"got {value!r}")
    return f


def _setting(fn: str, name: str, override: int | None, env_name: str, default: int) -> int:
    """A positive integer setting: the argument, else the environment variable, else the
    device default."""
    if override is not None:
        return check_int(fn, name, override, note=" or None")
    env = env_positive_int(env_name)
    return default if env is None else env
