"""Random bad inputs against every public function and CLI command (issue 18, "done means").

For each target (everything in ``paged_decode.__all__`` that takes arguments, the
methods of ``PagePool``, ``PageTable`` and ``DecodePlan``, and ``paged-decode
info|check|bench|plot``), ``N`` seeded random calls each replace one or two arguments of
a valid call by a value that is wrong for it (bools for ints, strings for floats,
``None``, zero or negative sizes, wrong shapes, dtypes and ndim, read-only or
non-contiguous outputs, out-of-range ids, objects of the wrong type, plans and tables of
another call). Every call must raise this package's own error whose message starts with
the function's name: a raw Python or numpy exception, or a call that returns, fails the
test. A CLI command must exit non-zero with a one-line ``Error:`` message and no
traceback. Result types built by the functions (``DecodePlan``, ``Selection``, ...) are
reached through those functions, not constructed here.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import paged_decode as pd
from paged_decode.cli import main
from paged_decode.errors import PagedDecodeError
from paged_decode.problems import ProblemSpec, make_problem

N = 200   # random bad inputs per target


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def short(v: Any) -> str:
    if isinstance(v, np.ndarray):
        flags = "" if v.flags.writeable else " read-only"
        flags += "" if v.flags.c_contiguous else " strided"
        return f"array{list(v.shape)} {v.dtype}{flags}"
    return repr(v)[:60]


def read_only(a: np.ndarray) -> np.ndarray:
    b = a.copy()
    b.setflags(write=False)
    return b


def strided(a: np.ndarray) -> np.ndarray:
    """The same shape and values, not C-contiguous."""
    return np.asfortranarray(a) if a.ndim > 1 and a.size > 1 else a[::1]


# ---------------------------------------------------------------------------- value pools
POSITIVE = [0, -1, -7, True, False, 1.5, 2.0, "4", [4], np.float32(4), 1j, b"4",
            np.array(4), np.bool_(True)]
NON_NEGATIVE = [-1, -5, True, 1.5, "0", [0], np.float64(0), 2j]
FLAGS = ["yes", "True", 1, 0, 1.0, None, [True], np.int64(1)]
SCALES = ["0.1", True, False, float("nan"), float("inf"), -float("inf"), [1.0], 1j,
          np.array([0.5]), b"1", np.float32("nan")]
DTYPES = ["float64", "int8", "int32", 5, "", 0, False, np.float64, "half-precision", [1],
          "bool", np.dtype("complex64")]
BACKENDS = ["nope", "", 3, ["reference"], True, 1.5, object(), "Reference"]
NOT_ARRAYS = [None, "abc", {"a": 1}, object(), 3, [[1.0], [2.0, 3.0]], b"\x00"]


def wrong_arrays(a: np.ndarray, *, zero_axes: tuple[int, ...] = (), layout: bool = True,
                 last_axis: bool = True) -> list[Any]:
    """Arrays wrong for an argument shaped like ``a``: ndim, each axis (the last one only
    with ``last_axis``), dtype, and (with ``layout``, for arguments kernels read through
    raw pointers) a strided layout."""
    with np.errstate(invalid="ignore"):   # pools hold NaN where no request reads
        cast = [a.astype(t) for t in (np.float64, np.int32, bool, np.complex64, object)]
    out: list[Any] = [a[0], a[None], *cast, *([strided(a)] if layout else []), *NOT_ARRAYS]
    for ax in range(a.ndim - (not last_axis)):
        bigger = list(a.shape)
        bigger[ax] += 1
        out.append(np.zeros(bigger, a.dtype))
    for ax in zero_axes:
        empty = list(a.shape)
        empty[ax] = 0
        out.append(np.zeros(empty, a.dtype))
    return out


def wrong_outputs(a: np.ndarray) -> list[Any]:
    other = np.float16 if a.dtype != np.float16 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):   # uninitialised buffers
        cast = [a.astype(other), a.astype(np.float64)]
    return [read_only(a), strided(a), *cast, a[:-1], a[None],
            np.zeros((*a.shape[:-1], a.shape[-1] + 1), a.dtype), "out", [1.0], 3]


# ---------------------------------------------------------------------------- valid calls
SPEC = ProblemSpec(2, 40, 8, 2, 64, 16, "float16", "float16", seed=3)
PR = make_problem(SPEC)
OTHER = make_problem(ProblemSpec(3, 40, 8, 2, 64, 16, "float16", "float16", seed=4))
PLAN = pd.plan_decode(PR.table, 8, 2, 64)
EMPTY_TABLE = pd.PageTable.build([], [0], [], page_size=16)


def shared_problem():
    """Two forks of one 3-page prefix (a cascade with ``min_shared_pages <= 2``)."""
    pool = pd.PagePool(32, 16, 2, 64, "float16")
    s = pool.new_sequence()
    kv = np.ones((40, 2, 64), np.float16)
    pool.append(s, kv, kv)
    forks = [pool.fork(s), pool.fork(s)]
    for f in forks:
        pool.append(f, kv[:5], kv[:5])
    return pool, pool.page_table(forks)


SHARED_POOL, SHARED = shared_problem()
CPLAN = pd.detect_shared_prefix(SHARED, min_shared_pages=1)
OTHER_CPLAN = pd.detect_shared_prefix(
    pd.PageTable.build([5, 6, 5, 7], [0, 2, 4], [3, 3], page_size=16), min_shared_pages=1)
Q = PR.q
OUT = np.empty(Q.shape, np.float16)
LSE = np.empty(Q.shape[:2], np.float32)
TABLES = ["table", None, 3, PLAN, {"indices": [0]}, OTHER.table, PR.table.indices]


def decode_bad() -> dict[str, list[Any]]:
    return {
        "q": wrong_arrays(Q, zero_axes=(1, 2)) + [Q[:, :7]],       # 7 heads over 2 KV heads
        "k_pages": wrong_arrays(PR.k_pages, zero_axes=(1, 2, 3))
        + [PR.k_pages[:3], PR.k_pages.astype(np.float32)],           # too few pages; != v
        "v_pages": wrong_arrays(PR.v_pages) + [PR.v_pages.astype(np.float32)],
        "table": TABLES,
        "plan": ["plan", 3, PR.table, pd.plan_decode(OTHER.table, 8, 2, 64),
                 pd.plan_decode(PR.table, 16, 2, 64)],
        "path": ["v3", "", 2, None, ["v2"], "V2", "auto "],
        "sm_scale": SCALES,
        "out": wrong_outputs(OUT),
        "lse": wrong_outputs(LSE),
        "return_lse": FLAGS[:5] + FLAGS[6:],
        "out_dtype": DTYPES,
        "backend": BACKENDS,
        "cascade": ["yes", 1, 0, [], OTHER_CPLAN, 2.0],
    }


def decode_base() -> dict[str, Any]:
    return dict(q=Q, k_pages=PR.k_pages, v_pages=PR.v_pages, table=PR.table)


# ---------------------------------------------------------------------------- targets
Target = tuple[str, Callable[[], dict[str, Any]], Callable[[], dict[str, list[Any]]],
               Callable[..., Any]]


def pool() -> pd.PagePool:
    p = pd.PagePool(8, 4, 2, 64, "float32")
    s = p.new_sequence()
    kv = np.ones((6, 2, 64), np.float32)
    p.append(s, kv, kv)
    return p


SEQ_IDS = [99, -1, True, 1.5, "0", None, [0], np.float64(0)]
KV = np.ones((3, 2, 64), np.float32)


def method(name: str) -> Callable[..., Any]:
    return lambda **kw: getattr(pool(), name)(**kw)


V3 = np.zeros((4, 3, 64), np.float32)
L2 = np.zeros((4, 3), np.float32)
SEL = pd.make_selection(np.array([[[0, 1], [2, 3]], [[1, 5], [0, 4]]]))
CACHE = np.zeros((2, 2, 8, 64), np.float16)
QS = np.ones((2, 8, 64), np.float16)
BLOCKS = np.array([[[0], [1]], [[0], [1]]])
INDPTRS = [[1, 4], [0, 3], [0, 3, 2, 4], [0.0, 4.0], [[0, 4]], [], "0,4", None, [0, 2, 4.5],
           [True, False], [[0], [1, 2]], np.zeros(0, np.int64)]
GEO_BAD = {"num_qo_heads": POSITIVE + [7], "num_kv_heads": POSITIVE + [3],
           "head_dim": POSITIVE}
DEVICES = ["cuda", 3, {"compute_units": 8}, PR.table]

TARGETS: list[Target] = [
    ("decode", decode_base, decode_bad, pd.decode),
    ("prepare_decode", decode_base, decode_bad, pd.prepare_decode),
    ("cascade_decode", lambda: dict(q=SHARED_POOL and np.ones((2, 8, 64), np.float16),
                                    k_pages=SHARED_POOL.k, v_pages=SHARED_POOL.v,
                                    table=SHARED),
     lambda: {**{k: v for k, v in decode_bad().items()
                 if k in ("q", "sm_scale", "out", "lse", "return_lse", "out_dtype",
                          "backend", "table")},
              "cascade_plan": ["x", True, 1, OTHER_CPLAN, PLAN]},
     pd.cascade_decode),
    ("plan_decode", lambda: dict(table=PR.table, num_qo_heads=8, num_kv_heads=2, head_dim=64),
     lambda: {"table": TABLES[:5] + [EMPTY_TABLE], **GEO_BAD, "device": DEVICES,
              "backend": BACKENDS, "target_ctas": POSITIVE, "pages_per_chunk": POSITIVE,
              "min_chunk_tokens": POSITIVE, "ctas_per_chunk": POSITIVE,
              "max_chunks": POSITIVE + [None, 10**6]},
     pd.plan_decode),
    ("PagePool", lambda: dict(num_pages=8, page_size=4, num_kv_heads=2, head_dim=64),
     lambda: {"num_pages": POSITIVE, "page_size": POSITIVE, "num_kv_heads": POSITIVE,
              "head_dim": POSITIVE, "num_layers": POSITIVE, "backend": BACKENDS,
              "dtype": DTYPES + [None]},
     pd.PagePool),
    ("PagePool.refcount", lambda: dict(page=0),
     lambda: {"page": [-1, 8, 10**6, True, 1.0, "0", None, [0], np.float32(1)]},
     method("refcount")),
    ("PagePool.seq_pages", lambda: dict(seq=0), lambda: {"seq": SEQ_IDS}, method("seq_pages")),
    ("PagePool.seq_len", lambda: dict(seq=0), lambda: {"seq": SEQ_IDS}, method("seq_len")),
    ("PagePool.fork", lambda: dict(seq=0), lambda: {"seq": SEQ_IDS}, method("fork")),
    ("PagePool.free", lambda: dict(seq=0), lambda: {"seq": SEQ_IDS}, method("free")),
    ("PagePool.layer", lambda: dict(i=0),
     lambda: {"i": [1, -1, True, 0.0, "0", None, [0]]}, method("layer")),
    ("PagePool.trim_front", lambda: dict(seq=0, n=1),
     lambda: {"seq": SEQ_IDS, "n": [-1, 7, 10**6, True, 1.5, "1", None, [1]]},
     method("trim_front")),
    ("PagePool.append", lambda: dict(seq=0, k=KV, v=KV),
     lambda: {"seq": SEQ_IDS, "k": wrong_arrays(KV, layout=False),
              "v": [KV[:2], KV.astype(np.int64), KV[:, :1], "v", None, KV.astype(np.float64)]},
     method("append")),
    ("PagePool.page_table", lambda: dict(seqs=[0]),
     lambda: {"seqs": [5, "ab", [99], [True], [0, 1.5], None, [None], 2.0, b"\x00"]},
     method("page_table")),
    ("PageTable.build",
     lambda: dict(indices=[3, 1, 2], indptr=[0, 2, 3], last_page_len=[4, 2], page_size=4,
                  first_page_offset=[1, 0], num_pages=8),
     lambda: {"indices": [[3, 1], [3, -1, 2], [3, 1, 9], [3.0, 1.0, 2.0], [[3, 1, 2]], None,
                          "312", [3, 1, 2**40], [[3], [1, 2]]],
              "indptr": [[1, 2, 3], [0, 3, 2], [0, 2, 4], [0.0, 2.0, 3.0], [], None,
                         [[0, 2, 3]]],
              "last_page_len": [[0, 2], [5, 2], [4, -1], [4], [4.0, 2.0], None],
              "page_size": POSITIVE + [None],
              "first_page_offset": [[4, 0], [-1, 0], [1, 3], [1], [0.5, 0]],
              "rope_positions": [[0, 0], [6], [6.0, 2.0], "6,2"],
              "num_pages": [True, -1, 1.5, "8", 2]},
     pd.PageTable.build),
    ("PageTable.request_pages", lambda: dict(r=0),
     lambda: {"r": [2, -1, True, 1.5, "0", None, [0]]},
     lambda **kw: PR.table.request_pages(**kw)),
    ("PageTable.subset", lambda: dict(requests=[0]),
     lambda: {"requests": [[2], [-1], [True], [0.5], "0", None, 3, [[0]]]},
     lambda **kw: PR.table.subset(**kw)),
    ("PageTable.validate", lambda: dict(num_pages=None),
     lambda: {"num_pages": [True, -1, 1.5, "8", 1]},
     lambda **kw: PR.table.validate(**kw)),
    ("DecodePlan.mismatch", lambda: dict(table=PR.table),
     lambda: {"table": TABLES[:5]}, lambda **kw: PLAN.mismatch(**kw)),
    ("merge_states", lambda: dict(v=V3, lse=L2, indptr=[0, 1, 4]),
     lambda: {"v": wrong_arrays(V3, zero_axes=(1, 2), last_axis=False)   # any D merges
              + [V3.astype(np.float16)],
              "lse": wrong_arrays(L2)[:-2] + [L2.astype(np.float16), L2[:, :2]],
              "indptr": INDPTRS, "out_dtype": DTYPES, "backend": BACKENDS},
     pd.merge_states),
    ("merge_state", lambda: dict(v_a=V3, lse_a=L2, v_b=V3, lse_b=L2),
     lambda: {"v_a": wrong_arrays(V3, zero_axes=(1, 2), layout=False, last_axis=False)
              + [V3.astype(np.float16), V3[..., :5]],
              "lse_a": [L2[:, :2], L2.astype(np.float64), L2.astype(np.bfloat16)
                        if hasattr(np, "bfloat16") else L2.astype(np.float16), "x", None],
              "v_b": [V3[:3], V3.astype(np.float16), V3[0], None, "x"],
              "lse_b": [L2[:3], L2.astype(np.int32), None],
              "out_dtype": DTYPES, "backend": BACKENDS},
     pd.merge_state),
    ("detect_shared_prefix", lambda: dict(table=SHARED),
     lambda: {"table": TABLES[:5], "min_shared_pages": POSITIVE,
              "min_members": [1, 0, -2, True, 2.5, "2", [2], None]},
     pd.detect_shared_prefix),
    ("plan_cascade",
     lambda: dict(table=SHARED, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                  min_shared_pages=1),
     lambda: {"table": TABLES[:5], **GEO_BAD, "prefix": ["p", OTHER_CPLAN, PLAN, 3],
              "device": DEVICES, "backend": BACKENDS, "min_shared_pages": POSITIVE,
              "min_members": [1, 0, True, 2.5, "2"], "level0": ["x", None, 1, "TC", "tc"]},
     pd.plan_cascade),
    ("sparse_decode", lambda: dict(q=QS, k_cache=CACHE, v_cache=CACHE, selection=SEL,
                                   live_lens=[8, 8]),
     lambda: {"q": wrong_arrays(QS, zero_axes=(1, 2)) + [QS[:, :3]],
              "k_cache": wrong_arrays(CACHE, zero_axes=(1, 3))
              + [CACHE.astype(np.float32)],
              "v_cache": [CACHE.astype(np.float32), CACHE[:, :, :4], CACHE[0], "v", None],
              "selection": [pd.make_selection(np.zeros((2, 1, 1), np.int64)),
                            pd.make_selection(np.full((2, 2, 1), 8)),
                            pd.make_selection(np.full((2, 2, 1), -1)),
                            pd.make_selection(np.zeros((2, 2, 2), np.int64)),
                            np.zeros((2, 2, 1)), np.zeros((2, 2)), "sel", None, 3],
              "live_lens": [[8], [9, 8], [-1, 8], [8.0, 8.0], None, "88", 8, [[8, 8]]],
              "min_sparsity": [-1, float("nan"), float("inf"), "2", True, None, [2.0]],
              "sm_scale": SCALES, "return_lse": FLAGS, "check_duplicates": FLAGS,
              "return_outcome": FLAGS, "out_dtype": DTYPES, "backend": BACKENDS},
     pd.sparse_decode),
    ("make_selection", lambda: dict(positions=np.zeros((2, 2, 3), np.int64), counts=None),
     lambda: {"positions": [np.zeros((2, 3)), np.zeros((1, 2, 2, 3)),
                            np.zeros((2, 2, 3)), np.zeros((2, 2, 3), bool), "x", None,
                            [[[0], [1, 2]]], np.full((1, 1, 1), 2**40)],
              "counts": [np.full((2, 2), 4), np.full((2, 2), -1), np.zeros((2, 3), int),
                         np.zeros((2, 2)), "x", [[1, 1]]]},
     pd.make_selection),
    ("selection_from_blocks",
     lambda: dict(block_ids=BLOCKS, block_size=4, live_lens=[8, 8]),
     lambda: {"block_ids": [np.full((2, 2, 1), 2), np.full((2, 2, 1), -1),
                            BLOCKS.astype(float), BLOCKS[0], "x", None],
              "block_size": POSITIVE + [None], "live_lens": [[8], [-1, 8], [8.5, 8], None],
              "block_counts": [np.full((2, 2), 2), np.full((2, 2), -1), np.zeros((2, 3), int),
                               np.zeros((2, 2)), "x"],
              "include_tail": FLAGS},
     pd.selection_from_blocks),
    ("get_backend", lambda: dict(name="reference"),
     lambda: {"name": BACKENDS}, pd.get_backend),
    ("DeviceInfo", lambda: dict(backend="x", name="dev", compute_units=8, ctas_per_unit=2),
     lambda: {"backend": [None, 3, b"x"], "name": [None, 3], "compute_units": POSITIVE,
              "ctas_per_unit": POSITIVE, "index": NON_NEGATIVE, "detail": [None, 3],
              "min_chunk_tokens": POSITIVE, "prefix_tile_rows": NON_NEGATIVE,
              "shared_mem_per_unit": NON_NEGATIVE},
     pd.DeviceInfo),
    ("DeviceInfo.target_ctas", lambda: dict(override=None),
     lambda: {"override": POSITIVE},
     lambda **kw: pd.DeviceInfo("x", "dev", 8, 2).target_ctas(**kw)),
    ("DeviceInfo.chunk_floor", lambda: dict(override=None),
     lambda: {"override": POSITIVE},
     lambda **kw: pd.DeviceInfo("x", "dev", 8, 2).chunk_floor(**kw)),
]

def bad_calls(target: Target, n: int = N) -> list[tuple[str, Callable[[], Any]]]:
    """``n`` seeded calls of ``target`` with one or two bad arguments."""
    name, base, bad, fn = target
    rng = rng_for(name)
    pools = bad()
    names = sorted(pools)
    calls = []
    for _ in range(n):
        kw = base()
        picked = rng.choice(len(names), size=min(len(names), 1 + int(rng.random() < 0.3)),
                            replace=False)
        desc = []
        for i in picked:
            arg = names[int(i)]
            value = pools[arg][int(rng.integers(len(pools[arg])))]
            kw[arg] = value
            desc.append(f"{arg}={short(value)}")
        calls.append((", ".join(desc), lambda kw=kw: fn(**kw)))
    return calls


@pytest.mark.parametrize("target", TARGETS, ids=[t[0] for t in TARGETS])
def test_bad_inputs_raise_this_packages_errors(target):
    name = target[0]
    prefix = name + ":"
    # the valid call itself must work, or every bad call below would prove nothing
    target[3](**target[1]())
    problems = []
    for desc, call in bad_calls(target):
        try:
            res = call()
        except PagedDecodeError as exc:
            if not str(exc).startswith(prefix):
                problems.append(f"{name}({desc}): message does not start with {prefix!r}: "
                                f"{exc}")
            continue
        except Exception as exc:   # noqa: BLE001 - exactly what this test looks for
            problems.append(f"{name}({desc}): raw {type(exc).__name__}: {exc}")
            continue
        problems.append(f"{name}({desc}): accepted, returned {short(res)}")
    assert not problems, f"{len(problems)} of {N}:\n" + "\n".join(sorted(set(problems))[:25])


# ---------------------------------------------------------------------------- command line
def cli_cases(tmp: Any) -> dict[str, list[list[str]]]:
    """Bad argument lists per command (each alone makes the command fail)."""
    (tmp / "dir").mkdir(exist_ok=True)
    csv = tmp / "r.csv"
    csv.write_text("a,b\n1,2\n")
    files = {}
    for stem, text in (("list", "[]"), ("obj", "{}"), ("junk", "\x00\xff"),
                       ("badcase", '{"results": [{"case": {"batch": "x"}, "arms": {}}]}'),
                       ("badarm", '{"results": [{"case": {"batch": 1, "context": 64, '
                                  '"page_size": 16, "num_qo_heads": 8, "num_kv_heads": 2, '
                                  '"head_dim": 64, "dtype": "float16"}, "arms": {"v2": '
                                  '{"verified": true, "call": 5}}}]}'),
                       ("cpu", '{"results": [{"case": {"batch": 1, "context": 64, '
                               '"page_size": 16, "num_qo_heads": 8, "num_kv_heads": 2, '
                               '"head_dim": 64, "dtype": "float16"}, "arms": {"v2": '
                               '{"verified": true, "ran": "v2", "call": {"median_us": 5}}}}]}')):
        f = tmp / f"{stem}.json"
        f.write_bytes(text.encode("latin-1"))
        files[stem] = str(f)
    missing = str(tmp / "no" / "x.json")
    common = [["--backend", "nope"], ["--backend", ""], ["--no-such-option"], ["extra-arg"]]
    return {
        "info": common + [["--json", "x"], ["--backend", "cuda"]],
        "check": common + [["--dtype", "float64"], ["--max-configs", "0"],
                           ["--max-configs", "-1"], ["--max-configs", "x"], ["--path", "v3"],
                           ["--shard", "3/2"], ["--shard", "1/0"], ["--shard", "a/b"],
                           ["--shard", "1"], ["--shard", "1/2/3"], ["--shard", "-1/2"],
                           ["--json", missing], ["--json", str(tmp / "dir")]],
        "bench": common + [["--page", "0"], ["--page", "-16"], ["--page", "x"],
                           ["--batch", "0"], ["--context", "-5"], ["--context", "1.5"],
                           ["--reps", "0"], ["--warmup", "-1"], ["--arms", "v3"],
                           ["--arms", ""], ["--arms", ","], ["--preset", "nope"],
                           ["--suite", "nope"], ["--suite", "cascade"],
                           ["--preset", "sparse", "--suite", "cascade"], ["--dtype", "float64"],
                           ["--json", missing], ["--plot", missing], ["--csv", str(tmp / "dir")],
                           ["--markdown", missing], ["--write-crossover", missing],
                           ["--arms", "flashinfer", "--batch", "1", "--context", "64"],
                           ["--page", "512", "--batch", "1", "--context", "64"]],
        "plot": [[str(tmp / "none.json"), "o.png"], [str(csv), str(tmp / "o.png")],
                 [files["list"], str(tmp / "o.png")], [files["obj"], str(tmp / "o.png")],
                 [files["junk"], str(tmp / "o.png")], [files["badcase"], str(tmp / "o.png")],
                 [files["badarm"], str(tmp / "o.png")],
                 [files["cpu"], str(tmp / "o.png"), "--metric", "gpu"],
                 [files["cpu"], str(tmp / "o.png"), "--metric", "ms"],
                 [files["cpu"], missing], [files["cpu"], str(tmp / "dir")], [files["cpu"]], []],
    }


#: valid options a bad one may come with (none of them makes a run long)
CLI_VALID = {"info": [["--backend", "reference"], ["--json"]],
             "check": [["--backend", "reference"], ["--dtype", "bfloat16"], ["--path", "v1"]],
             "bench": [["--backend", "reference"], ["--warm-l2"], ["--no-graph"],
                       ["--dtype", "float32"], ["--arms", "v2"]],
             "plot": [[]]}


@pytest.mark.parametrize("command", ["info", "check", "bench", "plot"])
def test_bad_command_lines_fail_cleanly(command, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")   # plot's bad inputs must fail for themselves
    monkeypatch.chdir(tmp_path)
    bad = cli_cases(tmp_path)[command]
    rng = rng_for("cli " + command)
    runner = CliRunner()
    problems = []
    for _ in range(N):
        args = list(bad[int(rng.integers(len(bad)))])
        extra = CLI_VALID[command][int(rng.integers(len(CLI_VALID[command])))]
        if extra and extra[0] not in args and rng.random() < 0.5:   # never overriding it
            args = extra + args if rng.random() < 0.5 else args + extra
        res = runner.invoke(main, [command, *args])
        lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
        clean = (res.exit_code != 0 and (res.exception is None
                                         or isinstance(res.exception, SystemExit))
                 and "Traceback" not in res.output and lines
                 and lines[-1].startswith("Error: "))
        if not clean:
            why = (f"{type(res.exception).__name__}: {res.exception}"
                   if res.exception is not None and not isinstance(res.exception, SystemExit)
                   else f"exit {res.exit_code}: {lines[-1:] if lines else 'no output'}")
            problems.append(f"{command} {' '.join(args)!r}: {why}")
    assert not problems, f"{len(problems)} of {N}:\n" + "\n".join(sorted(set(problems))[:25])
