"""What balanced chunks change in the plans of the H200 (a plan property, no GPU).

``plan_decode`` searches the largest chunk size that reaches the CTA target, then shrinks
it to even chunks with the same count per request (``plan.balanced_chunk_size``). This
prints, for the CUDA backend's planning constants on a 132-SM device (the H200), every
batch size 1-128 at several contexts, uniform and ragged (lengths drawn uniformly from a
quarter of the context to the context, seeded): the longest chunk in tokens without and
with balancing. The longest chunk bounds the decode's critical path: its CTAs run
longest. Chunk and CTA counts, and so the merge work, are the same in both plans.

    python bench/plan_balance.py [--markdown] [--heads 32/8] [--v2tc]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import numpy as np

from paged_decode import plan as plan_mod
from paged_decode.backends import cuda as cuda_consts
from paged_decode.device import DeviceInfo
from paged_decode.page_table import PageTable
from paged_decode.plan import chunk_token_ranges, make_plan
from paged_decode.specs import v2tc_ctas_per_chunk

H200 = DeviceInfo("cuda", "NVIDIA H200 (planning constants only)", 132,
                  cuda_consts.CTAS_PER_SM, min_chunk_tokens=cuda_consts.MIN_CHUNK_TOKENS,
                  ragged_split=cuda_consts.RAGGED_SPLIT,
                  fp8_ctas_per_unit=cuda_consts.FP8_CTAS_PER_SM)
PAGE = 16
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)


def table(lengths: list[int]) -> PageTable:
    pages = [-(-n // PAGE) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lengths, pages)], np.int32)
    return PageTable.build(np.arange(indptr[-1], dtype=np.int32), indptr, last, page_size=PAGE)


@contextlib.contextmanager
def unbalanced() -> Iterator[None]:
    """Plans as the search left them (before balancing)."""
    real = plan_mod.balanced_chunk_size
    plan_mod.balanced_chunk_size = lambda pages, ppc, lower=1: ppc
    try:
        yield
    finally:
        plan_mod.balanced_chunk_size = real


def longest(t: PageTable, hq: int, hkv: int, v2tc: bool) -> tuple[int, int]:
    """(longest chunk in tokens, CTAs) of the plan ``plan_decode`` makes for ``t``."""
    ctas = v2tc_ctas_per_chunk(hq, hkv) if v2tc else None
    p = make_plan(t, hq, hkv, 128, device=H200, ctas_per_chunk=ctas)
    lo, hi = chunk_token_ranges(t, p)
    return int((hi - lo).max()), p.num_ctas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="32/8", help="Hq/Hkv (default 32/8)")
    ap.add_argument("--v2tc", action="store_true", help="plans searched for v2tc's CTAs")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    rng = np.random.default_rng(17)
    rows = []
    for kind in ("uniform", "ragged"):
        for ctx in CONTEXTS:
            for b in range(1, 129):
                lens = ([ctx] * b if kind == "uniform"
                        else rng.integers(ctx // 4, ctx + 1, b).tolist())
                t = table(lens)
                with unbalanced():
                    before, n0 = longest(t, hq, hkv, args.v2tc)
                after, n1 = longest(t, hq, hkv, args.v2tc)
                assert n0 == n1 and after <= before
                rows.append((kind, ctx, b, before, after, n1))
    changed = [r for r in rows if r[4] < r[3]]
    print(f"{len(changed)} of {len(rows)} plans change ({hq}/{hkv} heads, "
          f"{'v2tc' if args.v2tc else 'v2'} CTAs, page {PAGE}); longest chunk before / after "
          "(tokens), CTAs:")
    if args.markdown:
        print("| batch | context | lengths | longest chunk before | after | before / after "
              "| CTAs |")
        print("|---|---|---|---|---|---|---|")
    for kind, ctx, b, before, after, n in changed:
        if args.markdown:
            print(f"| {b} | {ctx} | {kind} | {before} | {after} | {before / after:.2f} | {n} |")
        else:
            print(f"{kind:8s} B{b:<4d} ctx {ctx:<6d} {before:6d} -> {after:6d} "
                  f"({before / after:.2f}x)  {n} CTAs")
    ratios = np.array([r[3] / r[4] for r in changed]) if changed else np.ones(1)
    print(f"before / after over the changed plans: median {np.median(ratios):.2f}, "
          f"max {ratios.max():.2f}")


if __name__ == "__main__":
    main()
