"""What the two generation examples share: arguments, prompts, timing and the report."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from paged_decode.integrations.random_models import GEOMETRIES


def parse(description: str, backends: tuple[str, ...]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model-config", default="llama", choices=sorted(GEOMETRIES),
                   help="random model geometry (paged_decode.integrations.random_models)")
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=40, help="shared system prompt tokens")
    p.add_argument("--prompt-len", type=int, default=24,
                   help="longest prompt tail after the prefix (tails are ragged)")
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--backend", default=None, choices=(None, *backends))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per arm (best kept)")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args()


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """``batch`` prompts: one shared prefix, tails of ragged lengths up to prompt_len."""
    g = np.random.default_rng(args.seed + 1)
    head = g.integers(0, vocab, args.prefix_len).tolist()
    tails = np.linspace(1, args.prompt_len, args.batch).round().astype(int)[::-1]
    return [head + g.integers(0, vocab, int(n)).tolist() for n in tails]


def timed(run: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> tuple[Any, float]:
    """``run()`` once to warm up, then ``repeats`` timed runs: (last result, best seconds)."""
    out, best = run(), float("inf")
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = run()
        sync()
        best = min(best, time.perf_counter() - t)
    return out, best


def report(args: argparse.Namespace, rows: list[dict[str, Any]], reference: str) -> None:
    """Print tokens per second per arm and whether each chose the reference's tokens."""
    ref = next(r for r in rows if r["arm"] == reference)["tokens"]
    n = args.batch * args.new
    print(f"{args.model_config}: batch {args.batch}, prefix {args.prefix_len}, tails up to "
          f"{args.prompt_len}, {args.new} new tokens, {args.dtype}")
    print(f"{'arm':<34} {'seconds':>8} {'tokens/s':>9} {'KV MiB':>8}  same tokens")
    for r in rows:
        r["tokens_per_s"] = n / r["seconds"]
        r["same_tokens"] = r["tokens"] == ref
        print(f"{r['arm']:<34} {r['seconds']:8.3f} {r['tokens_per_s']:9.1f} "
              f"{r['kv_bytes'] / 2**20:8.2f}  {r['same_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": [{k: v for k, v in r.items()
                                                       if k != "tokens"} for r in rows]},
                      f, indent=1)


def kv_bytes(layers: int, tokens: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V bytes of ``tokens`` token slots in every layer."""
    return 2 * layers * tokens * kv_heads * head_dim * itemsize
