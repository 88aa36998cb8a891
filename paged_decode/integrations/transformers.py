"""Greedy batched generation for Hugging Face transformers models with the K/V in a
``PagePool`` (extra ``[transformers]``; tested with transformers 5.24 and torch 2.13).

The seams are transformers' own extension points, no model code is patched:

- **Cache API**: ``PagedCache`` is a ``transformers.Cache`` whose layers
  (``PagedCacheLayer``) append each forward's new K/V into the pool (``update``), through
  the one adapter ``paged_batch.PagedBatch``.
- **AttentionInterface**: ``paged_attention`` is registered as ``"paged_decode"``; the
  model runs with ``attn_implementation="paged_decode"`` (set for the call, restored
  after). Decode steps run on the pool's pages: through a ``DecodeStep`` (prepared
  append and decode launches per layer, ``PagedBatch(step_engine=True)``) for a flat
  decode, through ``paged_decode.decode`` for a cascade; prefill runs torch SDPA per
  sequence over its K/V gathered from the pool. transformers builds no mask for
  an implementation without a registered mask function, so the page table is the mask.

Batches are packed: one forward takes ``input_ids [1, N]`` holding every sequence's new
tokens in order, with explicit ``position_ids``; a shared prompt prefix is prefilled once
and forked. transformers' own continuous-batching paged cache (``generate_batch``,
``PagedAttentionCache``) is not used: it owns its own block table and K/V tensors, so
the pages would have two owners.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
    from transformers import AttentionInterface, Cache
    from transformers.cache_utils import CacheLayerMixin
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("paged_decode.integrations.transformers needs torch and transformers: "
                      "pip install 'paged-decode[transformers]'") from exc

from ..errors import InvalidArgumentError, UnsupportedProblemError, check_bool
from .decode_graph import DecodeGraph
from .model_checks import Geometry, check_attention, refuse
from .paged_batch import PagedBatch
from .prompts import pool_pages, prompt_batch

#: the name ``paged_attention`` is registered under in transformers' AttentionInterface
ATTN_NAME = "paged_decode"

_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                 torch.float32: "float32"}


def to_torch(x: Any, like: torch.Tensor) -> torch.Tensor:
    """A backend array (numpy, CuPy, torch) as a torch tensor on ``like``'s device
    (zero-copy where the kinds allow; numpy bfloat16 by its bits)."""
    if isinstance(x, torch.Tensor):
        return x.to(like.device)
    if isinstance(x, np.ndarray):
        x = np.ascontiguousarray(x)
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(like.device)
        return torch.from_numpy(x).to(like.device)
    return torch.from_dlpack(x)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function over the pool of ``kwargs["paged_batch"]``.

    ``query [1, Hq, N, D]`` holds the new tokens of every sequence, packed in batch
    order (``PagedBatch.counts`` each; one each in a decode step); ``key``/``value`` are
    the same tokens' K/V, already appended by ``PagedCache`` (read back from the pool,
    not used here). Returns ``[1, N, Hq, D]`` in ``query``'s dtype and ``None`` (no
    attention weights). A sliding window, a logit soft cap or attention sinks in the
    call raise ``UnsupportedProblemError``.
    """
    fn = "paged_attention"
    batch = kwargs.get("paged_batch")
    if not isinstance(batch, PagedBatch):
        raise InvalidArgumentError(
            f"{fn}: attn_implementation {ATTN_NAME!r} runs inside paged_decode.integrations."
            "transformers.generate, which passes paged_batch= to the model; got "
            f"{type(batch).__name__}")
    for name, feature in (("sliding_window", "a sliding window"),
                          ("softcap", "a logit soft cap"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            raise refuse(fn, feature, name, kwargs[name])
    if dropout and module.training:
        raise UnsupportedProblemError(f"{fn}: attention dropout ({dropout}) in training "
                                      "mode is not supported (generation runs in eval mode)")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)                                  # [N, Hq, D]
    counts = batch.counts
    if counts is None:                                            # decode: one query each
        # the engine step copies q into its own buffer (any strides): no copy here
        out = to_torch(batch.decode(layer, q if batch.in_engine_step else q.contiguous(),
                                    scale), query)
        return out[None], None
    out = torch.empty_like(q)
    k_all, v_all = batch.gather(layer)                            # [B, W, Hkv, D], left-padded
    k_all, v_all = to_torch(k_all, query), to_torch(v_all, query)
    lens = batch.lengths
    width = k_all.shape[1]
    start = 0
    for i, c in enumerate(int(c) for c in counts):
        if c == 0:
            continue
        t = int(lens[i])
        k = k_all[i, width - t:].transpose(0, 1)                  # [Hkv, T, D]
        v = v_all[i, width - t:].transpose(0, 1)
        rows = torch.arange(c, device=query.device)[:, None] + (t - c)
        mask = torch.arange(t, device=query.device)[None, :] <= rows       # causal, offset
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + c].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
            enable_gqa=True)
        out[start:start + c] = o.transpose(0, 1)
        start += c
    return out[None], None


