"""What a model must be for paged-decode to generate with it, checked before any model
call (framework-neutral; each integration reads the numbers off its framework's config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, UnsupportedProblemError, check_int
from ..specs import MAX_PAGE_SIZE, SUPPORTED_HEAD_DIMS

#: model dtypes the pool and kernels serve
MODEL_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Geometry:
    """What ``generate`` reads off a model (either framework): attention shape, layers,
    vocabulary, dtype, and the longest position it embeds (``None``: not stated)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: str
    max_positions: int | None = None


def check_attention(fn: str, *, num_heads: Any, num_kv_heads: Any, head_dim: Any,
                    dtype: str, page_size: Any) -> None:
    """Raise ``UnsupportedProblemError`` (or ``InvalidArgumentError`` for a malformed
    number) unless the attention geometry is one the kernels serve: head_dim in
    ``SUPPORTED_HEAD_DIMS``, ``num_heads`` a multiple of ``num_kv_heads``, a dtype in
    ``MODEL_DTYPES``, and ``1 <= page_size <= MAX_PAGE_SIZE``."""
    h = check_int(fn, "the model's num_attention_heads", num_heads)
    hkv = check_int(fn, "the model's num_key_value_heads", num_kv_heads)
    d = check_int(fn, "the model's head_dim", head_dim)
    check_int(fn, "page_size", page_size, 1, MAX_PAGE_SIZE)
    if h % hkv:
        raise InvalidArgumentError(f"{fn}: the model's num_attention_heads ({h}) is not a "
                                   f"multiple of its num_key_value_heads ({hkv})")
    if d not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedProblemError(f"{fn}: the model's head_dim must be one of "
                                      f"{SUPPORTED_HEAD_DIMS} (what the kernels serve), "
                                      f"got {d}")
    if dtype not in MODEL_DTYPES:
        raise UnsupportedProblemError(f"{fn}: the model's dtype must be one of "
                                      f"{', '.join(MODEL_DTYPES)}, got {dtype}")


def refuse(fn: str, feature: str, field: str, value: Any) -> UnsupportedProblemError:
    """The error for a model feature paged-decode does not implement (never ignored)."""
    return UnsupportedProblemError(f"{fn}: the model uses {feature} ({field}={value!r}), "
                                   "which paged-decode does not support")
