"""Strict JSON for the files the package writes: no NaN / Infinity literals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from paged_decode import json_text


def test_non_finite_numbers_become_null_at_any_depth():
    obj = {"a": math.nan, "b": [1.0, math.inf, (-math.inf, 2)], "c": {"d": {"e": math.nan}},
           "f": "NaN", "g": 3, "h": None, "i": True}
    text = json_text.dumps(obj, indent=1)
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text
    assert json.loads(text) == {"a": None, "b": [1.0, None, [None, 2]],
                                "c": {"d": {"e": None}}, "f": "NaN", "g": 3, "h": None,
                                "i": True}


def test_numpy_scalars_are_written_as_numbers_or_null():
    text = json_text.dumps({"a": np.float32("nan"), "b": np.float32(1.5), "c": np.int64(7),
                            "d": [np.float64("-inf")]})
    assert json.loads(text) == {"a": None, "b": 1.5, "c": 7, "d": [None]}


def test_a_non_finite_value_it_cannot_see_is_refused_not_written():
    class Odd:        # turned into a float by default= after finite() has run
        pass
    with pytest.raises(ValueError):
        json_text.dumps({"x": Odd()}, default=lambda o: math.nan)
