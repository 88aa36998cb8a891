"""Greedy batched generation with a random mlx-lm model (built from a config in code,
no download), the K/V in a paged-decode PagePool, next to mlx-lm's own BatchKVCache:
tokens per second, K/V memory, and whether both chose the same tokens. Runs on MLX's CPU
device off Apple silicon (backend ``mlx``); ``metal`` on a Mac (never run there yet).

    python examples/generate_mlx_lm.py --model-config gemma
"""

from __future__ import annotations

import _common
import mlx.core as mx

from paged_decode.integrations import mlx_lm as pm
from paged_decode.integrations.prompts import prompt_batch
from paged_decode.integrations.random_models import mlx_lm_model


def main() -> None:
    args = _common.parse(__doc__.splitlines()[0], ("mlx", "metal"))
    model = mlx_lm_model(args.model_config, seed=args.seed, dtype=args.dtype,
                         layers=args.layers)
    geo = pm.check_model("example", model, args.page_size)
    prompts = _common.prompts(args, geo.vocab_size)
    item = getattr(mx, args.dtype).size
    width = max(map(len, prompts)) + args.new
    dense = _common.kv_bytes(geo.num_layers, args.batch * width, geo.num_kv_heads,
                             geo.head_dim, item)
    pages = prompt_batch("example", prompts, args.new, vocab_size=geo.vocab_size,
                         max_positions=None).pages_needed(args.page_size)
    paged = _common.kv_bytes(geo.num_layers, pages * args.page_size, geo.num_kv_heads,
                             geo.head_dim, item)
    rows = []
    out, s = _common.timed(lambda: pm.framework_generate(model, prompts, args.new),
                           args.repeats, lambda: None)
    rows.append(dict(arm="mlx-lm BatchKVCache", seconds=s, tokens=out.tokens, kv_bytes=dense))
    out, s = _common.timed(lambda: pm.generate(model, prompts, args.new, backend=args.backend,
                                               page_size=args.page_size),
                           args.repeats, lambda: None)
    rows.append(dict(arm=f"paged-decode ({args.backend or pm.default_backend()})", seconds=s,
                     tokens=out.tokens, kv_bytes=paged))
    _common.report(args, rows, "mlx-lm BatchKVCache")


if __name__ == "__main__":
    main()
