"""The engine suite's FlashInfer arms on the CPU: the vectorized host page table against
a per-sequence model of the same engine loop, and the whole loop (both arms) driven
through ``paged_decode.compat.flashinfer`` (FlashInfer's API) on CPU torch tensors, so
the harness's bookkeeping, appends and verification are checked before any GPU runs it
with FlashInfer itself."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.bench.engine_case import EngineCase, prompts
from paged_decode.bench.engine_flashinfer import HostPages, run_loop


def model_steps(lens, p, steps):
    """The loop one request at a time: page lists, lengths, refcounts, copies in order."""
    b, half = len(lens), len(lens) // 2
    nxt, ref, pages, length = 0, {}, [], []
    for i, n in enumerate(lens):
        if i > half and i % 2 == 0:
            pages.append(list(pages[0]))
            length.append(length[0])
            for pg in pages[0]:
                ref[pg] += 1
            continue
        own = list(range(nxt, nxt + -(-n // p)))
        nxt += len(own)
        for pg in own:
            ref[pg] = 1
        pages.append(own)
        length.append(n)
    out = []
    for _ in range(steps):
        copies = []
        for r in range(b):
            if length[r] % p == 0:
                pages[r].append(nxt)
                ref[nxt] = 1
                nxt += 1
            elif ref[pages[r][-1]] > 1:
                ref[pages[r][-1]] -= 1
                copies.append((pages[r][-1], nxt))
                pages[r][-1] = nxt
                ref[nxt] = 1
                nxt += 1
            length[r] += 1
        out.append(([list(x) for x in pages], list(length), copies))
    return out


@pytest.mark.parametrize("batch, context, p", [(8, 40, 16), (13, 7, 4), (2, 16, 16),
                                               (32, 100, 1)])
def test_host_pages_follow_the_per_request_model(batch, context, p):
    case = EngineCase(batch, context=context, steps=20, page_size=p)
    lens = prompts(case, 3)
    host = HostPages(lens, p, case.steps)
    for it, (pages, length, copies) in enumerate(model_steps(lens, p, case.steps)):
        t = host.step()
        got = [t.indices[t.indptr[r]:t.indptr[r + 1]].tolist() for r in range(batch)]
        assert got == pages, it
        assert t.last_page_len.tolist() == [(n - 1) % p + 1 for n in length]
        assert t.positions.tolist() == [n - 1 for n in length]
        assert sorted(zip(t.copy_src.tolist(), t.copy_dst.tolist())) == sorted(copies), it
    assert host.next <= host.num_pages


@pytest.mark.parametrize("arm", ["flashinfer", "flashinfer-captured"])
def test_the_flashinfer_loop_runs_and_verifies_through_the_drop_in(arm):
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    case = EngineCase(6, context=24, layers=2, steps=4, page_size=4, num_qo_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="float16")
    res = run_loop(shim, torch, torch.device("cpu"), case, arm)
    assert res.ran and len(res.errors) == 6 and res.verified, res
    assert np.isnan(res.gpu_us) and res.step_us > 0


def test_a_plan_over_a_wrong_page_fails_the_flashinfer_loop_s_verification(monkeypatch):
    """Negative control: a plan that reads another request's page in place of request 0's
    first (the appends still go where the engine's table says) must fail the oracle."""
    torch = pytest.importorskip("torch")
    import paged_decode.compat.flashinfer as shim
    cls = shim.BatchDecodeWithPagedKVCacheWrapper
    real = cls.plan

    def wrong_page(self, indptr, indices, *args, **kw):
        indices = indices.clone()
        indices[0] = indices[-1]
        return real(self, indptr, indices, *args, **kw)

    monkeypatch.setattr(cls, "plan", wrong_page)
    case = EngineCase(4, context=24, layers=1, steps=3, page_size=4, num_qo_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="float16")
    res = run_loop(shim, torch, torch.device("cpu"), case, "flashinfer")
    assert res.ran and not res.verified
