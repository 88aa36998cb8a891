"""The problem builders' page-id helpers (``paged_decode.problems``)."""

from __future__ import annotations

import numpy as np

from paged_decode.problems import ProblemSpec, in_order, make_problem
from paged_decode.reference import oracle_decode


def test_in_order_lays_each_request_out_contiguously_and_decodes_the_same():
    """``in_order`` keeps every request's lengths and offsets and renumbers its pages in
    list order; over pools permuted the same way, the float64 oracle gives the same output
    bit for bit, so floor.py's in-order timing reads the same bytes as its shuffled one."""
    spec = ProblemSpec(4, 0, 8, 2, 64, 16, seed=3)
    pr = make_problem(spec, lengths=[70, 0, 300, 17], offsets=[3, 0, 15, 9])
    t = pr.table
    t2 = in_order(t)
    assert t2.indices.tolist() == list(range(t.total_pages))
    assert t.indices.tolist() != t2.indices.tolist()          # the original was shuffled
    for name in ("indptr", "last_page_len", "first_page_offset"):
        assert getattr(t2, name).tolist() == getattr(t, name).tolist(), name
    assert t2.num_pages == t.num_pages and t2.page_size == t.page_size
    k2 = np.full_like(pr.k_pages, np.nan)
    v2 = np.full_like(pr.v_pages, np.nan)
    k2[t2.indices] = pr.k_pages[t.indices]
    v2[t2.indices] = pr.v_pages[t.indices]
    want, want_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, t)
    got, got_lse = oracle_decode(pr.q, k2, v2, t2)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_lse, want_lse)
