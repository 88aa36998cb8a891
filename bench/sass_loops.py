"""The hottest loop of a CUDA kernel in SASS: how many instructions one trip issues per
warp and of which kinds, for our kernel strings (compiled here by NVRTC or nvcc, as the
``cuda`` backend compiles them) or for any cubin inside a shared library (FlashInfer's
prebuilt ops). A compile fact of this machine's toolkit, no GPU needed and no timing: it
says how much work a kernel's loop asks of the issue slots per token, not how fast it
runs (session 30 used it to put v2tc's loop beside FlashInfer's, docs/tensor-core-decode.md).

The hottest loop of a function is the backward branch whose body holds the most tensor-core
instructions (HMMA), or the most instructions when there are none.

Usage:
  python bench/sass_loops.py v2tc [--kv float16] [--head-dim 128] [--merged DTYPE]
  python bench/sass_loops.py so PATH [--match SUBSTRING]
Needs nvdisasm (v2tc) or cuobjdump (so): on PATH, or from the PyPI wheels
nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:`\((\.L_x_\d+)\)|(0x[0-9a-f]+))")
_FUNCTION = re.compile(r"^\s*(?:Function : (\S+)|\.text\.(\S+):)\s*$")


@dataclass(frozen=True)
class Loop:
    """A function's hottest loop: its instruction count per trip and per opcode."""
    function: str
    instructions: int
    mix: dict[str, int]

    @property
    def hmma(self) -> int:
        return self.mix.get("HMMA", 0)


def opcode(text: str) -> str:
    """``@!P0 HMMA.16816.F32 R4, ...`` -> ``HMMA``."""
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def functions(listing: str) -> dict[str, list[tuple[int, str]]]:
    """The (address, instruction) rows of each function of an nvdisasm or cuobjdump
    listing; nvdisasm's branch labels rewritten to the address they stand at."""
    out: dict[str, list[tuple[int, str]]] = {}
    name = None
    rows: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []

    def close() -> None:
        if name is not None and rows:
            out[name] = [(a, _BRANCH.sub(lambda m: _resolve(m, labels), t)) for a, t in rows]

    for line in listing.splitlines():
        f = _FUNCTION.match(line)
        if f:
            close()
            name, rows, labels, pending = f.group(1) or f.group(2), [], {}, []
            continue
        lab = _LABEL.match(line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        ins = _INSTRUCTION.match(line)
        if ins and name is not None:
            addr = int(ins.group(1), 16)
            for p in pending:
                labels[p] = addr
            pending = []
            rows.append((addr, ins.group(2)))
    close()
    return out


def _resolve(m: re.Match[str], labels: dict[str, int]) -> str:
    if m.group(1) is None:
        return m.group(0)
    target = labels.get(m.group(1))
    return m.group(0) if target is None else f"BRA {target:#x}"


def hottest_loop(name: str, rows: list[tuple[int, str]]) -> Loop | None:
    """The backward branch of ``rows`` whose body (target to branch, both included) holds
    the most HMMA, ties and HMMA-free functions going to the longer body; None without a
    backward branch."""
    index = {a: i for i, (a, _) in enumerate(rows)}
    best: tuple[int, int, list[str]] | None = None
    for i, (addr, text) in enumerate(rows):
        m = _BRANCH.search(text)
        if not m or m.group(2) is None:
            continue
        target = int(m.group(2), 16)
        if target > addr or target not in index:
            continue
        body = [t for _, t in rows[index[target]:i + 1]]
        key = (sum(opcode(t) == "HMMA" for t in body), len(body), body)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        return None
    mix = collections.Counter(opcode(t) for t in best[2])
    return Loop(name, best[1], dict(mix.most_common()))


def loops(listing: str, match: str = "") -> list[Loop]:
    """The hottest loop of every function of ``listing`` whose name contains ``match``."""
    found = (hottest_loop(n, rows) for n, rows in functions(listing).items() if match in n)
    return [lp for lp in found if lp is not None]


def tool(name: str) -> str:
    """The path of an NVIDIA binary tool: PATH first, then the PyPI wheels' bin folders."""
    path = shutil.which(name)
    if path:
        return path
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for p in sorted(glob.glob(os.path.join(site, "nvidia", "*", "bin", name))):
            if os.access(p, os.X_OK):
                return p
    sys.exit(f"sass_loops: no {name} on PATH or in a nvidia-cuda-{name} wheel "
             f"(pip install nvidia-cuda-{name})")


def v2tc_listing(kv: str, head_dim: int, merged: str) -> str:
    """nvdisasm's listing of the tensor-core partial for one pool dtype and head_dim,
    compiled as the backend compiles it (page size 16, float16 queries)."""
    from paged_decode import cuda_compile
    from paged_decode.specs import v2tc_spec
    q = "bfloat16" if kv == "bfloat16" else "float16"
    spec = v2tc_spec(kv, "float32" if merged else q, head_dim, 16, q_dtype=q,
                     merged_dtype=merged)
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        cuda_compile.compile_spec(spec, cubin_path=cubin)
        return subprocess.run([tool("nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout


def report(found: list[Loop]) -> str:
    lines = []
    for lp in found:
        per = f", {lp.instructions / lp.hmma:.1f} per HMMA" if lp.hmma else ""
        mix = ", ".join(f"{k} {v}" for k, v in list(lp.mix.items())[:12])
        lines.append(f"{lp.function}\n  {lp.instructions} instructions per trip, {lp.hmma} "
                     f"HMMA{per}: {mix}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("v2tc", help="our tensor-core partial, compiled here")
    a.add_argument("--kv", default="float16")
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--merged", default="", help="the fused merge's output dtype (none: off)")
    b = sub.add_parser("so", help="every cubin function of a shared library (cuobjdump)")
    b.add_argument("path")
    b.add_argument("--match", default="")
    args = ap.parse_args(argv)
    if args.what == "v2tc":
        found = loops(v2tc_listing(args.kv, args.head_dim, args.merged))
    else:
        listing = subprocess.run([tool("cuobjdump"), "-sass", args.path], capture_output=True,
                                 text=True, check=True).stdout
        found = loops(listing, args.match)
    if not found:
        sys.exit("sass_loops: no function with a loop matched")
    print(report(found))


if __name__ == "__main__":
    main()
