"""Greedy batched generation for mlx-lm models with the K/V in a ``PagePool`` (extra
``[mlx-lm]``; tested with mlx-lm 0.32.2 on MLX 0.32.4's CPU build).

The seam is mlx-lm's per-layer cache protocol, the one a model's attention calls: each
layer's ``PagedLayerCache`` gives the rope ``offset``, and ``update_and_fetch(keys,
values)`` appends the forward's new K/V into the pool (through ``paged_batch.PagedBatch``)
and returns every sequence's visible K/V gathered from its pages; layer 0's
``make_mask`` gives the padding-and-causal mask. mlx-lm has **no hook for the attention
call itself**: every model calls ``mx.fast.scaled_dot_product_attention`` (via
``models.base.scaled_dot_product_attention``) on what the cache returns. So with
mlx-lm, paged-decode owns the pages (allocation, fork of a shared prefix, copy-on-write,
the page table) and the attention is MLX's own SDPA over the gathered K/V, the same
gather arm the ``mlx`` backend runs; the Metal decode kernels are not reached from
mlx-lm without patching its model code, which this module does not do.

Backends: ``metal`` where MLX has a Metal device (Apple silicon; never run on Apple
hardware), else ``mlx`` (MLX's CPU device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("paged_decode.integrations.mlx_lm needs mlx and mlx-lm: "
                      "pip install 'paged-decode[mlx-lm]'") from exc

from ..errors import InvalidArgumentError, UnsupportedProblemError, check_bool
from .model_checks import Geometry, check_attention, refuse
from .paged_batch import PagedBatch
from .prompts import pool_pages, prompt_batch

_MX_DTYPES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}


class _Forward:
    """One forward's layout, shared by the layer caches: ``B`` rows of width ``W``, row
    ``b`` holding ``counts[b]`` new tokens right-aligned (``pads[b] = W - counts[b]``),
    after ``before[b]`` tokens already in the pool."""

    def __init__(self, batch: PagedBatch, counts: np.ndarray) -> None:
        self.before = batch.lengths.astype(np.int64)
        self.counts = counts
        self.width = int(counts.max())
        self.pads = self.width - counts
        b = np.repeat(np.arange(counts.size), counts)
        col = np.concatenate([np.arange(p, self.width) for p in self.pads])
        self.rows = b * self.width + col          # the valid rows of a [B * W] flattening
        self.offset = mx.array(self.before - self.pads)   # rope position of column 0


class PagedLayerCache:
    """mlx-lm cache of one layer: the protocol a model's attention uses
    (``offset``, ``update_and_fetch``, ``make_mask``) over the pool of ``batch``."""

    def __init__(self, batch: PagedBatch, layer: int, state: dict[str, _Forward]) -> None:
        self.batch, self.layer, self._state = batch, layer, state

    @property
    def _fwd(self) -> _Forward:
        return self._state["forward"]

    @property
    def offset(self) -> Any:
        """Rope position of each row's column 0, ``mx.array [B]`` (pads count negative)."""
        return self._fwd.offset

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """``keys, values [B, Hkv, W, D]`` (left-padded rows): the valid tokens go to the
        pool; returns every sequence's visible K/V ``[B, Hkv, T, D]`` gathered from its
        pages, right-aligned (``T``: the longest), which ``make_mask`` matches."""
        f = self._fwd
        b, hkv, w, d = keys.shape
        if (b, w) != (f.counts.size, f.width):
            raise InvalidArgumentError(
                f"PagedLayerCache.update_and_fetch: keys must be [B, Hkv, W, D] with B, W = "
                f"{f.counts.size}, {f.width} (the forward generate started), got "
                f"{list(keys.shape)}")
        rows = mx.array(f.rows)
        k = keys.transpose(0, 2, 1, 3).reshape(b * w, hkv, d)[rows]
        v = values.transpose(0, 2, 1, 3).reshape(b * w, hkv, d)[rows]
        if self.layer == 0:
            self.batch.begin(f.counts)
        self.batch.append(self.layer, k, v)
        kg, vg = self.batch.gather(self.layer)
        return kg.transpose(0, 2, 1, 3), vg.transpose(0, 2, 1, 3)

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None,
                  **kwargs: Any) -> Any:
        """Bool ``[B, 1, W, T]``: query column ``j`` of row ``b`` sees key column ``t``
        when ``t`` holds a token of ``b`` at or before the query's position (a padding
        query sees the sequence's first token only, so no row is empty)."""
        if window_size is not None:
            raise refuse("PagedLayerCache.make_mask", "a sliding window", "window_size",
                         window_size)
        f = self._fwd
        after = f.before + f.counts
        t_max = int(after.max())
        first = (t_max - after)[:, None, None]                         # first valid column
        pos = f.before[:, None] + np.arange(f.width)[None, :] - f.pads[:, None]   # [B, W]
        t = np.arange(t_max)[None, None, :]
        mask = (t >= first) & (t - first <= np.maximum(pos, 0)[:, :, None])
        return mx.array(mask[:, None])

    def is_trimmable(self) -> bool:
        return False




