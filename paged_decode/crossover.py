"""Per-device crossover tables: which path ``decode(path="auto")`` takes.

A table is the measured best of this package's arms (``gather``, ``v1``, ``v2``,
``v2tc``) per benchmark cell, by median GPU time under CUDA-graph replay
(``paged-decode bench --write-crossover PATH`` writes one from a sweep; ``merged`` folds
a later run's cells in). ``choose`` takes the nearest measured cell in (log2 batch, log2
mean visible context, log2 page size), preferring cells with the same GQA group, and
returns its best path among those the call can run (the tensor-core partial takes 16-bit
queries with pools in their dtype or fp8: a call on other pools, or with a variant a path
does not implement (``variants.PATH_VARIANTS``), gets the cell's fastest other path; an
fp8 call reads the cells measured on 16-bit pools).

Lookup order for a device: ``PAGED_DECODE_CROSSOVER`` (a JSON file), then
``~/.cache/paged-decode/crossover/<device>.json`` (re-measured on this machine), then the
table shipped in ``paged_decode/data/crossover/<device>.json`` (the H200's and the H100
80GB HBM3's), then a shipped table measured on another device of the same architecture
(``SHIPPED_ARCH``: the H200's for any other compute capability 9.0 GPU). ``<device>`` is
the device name in lower case with non-alphanumerics as ``-`` (e.g. ``nvidia-h200``).
With no table, auto runs v2.
The architecture decides most of a cell's choice (at GQA 7-16 the CUDA-core partial runs
out of issue slots and registers, at GQA 1-2 the tensor-core one pads most of its tile),
the memory system the rest, so a borrowed table is a better guess than v2 everywhere but
not a measurement: the call's reason names the device the table was measured on.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import settings
from .errors import InvalidArgumentError

ENV = "PAGED_DECODE_CROSSOVER"
PATHS = ("gather", "v1", "v2", "v2tc")
SHIPPED = Path(__file__).parent / "data" / "crossover"
#: each shipped table's architecture (CUDA compute capability), for devices with no table
#: of their own (``table_for``)
SHIPPED_ARCH = {"nvidia-h200": "9.0"}
USER = Path(os.path.expanduser("~")) / ".cache" / "paged-decode" / "crossover"


@dataclass(frozen=True)
class Cell:
    """One measured cell: geometry, the best path and each path's median GPU time (us)."""

    batch: int
    context: int
    page_size: int
    group: int                   # Hq / Hkv
    best: str
    times_us: dict[str, float]


@dataclass(frozen=True)
class CrossoverTable:
    device: str
    source: str                  # the file it came from
    cells: tuple[Cell, ...]

    def choose(self, batch: int, context: float, page_size: int, group: int,
               allowed: tuple[str, ...] = PATHS) -> tuple[str | None, Cell]:
        """The fastest path in ``allowed`` of the nearest cell and that cell (``None``
        when the cell timed none of them). Cells of the nearest measured GQA group are
        searched (the group decides between the CUDA-core and tensor-core partials), then
        the nearest in (log2 batch, log2 context, log2 page size)."""
        near = min({c.group for c in self.cells},
                   key=lambda g: (abs(math.log2(g) - math.log2(max(1, group))), g))
        same = [c for c in self.cells if c.group == near]

        def dist(c: Cell) -> float:
            return ((math.log2(max(1, batch)) - math.log2(c.batch)) ** 2
                    + (math.log2(max(1.0, context)) - math.log2(c.context)) ** 2
                    + (math.log2(page_size) - math.log2(c.page_size)) ** 2)
        cell = min(same, key=dist)
        if cell.best in allowed:
            return cell.best, cell
        times = {p: t for p, t in cell.times_us.items() if p in allowed}
        return (min(times, key=lambda p: times[p]) if times else None), cell


