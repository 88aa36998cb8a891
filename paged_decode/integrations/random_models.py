"""Randomly initialised models built from configs in code (no download), for the
integration tests and examples: Llama-, Qwen2- (GQA 7) and Gemma-style attention shapes,
scaled down in width and depth, and the 16-layer Llama-3-8B-heads model of the H200 run.

``GEOMETRIES[name]`` is the one place the shapes live; ``transformers_model`` and
``mlx_lm_model`` build the same architecture in each framework (weights differ: each
framework draws its own).
"""

from __future__ import annotations

from typing import Any

from ..errors import check_choice, check_int

#: name -> architecture and shape (head_dim is always one the kernels serve)
GEOMETRIES: dict[str, dict[str, Any]] = {
    # Llama: GQA 4
    "llama": dict(arch="llama", hidden_size=512, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                  num_hidden_layers=2, vocab_size=1024),
    # Qwen2-0.5B's attention (14 q heads over 2 kv heads: GQA 7, head_dim 64, qkv bias)
    "qwen2": dict(arch="qwen2", hidden_size=896, num_attention_heads=14,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                  num_hidden_layers=2, vocab_size=1024),
    # Gemma-2B's attention (multi-query, head_dim 256), GeGLU, scaled embeddings
    "gemma": dict(arch="gemma", hidden_size=512, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=256, intermediate_size=1024,
                  num_hidden_layers=2, vocab_size=1024),
    # Llama-3-8B's heads and width, 16 layers (the H200 run)
    "llama3-8b-16l": dict(arch="llama", hidden_size=4096, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                          num_hidden_layers=16, vocab_size=32000),
}

#: weight scale of the random models: wide enough that greedy logits are well separated
INIT_STD = 0.1


def _geometry(fn: str, name: str, layers: int | None) -> dict[str, Any]:
    g = dict(GEOMETRIES[check_choice(fn, "name", name, tuple(GEOMETRIES))])
    if layers is not None:
        g["num_hidden_layers"] = check_int(fn, "layers", layers)
    return g


def transformers_model(name: str, *, seed: int = 0, dtype: str = "float32",
                       layers: int | None = None, device: str = "cpu",
                       init_on_device: bool = False) -> Any:
    """A random transformers causal LM of geometry ``name`` in eval mode on ``device``.
    Its weights are drawn on the CPU (the same model on every device) unless
    ``init_on_device`` (other weights, drawn by the device's generator: minutes faster for
    the 16-layer model, whose CPU draw is slow)."""
    import torch
    import transformers

    fn = "transformers_model"
    g = _geometry(fn, name, layers)
    arch = g.pop("arch")
    common = dict(max_position_embeddings=4096, initializer_range=INIT_STD,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0, **g)
    config: Any
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False,
                                          tie_word_embeddings=True)
    else:
        config = transformers.GemmaConfig(**common, hidden_act="gelu_pytorch_tanh")
    torch.manual_seed(seed)
    with torch.device(device if init_on_device else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval()


def mlx_lm_model(name: str, *, seed: int = 0, dtype: str = "float32",
                 layers: int | None = None) -> Any:
    """A random mlx-lm model of geometry ``name``: matrices (embeddings, projections)
    ``N(0, INIT_STD)`` as transformers draws them; norms and biases keep mlx-lm's init."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import gemma, llama, qwen2

    fn = "mlx_lm_model"
    g = _geometry(fn, name, layers)
    arch = g.pop("arch")
    module = {"llama": llama, "qwen2": qwen2, "gemma": gemma}[arch]
    args = dict(model_type=arch, rms_norm_eps=1e-6, rope_theta=10000.0, **g)
    if arch == "qwen2":
        args["tie_word_embeddings"] = True
    model = module.Model(module.ModelArgs.from_dict(args))
    mx.random.seed(seed)
    flat: Any = tree_flatten(model.parameters())
    params = [(k, INIT_STD * mx.random.normal(v.shape) if v.ndim >= 2 else v)
              for k, v in flat]
    model.update(tree_unflatten(params))
    model.set_dtype(getattr(mx, dtype))
    nn.Module.eval(model)
    mx.eval(model.parameters())
    return model