AttentionInterface.register(ATTN_NAME, paged_attention)


class PagedCacheLayer(CacheLayerMixin):
    """One layer of ``PagedCache``: ``update`` appends the new K/V to the pool."""

    is_sliding = False

    def __init__(self, batch: PagedBatch, layer: int) -> None:
        super().__init__()
        self.batch, self.layer = batch, layer

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            ) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states, value_states [1, Hkv, N, D]`` (the packed forward's new tokens)
        go to the pool; they are returned unchanged (``paged_attention`` reads the pool)."""
        if key_states.ndim != 4 or key_states.shape[0] != 1:
            raise InvalidArgumentError(
                "PagedCacheLayer.update: key_states must be [1, Hkv, N, D] (a packed batch, "
                f"as generate runs the model), got {list(key_states.shape)}")
        k, v = key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        if not self.batch.in_engine_step:
            k, v = k.contiguous(), v.contiguous()   # the engine step copies views itself
        self.batch.append(self.layer, k, v)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        lens = self.batch.lengths
        return int(lens.max()) if lens.size else 0

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """A transformers ``Cache`` whose K/V live in ``batch``'s ``PagePool`` (one
    ``PagedCacheLayer`` per model layer)."""

    def __init__(self, batch: PagedBatch) -> None:
        super().__init__(layers=[PagedCacheLayer(batch, i) for i in range(batch.num_layers)])
        self.batch = batch




def check_model(fn: str, model: Any, page_size: int = 16) -> Geometry:
    """The model's geometry, or ``UnsupportedProblemError`` naming what paged-decode does
    not serve: an encoder-decoder, a sliding window (``sliding_window`` /
    ``layer_types``), a logit soft cap (``attn_logit_softcapping``), ALiBi, a model
    whose attention ignores ``attn_implementation`` (``_supports_attention_backend``
    False: Bloom, MPT, GPT-Neo, Falcon, XGLM, ...), a head_dim outside
    ``SUPPORTED_HEAD_DIMS``, a dtype other than float16/bfloat16/float32."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "forward"):
        raise InvalidArgumentError(f"{fn}: model must be a transformers causal LM, got "
                                   f"{type(model).__name__}")
    if getattr(config, "is_encoder_decoder", False):
        raise refuse(fn, "an encoder-decoder architecture", "is_encoder_decoder", True)
    can_generate = getattr(model, "can_generate", None)
    if not (callable(can_generate) and can_generate()):
        # a base model (no logits) or a masked LM: generate would fail inside its forward
        raise InvalidArgumentError(f"{fn}: model must be a transformers causal LM (a "
                                   f"language-modelling head whose can_generate() is True, "
                                   f"e.g. LlamaForCausalLM), got {type(model).__name__}")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type",
                                                   None) == "alibi":
        raise refuse(fn, "ALiBi position biases", "alibi", True)
    if not getattr(type(model), "_supports_attention_backend", False):
        # its attention module ignores attn_implementation, so paged_attention would
        # never run: the model's own attention would see only the new tokens' K/V
        raise UnsupportedProblemError(
            f"{fn}: {type(model).__name__} does not route its attention through "
            "transformers' AttentionInterface (_supports_attention_backend is False), "
            "so paged-decode cannot serve it")
    kinds = getattr(config, "layer_types", None)
    if kinds is not None and any(k != "full_attention" for k in kinds):
        raise refuse(fn, "layers other than full attention", "layer_types",
                     sorted(set(kinds)))
    window = getattr(config, "sliding_window", None)
    if window is not None and kinds is None and getattr(config, "use_sliding_window", True):
        raise refuse(fn, "a sliding window", "sliding_window", window)
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is not None:
        raise refuse(fn, "a logit soft cap", "attn_logit_softcapping", cap)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = _TORCH_DTYPES.get(model.dtype, str(model.dtype).removeprefix("torch."))
    check_attention(fn, num_heads=heads, num_kv_heads=kv, head_dim=d, dtype=dtype,
                    page_size=page_size)
    return Geometry(int(config.num_hidden_layers), int(heads), int(kv), int(d),
                    int(config.vocab_size), dtype,
                    getattr(config, "max_position_embeddings", None))


