"""A transformers decode forward replayed as one CUDA graph (torch on CUDA).

An eager decode step of a transformers model costs the host far more than the GPU: every
layer is a few dozen torch calls plus paged-decode's append and decode. ``DecodeGraph``
captures the whole forward (the model's own ops and paged-decode's prepared launches,
which read the engine step's device-resident table) once, and after that each step is
``PagedBatch.begin`` (host bookkeeping and one upload), two small input updates on the
device, and one graph replay: no host synchronization per step.

The capture is made at the first decode step and again whenever the engine step's plan or
table buffer changes (``PagedBatch.graph_state``: a replan when a sequence outgrows the
plan's headroom, or a grown table). A capture step runs its forward eagerly first (the
step's own result; it compiles and allocates on the capture stream), then records it.

Inputs live in fixed buffers: ``ids [1, B]`` (int64, the step's tokens, copied from the
previous step's argmax on the device) and ``positions [1, B]`` (int64, set from the host
lengths at each capture and advanced by one on the device after every step: each decode
step adds exactly one token per sequence). The output is the graph's own logits tensor
``[B, V]`` float32, overwritten by the next replay (copy what must outlive it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedProblemError
from .paged_batch import PagedBatch


class DecodeGraph:
    """Decode steps of ``paged`` through ``forward(ids, positions) -> logits [B, V]``
    (float32), replayed from a CUDA graph.

    Args:
        forward: runs the model on ``ids, positions [1, B]`` (int64 CUDA tensors) for a
            decode step whose ``begin`` has run, returning ``[B, V]`` float32 logits.
        paged: the batch (``step_engine=True``, cuda backend).
        batch_size: ``B``.
        device: the model's CUDA device.
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 paged: PagedBatch, batch_size: int, device: torch.device) -> None:
        self.forward, self.paged = forward, paged
        self.ids = torch.zeros((1, batch_size), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, batch_size), dtype=torch.long, device=device)
        self.stream = torch.cuda.Stream(device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self._state: tuple[Any, ...] = (None,)
        #: captures made (the first decode step's, then one per replan or new table)
        self.captures = 0
        self.replays = 0

    def step(self, tokens: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """One decode step: ``tokens [B]`` (int64, on the device) at positions
        ``lengths [B]`` (the host lengths before the step; read only when capturing).
        Returns the step's logits ``[B, V]`` float32 (after a replay: the graph's
        output, valid until the next step)."""
        paged = self.paged
        paged.begin(None)
        self.ids[0].copy_(tokens)
        try:
            if self.graph is not None and paged.graph_state() == self._state:
                self.graph.replay()
                paged.replayed()
                self.replays += 1
                assert self.logits is not None
                return self.logits
            return self._capture(lengths)
        finally:
            self.positions.add_(1)     # the next step's positions, in stream order

    def _capture(self, lengths: np.ndarray) -> torch.Tensor:
        paged = self.paged
        self.graph = self.logits = None          # the old graph's memory goes first
        self.positions[0].copy_(torch.as_tensor(np.asarray(lengths, np.int64)))
        s = self.stream
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            # the step itself, eagerly: compiles, and allocates paged-decode's per-stream
            # workspaces on the stream the graph is captured on
            result = self.forward(self.ids, self.positions)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=s):
                    paged.begin_capture()
                    logits = self.forward(self.ids, self.positions)
            except Exception as exc:     # a host sync or allocation inside the model
                raise UnsupportedProblemError(
                    "generate: the decode step's forward could not be captured in a CUDA "
                    f"graph ({type(exc).__name__}: {str(exc)[:300]}); pass "
                    "cuda_graph=False to run the decode steps eagerly") from exc
        torch.cuda.current_stream().wait_stream(s)
        result.record_stream(torch.cuda.current_stream())   # made on s, read after it
        self.graph, self.logits = graph, logits
        self._state = paged.graph_state()
        self.captures += 1
        return result


__all__ = ["DecodeGraph"]
