"""The benchmark suite behind ``paged-decode bench``: one case registry, one runner."""

from .cases import PRESETS, BenchCase, preset_cases
from .runner import BenchResult, run_bench

__all__ = ["PRESETS", "BenchCase", "BenchResult", "preset_cases", "run_bench"]
