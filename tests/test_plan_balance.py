"""``bench/plan_balance.py``: balanced chunks in the H200's plans, and its ``unbalanced``
helper (the plan the search left), which ``bench/device/tune_chunks.py`` times against."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from paged_decode import plan as plan_mod
from paged_decode.bench.cases import preset_cases
from paged_decode.plan import chunk_token_ranges, make_plan

_SPEC = importlib.util.spec_from_file_location(
    "plan_balance", Path(__file__).resolve().parents[1] / "bench" / "plan_balance.py")
pb = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(pb)


def test_unbalanced_restores_the_searched_size_and_only_inside():
    t = pb.table([20000] * 17)
    real = plan_mod.balanced_chunk_size
    with pb.unbalanced():
        searched = make_plan(t, 32, 8, 128, device=pb.H200)
    assert plan_mod.balanced_chunk_size is real
    balanced = make_plan(t, 32, 8, 128, device=pb.H200)
    assert searched.pages_per_chunk == 1249 and balanced.pages_per_chunk == 664
    assert searched.num_ctas == balanced.num_ctas == 272
    assert searched.chunks_per_request.tolist() == balanced.chunks_per_request.tolist()
    lo, hi = chunk_token_ranges(t, searched)
    assert sorted(set((hi - lo).tolist())) == [16, 19984]       # a full chunk and a sliver
    assert pb.longest(t, 32, 8, False) == (10624, 272)


def test_the_documented_counts(capsys, monkeypatch):
    """docs/concepts.md quotes these: 119 of 1536 plans change at Llama-3-8B heads, the
    longest chunk 1.35x shorter in median and 1.88x at most; the targets preset's batch
    sizes never change."""
    monkeypatch.setattr("sys.argv", ["plan_balance.py"])
    pb.main()
    out = capsys.readouterr().out
    assert out.startswith("119 of 1536 plans change (32/8 heads, v2 CTAs")
    assert "median 1.35, max 1.88" in out
    targets = {c.batch for c in preset_cases("targets")}
    changed = {int(line.split()[1][1:]) for line in out.splitlines()
               if line.startswith("uniform")}
    assert changed and not changed & targets


def test_batches_preset_holds_batches_whose_plans_changed():
    cases = preset_cases("batches")
    assert [(c.batch, c.context) for c in cases] == \
        [(b, t) for t in (4096, 16384) for b in (5, 12, 20, 24, 48, 96)]
    moved = 0
    for c in cases:
        t = pb.table([c.context] * c.batch)
        with pb.unbalanced():
            before = pb.longest(t, 32, 8, False)
        after = pb.longest(t, 32, 8, False)
        assert after[1] == before[1] and after[0] <= before[0]
        moved += after[0] < before[0]
    assert moved >= 4


def test_every_plan_keeps_its_ctas_and_never_lengthens(monkeypatch):
    rng = np.random.default_rng(3)
    for _ in range(40):
        lens = rng.integers(1, 40000, int(rng.integers(1, 130))).tolist()
        t = pb.table(lens)
        for v2tc in (False, True):
            with pb.unbalanced():
                before = pb.longest(t, 28, 4, v2tc)
            after = pb.longest(t, 28, 4, v2tc)
            assert after[1] == before[1] and after[0] <= before[0]