@functools.lru_cache(maxsize=64)
def device_slug(name: str) -> str:
    """``name`` in lower case with non-alphanumerics as ``-`` (cached: every
    ``path="auto"`` call compares a table's device with its own, ``measured_elsewhere``)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def parse(data: Any, source: str) -> CrossoverTable:
    """A table from its JSON form (``{"device": ..., "cells": [...]}``); errors name the
    file and the field."""
    fn = f"crossover table {source}"
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise InvalidArgumentError(f"{fn}: expected an object with a 'cells' list")
    cells = []
    for i, c in enumerate(data["cells"]):
        try:
            cell = Cell(int(c["batch"]), int(c["context"]), int(c["page_size"]),
                        int(c.get("group", 1)), str(c["best"]),
                        {str(k): float(v) for k, v in c.get("times_us", {}).items()})
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{fn}: cell {i} is malformed ({exc})") from exc
        if cell.best not in PATHS:
            raise InvalidArgumentError(f"{fn}: cell {i} best must be one of {PATHS}, "
                                       f"got {cell.best!r}")
        if min(cell.batch, cell.context, cell.page_size, cell.group) < 1:
            raise InvalidArgumentError(f"{fn}: cell {i} has a non-positive dimension")
        cells.append(cell)
    if not cells:
        raise InvalidArgumentError(f"{fn}: no cells")
    return CrossoverTable(str(data.get("device", "?")), source, tuple(cells))


@functools.cache
def _load(path: str, mtime: float) -> CrossoverTable:
    return parse(json.loads(Path(path).read_text()), path)


@functools.lru_cache(maxsize=64)
def _candidates(env: str | None, device_name: str, user: str, shipped: str) -> tuple[str, ...]:
    slug = device_slug(device_name)
    return ((env,) if env else ()) + (os.path.join(user, f"{slug}.json"),
                                       os.path.join(shipped, f"{slug}.json"))


@functools.lru_cache(maxsize=64)
def _candidates_by_arch(arch: str, shipped: str) -> tuple[str, ...]:
    return tuple(os.path.join(shipped, f"{slug}.json")
                 for slug, a in SHIPPED_ARCH.items() if arch and a == arch)


def table_for(device_name: str, arch: str = "") -> CrossoverTable | None:
    """The crossover table for ``device_name`` of architecture ``arch`` (``DeviceInfo.arch``;
    see the module doc for the lookup). Every ``path="auto"`` call looks it up, so the
    lookup is one ``stat`` per candidate file (a table written or changed later is seen at
    the next call). ``measured_elsewhere`` tells a borrowed table."""
    env = settings.get(ENV)
    for p in (_candidates(env, device_name, str(USER), str(SHIPPED))
              + _candidates_by_arch(arch, str(SHIPPED))):
        try:
            st = os.stat(p)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode):
            return _load(p, st.st_mtime)
        if env and p == env:
            raise InvalidArgumentError(f"{ENV}: no such file {env!r}")
    return None


def measured_elsewhere(table: CrossoverTable, device_name: str) -> bool:
    """Whether ``table`` was measured on another device than ``device_name`` (a table of
    the same architecture, or a file named by ``PAGED_DECODE_CROSSOVER``)."""
    return device_slug(table.device) != device_slug(device_name)


def from_results(results: list[Any], device: str) -> dict[str, Any]:
    """The JSON form of a table from bench results (``BenchResult`` list): per case, the
    fastest verified arm among ``PATHS`` that ran what it stands for, by GPU median (by
    the per-call median on backends without GPU timing, e.g. Metal)."""
    cells = []
    gpu = any(x.gpu for r in results for x in r.arms.values())
    for r in results:
        # a NaN median (a timer that measured nothing) is truthy: finite ones only
        times = {a: (x.gpu if gpu else x.call)["median_us"] for a, x in r.arms.items()
                 if a in PATHS and x.verified and not x.fell_back
                 and math.isfinite((x.gpu if gpu else x.call).get("median_us") or math.nan)}
        if not times:
            continue
        c = r.case
        cells.append({"batch": c.batch, "context": c.context, "page_size": c.page_size,
                      "group": c.num_qo_heads // c.num_kv_heads,
                      "best": min(times, key=lambda a: times[a]),
                      "times_us": {a: round(t, 2) for a, t in times.items()}})
    metric = ("median GPU time under CUDA-graph replay, cold L2" if gpu
              else "median host-measured time per synchronized call")
    return {"device": device, "metric": metric, "cells": cells}


def merged(old: dict[str, Any], new: dict[str, Any], source: str) -> dict[str, Any]:
    """``old`` (a table's JSON form) with ``new``'s cells (``from_results``) in place of
    the cells of the same geometry (batch, context, page size, group) and added where it
    has none; ``source`` (a device run and its report) is appended to the table's
    ``sources`` and written into every new cell, so each cell says which run timed it (a
    cell without one is from the first source). Both tables must share a metric.
    ``bench/crossover_merge.py`` applies it to saved bench JSON."""
    fn = "crossover.merged"
    if old.get("metric") != new.get("metric"):
        raise InvalidArgumentError(f"{fn}: the tables' metrics differ ({old.get('metric')!r} "
                                   f"against {new.get('metric')!r}): their times cannot mix")
    key = ("batch", "context", "page_size", "group")
    fresh = [{**c, "source": source} for c in new["cells"]]
    taken = {tuple(c.get(k, 1) for k in key) for c in fresh}
    kept = [c for c in old["cells"] if tuple(c.get(k, 1) for k in key) not in taken]
    out = {**old, "cells": kept + fresh}
    out["sources"] = [*old.get("sources", []), source]
    parse(out, fn)           # the result must load
    return out


__all__ = ["Cell", "CrossoverTable", "ENV", "device_slug", "from_results",
           "measured_elsewhere", "merged", "parse", "table_for"]
