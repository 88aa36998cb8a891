"""Several layers' calls in one CUDA graph (``paged-decode bench --graph-layers N``).

In an engine's decode step every layer's attention call sits in one CUDA graph, back to
back, each over its own layer's K/V pools: no call pays the graph's launch latency alone,
and each finds its K/V cold in L2 (the call before it read another layer's pools). The
decode suite's default (N = 1) times one call per replay, so every call is charged the
launch. With N > 1 the case's pools are copied N - 1 times (distinct memory, the same
content, so the float64 oracle of layer 0 checks every layer), each arm is built once per
layer over that layer's pools, the N calls are captured in one graph, every layer's output
is checked after a NaN-poisoned replay, and each replay's time is reported per call
(divided by N). The L2 flush still comes before each replay.

N is capped per case by device memory (``layers_that_fit``): the copies take at most half
of the free memory, the other half is left to the arms' own buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backends import Backend
from . import timing
from .arms import Arm
from .memory import release_memory


class LayerOutputError(RuntimeError):
    """A layer's output after a replay of the N-layer graph is not the oracle's (``error``:
    the worst layer's max relative error, NaN when a layer wrote nothing)."""

    def __init__(self, message: str, error: float) -> None:
        super().__init__(message)
        self.error = error


def layers_that_fit(requested: int, layer_bytes: int, free_bytes: int) -> int:
    """How many layers a case runs: ``requested``, capped so that the copies of the
    case's pools for layers 1 .. n-1 (``layer_bytes`` each: its K and V pools) take at most
    half of ``free_bytes`` (the device's free memory with the case's own pools, layer 0's,
    already allocated; the other half is left to the arms' buffers: FlashInfer's
    workspaces, SDPA's contiguous K/V); never below 1."""
    if requested < 1 or layer_bytes < 1 or free_bytes < 0:
        raise ValueError(f"layers_that_fit: expected requested >= 1, layer_bytes >= 1 and "
                         f"free_bytes >= 0, got {requested}, {layer_bytes}, {free_bytes}")
    return max(1, min(requested, 1 + (free_bytes // 2) // layer_bytes))


def device_free_bytes() -> int:
    """Free memory of the current CUDA device, in bytes (CuPy's ``memGetInfo``)."""
    import cupy as cp
    return int(cp.cuda.runtime.memGetInfo()[0])


def layer_pools(be: Backend, k: Any, v: Any, requested: int, *,
                free_bytes: int | None = None) -> tuple[list[tuple[Any, Any]], str]:
    """The pools of layers 1 .. n-1 and a note: ``n`` is ``requested`` capped by
    ``layers_that_fit`` (``free_bytes``, else the device's free memory after handing the
    allocators' cached blocks back), each layer's ``(k, v)`` a device copy of the case's
    pools ``k`` / ``v`` (``[num_pages, P, Hkv, D]``, the case's pool dtype, C-contiguous;
    distinct memory, the same content). The note says why ``n`` is below ``requested``
    ("" when it is not)."""
    layer_bytes = int(k.nbytes) + int(v.nbytes)
    if free_bytes is None:
        release_memory(be)      # the pools' generation scratch, cached, is free memory
        free_bytes = device_free_bytes()
    n = layers_that_fit(requested, layer_bytes, free_bytes)
    note = "" if n == requested else (
        f"graph layers {requested} capped to {n}: each layer's K/V pools take "
        f"{layer_bytes / 2**30:.2f} GiB and the copies may use half of the "
        f"{free_bytes / 2**30:.1f} GiB free")
    return [(k.copy(), v.copy()) for _ in range(n - 1)], note


def output_of(result: Any, out: Any) -> Any:
    """The output array of a call that returned ``result`` (``(out, lse)``, an array, or
    None: the arm's ``out``)."""
    target = result[0] if isinstance(result, tuple) else result
    return out if target is None else target


def graph_layer_times(be: Backend, layers: Sequence[Arm],
                      check_output: Callable[[Any], float] | None, tolerance: float, *,
                      warmup: int, reps: int, cold_l2: bool | str) -> np.ndarray:
    """Per-call GPU seconds of each timed replay of one CUDA graph holding every layer's
    call in order (``layers``: one arm per layer, layer 0's first, each over its own
    pools): the replay's time divided by ``len(layers)``.

    Before timing, every layer's output (``[B, Hq, D]``, the queries' dtype) is filled with
    NaN, the graph replayed once, and each output checked by ``check_output`` (its max
    relative error against the oracle): a layer over ``tolerance`` raises
    ``LayerOutputError``, so a graph that skips a layer, or a layer that reads the wrong
    pools, is never timed. A failed capture raises ``timing.GraphCaptureError``."""
    if len(layers) < 2 or check_output is None:
        raise ValueError(f"graph_layer_times: expected the arms of 2 or more layers and a "
                         f"check_output, got {len(layers)} and {check_output!r}")
    # the list keeps every layer's output alive during capture (SDPA's come from the
    # graph's pool: one freed there would be reused by the next layer's)
    replay, results = timing.capture(lambda: [a.call() for a in layers])
    outs = [output_of(r, a.out) for r, a in zip(results, layers)]
    for o in outs:
        be.asarray(o).fill(float("nan"))
    replay()
    timing.synchronize()
    errs = [check_output(o) for o in outs]
    bad = [i for i, e in enumerate(errs) if not e <= tolerance]
    if bad:
        worst = max((errs[i] for i in bad), key=lambda e: np.inf if np.isnan(e) else e)
        raise LayerOutputError(
            f"graph_layer_times: layer(s) {', '.join(map(str, bad))} of {len(layers)} in the "
            f"replayed graph gave a max rel error of {worst:.3g}, over the tolerance "
            f"{tolerance:g}; not timed", worst)
    times = timing.replay_times(replay, warmup=warmup, reps=reps, cold_l2=cold_l2)
    return np.asarray(times) / len(layers)


def check_graph_layers(fn: str, graph_layers: Any, backend: str, graph: bool) -> None:
    """``ValueError`` naming ``fn`` unless ``graph_layers`` is an int >= 1, and 1 unless
    the run times CUDA-graph replays (``graph``) on the cuda ``backend``."""
    if isinstance(graph_layers, bool) or not isinstance(graph_layers, int) or graph_layers < 1:
        raise ValueError(f"{fn}: graph_layers must be an int >= 1, got {graph_layers!r}")
    if graph_layers > 1 and not (graph and backend == "cuda"):
        raise ValueError(f"{fn}: graph_layers > 1 times N calls in one CUDA-graph replay: it "
                         f"needs graph=True on the cuda backend, got graph_layers="
                         f"{graph_layers}, graph={graph}, backend {backend!r}")


__all__ = ["LayerOutputError", "check_graph_layers", "device_free_bytes", "graph_layer_times",
           "layer_pools", "layers_that_fit", "output_of"]
