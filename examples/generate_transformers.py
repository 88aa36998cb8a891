"""Greedy batched generation with a random transformers model (built from a config in
code, no download), the K/V in a paged-decode PagePool, next to transformers' own dynamic
and static caches (SDPA): tokens per second, K/V memory, and whether every arm chose the
same tokens.

    python examples/generate_transformers.py --model-config qwen2
    python examples/generate_transformers.py --model-config llama3-8b-16l --dtype float16 \
        --batch 32 --prefix-len 512 --prompt-len 512 --new 64      # on a CUDA GPU
"""

from __future__ import annotations

import _common
import torch

from paged_decode.integrations import transformers as pt
from paged_decode.integrations.prompts import prompt_batch
from paged_decode.integrations.random_models import transformers_model


def main() -> None:
    args = _common.parse(__doc__.splitlines()[0], ("reference", "cuda", "emulated-cuda"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers_model(args.model_config, seed=args.seed, dtype=args.dtype,
                               layers=args.layers, device=device,
                               init_on_device=device == "cuda")
    geo = pt.check_model("example", model, args.page_size)
    prompts = _common.prompts(args, geo.vocab_size)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    item = torch.finfo(model.dtype).bits // 8
    dense = _common.kv_bytes(geo.num_layers, args.batch * (max(map(len, prompts)) + args.new),
                             geo.num_kv_heads, geo.head_dim, item)
    rows = []
    # on CUDA, generate compiles the forward itself for a static cache (torch.compile);
    # the uncompiled static arm is the same cache in eager mode
    for arm, cache, compiled in (("transformers dynamic cache (sdpa)", None, True),
                                 ("transformers static cache (sdpa)", "static", True),
                                 ("transformers static, not compiled", "static", False)):
        if not compiled and device != "cuda":
            continue                       # generate compiles only on accelerators
        out, s = _common.timed(lambda c=cache, k=compiled: pt.framework_generate(
            model, prompts, args.new, cache_implementation=c, compile=k), args.repeats, sync)
        rows.append(dict(arm=arm, seconds=s, tokens=out.tokens, kv_bytes=dense))
    pages = prompt_batch("example", prompts, args.new, vocab_size=geo.vocab_size,
                         max_positions=None).pages_needed(args.page_size)
    paged_bytes = _common.kv_bytes(geo.num_layers, pages * args.page_size,
                                   geo.num_kv_heads, geo.head_dim, item)
    # paged-decode's default on CUDA replays each decode step from a CUDA graph; the
    # eager arm runs the same steps op by op
    arms = [("paged-decode", None, None), ("paged-decode, cascade", True, None)]
    if device == "cuda":
        arms.insert(1, ("paged-decode, eager steps", None, False))
    for arm, cascade, graph in arms:
        out, s = _common.timed(lambda c=cascade, g=graph: pt.generate(
            model, prompts, args.new, backend=args.backend, page_size=args.page_size,
            cascade=c, cuda_graph=g), args.repeats, sync)
        rows.append(dict(arm=arm, seconds=s, tokens=out.tokens, kv_bytes=paged_bytes,
                         decode_steps=out.decode_steps, captures=out.captures))
    _common.report(args, rows, "transformers dynamic cache (sdpa)")


if __name__ == "__main__":
    main()
