"""What the FlashInfer shim refuses, in one place (lift a refusal here when paged-decode
gains the feature). ``window_left`` and ``logits_soft_cap`` are served (paged-decode's
decode variants, ``docs/variants.md``) except in graph mode, whose launches are recorded
for the plain kernels; fp8 caches and the ``q_scale`` / ``k_scale`` / ``v_scale`` of
``run`` are served in both modes (``fi_decode``).

Every refusal raises ``UnsupportedProblemError`` naming the function and the argument;
no unsupported argument is ever ignored. Arguments that change only how FlashInfer
schedules work, never the result (``use_tensor_cores``, ``non_blocking``,
``enable_pdl``), are accepted and documented in ``docs/flashinfer-compat.md``.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedProblemError, check_int, check_number
from ..fp8 import check_scale
from ..variants import check_soft_cap

POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
#: FlashInfer backend names that select one of its own kernel families
FLASHINFER_BACKENDS = ("fa2", "fa3", "trtllm-gen", "cudnn", "cute-dsl", "cutile")


def _refuse(fn: str, name: str, value: Any, why: str) -> UnsupportedProblemError:
    return UnsupportedProblemError(f"{fn}: {name}={value!r} is not supported by paged-decode "
                                   f"({why})")


def check_layout(fn: str, kv_layout: Any) -> None:
    if kv_layout == "HND":
        raise _refuse(fn, "kv_layout", kv_layout, "its pools are NHD, [pages, P, Hkv, D]; "
                      "HND would need a transposed copy of the cache")
    if kv_layout != "NHD":
        raise UnsupportedProblemError(f"{fn}: kv_layout must be 'NHD' (or FlashInfer's "
                                      f"'HND', refused), got {kv_layout!r}")


def check_constructor(fn: str, *, jit_args: Any) -> None:
    if jit_args is not None:
        raise _refuse(fn, "jit_args", "...", "custom FlashInfer JIT kernels")


def check_backend_name(fn: str, backend: Any) -> None:
    if isinstance(backend, str) and backend in FLASHINFER_BACKENDS:
        raise _refuse(fn, "backend", backend, "it runs its own kernels; pass 'auto' or a "
                      "paged-decode backend name such as 'cuda' or 'reference'")


def check_plan(fn: str, *, pos_encoding_mode: Any, window_left: Any, logits_soft_cap: Any,
               rope_scale: Any, rope_theta: Any, block_tables: Any, seq_lens: Any,
               graph: bool) -> tuple[int, float | None]:
    """The plan arguments that would change the attention paged-decode computes; returns
    ``(window_left, logits_soft_cap)`` as decode takes them (``-1`` / ``None``: off;
    FlashInfer's cap of ``0`` is off too)."""
    if not isinstance(pos_encoding_mode, str) or pos_encoding_mode not in POS_ENCODING_MODES:
        raise UnsupportedProblemError(f"{fn}: pos_encoding_mode must be one of "
                                      f"{', '.join(POS_ENCODING_MODES)}, got "
                                      f"{pos_encoding_mode!r}")
    if pos_encoding_mode == "ROPE_LLAMA":
        raise _refuse(fn, "pos_encoding_mode", pos_encoding_mode, "on-the-fly RoPE inside "
                      "attention; apply RoPE to q and k before appending them")
    if pos_encoding_mode == "ALIBI":
        raise _refuse(fn, "pos_encoding_mode", pos_encoding_mode, "ALiBi biases")
    window = check_int(fn, "window_left", window_left, -1, note=" (-1: no window)")
    cap = None if logits_soft_cap is None else \
        check_number(fn, "logits_soft_cap", logits_soft_cap, 0.0)
    cap = None if cap == 0 else check_soft_cap(fn, cap)      # FlashInfer's 0: no cap
    if graph and window != -1:
        raise _refuse(fn, "window_left", window_left, "in graph mode (use_cuda_graph=True), "
                      "whose recorded launches serve a plain decode; plan it without the "
                      "graph mode")
    if graph and cap is not None:
        raise _refuse(fn, "logits_soft_cap", logits_soft_cap, "in graph mode "
                      "(use_cuda_graph=True), whose recorded launches serve a plain decode")
    for name, value in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):
        if value is not None:
            raise _refuse(fn, name, value, "it only applies to pos_encoding_mode='ROPE_LLAMA'")
    for name, value in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if value is not None:
            raise _refuse(fn, name, "...", "the trtllm-gen backend's inputs; the page table "
                          "is indptr / indices / last_page_len")
    return window, cap


def check_run(fn: str, *, args: tuple[Any, ...], q_scale: Any, k_scale: Any, v_scale: Any,
              window_left: Any, sinks: Any, q_len_per_req: Any,
              planned_window: int) -> tuple[float, float, float]:
    """The run arguments that would change the result (``planned_window``: the plan's
    ``window_left``, which a run may repeat but not change); returns ``(q_scale, k_scale,
    v_scale)``, each a positive finite float32 number, 1 when not given (FlashInfer's
    default)."""
    if args:
        raise _refuse(fn, "*args", args, "custom-kernel arguments")
    scales = tuple(1.0 if value is None else check_scale(fn, name, value)
                   for name, value in (("q_scale", q_scale), ("k_scale", k_scale),
                                       ("v_scale", v_scale)))
    if window_left is not None and check_int(fn, "window_left", window_left, -1,
                                             note=" or None") != planned_window:
        raise _refuse(fn, "window_left", window_left, f"a window other than the plan's "
                      f"({planned_window}); plan again with it")
    if sinks is not None:
        raise _refuse(fn, "sinks", "...", "FlashInfer 0.3.1 reads them on its trtllm-gen "
                      "backend only, which this wrapper does not mirror; paged-decode's "
                      "decode(sinks=...) takes them, docs/variants.md")
    if q_len_per_req not in (None, 1):
        raise _refuse(fn, "q_len_per_req", q_len_per_req, "FlashInfer 0.3.1 reads it on its "
                      "trtllm-gen backend only; paged-decode's decode takes several query "
                      "tokens per request as q [B, T, Hq, D], docs/multi-token.md")
    return scales[0], scales[1], scales[2]


__all__ = ["FLASHINFER_BACKENDS", "POS_ENCODING_MODES", "check_backend_name",
           "check_constructor", "check_layout", "check_plan", "check_run"]
