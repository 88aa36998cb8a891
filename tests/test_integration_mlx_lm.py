"""mlx-lm integration (``paged_decode.integrations.mlx_lm``) on the ``mlx`` backend
(MLX's CPU device): greedy tokens with the K/V in the paged pool equal mlx-lm's own
``BatchKVCache`` for Llama-, Qwen2- (GQA 7) and Gemma-style random float32 models; bad
models and prompts fail before the model runs. Skipped cleanly where mlx or mlx-lm is
missing (CI installs both through the ``ci`` extra)."""

from __future__ import annotations

import pytest
from helpers import assert_same_greedy, ragged_prompts, require_mlx

mx = require_mlx()
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (extra [mlx-lm])")

from mlx_lm.models import gemma2, llama  # noqa: E402

from paged_decode.errors import InvalidArgumentError, UnsupportedProblemError  # noqa: E402
from paged_decode.integrations import mlx_lm as pm  # noqa: E402
from paged_decode.integrations.paged_batch import PagedBatch  # noqa: E402
from paged_decode.integrations.random_models import mlx_lm_model  # noqa: E402

NEW = 32
#: model seeds; Llama's seed 0 has a top-2 gap of 1.5e-5 at one step (its tokens still
#: match: both runs' logits are bitwise equal here), seed 1 a gap of 3.8e-3
SEEDS = {"llama": 1, "qwen2": 0, "gemma": 0}


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma"])
def test_greedy_tokens_equal_the_batch_cache(name):
    model = mlx_lm_model(name, seed=SEEDS[name])
    prompts = ragged_prompts(model.args.vocab_size, seed=1)
    ref = pm.framework_generate(model, prompts, NEW)
    got = pm.generate(model, prompts, NEW, backend="mlx", return_logits=True)
    assert_same_greedy(ref.tokens, ref.logits, got.tokens, got.logits)


def test_without_sharing_and_small_pages():
    model = mlx_lm_model("llama", seed=2)
    prompts = ragged_prompts(model.args.vocab_size, seed=3, prefix=0, tails=(9, 33, 2, 20))
    ref = pm.framework_generate(model, prompts, NEW)
    got = pm.generate(model, prompts, NEW, backend="mlx", page_size=8, share_prefix=False,
                      return_logits=True)
    assert_same_greedy(ref.tokens, ref.logits, got.tokens, got.logits)


def test_a_quantized_model_runs_in_its_float_dtype():
    """nn.quantize packs the weights into uint32 (the first parameter mlx-lm flattens);
    the pool takes the dtype of the scales, which the activations and K/V come out in."""
    nn = pytest.importorskip("mlx.nn")
    model = mlx_lm_model("llama", seed=SEEDS["llama"])
    nn.quantize(model, group_size=64, bits=4)
    prompts = ragged_prompts(model.args.vocab_size, seed=1)
    ref = pm.framework_generate(model, prompts, NEW)
    got = pm.generate(model, prompts, NEW, backend="mlx", return_logits=True)
    assert_same_greedy(ref.tokens, ref.logits, got.tokens, got.logits)


def test_a_misplaced_gather_changes_the_tokens(monkeypatch):
    """Negative control: K/V gathered one sequence off (the batch rolled) must not pass."""
    model = mlx_lm_model("llama", seed=0)
    prompts = ragged_prompts(model.args.vocab_size, seed=1)
    ref = pm.framework_generate(model, prompts, NEW)
    real = PagedBatch.gather

    def rolled(self, layer, rows=None, width=None):
        k, v = real(self, layer, rows, width)
        return mx.roll(k, 1, axis=0), mx.roll(v, 1, axis=0)

    monkeypatch.setattr(PagedBatch, "gather", rolled)
    assert pm.generate(model, prompts, NEW, backend="mlx").tokens != ref.tokens


def test_a_prompt_longer_than_the_pool_fails_before_the_model_runs():
    model = mlx_lm_model("llama", seed=0)
    with pytest.raises(InvalidArgumentError, match=r"generate: the pool of 4 pages of 16 "
                       r"tokens cannot hold the run: 1 prompts of \[100\]"):
        pm.generate(model, [[1] * 100], NEW, backend="mlx", num_pages=4)
    with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]\[0\] = -1 is not a token"):
        pm.generate(model, [[-1]], NEW, backend="mlx")
    with pytest.raises(InvalidArgumentError, match=r"cascade must be None with mlx-lm .*, got "
                                                   r"True"):
        pm.generate(model, [[1]], NEW, backend="mlx", cascade=True)
    with pytest.raises(InvalidArgumentError, match=r"generate: backend must be one of mlx, "
                                                   r"metal .*, got 'reference'"):
        pm.generate(model, [[1]], NEW, backend="reference")


def _llama(**kw):
    args = dict(model_type="llama", hidden_size=256, num_hidden_layers=2,
                intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                rms_norm_eps=1e-6, vocab_size=64, head_dim=64)
    args.update(kw)
    return llama.Model(llama.ModelArgs.from_dict(args))


@pytest.mark.parametrize("build, match", [
    (lambda: _llama(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
     r"a RotatingKVCache for layer 0"),
    (lambda: gemma2.Model(gemma2.ModelArgs.from_dict(dict(
        model_type="gemma2", hidden_size=256, num_hidden_layers=1, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
        vocab_size=64))), r"attn logit softcapping"),
    (lambda: _llama(head_dim=80), r"head_dim must be one of \(64, 96, 128, 256\)"),
])
def test_unsupported_models_are_refused(build, match):
    model = build()
    model.set_dtype(mx.float32)
    with pytest.raises(UnsupportedProblemError, match="generate: .*" + match):
        pm.generate(model, [[1, 2, 3]], 4, backend="mlx")


def test_a_sliding_window_mask_is_refused():
    batch = PagedBatch(num_layers=1, num_pages=4, page_size=16, num_kv_heads=2,
                       num_qo_heads=4, head_dim=64, dtype="float32", backend="mlx")
    cache = pm.PagedLayerCache(batch, 0, {})
    with pytest.raises(UnsupportedProblemError, match=r"a sliding window \(window_size=8\)"):
        cache.make_mask(1, window_size=8)


def test_models_whose_args_name_other_fields_and_bad_flags_are_refused():
    """gpt2's args name n_head, not num_attention_heads (an AttributeError once);
    return_logits must be a bool ("no" returned logits)."""
    from mlx_lm.models import gpt2
    model = gpt2.Model(gpt2.ModelArgs.from_dict(dict(
        model_type="gpt2", n_ctx=16, n_embd=128, n_head=2, n_layer=1, n_positions=16,
        layer_norm_epsilon=1e-5, vocab_size=64)))
    with pytest.raises(UnsupportedProblemError, match="generate: the model's args .* do not "
                                                      "name num_attention_heads"):
        pm.generate(model, [[1, 2, 3]], 2, backend="mlx")
    with pytest.raises(InvalidArgumentError, match="generate: return_logits must be a bool"):
        pm.generate(_llama(), [[1, 2, 3]], 2, backend="mlx", return_logits="no")
