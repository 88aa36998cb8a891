"""Where a CUDA-graph decode step (integrations.decode_graph) departs from the eager one:
per-step logit differences, the positions buffer against the host lengths, and the
layer-0 K appended per step, for the eager loop, the graph, and a graph-free imitation of
it (replay = record the table update, run the forward again).

Usage on the GPU machine: python3 bench/device/debug_decode_graph.py [MODEL]
"""

import sys

import cupy as cp
import numpy as np
import torch

sys.path.insert(0, "tests")
from helpers import ragged_prompts  # noqa: E402

from paged_decode.integrations import decode_graph as dg  # noqa: E402
from paged_decode.integrations import paged_batch as pb  # noqa: E402
from paged_decode.integrations import transformers as pt  # noqa: E402
from paged_decode.integrations.random_models import transformers_model  # noqa: E402

NEW = 12
seen = []
_launch = cp.cuda.driver.launchKernel


def watched_launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    try:
        cap = cp.cuda.runtime.streamIsCapturing(stream)
    except Exception as exc:
        cap = f"err {exc}"
    seen.append((stream, cap))
    return _launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra)


cp.cuda.driver.launchKernel = watched_launch
batches = []
orig_close = pb.PagedBatch.close
pb.PagedBatch.close = lambda self: batches.append(self)      # keep the pools to compare
trace = []
orig_step = dg.DecodeGraph.step


def traced_step(self, tokens, lengths):
    out = orig_step(self, tokens, lengths)
    torch.cuda.synchronize()
    trace.append((np.asarray(lengths).tolist(), (self.positions[0] - 1).tolist()))
    return out


dg.DecodeGraph.step = traced_step


class Imitation(dg.DecodeGraph):
    """Replays by running the recorded work again, eagerly (no CUDA graph)."""

    def _capture(self, lengths):
        paged = self.paged
        self.positions[0].copy_(torch.as_tensor(np.asarray(lengths, np.int64)))
        result = self.forward(self.ids, self.positions)

        class Again:
            def replay(inner):
                paged._next_layer = paged.num_layers
                paged.begin_capture()
                self.logits = self.forward(self.ids, self.positions)
        self.graph = Again()
        self._state = paged.graph_state()
        self.captures += 1
        return result


name = sys.argv[1] if len(sys.argv) > 1 else "llama"
model = transformers_model(name, seed=0, device="cuda")
prompts = ragged_prompts(model.config.vocab_size, seed=1)
runs = {}
runs["eager"] = pt.generate(model, prompts, NEW, cuda_graph=False, return_logits=True)
seen.clear()
orig_capture = dg.DecodeGraph._capture


def watched_capture(self, lengths):
    n0 = len(seen)
    out = orig_capture(self, lengths)
    print("capture stream", self.stream.cuda_stream, "launches during eager+capture:",
          len(seen) - n0, "distinct (stream, capturing):", sorted(set(map(str, seen[n0:]))))
    return out


dg.DecodeGraph._capture = watched_capture
runs["graph"] = pt.generate(model, prompts, NEW, cuda_graph=True, return_logits=True)
dg.DecodeGraph._capture = orig_capture
print("graph positions (host lengths, device positions) per step:")
for t in trace:
    print("  ", t)
real = dg.DecodeGraph
pt.generate.__globals__["DecodeGraph"] = Imitation
runs["imitation"] = pt.generate(model, prompts, NEW, cuda_graph=True, return_logits=True)
pt.generate.__globals__["DecodeGraph"] = real
# the same graph with the device idle between begin (its upload) and the replay
orig_begin = pb.PagedBatch.begin


def synced_begin(self, counts):
    orig_begin(self, counts)
    torch.cuda.synchronize()


pb.PagedBatch.begin = synced_begin
runs["graph, synced begin"] = pt.generate(model, prompts, NEW, cuda_graph=True,
                                          return_logits=True)
pb.PagedBatch.begin = orig_begin
eng_desc = []
orig_replayed = pb.PagedBatch.replayed


def probe_replayed(self):
    torch.cuda.synchronize()
    t = self._engine.table
    eng_desc.append((t.upload.desc.get()[:, :4].tolist(), t.visible_lens[:4].tolist()))
    orig_replayed(self)


pb.PagedBatch.replayed = probe_replayed
runs["graph, probed"] = pt.generate(model, prompts, NEW, cuda_graph=True, return_logits=True)
pb.PagedBatch.replayed = orig_replayed
print("device desc[:, :4] and host lengths after each replay:")
for d in eng_desc[:4]:
    print("  desc", d)
e = runs["eager"].logits
for arm in ("graph", "imitation", "graph, synced begin", "graph, probed"):
    g = runs[arm].logits
    diffs = [float((g[i] - e[i]).abs().max()) for i in range(e.shape[0])]
    print(arm, runs[arm].decode_steps, runs[arm].captures, runs[arm].replays,
          "tokens equal:", runs[arm].tokens == runs["eager"].tokens)
    print("   max |logit diff| per step:", " ".join(f"{d:.2e}" for d in diffs))
# layer-0 K of every sequence's visible tokens, eager pool against the others
b_eager, b_graph, b_imit = batches[:3]
print("engine paths:", [b._engine.path if b._engine is not None else None for b in batches])
for arm, b in (("graph", b_graph), ("imitation", b_imit)):
    te, tg = b_eager.pool.page_table(b_eager.seqs), b.pool.page_table(b.seqs)
    ke, kg = b_eager.pool.layer(0)[0], b.pool.layer(0)[0]
    for r in range(te.batch_size):
        n = int(te.visible_lens[r])
        pe = np.asarray(te.request_pages(r))
        pg = np.asarray(tg.request_pages(r))
        re_ = ke[pe].reshape(-1, *ke.shape[2:])[:n]
        rg = kg[pg].reshape(-1, *kg.shape[2:])[:n]
        bad = np.nonzero(np.abs((re_ - rg).get()).max(axis=(1, 2)) > 1e-6)[0]
        print(f"{arm} request {r}: {n} tokens (graph run {int(tg.visible_lens[r])}), "
              f"K rows differing from eager: {bad.tolist()[:20]}")
