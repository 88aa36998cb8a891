"""How a split-KV grid fills the GPU: a cost model of the tensor-core partial's chunking.

The CTA-target rule of ``plan.make_plan`` aims every plan at one CTA count (2 per SM on
CUDA). On the H200 the tensor-core partial's time depends on how its CTAs share the SMs,
which that rule does not see (S22-R1, ``docs/benchmarks/h200-2026-12-05-s22.md``: 12
requests x 16K at Llama-3-8B heads took 207 us at 384 CTAs, 219-221 at the rule's 288,
261 at 480; batch 5 x 16K 99.6 at 240, 104.8 at the rule's 280). What the sweeps show:

- an SM streams K/V at one saturated rate once it holds two or more of the partial's
  CTAs, about ``ONE_CTA`` of it with one (so 288 CTAs on 132 SMs, three on some SMs and
  two on the rest, take as long as 192, two on 60 SMs and one on 72);
- the device as a whole streams at most ``DEVICE_SHARE`` of the SMs' summed rate (DRAM),
  so a grid that loads every SM evenly is DRAM-bound;
- a grid of more CTAs than the SMs hold at once runs in waves; a wave's tail, with few
  CTAs on few SMs, is slow, and each wave costs ``WAVE_COST`` beyond its bytes (a
  fitted term for the ramp-up and drain of its CTAs, not measured on its own).

``grid_cost`` turns that into a time (in bytes one SM streams at its saturated rate) of a
plan's chunks: the mean chunk for the waves, the longest chunk as a floor.
``wave_chunk_size`` picks the chunk size whose cost is least; among sizes within ``TIE``
of the best (``pick_tied``) it keeps the CTA-target rule's size, else takes the most CTAs
that one wave holds within the CTA target (shorter chunks, each CTA's serial latency),
else the fewest CTAs (fewer chunks, less merge work).
The constants were fitted to the 18 cells of S22-R1 and S21-R3 (batch 5-128, 4K-16K,
GQA 4-16, head_dim 128 and 256): the model's pick is on average 0.6% and at most 4%
slower than the fastest measured chunking there, where the CTA-target rule's was 7%
slower on average and up to 22%. Other GPUs use the same ratios (not measured: no other GPU here).
"""

from __future__ import annotations

import numpy as np

#: an SM holding one CTA streams at this fraction of its saturated rate (S22-R1: 12 x 16K,
#: 96 CTAs one per SM, against 192 / 288 with two or three per SM)
ONE_CTA = 0.67
#: the device's read rate as a fraction of the SMs' summed saturated rate
DEVICE_SHARE = 0.855
#: the cost of one wave, in bytes one SM streams at its saturated rate (about 12 us at
#: the H200's 39 GB/s per SM)
WAVE_COST = 468e3
#: sizes whose cost is within this fraction of the least are ties (``wave_chunk_size``)
TIE = 0.02
#: the search tries chunkings of up to this many waves of CTAs
MAX_WAVES = 8


