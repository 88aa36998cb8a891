"""Benchmark cases and named presets (the one registry the CLI and ``bench/`` use)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

#: the seed of a ragged case's lengths (``BenchCase.lengths``)
RAGGED_SEED = 17


@dataclass(frozen=True)
class BenchCase:
    batch: int
    context: int
    page_size: int
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    model: str = "llama3-8b"
    #: decode variants (``paged_decode.variants``): a sliding window (-1: off), a logits
    #: soft cap (0: off) and per-head attention sinks
    window_left: int = -1
    soft_cap: float = 0.0
    sinks: bool = False
    #: the pools' dtype when it is not ``dtype`` (an fp8 K/V cache: ``"float8_e4m3fn"``,
    #: ``"float8_e5m2"``; ``dtype`` is then the queries' and outputs')
    kv_dtype: str = ""
    #: a ragged batch: request lengths drawn uniformly from [ragged_min, context] (seeded,
    #: ``lengths``); 0: every request has ``context`` tokens
    ragged_min: int = 0

    def lengths(self) -> list[int]:
        """Each request's context length (the same draw every call)."""
        if not self.ragged_min:
            return [self.context] * self.batch
        rng = np.random.default_rng(RAGGED_SEED)
        return [int(x) for x in rng.integers(self.ragged_min, self.context + 1, self.batch)]

    @property
    def pool_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def label(self) -> str:
        extra = "".join([f" W{self.window_left}" if self.window_left >= 0 else "",
                         f" cap{self.soft_cap:g}" if self.soft_cap else "",
                         " sinks" if self.sinks else "",
                         f" kv {self.kv_dtype}" if self.kv_dtype else ""])
        ctx = f"{self.ragged_min}-{self.context}" if self.ragged_min else str(self.context)
        return (f"{self.model} B{self.batch} ctx{ctx} ps{self.page_size} "
                f"{self.num_qo_heads}/{self.num_kv_heads}x{self.head_dim} {self.dtype}"
                f"{extra}")

    @property
    def attended(self) -> int:
        """Tokens the batch attends to: each request's context or its window, summed."""
        lens = self.lengths()
        if self.window_left < 0:
            return sum(lens)
        return sum(min(n, self.window_left + 1) for n in lens)

    def kv_bytes(self) -> int:
        """Bytes of K and V the decode must read (each attended element once)."""
        elt = {"float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}.get(self.pool_dtype, 2)
        return 2 * self.attended * self.num_kv_heads * self.head_dim * elt

    def io_bytes(self) -> int:
        """K + V + q + output bytes: the explicit byte count behind GB/s."""
        elt = 4 if self.dtype == "float32" else 2
        return self.kv_bytes() + 2 * self.batch * self.num_qo_heads * self.head_dim * elt


MODELS = {  # (Hq, Hkv, D)
    "llama3-8b": (32, 8, 128),
    "llama3-70b-tp8": (8, 1, 128),
    "mistral-7b": (32, 8, 128),
    "qwen2-7b": (28, 4, 128),
    "gqa16": (32, 2, 128),
    "gemma2-9b": (16, 8, 256),
    "phi3-mini": (32, 32, 96),
}


def _grid(contexts: list[int], batches: list[int], pages: list[int], model: str = "llama3-8b",
          dtype: str = "float16") -> list[BenchCase]:
    hq, hkv, d = MODELS[model]
    return [BenchCase(b, c, p, hq, hkv, d, dtype, model)
            for c, b, p in itertools.product(contexts, batches, pages)]


def _variants() -> list[BenchCase]:
    """8 x 8K, float16, Hkv 8, D 128, page 16 unless varied: bfloat16; head_dim 64 and 256;
    GQA 1, 7 and 16; page sizes 1 to 64 (each compared with its own contiguous SDPA)."""
    base = BenchCase(8, 8192, 16)
    out = [base, dataclasses.replace(base, dtype="bfloat16")]
    out += [dataclasses.replace(base, head_dim=d) for d in (64, 256)]
    out += [dataclasses.replace(base, num_qo_heads=8 * g, model=f"gqa{g}") for g in (1, 7, 16)]
    out += [dataclasses.replace(base, page_size=p) for p in (1, 2, 4, 8, 32, 64)]
    return out


def _ragged() -> list[BenchCase]:
    """#17's ragged batches at Llama-3-8B heads, float16, page 16: 16 requests of 1K-8K
    tokens and 128 of 512-4K."""
    return [BenchCase(16, 8192, 16, ragged_min=1024), BenchCase(128, 4096, 16, ragged_min=512)]


#: contexts, batches and page sizes of the adr sweep (Llama-3-8B heads, float16)
ADR_AXES = ([1024, 4096, 16384, 32768], [1, 4, 8, 32, 64, 128], [16, 32, 64])

PRESETS = {
    # the gather / v1 / v2 sweep on a GPU (Llama-3-8B heads, float16); also the cells of
    # the crossover table behind path="auto"
    "adr": lambda: _grid(*ADR_AXES),
    # the performance targets of the H200 (page 16): compare with --arms
    # v1,v2,sdpa,flashinfer,flashinfer-tc
    "targets": lambda: _grid([1024, 4096, 16384, 32768], [1, 4, 8, 32, 64, 128], [16]),
    "variants": _variants,
    "ragged": _ragged,
    # batch sizes between the targets' powers of two (Llama-3-8B heads, page 16), where the
    # plan once left one full chunk and a sliver per request (bench/plan_balance.py)
    "batches": lambda: _grid([4096, 16384], [5, 12, 20, 24, 48, 96], [16]),
    # small enough for the numpy reference backend to finish in about a minute
    "cpu": lambda: _grid([512, 2048], [1, 4], [16, 64]),
    # the cells of the crossover table behind path="auto" (--arms v1,v2,v2tc
    # --write-crossover): the adr grid at GQA 4 and page 16 (v2 won every page size of the
    # last adr table; the 117 cells with pages 32 and 64 outran one device command), and
    # every other models layout
    "crossover": lambda: _grid(*ADR_AXES[:2], [16]) + [
        c for m, (hq, hkv, _) in MODELS.items() if hq != 4 * hkv
        for c in _grid([1024, 8192, 32768], [1, 8, 64], [16], model=m)],
    "models": lambda: [c for m in MODELS for c in _grid([1024, 8192, 32768], [1, 8, 64], [16],
                                                        model=m)],
}


def preset_cases(name: str, *, contexts: list[int] | None = None,
                 batches: list[int] | None = None, pages: list[int] | None = None,
                 dtype: str | None = None) -> list[BenchCase]:
    """The cases of preset ``name``, optionally with axes replaced: each distinct shape of
    the preset (every field but batch, context and page size: heads, variants, pool dtype,
    a ragged batch's shortest request) over the product of the given axes and the
    preset's own values of the others; ``dtype`` replaces the queries' dtype."""
    if name not in PRESETS:
        raise ValueError(f"bench: preset must be one of {', '.join(PRESETS)}, got {name!r}")
    cases = PRESETS[name]()
    if contexts or batches or pages or dtype:
        axes = ("batch", "context", "page_size")
        seen: dict[tuple[Any, ...], BenchCase] = {}
        for c in cases:
            shape = tuple(v for k, v in dataclasses.asdict(c).items() if k not in axes)
            seen.setdefault(shape, c)
        out = []
        for base in seen.values():
            for ctx, b, p in itertools.product(contexts or sorted({x.context for x in cases}),
                                               batches or sorted({x.batch for x in cases}),
                                               pages or sorted({x.page_size for x in cases})):
                if base.ragged_min > ctx:
                    raise ValueError(f"bench: preset {name}'s ragged batch draws requests of "
                                     f"{base.ragged_min} tokens and more; --context {ctx} "
                                     "is shorter")
                out.append(dataclasses.replace(base, batch=b, context=ctx, page_size=p,
                                               dtype=dtype or base.dtype))
        cases = list(dict.fromkeys(out))
    return cases
