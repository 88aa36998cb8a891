"""Model-framework integrations: greedy batched generation with the K/V in a ``PagePool``.

- ``paged_decode.integrations.transformers`` (extra ``[transformers]``): Hugging Face
  transformers models through its ``AttentionInterface`` registry and ``Cache`` API.
- ``paged_decode.integrations.mlx_lm`` (extra ``[mlx-lm]``): mlx-lm models through its
  per-layer cache protocol (``update_and_fetch`` / ``make_mask``).
- ``paged_batch``: the framework-neutral adapter both use (one pool, the batch's
  sequences, the per-step append / table / plan / decode calls).
- ``prompts``: prompt validation, the shared prefix, the pool size a run needs.

Importing this package imports neither torch nor MLX; each integration module imports
its framework and says which extra installs it when it is missing.
"""
