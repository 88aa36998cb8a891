"""paged-decode: fused paged-attention decode kernels with one host layer.

Quick start (CPU reference backend; the same code runs on CUDA with CuPy arrays)::

    import paged_decode as pd
    pool = pd.PagePool(num_pages=256, page_size=16, num_kv_heads=8, head_dim=128)
    seq = pool.new_sequence(); pool.append(seq, k, v)        # k, v: [T, Hkv, D]
    table = pool.page_table([seq])
    plan = pd.plan_decode(table, num_qo_heads=32, num_kv_heads=8, head_dim=128)
    out, lse = pd.decode(q, pool.k, pool.v, table, plan, return_lse=True)

LSEs are base 2 everywhere.
"""

from .backends import available_backends, get_backend
from .call import plan_decode
from .cascade import (
    CascadeDecodePlan,
    CascadePlan,
    detect_shared_prefix,
    plan_cascade,
)
from .compile_ahead import AheadReport, compile_ahead
from .decode import cascade_decode, decode
from .device import DeviceInfo
from .engine_step import CapturedStep, DecodeStep, StaleStepError
from .errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidDtypeError,
    PagedDecodeError,
    PageTableError,
    PlanMismatchError,
    PoolExhaustedError,
    UnsupportedProblemError,
)
from .merge import merge_state, merge_states
from .outcome import DecodeOutcome, counters, last_outcome, reset_counters
from .page_table import PageTable
from .plan import DecodePlan
from .pool import PagePool
from .prepared import PreparedDecode, prepare_decode
from .sparse import Selection, make_selection, selection_from_blocks, sparse_decode
from .step_table import StepTable

__version__ = "0.1.0"

__all__ = [
    "CapturedStep",
    "DecodeStep",
    "StaleStepError",
    "StepTable",
    "AheadReport", "compile_ahead",
    "BackendUnavailableError", "DecodeOutcome", "DecodePlan", "DeviceInfo",
    "InvalidArgumentError", "InvalidDtypeError", "PageTable", "PageTableError", "PagePool",
    "PagedDecodeError", "PlanMismatchError", "PoolExhaustedError", "UnsupportedProblemError",
    "available_backends", "counters", "decode", "get_backend", "last_outcome", "merge_state",
    "merge_states", "plan_decode", "prepare_decode", "PreparedDecode", "reset_counters",
    "__version__",
    "CascadeDecodePlan", "CascadePlan", "cascade_decode", "detect_shared_prefix", "plan_cascade",
    "Selection", "make_selection", "selection_from_blocks", "sparse_decode",
]