def check_model(fn: str, model: Any, page_size: int = 16) -> Geometry:
    """The model's geometry, or ``UnsupportedProblemError`` naming what paged-decode does
    not serve: a layer whose own cache (``make_prompt_cache``) is not a plain
    ``KVCache`` (a sliding window's rotating cache, an SSM state...), a logit soft cap,
    a head_dim outside ``SUPPORTED_HEAD_DIMS``, a dtype other than float16/bfloat16/
    float32."""
    args = getattr(model, "args", None)
    if args is None or not hasattr(model, "layers"):
        raise InvalidArgumentError(f"{fn}: model must be an mlx-lm model (with .args and "
                                   f".layers), got {type(model).__name__}")
    for i, c in enumerate(make_prompt_cache(model)):
        if type(c) is not KVCache:
            raise refuse(fn, f"a {type(c).__name__} for layer {i}", "make_cache",
                         type(c).__name__)
    for field in ("attn_logit_softcapping", "sliding_window"):
        if getattr(args, field, None) is not None:
            raise refuse(fn, field.replace("_", " "), field, getattr(args, field))
    heads = getattr(args, "num_attention_heads", None)
    if not isinstance(heads, int) or (getattr(args, "head_dim", None) is None
                                      and not isinstance(getattr(args, "hidden_size", None),
                                                         int)):
        raise UnsupportedProblemError(
            f"{fn}: the model's args ({type(args).__module__}.{type(args).__name__}) do not "
            "name num_attention_heads and head_dim or hidden_size, the fields paged-decode "
            "reads the attention's geometry from (Llama-style mlx-lm models)")
    kv = getattr(args, "num_key_value_heads", None) or heads
    d = getattr(args, "head_dim", None) or args.hidden_size // heads
    flat: Any = tree_flatten(model.parameters())
    # the activations' dtype: a quantized model packs its weights into uint32 and keeps
    # its scales and biases (which the dequantized rows come out in) in the float dtype
    floats = [p.dtype for _, p in flat if mx.issubdtype(p.dtype, mx.floating)]
    dtype = floats[0] if floats else flat[0][1].dtype
    name = _MX_DTYPES.get(dtype, str(dtype).removeprefix("mlx.core."))
    check_attention(fn, num_heads=heads, num_kv_heads=kv, head_dim=d, dtype=name,
                    page_size=page_size)
    return Geometry(len(model.layers), int(heads), int(kv), int(d), int(args.vocab_size),
                    name)


#: the backends whose arrays are MLX's (what mlx-lm's attention takes)
MLX_BACKENDS = ("mlx", "metal")


def default_backend() -> str:
    """``"metal"`` where MLX has a Metal device, else ``"mlx"`` (MLX's CPU device)."""
    return "metal" if mx.metal.is_available() else "mlx"


@dataclass(frozen=True)
class Generation:
    """``tokens[i]``: the new token ids of prompt ``i``; ``logits``: float32 numpy
    ``[steps, B, V]`` (the logits each token was chosen from; ``None`` unless asked)."""

    tokens: list[list[int]]
    logits: np.ndarray | None


def _greedy(model: Any, caches: list[Any], first: Any, steps: int,
            on_forward: Any) -> tuple[list[list[int]], np.ndarray]:
    """Greedy loop shared by both caches: ``first`` the prefill's last-position logits
    ``[B, V]``; ``on_forward(counts)`` prepares each later one-token forward."""
    out, logits = [], first
    for i in range(steps):
        mx.eval(logits)
        out.append(np.array(logits.astype(mx.float32)))
        if i + 1 == steps:
            break
        nxt = mx.argmax(logits, axis=-1)
        on_forward(np.ones(nxt.size, np.int64))
        logits = model(nxt[:, None], cache=caches)[:, -1, :]
    stacked = np.stack(out)
    return stacked.argmax(-1).T.tolist(), stacked