def grid_cost(num_chunks: np.ndarray, mean_tokens: np.ndarray, longest_tokens: np.ndarray,
              ctas_per_chunk: int, unique_bytes: float, token_bytes: int, units: int,
              slots: int) -> np.ndarray:
    """The modeled time of one partial launch per candidate chunking, in bytes one SM
    streams at its saturated rate, ``float64 [K]``.

    Args:
        num_chunks: chunks of each candidate, ``int64 [K]``.
        mean_tokens, longest_tokens: each candidate's mean and longest chunk in tokens,
            ``float64 [K]``.
        ctas_per_chunk: CTAs each chunk launches (KV heads x row tiles).
        unique_bytes: K/V bytes the launch reads from DRAM (every token once per KV head).
        token_bytes: bytes one CTA streams per token (K and V rows of one KV head).
        units: SMs.
        slots: CTAs of this kernel one SM holds at once (shared memory, registers).
    """
    n = num_chunks.astype(np.int64) * ctas_per_chunk
    per_cta = mean_tokens * token_bytes
    device = units * DEVICE_SHARE                 # the device's rate, in SM rates
    wave = units * slots
    full, rest = np.divmod(n, wave)
    # a full wave: every SM holds `slots` CTAs (saturated), or DRAM-bound
    cost = full * per_cta * max(slots, wave / device)
    k = -(-rest // units)                         # CTAs on the busiest SM of the tail
    cost = cost + np.where(rest > 0, np.maximum(k * per_cta / _sm_rate(k),
                                                rest * per_cta / device), 0.0)
    cost = np.maximum(cost, unique_bytes / device)
    # the longest chunk's CTA shares its SM with up to `slots - 1` others
    k = np.minimum(slots, -(-n // units))
    cost = np.maximum(cost, longest_tokens * token_bytes * k / _sm_rate(k))
    return cost + (full + (rest > 0)) * WAVE_COST


def _sm_rate(ctas: np.ndarray) -> np.ndarray:
    """An SM's streaming rate holding ``ctas`` CTAs, in its saturated rate."""
    return np.where(ctas >= 2, 1.0, ONE_CTA)


def pick_tied(sizes: np.ndarray, ctas: np.ndarray, tied: np.ndarray, fill: int,
              prefer: int | None = None) -> int:
    """The chunk size a tie of the wave model takes: ``prefer`` (the CTA-target rule's
    size) when tied; else the smallest tied size whose grid has at most ``fill`` CTAs
    (the CTA target, or one wave if fewer: every such grid is one wave, so the most CTAs
    give the shortest chunks); else the largest tied size (the fewest CTAs).

    ``sizes``, ``ctas``, ``tied``: each candidate's pages per chunk, CTA count and whether
    it ties the least cost, ``[K]`` (int64, int64, bool; at least one tied).

    Why: where the model sees only the DRAM floor, every one-wave size ties, but a
    chunk's time is its serial latency. One more 64-token stage per chunk (144 tokens
    against 128) took up to 10% longer on the H200 (S22-R4, Llama-3-70B TP8 8 x 2K), and
    224 CTAs (the fewest tied) against 256 took 1.7-4.9% longer on the H100 at GQA 16 8 x
    8K / 8 x 32K and Llama-3-8B 1 x 16K (S36-R1, S37-R6). Past one wave the fewest CTAs
    stay: 640 CTAs at Llama-3-8B 20 x 16K (two waves) took 10.7% longer than 320 on the
    H200 (S22-R1)."""
    if prefer is not None and bool(tied[sizes == prefer].any()):
        return prefer
    within = tied & (ctas <= fill)
    if within.any():
        return int(sizes[within].min())
    return int(sizes[tied].max())


def wave_chunk_size(pages: np.ndarray, page_size: int, ctas_per_chunk: int, num_kv_heads: int,
                    token_bytes: int, units: int, slots: int, lower: int, upper: int,
                    max_chunks: int, prefer: int | None = None, target: int = 0) -> int:
    """The ``pages_per_chunk`` in ``[lower, upper]`` whose ``grid_cost`` is least, over the
    sizes that cut the longest request into 1, 2, ... even chunks, up to ``MAX_WAVES``
    waves of CTAs. Sizes within ``TIE`` of the least are ties, broken by ``pick_tied``
    (``prefer``: the CTA-target rule's size; ``target``: its CTA count, 0 for none).
    Chunks are costed as ``plan.balanced_chunk_size`` makes them: each request's pages in
    ``ceil(pages / size)`` even chunks.

    ``pages``: the non-empty requests' page counts, ``int64 [B']`` (at least one);
    ``token_bytes``: bytes a CTA streams per token; ``max_chunks``: the grid bound on the
    total chunk count (the empty requests' chunks already taken off)."""
    pages = np.asarray(pages, np.int64)
    longest = int(pages.max())
    most = max(1, min(-(-longest // lower),
                      MAX_WAVES * units * slots // max(1, ctas_per_chunk * pages.size)))
    sizes = np.unique(np.clip(-(-longest // np.arange(1, most + 1)), lower, upper))
    if prefer is not None:
        sizes = np.unique(np.append(sizes, prefer))
    counts = -(-pages[None, :] // sizes[:, None])                 # [K, B']
    chunks = counts.sum(axis=1)
    ok = chunks <= max_chunks
    if not ok.any():
        return upper if prefer is None else prefer
    sizes, counts, chunks = sizes[ok], counts[ok], chunks[ok]
    tokens = float(pages.sum()) * page_size
    longest_tokens = (pages[None, :] * page_size / counts).max(axis=1)
    cost = grid_cost(chunks, tokens / chunks, longest_tokens, ctas_per_chunk,
                     tokens * token_bytes * num_kv_heads, token_bytes, units, slots)
    tied = cost <= cost.min() * (1 + TIE)
    return pick_tied(sizes, chunks * ctas_per_chunk, tied, min(target, units * slots), prefer)
