"""FlashInfer-style decode problems for the shim's tests (CPU and GPU): FlashInfer's own
decode-test geometries (``tests/test_batch_decode_kernels.py`` of flashinfer-python 0.3.1:
batch 12/17/128, kv_len 54..16384, page 1/8/16, Hq 4/32 over Hkv 4, head_dim 128/256)
as its CSR arrays (int32 ``indptr [B+1]``, ``indices``, ``last_page_len [B]``), a
combined NHD cache ``[num_pages, 2, P, Hkv, D]`` over shuffled pages, and the float64
oracle's answer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paged_decode import PageTable
from paged_decode.dtypes import numpy_dtype
from paged_decode.reference import oracle_decode


@dataclass(frozen=True)
class FiCase:
    batch: int
    kv_len: int
    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    ragged: bool = False       # lengths drawn in [1, kv_len] instead of all kv_len
    spare_pages: int = 3

    @property
    def id(self) -> str:
        return (f"b{self.batch}-kv{self.kv_len}-ps{self.page_size}-h{self.num_qo_heads}"
                f"x{self.num_kv_heads}-d{self.head_dim}-{self.dtype}"
                f"{'-ragged' if self.ragged else ''}")


@dataclass
class FiProblem:
    case: FiCase
    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    q: np.ndarray            # [B, Hq, D]
    cache: np.ndarray        # [num_pages, 2, P, Hkv, D], C-contiguous
    table: PageTable         # the same pages, for the oracle

    def oracle(self) -> tuple[np.ndarray, np.ndarray]:
        return oracle_decode(self.q, self.cache[:, 0], self.cache[:, 1], self.table)

    def pair(self) -> tuple[np.ndarray, np.ndarray]:
        """The cache as a (k, v) pair of contiguous arrays."""
        return (np.ascontiguousarray(self.cache[:, 0]), np.ascontiguousarray(self.cache[:, 1]))


def lengths_of(case: FiCase, rng: np.random.Generator) -> np.ndarray:
    if case.ragged:
        return rng.integers(1, case.kv_len + 1, case.batch)
    return np.full(case.batch, case.kv_len)


def fi_arrays(lens: np.ndarray, page_size: int, rng: np.random.Generator, spare: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(indptr, indices, last_page_len, num_pages)`` for requests of ``lens`` tokens
    over shuffled page ids of a pool with ``spare`` unused pages."""
    pages = -(-lens // page_size)
    num_pages = int(pages.sum()) + spare
    indices = rng.permutation(num_pages)[: int(pages.sum())].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    lpl = (lens - (pages - 1) * page_size).astype(np.int32)
    return indptr, indices, lpl, num_pages


def uniform(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values uniform in [-2, 2) (a quarter of the cost of normals at 100M values)."""
    return (rng.random(shape, np.float32) - 0.5) * 4


def make_fi_problem(case: FiCase, seed: int = 0) -> FiProblem:
    rng = np.random.default_rng(seed)
    lens = lengths_of(case, rng)
    indptr, indices, lpl, n = fi_arrays(lens, case.page_size, rng, case.spare_pages)
    dt = numpy_dtype(case.dtype)
    q = uniform(rng, (case.batch, case.num_qo_heads, case.head_dim)).astype(dt)
    cache = uniform(rng, (n, 2, case.page_size, case.num_kv_heads, case.head_dim)).astype(dt)
    table = PageTable.build(indices, indptr, lpl, page_size=case.page_size)
    return FiProblem(case, indptr, indices, lpl, q, cache, table)


#: FlashInfer's decode-test geometries, sampled so the CPU suite stays small: every value
#: of every axis appears, long contexts at the small batches, batch 128 at short ones
CPU_CASES = [
    FiCase(12, 54, 1, 4, 4, 128),
    FiCase(12, 97, 8, 32, 4, 256),
    FiCase(12, 512, 16, 32, 4, 128),
    FiCase(12, 2048, 16, 4, 4, 256),
    FiCase(12, 16384, 16, 4, 4, 128),
    FiCase(17, 54, 16, 32, 4, 256),
    FiCase(17, 97, 1, 32, 4, 128),
    FiCase(17, 512, 8, 4, 4, 128),
    FiCase(17, 2048, 8, 32, 4, 128, ragged=True),
    FiCase(128, 54, 8, 4, 4, 128),
    FiCase(128, 97, 16, 32, 4, 128, ragged=True),
    FiCase(128, 54, 1, 32, 4, 256),
    FiCase(12, 97, 16, 32, 4, 128, dtype="bfloat16"),
    FiCase(12, 97, 8, 4, 4, 128, dtype="float32"),
]

#: the emulated-cuda subset (the real kernel sources on the CPU emulator: slow)
EMULATED_CASES = [
    FiCase(12, 54, 1, 4, 4, 128),
    FiCase(12, 97, 8, 32, 4, 128, ragged=True),
    FiCase(17, 54, 16, 4, 4, 256),
]

#: the H200 side-by-side: the full product of FlashInfer's decode-test axes (float16)
GPU_CASES = [FiCase(b, kv, ps, hq, 4, d)
             for b in (12, 17, 128) for kv in (54, 97, 512, 2048, 16384)
             for ps in (1, 8, 16) for hq in (4, 32) for d in (128, 256)]
