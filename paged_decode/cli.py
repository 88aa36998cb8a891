"""The ``paged-decode`` command line: ``info``, ``check``, ``bench`` and ``plot``."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from . import __version__, json_text
from .backends import REGISTRY, availability, get_backend, last_auto_choice
from .errors import PagedDecodeError
from .page_table import MAX_ENTRIES
from .variants import SOFT_CAP_RANGE


def _package_errors(command: Any) -> Any:
    """``command`` with this package's own errors (a value the options let through but
    a function refuses, a pool that cannot be allocated) as one ``Error:`` line, not a
    traceback."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except PagedDecodeError as exc:
            raise click.ClickException(str(exc)) from exc
    return run


def _backend(name: str | None):  # type: ignore[no-untyped-def]
    try:
        be = get_backend(name)
    except Exception as exc:
        raise click.ClickException(str(exc)) from exc
    if be.name == "reference":
        # The reference backend's matmuls have a handful of rows; multi-threaded OpenBLAS
        # made them 10-100x slower on a 2-core VM, so the CLI runs BLAS on one thread.
        from threadpoolctl import threadpool_limits
        threadpool_limits(limits=1, user_api="blas")
    return be


class OutPath(click.Path):
    """A file the command writes: refused before any work when its folder is missing or
    not writable (a long run must not end in a traceback at the last step)."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        folder = os.path.dirname(os.path.abspath(os.fsdecode(path)))
        if not os.path.isdir(folder):
            self.fail(f"folder {folder!r} does not exist", param, ctx)
        if not os.access(folder, os.W_OK):
            self.fail(f"folder {folder!r} is not writable", param, ctx)
        return path


def _write(what: str, path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise click.ClickException(f"cannot write {what} {path}: {exc.strerror or exc}") \
            from exc


POSITIVE = click.IntRange(min=1)
#: bench --batch's most: a million requests (past it the cases' own host lists run out of
#: memory before any pool is sized)
MAX_BATCH = 2**20
#: bench --graph-layers' most (``paged_decode.bench.layers.MAX_GRAPH_LAYERS``, not
#: imported here: the bench modules load only when a bench runs; a test checks they agree)
MAX_GRAPH_LAYERS = 256


@click.group()
@click.version_option(__version__, prog_name="paged-decode")
def main() -> None:
    """Fused paged-attention decode kernels: inspect, verify and benchmark.

    Without --backend, the best available backend is used (CUDA when a GPU and CuPy are
    present, otherwise the CPU reference backend); PAGED_DECODE_BACKEND sets it too.
    """


@main.command()
@click.option("--backend", default=None, help="Backend to describe (default: automatic).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_package_errors
def info(backend: str | None, as_json: bool) -> None:
    """Available backends, the selected device and its plan target."""
    import numpy as np
    rows = {name: availability(name) for name in REGISTRY}
    be = _backend(backend)
    dev = be.device_info()
    data = {"paged_decode": __version__, "numpy": np.__version__,
            "backends": {n: {"available": s.ok, "reason": s.reason} for n, s in rows.items()},
            "selected": be.name, "auto_choice": last_auto_choice(),
            "device": dev.name, "compute_units": dev.compute_units,
            "ctas_per_unit": dev.ctas_per_unit, "target_ctas": dev.target_ctas(),
            "detail": dev.detail, **{k: v for k, v in be.describe().items() if k != "backend"}}
    data["v2tc_plans"] = _v2tc_plan_rule(dev)
    from .crossover import measured_elsewhere, table_for
    try:
        xt = table_for(dev.name, dev.arch)
        data["crossover"] = ("none: path='auto' runs v2" if xt is None else
                             f"{xt.source} ({len(xt.cells)} cells"
                             + (f"; measured on {xt.device}, not on this device"
                                if measured_elsewhere(xt, dev.name) else "") + ")")
    except Exception as exc:   # a malformed table file must not hide the rest of info
        data["crossover"] = f"unreadable: {exc}"
    if as_json:
        click.echo(json_text.dumps(data, indent=1, default=str))
        return
    click.echo(f"paged-decode {__version__} (numpy {np.__version__})")
    for n, s in rows.items():
        click.echo(f"  backend {n:<10} {'available' if s.ok else 'unavailable: ' + s.reason}")
    click.echo(f"selected: {be.name} on {dev.name} ({dev.detail})")
    click.echo(f"plan target: {dev.target_ctas()} CTAs ({dev.compute_units} units x "
               f"{dev.ctas_per_unit})")
    click.echo(f"tensor-core plans: {data['v2tc_plans']}")
    click.echo(f"crossover table: {data['crossover']}")
    for k, v in be.describe().items():
        if k not in ("backend", "device"):
            click.echo(f"  {k}: {v}")


def _v2tc_plan_rule(dev: Any) -> str:
    """Which rule plans the tensor-core partial on ``dev`` (``paged_decode/waves.py``)."""
    from .specs import SUPPORTED_HEAD_DIMS, plan_geometry
    slots = [plan_geometry("v2tc", 8, 8, d, None, dev)["slots_per_unit"]
             for d in SUPPORTED_HEAD_DIMS]
    if not all(slots):
        why = ("PAGED_DECODE_WAVE_PLAN=0" if dev.shared_mem_per_unit > 0
               else "the device reports no shared memory per unit")
        return f"CTA-target rule ({why})"
    dims = " / ".join(str(d) for d in SUPPORTED_HEAD_DIMS)
    return (f"wave rule, {' / '.join(map(str, slots))} resident CTAs per unit at head_dim "
            f"{dims} (16-bit pools, one query token; fp8 and multi-token: the target rule)")


@main.command()
@click.option("--backend", default=None, help="Backend to check (default: automatic).")
@click.option("--full", is_flag=True, help="The whole 360-configuration matrix per dtype.")
@click.option("--dtype", "dtypes", multiple=True, default=["float16"], show_default=True,
              type=click.Choice(["float16", "bfloat16", "float32"]),
              help="KV and query dtype (repeat for several).")
@click.option("--json", "json_path", type=OutPath(), default=None,
              help="Write every result as JSON here.")
@click.option("--max-configs", type=POSITIVE, default=None,
              help="Stop after this many configs (the matrix is ordered by dtype, then "
                   "cost, so a small number may not reach every --dtype).")
@click.option("--path", "paths", multiple=True,
              type=click.Choice(["v2", "v2-forced-merge", "v2-single", "v1", "gather", "v2tc",
                                 "v2tc-forced-merge"]),
              help="Paths to check (repeat for several; default: all the backend runs).")
@click.option("--shard", default=None, metavar="K/N",
              help="Run every N-th configuration from the K-th (0-based), to split a matrix "
                   "over N processes.")
@_package_errors
def check(backend: str | None, full: bool, dtypes: tuple[str, ...], json_path: str | None,
          max_configs: int | None, paths: tuple[str, ...], shard: str | None) -> None:
    """Correctness matrix against the float64 oracle; exits non-zero on any failure."""
    from .check import TC_PATHS, default_paths, format_result, run_check
    part = None
    if shard is not None:
        try:
            k, n = (int(x) for x in shard.split("/"))
        except ValueError as exc:
            raise click.BadParameter(f"expected K/N such as 0/4, got {shard!r}",
                                     param_hint="--shard") from exc
        if not (n >= 1 and 0 <= k < n):
            raise click.BadParameter(f"need 0 <= K < N, got {shard!r}", param_hint="--shard")
        part = (k, n)
    be = _backend(backend)
    paths = tuple(dict.fromkeys(paths))      # a path named twice runs once (dtypes do too)
    tc = [p for p in paths if p in TC_PATHS]
    if tc and not be.tensor_core_decode:
        raise click.ClickException(f"check: --path {tc[0]} needs a backend with the "
                                   f"tensor-core partial (cuda, metal, emulated-cuda, "
                                   f"emulated-metal); {be.name} has none")
    if paths and set(paths) <= set(TC_PATHS) and set(dtypes) == {"float32"}:
        raise click.ClickException(f"check: --path {paths[0]} takes float16 / bfloat16 "
                                   "queries, and --dtype float32 selects none")
    click.echo(f"checking backend {be.name} on {be.device_info().name}"
               f"{' (full matrix)' if full else ' (quick matrix; --full for all 360)'}")
    single = be.auto_path()
    if not paths and single is not None:  # a backend with one arm (MLX without Metal)
        click.echo(f"paths: {single[0]} only ({single[1]})")
    chosen = paths or (default_paths(be) if single is None else (single[0],))
    t0 = time.perf_counter()
    report = run_check(be, full=full, dtypes=list(dtypes), max_configs=max_configs,
                       paths=chosen, shard=part,
                       progress=lambda r: click.echo(format_result(r)))
    click.echo(report.summary())
    click.echo(f"elapsed {time.perf_counter() - t0:.1f} s")
    if json_path:
        _write("--json", json_path, report.to_json())
    if not report.passed:
        sys.exit(1)


@main.command()
@click.option("--backend", default=None, help="Backend to time (default: automatic).")
@click.option("--suite", default="decode", show_default=True,
              type=click.Choice(["decode", "cascade", "cascade-rule", "forks", "sparse",
                                 "engine"]),
              help="engine: an engine's decode loop (--layers, --steps; batch {8,64,128} "
                   "at context 1K unless --batch / --context; arms eager, captured and "
                   "flashinfer: append + table update + decode of every layer per step); "
                   "decode: gather/v1/v2 over --preset; cascade: flat v2 vs cascade "
                   "(tensor-core level 0, and v2 level 0 where both exist) over shared "
                   "prefixes {2K,8K,32K} x batch {4,8,32,128}, suffix 256; cascade-rule: "
                   "the same arms over short prefixes {128..2K} x batch {2..128}; forks: "
                   "flat v2, v2tc and FlashInfer (CUDA and tensor cores) beside cascade over "
                   "pages shared by every request (32 x 8K, 8 x 8K, 64/128 x 1K, 128 x 2K "
                   "shared, suffix 256); sparse: "
                   "dense masked vs fused over context {4K,16K,64K} x sparsity {2..32}x.")
@click.option("--preset", default=None,
              help="Case preset: adr (gather/v1/v2 GPU sweep, pages 16/32/64), targets "
                   "(page 16, batch up to 128), variants (8 x 8K: bf16, head_dim, GQA, "
                   "page size), models, crossover (adr at page 16 plus every other models "
                   "GQA layout: the cells of path='auto'), ragged (16 x 1K-8K, 128 x 512-4K), "
                   "batches (batch 5-96 between the targets' sizes, 4K / 16K), "
                   "cpu (small); cascade and sparse "
                   "select those "
                   "suites. Default: adr on a GPU backend, cpu on the others.")
@click.option("--context", "contexts", multiple=True,
              type=click.IntRange(min=1, max=MAX_ENTRIES), help="Override contexts.")
@click.option("--batch", "batches", multiple=True, type=click.IntRange(min=1, max=MAX_BATCH),
              help="Override batch sizes.")
@click.option("--page", "pages", multiple=True, type=POSITIVE, help="Override page sizes.")
@click.option("--dtype", default=None, type=click.Choice(["float16", "bfloat16", "float32"]))
@click.option("--arms", default="gather,v1,v2", show_default=True,
              help="Comma-separated arms: gather, v1, v2, v2tc (ours; v2tc: the tensor-core "
                   "partial, float16/bfloat16 on cuda), sdpa (torch SDPA on "
                   "contiguous K/V), flashinfer, flashinfer-tc (FlashInfer batch decode, "
                   "CUDA cores / tensor cores, when importable), flashinfer-xqa "
                   "(FlashInfer 0.6+'s XQA decode, when that version is importable).")
@click.option("--reps", default=30, show_default=True, type=POSITIVE,
              help="Timed repetitions (CPU backends time max(3, reps // 6) synchronized "
                   "calls).")
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(min=0))
@click.option("--warm-l2", is_flag=True, help="Do not flush L2 between iterations.")
@click.option("--l2-flush", "l2_flush", default="clean", show_default=True,
              type=click.Choice(["clean", "dirty"]),
              help="How L2 is flushed between iterations: clean reads a 256 MB buffer "
                   "(L2 left holding clean lines, as a projection's weights leave it "
                   "before attention); dirty overwrites it (L2 left full of modified "
                   "lines that the timed call writes back: the flush before session 25).")
@click.option("--no-graph", is_flag=True,
              help="GPU time from eager CUDA events instead of CUDA-graph replay.")
@click.option("--graph-layers", "graph_layers", default=1, show_default=True,
              type=click.IntRange(min=1, max=MAX_GRAPH_LAYERS),
              help="decode suite: GPU time of N calls captured in one CUDA graph, each over "
                   "its own copy of the case's K/V pools at other pages, read through its "
                   "own table (as an engine's step runs one call per layer), reported per "
                   "call (graph time / N); the L2 flush still comes before each replay. N "
                   "is capped per case so that the copies take at most half the free device "
                   "memory, and halved where the copies or an arm's per-layer buffers run "
                   "out of it (the report gives each case's and arm's N). 1: one call per "
                   f"replay; at most {MAX_GRAPH_LAYERS}.")
@click.option("--plot", "plot_path", type=OutPath(), default=None,
              help="Also write a PNG (GPU time against context, or per-call time on CPU "
                   "backends; one line per arm; needs matplotlib).")
@click.option("--write-crossover", "crossover_path", type=OutPath(),
              default=None, help="Write the measured crossover table (best of gather/v1/v2 "
                                 "per cell) that path='auto' reads; see "
                                 "paged_decode.crossover for where it is looked up.")
@click.option("--window-left", "window_left", default=-1, show_default=True,
              type=click.IntRange(min=-1),
              help="Decode variant: attend to the last W + 1 tokens of each request (our "
                   "arms and FlashInfer's window_left; -1: the whole context).")
@click.option("--soft-cap", "soft_cap", default=0.0, show_default=True,
              type=click.FloatRange(min=0.0),
              help="Decode variant: logits soft cap c (scores become c tanh(s / c); our "
                   "arms and FlashInfer's logits_soft_cap; 0: off).")
@click.option("--sinks", is_flag=True,
              help="Decode variant: one attention-sink logit per query head (our arms; "
                   "FlashInfer's decode wrapper and sdpa report unavailable).")
@click.option("--kv-dtype", "kv_dtype", default=None,
              type=click.Choice(["float8_e4m3fn", "float8_e5m2"]),
              help="decode, forks and engine suites: fp8 K/V pools (queries and outputs "
                   "keep --dtype; our arms and FlashInfer's fp8 decode; the engine suite "
                   "calibrates per-layer scales on its prompts; docs/fp8.md).")
@click.option("--json", "json_path", type=OutPath(), default=None)
@click.option("--csv", "csv_path", type=OutPath(), default=None)
@click.option("--markdown", "md_path", type=OutPath(), default=None)
@click.option("--layers", default=32, show_default=True, type=POSITIVE,
              help="engine suite: layers per step.")
@click.option("--steps", default=32, show_default=True, type=click.IntRange(min=2),
              help="engine suite: decode steps per case (the first is a warm-up).")
@click.option("--spec-tokens", "spec_tokens", default=4, show_default=True,
              type=click.IntRange(2, 8),
              help="engine suite: tokens per sequence per step of the speculative arms "
                   "(the token and its drafts; a random 0 to T-1 of them are rejected).")
@click.option("--model", default=None,
              help="engine suite: the attention heads of a models-preset layout (e.g. "
                   "qwen2-7b, llama3-70b-tp8; default llama3-8b on a GPU). Arms eager-tc "
                   "and captured-tc (the tensor-core partial) are named with --arms. "
                   "decode suite: only the preset's cases of that layout (models, "
                   "crossover). cascade, cascade-rule and forks suites: their cases with "
                   "that layout's heads.")
@_package_errors
def bench(backend: str | None, suite: str, preset: str | None, contexts: tuple[int, ...],
          batches: tuple[int, ...], pages: tuple[int, ...], dtype: str | None, arms: str,
          reps: int, warmup: int, warm_l2: bool, l2_flush: str, no_graph: bool,
          plot_path: str | None,
          crossover_path: str | None, window_left: int, soft_cap: float, sinks: bool,
          kv_dtype: str | None, json_path: str | None, csv_path: str | None,
          md_path: str | None, layers: int, steps: int, spec_tokens: int,
          model: str | None, graph_layers: int) -> None:
    """Time decode arms over a context x batch x page sweep (each arm verified against the
    float64 oracle first): GPU time under CUDA-graph replay and per-call time."""
    from .bench import preset_cases, run_bench
    from .bench.report import markdown, table, to_csv, to_json
    from .bench.runner import ARMS, header
    from .bench.timing import measure_read_bandwidth
    low, high = SOFT_CAP_RANGE
    if soft_cap and not low <= soft_cap <= high:     # nan fails both comparisons
        raise click.ClickException(f"bench: --soft-cap must be 0 (off) or a number in "
                                   f"[{low:g}, {high:g}], got {soft_cap!r}")
    be = _backend(backend)
    # --l2-flush given on the command line (its default is a value too)
    flush_given = (click.get_current_context().get_parameter_source("l2_flush")
                   != click.core.ParameterSource.DEFAULT)
    if graph_layers > 1:
        _check_graph_layers(graph_layers, suite, preset, no_graph, be.name)
    if suite == "engine":
        ignored = [name for name, given in (
            ("--preset", preset is not None), ("--window-left", window_left >= 0),
            ("--soft-cap", bool(soft_cap)), ("--sinks", sinks), ("--warm-l2", warm_l2),
            ("--l2-flush", flush_given), ("--no-graph", no_graph),
            ("--write-crossover", crossover_path is not None),
            ("--csv", csv_path is not None), ("--markdown", md_path is not None),
            ("--reps", reps != 30), ("--warmup", warmup != 5)) if given]
        if ignored:
            raise click.ClickException(f"bench --suite engine: {', '.join(ignored)} "
                                       "apply to the decode suite (the engine suite times "
                                       "--steps steps of --layers layers)")
        _bench_engine(be, contexts, batches, pages, dtype, arms, layers, steps, model, json_path,
                      plot_path, kv_dtype=kv_dtype or "", spec_tokens=spec_tokens)
        return
    if click.get_current_context().get_parameter_source("spec_tokens") \
            != click.core.ParameterSource.DEFAULT:
        raise click.ClickException(f"bench: --spec-tokens applies to the engine suite's "
                                   f"speculative arms, not the {suite} suite")
    if preset in ("cascade", "cascade-rule", "sparse"):   # the suites are presets too
        if suite not in ("decode", preset):
            raise click.ClickException(f"bench: --preset {preset} runs the {preset} suite; "
                                       f"it cannot be combined with --suite {suite}")
        suite, preset = preset, None
    name = preset if preset is not None else ("adr" if be.name in ("cuda", "metal") else "cpu")
    try:
        cases = preset_cases(name, contexts=list(contexts), batches=list(batches),
                             pages=list(pages), dtype=dtype)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if model is not None and suite != "decode":
        from .bench.cases import MODELS
        from .bench.suites import MODEL_SUITES
        if suite not in MODEL_SUITES:
            raise click.ClickException(f"bench: --model selects the engine suite's heads, "
                                       f"the decode suite's cases or the heads of the "
                                       f"{', '.join(MODEL_SUITES)} suites, not --suite {suite}")
        if model not in MODELS:
            raise click.ClickException(f"bench: --model must name a models-preset layout "
                                       f"({', '.join(MODELS)}), got {model!r}")
    elif model is not None:
        kept = [c for c in cases if c.model == model]
        if not kept:
            have = ", ".join(dict.fromkeys(c.model for c in cases))
            raise click.ClickException(f"bench: --model must name a layout of preset {name} "
                                       f"({have}), got {model!r}")
        cases = kept
    if window_left >= 0 or soft_cap or sinks:
        if suite != "decode":
            raise click.ClickException("bench: --window-left, --soft-cap and --sinks apply "
                                       f"to the decode suite, not --suite {suite}")
        cases = [dataclasses.replace(c, window_left=window_left, soft_cap=soft_cap,
                                     sinks=sinks) for c in cases]
    if kv_dtype:
        from .bench.suites import FP8_SUITES
        if suite not in ("decode", *FP8_SUITES):
            raise click.ClickException(f"bench: --kv-dtype applies to the decode and "
                                       f"{', '.join(FP8_SUITES)} suites, not --suite {suite}")
        cases = [dataclasses.replace(c, kv_dtype=kv_dtype) for c in cases]
    arm_list = tuple(dict.fromkeys(a.strip() for a in arms.split(",") if a.strip()))
    bad = [a for a in arm_list if a not in ARMS]
    if bad or not arm_list:
        raise click.ClickException(f"bench: --arms must name some of {', '.join(ARMS)}, "
                                   f"got {', '.join(bad) or repr(arms)}")
    if warm_l2 and flush_given:
        raise click.ClickException(f"bench: --warm-l2 flushes nothing, so --l2-flush "
                                   f"{l2_flush} has no effect; give one of them")
    cold_l2: bool | str = False if warm_l2 else l2_flush
    bw = measure_read_bandwidth() if be.name == "cuda" else None
    head = header(be, bandwidth=bw,
                  l2=("warm" if warm_l2 else l2_flush) if be.name == "cuda" else None)
    click.echo(" ".join(f"{k}={v}" for k, v in head.items()))
    if suite != "decode":
        from .bench.suites import SUITES, run_suite
        if be.name != "cuda":
            raise click.ClickException(f"bench: the {suite} suite is a GPU sweep (up to 64K "
                                       "contexts); run it with --backend cuda")
        n = len(SUITES[suite]())
        with click.progressbar(length=n, label=f"{n} cases", file=sys.stderr) as bar:
            results = run_suite(suite, be, warmup=warmup, reps=reps, cold_l2=cold_l2,
                                graph=not no_graph, progress=lambda r: bar.update(1),
                                kv_dtype=kv_dtype or "", model=model or "")
    else:
        with click.progressbar(length=len(cases), label=f"{len(cases)} cases",
                               file=sys.stderr) as bar:
            results = run_bench(cases, backend=be, arms=arm_list, warmup=warmup, reps=reps,
                                cold_l2=cold_l2, graph=not no_graph,
                                progress=lambda r: bar.update(1), graph_layers=graph_layers)
    click.echo(table(results, bandwidth=bw))
    ran = [a for r in results for a in r.arms.values() if a.ran != "unavailable"]
    if not ran:
        notes = sorted({f"{a.arm}: {a.note}" for r in results for a in r.arms.values()})
        raise click.ClickException("bench: no arm could run here (" + "; ".join(notes)[:300]
                                   + ")")
    # the files first: a failing plot must not lose them
    if json_path:
        _write("--json", json_path, to_json(results, head))
    if crossover_path:
        from .crossover import from_results
        xt = from_results(results, str(head.get("device", be.name)))
        _write("--write-crossover", crossover_path, json_text.dumps(xt, indent=1))
        click.echo(f"crossover table: {len(xt['cells'])} cells -> {crossover_path}")
    if csv_path:
        _write("--csv", csv_path, to_csv(results))
    if md_path:
        _write("--markdown", md_path, markdown(results, head, " ".join(sys.argv)))
    if plot_path:
        from .bench.plot import plot_results
        data = json.loads(to_json(results, head))
        _plot(lambda: plot_results(data, plot_path), plot_path, "bench: --plot")
    if not all(a.verified for r in results for a in r.arms.values() if a.ran != "unavailable"):
        raise click.ClickException("some arm failed verification against the oracle ('!')")
    if any(a.fell_back for r in results for a in r.arms.values() if a.ran != "unavailable"):
        raise click.ClickException("some arm fell back to another path ('*'); its comparisons "
                                   "were withheld")


def _check_graph_layers(n: int, suite: str, preset: str | None, no_graph: bool,
                        backend: str) -> None:
    """Refuse ``bench --graph-layers n`` (n > 1) where it cannot measure what it says."""
    from .bench.suites import SUITES
    runs = preset if preset in SUITES else suite       # --preset cascade runs that suite
    if runs != "decode":
        raise click.ClickException(f"bench: --graph-layers {n} applies to the decode suite, "
                                   f"not the {runs} suite")
    if no_graph:
        raise click.ClickException(f"bench: --graph-layers {n} times {n} calls in one "
                                   "CUDA-graph replay, without the launch gaps that --no-graph "
                                   "(eager calls between events) includes; give one of them")
    if backend != "cuda":
        raise click.ClickException(f"bench: --graph-layers {n} times CUDA-graph replays, "
                                   f"which only --backend cuda has; got backend {backend}")


def _bench_engine(be: Any, contexts: tuple[int, ...], batches: tuple[int, ...],
                  pages: tuple[int, ...], dtype: str | None, arms: str, layers: int,
                  steps: int, model: str | None, json_path: str | None,
                  plot_path: str | None, *, kv_dtype: str = "", spec_tokens: int = 4) -> None:
    """``bench --suite engine`` (``paged_decode.bench.engine``); ``kv_dtype``: fp8 pools
    (``""``: pools of the queries' dtype); ``spec_tokens``: the speculative arms' tokens
    per sequence per step."""
    from .bench.cases import MODELS
    from .bench.engine import (
        ALL_ENGINE_ARMS,
        ENGINE_ARMS,
        EngineCase,
        plot,
        report,
        run_engine,
        to_dict,
    )
    from .bench.runner import header
    arm_list = ENGINE_ARMS if arms == "gather,v1,v2" else tuple(
        a.strip() for a in arms.split(",") if a.strip())
    bad = [a for a in arm_list if a not in ALL_ENGINE_ARMS]
    if bad or not arm_list:
        raise click.ClickException(f"bench --suite engine: --arms must name some of "
                                   f"{', '.join(ALL_ENGINE_ARMS)}, got {arms!r}")
    if model is not None and model not in MODELS:
        raise click.ClickException(f"bench --suite engine: --model must be one of "
                                   f"{', '.join(MODELS)}, got {model!r}")
    gpu = be.name == "cuda"
    heads: dict[str, Any] = {} if gpu else {"num_qo_heads": 8, "num_kv_heads": 2,
                                            "head_dim": 64}
    if model is not None:
        hq, hkv, d = MODELS[model]
        heads = {"num_qo_heads": hq, "num_kv_heads": hkv, "head_dim": d, "model": model}
    cases = [EngineCase(b, c, layers, steps, page_size=p, dtype=dtype or (
                 "float16" if gpu else "float32"), kv_dtype=kv_dtype,
                        spec_tokens=spec_tokens, **heads)
             for b in (batches or ((8, 64, 128) if gpu else (4,)))
             for c in (contexts or ((1024,) if gpu else (64,)))
             for p in (pages or (16,))]
    head = header(be, bandwidth=None)
    click.echo(" ".join(f"{k}={v}" for k, v in head.items()))
    results = run_engine(be, cases, arms=arm_list,
                         progress=lambda s: click.echo(f"  {s}", err=True))
    click.echo(report(results))
    if not any(r.ran for _, a in results for r in a.values()):
        raise click.ClickException("bench --suite engine: no arm could run here (see the "
                                   "table's notes); nothing was written")
    if json_path:
        _write("--json", json_path, json_text.dumps({"head": head, "suite": "engine",
                                                     "results": to_dict(results)}, indent=1))
    if plot_path:
        _plot(lambda: Path(plot(results, plot_path)), plot_path, "bench --suite engine")
    bad_arms = [f"{c.label} {n}" for c, a in results for n, r in a.items()
                if r.ran and not r.verified]
    if bad_arms:
        raise click.ClickException("engine arms failed verification against the oracle: "
                                   + ", ".join(bad_arms))


@main.command()
@click.argument("json_path", type=click.Path(exists=True, dir_okay=False))
@click.argument("png_path", type=OutPath())
@click.option("--metric", default="auto", show_default=True,
              type=click.Choice(["auto", "gpu", "call", "gbps"]),
              help="auto: GPU time when the run has it, else per-call time (CPU runs).")
@_package_errors
def plot(json_path: str, png_path: str, metric: str) -> None:
    """Plot a `bench --json` result file as a PNG (needs matplotlib)."""
    from .bench.plot import plot_file
    _plot(lambda: plot_file(json_path, png_path, metric=metric), png_path,
          f"plot: {json_path}")


def _plot(draw: Any, png_path: str, what: str) -> Path:
    """Run ``draw`` (``bench.plot``), turning each of its failures into one line."""
    try:
        out: Path = draw()
    except ImportError as exc:
        raise click.ClickException(f"{what}: needs matplotlib ({exc}); pip install "
                                   "'paged-decode[plot]'") from exc
    except ValueError as exc:
        raise click.ClickException(f"{what}: {exc}") from exc
    except OSError as exc:
        raise click.ClickException(f"{what}: cannot write {png_path}: "
                                   f"{exc.strerror or exc}") from exc
    click.echo(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
