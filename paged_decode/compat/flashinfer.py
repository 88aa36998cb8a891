"""FlashInfer-compatible decode API: switch from FlashInfer 0.3.x with one import.

``import paged_decode.compat.flashinfer as flashinfer`` in place of ``import flashinfer``
serves code that uses these names of FlashInfer's decode, cascade and page modules, with
FlashInfer's argument names, order, defaults and return conventions (LSEs **base 2**,
as in both libraries):

- ``BatchDecodeWithPagedKVCacheWrapper`` (``plan`` / ``run``, graph mode with caller-owned
  index buffers) and ``CUDAGraphBatchDecodeWithPagedKVCacheWrapper`` (``fi_decode``);
- ``merge_state``, ``merge_state_in_place``, ``merge_states`` (``fi_cascade``);
- ``append_paged_kv_cache``, ``get_batch_indices_positions``, ``get_seq_lens``
  (``fi_page``).

Arrays may be torch tensors (CUDA on a GPU, CPU on the reference backend), CuPy or numpy;
results come back in the kind given. Only the NHD layout is served; what paged-decode
does not support is refused by name (``fi_unsupported``). ``docs/flashinfer-compat.md``
lists what is supported, what is refused and how the two differ.
"""

from __future__ import annotations

from .fi_cascade import merge_state, merge_state_in_place, merge_states
from .fi_decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
)
from .fi_page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens",
           "merge_state", "merge_state_in_place", "merge_states"]