@contextlib.contextmanager
def attn_implementation(model: Any, name: str) -> Iterator[None]:
    """Run ``model`` with attention implementation ``name`` inside the block."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def _cache_kwarg(model: Any) -> str:
    # transformers renamed the forward's past_key_values to cache (5.2x); both pinned
    # releases accept the name their signature shows
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass(frozen=True)
class Generation:
    """``tokens[i]``: the new token ids of prompt ``i``; ``logits``: ``[steps, B, V]``
    float32 (the logits each token was chosen from; ``None`` unless asked for).
    ``decode_steps``: how the decode steps ran (``"eager"``, or ``"cuda graph"`` with
    ``captures`` captures and ``replays`` replays, ``decode_graph.DecodeGraph``)."""

    tokens: list[list[int]]
    logits: torch.Tensor | None
    decode_steps: str = "eager"
    captures: int = 0
    replays: int = 0


def generate(model: Any, prompts: Sequence[Any], max_new_tokens: int, *,
             backend: Any = None, page_size: int = 16, num_pages: int | None = None,
             cascade: Any = None, share_prefix: bool = True,
             return_logits: bool = False, cuda_graph: bool | None = None) -> Generation:
    """Greedy generation of exactly ``max_new_tokens`` tokens (no stop tokens) for every
    prompt, the K/V in a ``PagePool``.

    Args:
        model: a transformers causal LM (Llama-, Qwen2-, Gemma-style...) in eval mode.
        prompts: ``B`` token-id sequences of any lengths.
        backend: the pool's backend (default: ``"cuda"`` for a CUDA model, else
            ``"reference"``).
        page_size, num_pages: the pool (``num_pages=None``: what the run needs, ``pages_needed``;
            too few raises before the model runs).
        cascade: passed to ``decode`` (``True`` reads the forked prefix once per step).
        share_prefix: prefill the prompts' common prefix once and fork it.
        return_logits: also return every step's logits.
        cuda_graph: replay every decode step's forward (the model's ops and paged-decode's
            appends and decodes, all layers) from a CUDA graph (``DecodeGraph``), captured
            at the first decode step and again after a replan; the host then does one
            ``begin`` and one replay per step, with no synchronization. ``None``: when the
            model is on a CUDA device, the backend is ``cuda`` and the decode is flat
            (not ``cascade=True``); ``True`` requires exactly that.
    """
    fn = "generate"
    if cascade is not None:     # np.True_ and 1 once ran a flat decode without a word
        cascade = check_bool(fn, "cascade", cascade)
    if cuda_graph is not None:
        cuda_graph = check_bool(fn, "cuda_graph", cuda_graph)
    return_logits = check_bool(fn, "return_logits", return_logits)
    geo = check_model(fn, model, page_size)
    batch = prompt_batch(fn, prompts, max_new_tokens, vocab_size=geo.vocab_size,
                         max_positions=geo.max_positions, share_prefix=share_prefix)
    device = next(model.parameters()).device
    if backend is None:
        backend = "cuda" if device.type == "cuda" else "reference"
    paged = PagedBatch(num_layers=geo.num_layers, num_pages=pool_pages(fn, batch, page_size,
                                                                        num_pages),
                       page_size=page_size, num_kv_heads=geo.num_kv_heads,
                       num_qo_heads=geo.num_heads, head_dim=geo.head_dim, dtype=geo.dtype,
                       backend=backend, cascade=cascade, step_engine=cascade is not True)
    graphable = device.type == "cuda" and paged.pool.backend.name == "cuda" \
        and paged.step_engine
    if cuda_graph and not graphable:
        paged.close()
        raise InvalidArgumentError(
            f"{fn}: cuda_graph=True needs a model on a CUDA device, the cuda backend and a "
            f"flat decode (cascade not True); got device {device.type}, backend "
            f"{paged.pool.backend.name!r}, cascade={cascade!r}")
    use_graph = graphable and cuda_graph is not False
    cache = PagedCache(paged)
    kw = _cache_kwarg(model)

    def run(ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The model on ``ids, positions [1, N]`` (begin has run) -> the logits of the
        positions ``keep`` ``[B, V]`` float32."""
        out = model(input_ids=ids, position_ids=positions, use_cache=True,
                    logits_to_keep=keep, paged_batch=paged, **{kw: cache})
        return out.logits[0].float()

    def forward(ids: list[int], positions: np.ndarray, counts: list[int] | None,
                ) -> torch.Tensor:
        paged.begin(counts)
        c = np.ones(len(paged.seqs), np.int64) if counts is None else np.asarray(counts)
        return run(torch.tensor([ids], device=device),
                   torch.as_tensor(positions[None], device=device),
                   torch.as_tensor(np.cumsum(c) - 1, device=device))

    every = torch.arange(batch.size, device=device)   # a decode step keeps every position
    steps: list[torch.Tensor] = []            # every step's logits (return_logits)
    chosen: list[torch.Tensor] = []           # every step's tokens [B], on the device
    graph: DecodeGraph | None = None
    try:
        with torch.inference_mode(), attn_implementation(model, ATTN_NAME):
            if batch.prefix_len:
                paged.start(1)
                forward(list(batch.prefix), np.arange(batch.prefix_len), [batch.prefix_len])
                paged.fork(batch.size)
            else:
                paged.start(batch.size)
            suffixes = batch.suffixes
            pos = np.concatenate([batch.prefix_len + np.arange(len(s)) for s in suffixes])
            logits = forward([t for s in suffixes for t in s], pos, [len(s) for s in suffixes])
            if use_graph:
                graph = DecodeGraph(lambda ids, positions: run(ids, positions, every),
                                    paged, batch.size, device)
            for _ in range(batch.max_new_tokens):
                nxt = logits.argmax(-1)
                chosen.append(nxt)
                if return_logits:        # a replay overwrites the graph's logits
                    steps.append(logits if graph is None else logits.clone())
                if len(chosen) == batch.max_new_tokens:
                    break
                if graph is not None:
                    logits = graph.step(nxt, paged.lengths)
                else:
                    logits = forward(nxt.tolist(), paged.lengths.astype(np.int64), None)
    finally:
        paged.close()
    tokens = torch.stack(chosen, 1).tolist()
    logits_out = torch.stack(steps) if return_logits else None
    if graph is None:
        return Generation(tokens, logits_out)
    return Generation(tokens, logits_out, decode_steps="cuda graph",
                      captures=graph.captures, replays=graph.replays)


