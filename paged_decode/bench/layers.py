"""Several layers' calls in one CUDA graph (``paged-decode bench --graph-layers N``).

In an engine's decode step every layer's attention call sits in one CUDA graph, back to
back, each over its own layer's K/V pools: no call pays the graph's launch latency alone,
and each finds its K/V cold in L2 (the call before it read another layer's pools). The
decode suite's default (N = 1) times one call per replay, so every call is charged the
launch. With N > 1 each arm is built once per layer over that layer's pools and table, the
N calls are captured in one graph, every layer's output is checked after a NaN-poisoned
replay, and each replay's time is reported per call (divided by N). The L2 flush still
comes before each replay.

Layer l's pools hold the case's K/V with a different page placement (``layer_pools``):
the case's pools rolled by ``s_l`` pages along the page axis (page p at index
``(p + s_l) mod num_pages``), read through a table of its own whose page ids are shifted
the same way. Every layer then holds the same logical K/V per request, so the float64
oracle of layer 0 (over the case's pools and table) checks every layer, while a layer that
reads another layer's pools with its own table, or its own pools with another layer's
table, reads other tokens and fails the check. The shifts are distinct for every layer
when the pools have at least N pages (``layer_shifts``); with fewer pages some layers share
a placement, and the check cannot tell those apart. Every layer's output must be distinct
memory too (``check_distinct_outputs``): two layers writing one buffer would leave only
the last one's output to check.

N is capped per case by device memory (``layers_that_fit``): the copies of the pools take
at most half of the free memory. The other half is not reserved: the arms allocate per
layer as well (each layer's output; FlashInfer a 128 MiB workspace per layer's wrapper;
SDPA a contiguous copy of each layer's visible K/V, nearly a pool's size), which the cap
does not count. Copies that still run out of memory are retried with half as many layers
(``layer_pools``), and so is an arm whose N layers run out of memory (the runner's
``time_arms``); each case and arm records the N it ran and why it is below the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..backends import Backend
from ..page_table import PageTable
from . import timing
from .arms import Arm
from .memory import out_of_memory, release_memory

#: the most layers ``--graph-layers`` takes (an engine's deepest step is ~128 layers)
MAX_GRAPH_LAYERS = 256


class LayerOutputError(RuntimeError):
    """A layer's output after a replay of the N-layer graph is not the oracle's, or two
    layers' outputs share memory (``error``: the worst layer's max relative error, NaN when
    a layer wrote nothing or the outputs alias)."""

    def __init__(self, message: str, error: float) -> None:
        super().__init__(message)
        self.error = error


class LayerPools(NamedTuple):
    """One layer's K/V pools (the case's, rolled by ``shift`` pages) and the table that
    reads the case's tokens from them (the case's page ids + ``shift``, mod the pool's
    pages)."""

    k: Any
    v: Any
    table: PageTable
    shift: int


def layers_that_fit(requested: int, layer_bytes: int, free_bytes: int) -> int:
    """How many layers a case runs: ``requested``, capped so that the copies of the
    case's pools for layers 1 .. n-1 (``layer_bytes`` each: its K and V pools) take at most
    half of ``free_bytes`` (the device's free memory with the case's own pools, layer 0's,
    already allocated); never below 1. The arms' per-layer buffers are not counted (the
    module docstring)."""
    if requested < 1 or layer_bytes < 1 or free_bytes < 0:
        raise ValueError(f"layers_that_fit: expected requested >= 1, layer_bytes >= 1 and "
                         f"free_bytes >= 0, got {requested}, {layer_bytes}, {free_bytes}")
    return max(1, min(requested, 1 + (free_bytes // 2) // layer_bytes))


def device_free_bytes() -> int:
    """Free memory of the current CUDA device, in bytes (CuPy's ``memGetInfo``)."""
    import cupy as cp
    return int(cp.cuda.runtime.memGetInfo()[0])


def layer_shifts(num_pages: int, n: int) -> list[int]:
    """The page shift of each of ``n`` layers over pools of ``num_pages`` pages: ``l *
    max(1, num_pages // n)`` mod ``num_pages``; 0 for layer 0, and distinct for every
    layer when ``num_pages >= n`` (with fewer pages, layers ``num_pages`` apart coincide)."""
    if num_pages < 1 or n < 1:
        raise ValueError(f"layer_shifts: expected num_pages >= 1 and n >= 1, got "
                         f"{num_pages}, {n}")
    step = max(1, num_pages // n)
    return [(layer * step) % num_pages for layer in range(n)]


def shifted_table(table: PageTable, shift: int, num_pages: int) -> PageTable:
    """``table`` with every page id moved to ``(id + shift) mod num_pages`` (the same
    requests, lengths, offsets and page size): it reads from pools rolled by ``shift``
    pages what ``table`` reads from the pools before the roll."""
    ids = (table.indices.astype(np.int64) + int(shift)) % int(num_pages)
    return PageTable.build(ids, table.indptr, table.last_page_len, page_size=table.page_size,
                           first_page_offset=table.first_page_offset,
                           rope_positions=table.rope_positions, num_pages=table.num_pages)


def rolled(be: Backend, pool: Any, shift: int) -> Any:
    """A device copy of ``pool`` (``[num_pages, ...]``) rolled by ``shift`` pages: page
    ``p`` lands at ``(p + shift) mod num_pages``. Always new memory (a shift of 0 too)."""
    with be.launch_context(pool):
        return be.array_module().roll(pool, int(shift), axis=0)


def layer_pools(be: Backend, k: Any, v: Any, table: PageTable, requested: int, *,
                free_bytes: int | None = None) -> tuple[list[LayerPools], str]:
    """Layers 1 .. n-1's pools and tables (``LayerPools``), and a note: ``n`` is
    ``requested`` capped by ``layers_that_fit`` (``free_bytes``, else the device's free
    memory after handing the allocators' cached blocks back); layer l's pools are ``k`` /
    ``v`` (``[num_pages, P, Hkv, D]``) rolled by ``layer_shifts(num_pages, n)[l]`` pages
    (``rolled``: new memory, the same dtype), its table ``shifted_table`` of ``table``.
    Copies that run out of device memory are dropped and made again for half as many
    layers (down to 1). The note says why ``n`` is below ``requested`` ("" when it is
    not)."""
    layer_bytes = int(k.nbytes) + int(v.nbytes)
    if free_bytes is None:
        release_memory(be)      # the pools' generation scratch, cached, is free memory
        free_bytes = device_free_bytes()
    n = layers_that_fit(requested, layer_bytes, free_bytes)
    notes = [] if n == requested else [
        f"graph layers {requested} capped to {n}: each layer's K/V pools take "
        f"{layer_bytes / 2**30:.2f} GiB and the copies may use half of the "
        f"{free_bytes / 2**30:.1f} GiB free"]
    num_pages = int(k.shape[0])
    made: list[LayerPools] = []
    while n > 1:
        why = ""
        try:
            for shift in layer_shifts(num_pages, n)[1:]:
                made.append(LayerPools(rolled(be, k, shift), rolled(be, v, shift),
                                       shifted_table(table, shift, num_pages), shift))
            break
        except Exception as exc:
            if not out_of_memory(exc):
                raise
            made.clear()
            why = f"{type(exc).__name__}: {str(exc)[:120]}"
        # outside the handler: the traceback, and the copies its frames held, are gone
        release_memory(be)
        notes.append(f"graph layers {n} ran out of device memory making the layers' K/V "
                     f"copies ({why}); retried with {n // 2}")
        n //= 2
    return made, "; ".join(notes)


def output_of(result: Any, out: Any) -> Any:
    """The output array of a call that returned ``result`` (``(out, lse)``, an array, or
    None: the arm's ``out``)."""
    target = result[0] if isinstance(result, tuple) else result
    return out if target is None else target


def byte_range(x: Any) -> tuple[int, int]:
    """``[first, last + 1)`` byte addresses of the array ``x`` (its
    ``__cuda_array_interface__`` or ``__array_interface__``: CuPy, torch CUDA tensors,
    numpy), whatever its strides; an empty array's range is empty."""
    face = (getattr(x, "__cuda_array_interface__", None)
            or getattr(x, "__array_interface__", None))
    if face is None:
        raise TypeError(f"byte_range: a {type(x).__name__} exposes no array interface")
    ptr = int(face["data"][0])
    shape = tuple(int(n) for n in face["shape"])
    item = int(face["typestr"][2:])
    if any(n == 0 for n in shape):
        return ptr, ptr
    strides = face.get("strides")
    if strides is None:         # C-contiguous
        strides, step = [], item
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
    lo = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = ptr + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + item
    return lo, hi


def check_distinct_outputs(be: Backend, outs: Sequence[Any]) -> None:
    """``LayerOutputError`` (error NaN) naming the first two of ``outs`` (one per layer)
    whose memory overlaps: each layer must write its own output, or the check after the
    replay sees only the last writer's."""
    spans = sorted((*byte_range(be.asarray(o)), i) for i, o in enumerate(outs))
    for (_lo, hi, i), (lo2, _hi2, j) in zip(spans, spans[1:]):
        if lo2 < hi:
            a, b = sorted((i, j))
            raise LayerOutputError(
                f"graph_layer_times: layers {a} and {b} of {len(outs)} write their outputs "
                f"to overlapping memory, so each layer's output cannot be checked; not "
                f"timed", float("nan"))


def graph_layer_times(be: Backend, layers: Sequence[Arm],
                      check_output: Callable[[Any], float] | None, tolerance: float, *,
                      warmup: int, reps: int, cold_l2: bool | str) -> np.ndarray:
    """Per-call GPU seconds of each timed replay of one CUDA graph holding every layer's
    call in order (``layers``: one arm per layer, layer 0's first, each over its own
    pools and table, ``layer_pools``): the replay's time divided by ``len(layers)``.

    Before timing, every layer's output (``[B, Hq, D]``, the queries' dtype) must be its
    own memory (``check_distinct_outputs``), is filled with NaN, the graph replayed once,
    and each output checked by ``check_output`` (its max relative error against the oracle
    of the case's pools and table: the tokens every layer holds, at other pages): a layer
    over ``tolerance`` raises ``LayerOutputError``, so a graph that skips a layer, or a
    layer that reads another layer's pools or table, is never timed (the module docstring:
    layers sharing a page placement are the exception). A failed capture raises
    ``timing.GraphCaptureError``."""
    if len(layers) < 2 or check_output is None:
        raise ValueError(f"graph_layer_times: expected the arms of 2 or more layers and a "
                         f"check_output, got {len(layers)} and {check_output!r}")
    # the list keeps every layer's output alive during capture (SDPA's come from the
    # graph's pool: one freed there would be reused by the next layer's)
    replay, results = timing.capture(lambda: [a.call() for a in layers])
    outs = [output_of(r, a.out) for r, a in zip(results, layers)]
    check_distinct_outputs(be, outs)
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
    """``ValueError`` naming ``fn`` unless ``graph_layers`` is an int in [1,
    ``MAX_GRAPH_LAYERS``], and 1 unless the run times CUDA-graph replays (``graph``) on the
    cuda ``backend``."""
    if (isinstance(graph_layers, bool) or not isinstance(graph_layers, int)
            or not 1 <= graph_layers <= MAX_GRAPH_LAYERS):
        raise ValueError(f"{fn}: graph_layers must be an int in [1, {MAX_GRAPH_LAYERS}], "
                         f"got {graph_layers!r}")
    if graph_layers > 1 and not (graph and backend == "cuda"):
        raise ValueError(f"{fn}: graph_layers > 1 times N calls in one CUDA-graph replay: it "
                         f"needs graph=True on the cuda backend, got graph_layers="
                         f"{graph_layers}, graph={graph}, backend {backend!r}")


__all__ = ["MAX_GRAPH_LAYERS", "LayerOutputError", "LayerPools", "byte_range",
           "check_distinct_outputs", "check_graph_layers", "device_free_bytes",
           "graph_layer_times", "layer_pools", "layer_shifts", "layers_that_fit",
           "output_of", "rolled", "shifted_table"]