def generate(model: Any, prompts: Sequence[Any], max_new_tokens: int, *,
             backend: Any = None, page_size: int = 16, num_pages: int | None = None,
             cascade: Any = None, share_prefix: bool = True,
             return_logits: bool = False) -> Generation:
    """Greedy generation of exactly ``max_new_tokens`` tokens (no stop tokens) for every
    prompt, the K/V in a ``PagePool`` on ``backend`` (default ``default_backend()``).

    The prompts' common prefix is prefilled once and forked (``share_prefix``); the
    other prompts' tokens are prefilled together, left-padded. ``num_pages`` (``None``:
    what the run needs) too small raises before the model runs. ``cascade`` is kept for
    symmetry with the transformers integration: mlx-lm's attention never calls
    ``decode`` (see the module docstring), so it must be ``None``.
    """
    fn = "generate"
    check_bool(fn, "return_logits", return_logits)
    if cascade is not None:
        raise InvalidArgumentError(f"{fn}: cascade must be None with mlx-lm (its attention "
                                   f"is MLX's SDPA over gathered pages), got {cascade!r}")
    name = backend if backend is not None else default_backend()
    be_name = getattr(name, "name", name)
    if be_name not in MLX_BACKENDS:      # the pages are gathered into MLX arrays for SDPA
        raise InvalidArgumentError(f"{fn}: backend must be one of {', '.join(MLX_BACKENDS)} "
                                   f"(MLX arrays: mlx-lm's attention reads them), got "
                                   f"{be_name!r}")
    geo = check_model(fn, model, page_size)
    batch = prompt_batch(fn, prompts, max_new_tokens, vocab_size=geo.vocab_size,
                         max_positions=None, share_prefix=share_prefix)
    paged = PagedBatch(num_layers=geo.num_layers,
                       num_pages=pool_pages(fn, batch, page_size, num_pages),
                       page_size=page_size, num_kv_heads=geo.num_kv_heads,
                       num_qo_heads=geo.num_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                       backend=name)
    state: dict[str, _Forward] = {}
    caches = [PagedLayerCache(paged, i, state) for i in range(geo.num_layers)]

    def prepare(counts: np.ndarray) -> None:
        state["forward"] = _Forward(paged, counts)

    def padded(rows: list[tuple[int, ...]]) -> Any:
        w = max(len(r) for r in rows)
        return mx.array([[0] * (w - len(r)) + list(r) for r in rows])

    try:
        if batch.prefix_len:
            paged.start(1)
            prepare(np.array([batch.prefix_len]))
            mx.eval(model(padded([batch.prefix]), cache=caches))
            paged.fork(batch.size)
        else:
            paged.start(batch.size)
        suffixes = batch.suffixes
        prepare(np.array([len(s) for s in suffixes]))
        first = model(padded(suffixes), cache=caches)[:, -1, :]
        tokens, logits = _greedy(model, caches, first, batch.max_new_tokens, prepare)
    finally:
        paged.close()
    return Generation(tokens, logits if return_logits else None)


def framework_generate(model: Any, prompts: Sequence[Any], max_new_tokens: int,
                       ) -> Generation:
    """The same greedy run on mlx-lm's own batch cache (``BatchKVCache``, prompts
    left-padded, as ``batch_generate`` runs them): the comparison of the tests and the
    example. ``logits`` holds every step's logits."""
    fn = "framework_generate"
    geo = check_model(fn, model)
    batch = prompt_batch(fn, prompts, max_new_tokens, vocab_size=geo.vocab_size,
                         max_positions=None, share_prefix=False)
    width = max(len(p) for p in batch.prompts)
    pads = [width - len(p) for p in batch.prompts]
    caches = [BatchKVCache(pads) for _ in range(geo.num_layers)]
    ids = mx.array([[0] * q + list(p) for q, p in zip(pads, batch.prompts)])
    first = model(ids, cache=caches)[:, -1, :]
    tokens, logits = _greedy(model, caches, first, batch.max_new_tokens, lambda c: None)
    return Generation(tokens, logits)
