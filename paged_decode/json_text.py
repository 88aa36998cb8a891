"""JSON text of the files this package writes (bench results, crossover tables, check
reports): strict JSON, so that any parser reads them. Python's ``json`` would write the
non-standard literals ``NaN`` and ``Infinity`` for a missing or failed measurement; those
become ``null`` here (``BenchResult.from_dict`` reads them back as NaN)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (in dicts, lists and tuples, at any depth)
    replaced by ``None``; numpy scalars become Python numbers."""
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` of ``finite(obj)``, refusing any NaN or infinity left (``kwargs``:
    ``json.dumps``'s, e.g. ``indent``)."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)