def framework_generate(model: Any, prompts: Sequence[Any], max_new_tokens: int, *,
                       attn: str = "sdpa", cache_implementation: str | None = None,
                       compile: bool = True) -> Generation:
    """The same greedy run through transformers' own ``generate`` and cache (dynamic by
    default; ``cache_implementation="static"`` for its static cache), prompts left-padded:
    the comparison every test and example makes. Stop tokens are off, so exactly
    ``max_new_tokens`` come back; ``logits`` holds the raw logits of every step.
    ``compile=False`` sets ``disable_compile``: with a static cache on a CUDA device,
    ``generate`` otherwise compiles the model's forward (``torch.compile``) itself."""
    fn = "framework_generate"
    geo = check_model(fn, model)
    batch = prompt_batch(fn, prompts, max_new_tokens, vocab_size=geo.vocab_size,
                         max_positions=geo.max_positions, share_prefix=False)
    device = next(model.parameters()).device
    width = max(len(p) for p in batch.prompts)
    ids = torch.zeros((batch.size, width), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch.prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    # a fresh config: plain greedy, as generate decodes (a model's own config may carry
    # beams, repetition penalties, suppressed or banned tokens). It stands in for the
    # model's for the call: transformers fills a given config's default-valued fields
    # from the model's, which would bring those back.
    saved = model.generation_config
    config = saved.__class__(
        eos_token_id=None, pad_token_id=0, max_new_tokens=max_new_tokens, do_sample=False,
        return_dict_in_generate=True, output_logits=True,
        cache_implementation=cache_implementation, disable_compile=not compile)
    model.generation_config = config
    try:
        with torch.inference_mode(), attn_implementation(model, attn):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config = saved
    tokens = out.sequences[:, width:].tolist()
    return Generation(tokens, torch.stack([s.float() for s in out.logits]))
