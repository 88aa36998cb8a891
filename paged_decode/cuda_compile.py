"""Compile CUDA specializations on a machine without a GPU (CI), to catch source errors.

Two compilers, NVRTC first because it is what CuPy uses at run time (no host C headers:
a kernel that leans on ``math.h`` compiles under nvcc and fails under NVRTC):

- NVRTC through ctypes, from ``libnvrtc`` of the ``nvidia-cuda-nvrtc`` wheel or a CUDA
  toolkit, with the toolkit's headers; produces sm_90 cubins (ptxas runs too);
- ``nvcc -cubin -arch=sm_90`` otherwise.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import site
import subprocess
import sys
import tempfile
from collections.abc import Iterable

from .specs import KernelSpec, cuda_defines, cuda_source

ARCH = "sm_90"


def find_nvrtc() -> str | None:
    roots = site.getsitepackages() + [site.getusersitepackages(), sys.prefix]
    pats = [os.path.join(r, "nvidia", "*", "lib", "libnvrtc.so*") for r in roots]
    pats += [os.path.join(r, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*") for r in roots]
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    pats += [os.path.join(cuda, "lib64", "libnvrtc.so*")]
    for pat in pats:
        hits = sorted(h for h in glob.glob(pat) if "builtins" not in h and "alt" not in h)
        if hits:
            return hits[0]
    return None


def cuda_include_dir() -> str | None:
    nvcc = shutil.which("nvcc")
    cands = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    if nvcc:
        real = os.path.realpath(nvcc)
        cands.append(os.path.dirname(os.path.dirname(real)))
        try:  # a wrapper script that execs the real nvcc
            with open(nvcc, errors="ignore") as f:
                for tok in f.read().split():
                    if tok.endswith("/bin/nvcc"):
                        cands.append(os.path.dirname(os.path.dirname(tok)))
        except OSError:
            pass
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_fp16.h")):
            return os.path.join(c, "include")
    return None


def available() -> str | None:
    """``"nvrtc"``, ``"nvcc"`` or ``None``."""
    if find_nvrtc() and cuda_include_dir():
        return "nvrtc"
    if shutil.which("nvcc"):
        return "nvcc"
    return None


def compile_specs(specs: Iterable[KernelSpec], compiler: str | None = None,
                  l2_prefetch: int | None = None, timeline: bool | None = None) -> None:
    """Compile every spec (grouped by kernel source and defines) as the ``cuda`` backend
    does, each with the defines ``specs.cuda_defines(l2_prefetch, timeline, spec)``; raise
    ``RuntimeError`` with the compiler's log on the first failure."""
    by_module: dict[tuple[str, tuple[str, ...]], list[KernelSpec]] = {}
    for s in specs:
        by_module.setdefault((s.kernel, cuda_defines(l2_prefetch, timeline, s)), []).append(s)
    for (kernel, defines), group in by_module.items():
        compile_source(cuda_source(kernel), sorted({s.cuda_name_expression() for s in group}),
                       compiler, defines)


def compile_source(src: str, exprs: Iterable[str] = (), compiler: str | None = None,
                   defines: tuple[str, ...] = (), ptxas_report: bool = False,
                   cubin_path: str | None = None) -> str:
    """Compile one CUDA source for ``ARCH`` with NVRTC or nvcc (``compiler``, else what is
    ``available``), instantiating the template name expressions ``exprs``: a kernel string
    of this package or of a device script (``bench/device/floor.py``); returns the
    compiler's log (with ``ptxas_report``, ptxas's ``-v`` report in it) and writes the
    cubin to ``cubin_path`` when given (``bench/sass_loops.py`` disassembles it);
    ``RuntimeError`` with the log on failure."""
    how = compiler or available()
    if how is None:
        raise RuntimeError("neither NVRTC nor nvcc is available")
    if how == "nvrtc":
        return _nvrtc(src, list(exprs), (*defines, *(("--ptxas-options=-v",) if ptxas_report
                                                      else ())), cubin_path)
    return _nvcc(src, list(exprs), (*defines, *(("-Xptxas", "-v") if ptxas_report else ())),
                 cubin_path)


def _load_nvrtc() -> ctypes.CDLL:
    path = find_nvrtc()
    assert path is not None
    # NVRTC dlopens its builtins library by name; load it first from the same folder.
    for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        break
    return ctypes.CDLL(path)


def _nvrtc(src: str, exprs: list[str], extra: tuple[str, ...] = (),
           cubin_path: str | None = None) -> str:
    """Compile with NVRTC for ``ARCH``; returns its log (``extra`` options added; the cubin
    written to ``cubin_path`` when given)."""
    lib = _load_nvrtc()
    prog = ctypes.c_void_p()
    check = _checker(lib)
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"pd.cu", 0, None, None),
          "create")
    try:
        for e in exprs:
            check(lib.nvrtcAddNameExpression(prog, e.encode()), "addNameExpression")
        opts = [f"--gpu-architecture={ARCH}", "-std=c++17", f"-I{cuda_include_dir()}", *extra]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        if rc != 0:
            raise RuntimeError(f"NVRTC failed for {exprs}:\n{text}")
        if cubin_path is not None:
            check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "getCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetCUBIN(prog, cubin), "getCUBIN")
            with open(cubin_path, "wb") as f:
                f.write(cubin.raw)
        return text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _checker(lib: ctypes.CDLL):  # type: ignore[no-untyped-def]
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(rc).decode()}")
    return check


def _nvcc(src: str, exprs: list[str], extra: tuple[str, ...] = (),
          cubin_path: str | None = None) -> str:
    """Compile with nvcc for ``ARCH``; returns its diagnostics (``extra`` flags added; the
    cubin kept at ``cubin_path`` when given)."""
    body = src + "\nvoid* pd_instances[] = {" + ", ".join(f"(void*)&{e}" for e in exprs) + "};\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(body)
        r = subprocess.run(["nvcc", f"-arch={ARCH}", "-std=c++17", "-cubin", *extra, "-o",
                            cubin_path or os.path.join(d, "k.cubin"), path],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed for {exprs}:\n{r.stderr}")
        return r.stderr


def compile_spec(spec: KernelSpec, compiler: str | None = None, *, ptxas_report: bool = False,
                 cubin_path: str | None = None) -> str:
    """Compile the one specialization ``spec`` as the ``cuda`` backend does (its kernel's
    source, the default defines) with ``compile_source``; returns the compiler's log."""
    return compile_source(cuda_source(spec.kernel), [spec.cuda_name_expression()], compiler,
                          cuda_defines(spec=spec), ptxas_report=ptxas_report,
                          cubin_path=cubin_path)


def text_bytes(cubin: bytes, function: str) -> int:
    """Bytes of machine code of ``function`` (its mangled name) in ``cubin`` (an ELF64
    cubin as ``compile_source`` writes it): the size of its ``.text.<function>`` section,
    16 bytes per SASS instruction on sm_70 and later. A compile fact like
    ``register_usage``: two sources' sizes say whether ptxas emitted the same amount of
    code, without a disassembler. ``ValueError`` when the cubin has no such section."""
    import struct
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("text_bytes: not an ELF64 cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, = struct.unpack_from("<I", cubin, shoff + i * shentsize)
        offset, size = struct.unpack_from("<QQ", cubin, shoff + i * shentsize + 0x18)
        return name, offset, size
    strtab = header(shstrndx)[1]
    want = b".text." + function.encode()
    for i in range(shnum):
        name, _, size = header(i)
        end = cubin.index(b"\0", strtab + name)
        if cubin[strtab + name:end] == want:
            return size
    raise ValueError(f"text_bytes: no .text section for {function!r}")


def register_usage(spec: KernelSpec, compiler: str | None = None) -> tuple[int, int]:
    """(registers per thread, spill-store bytes) ptxas reports for ``spec`` on ``ARCH``
    (``-v`` through NVRTC or nvcc, ``compiler`` else what is ``available``, with the
    backend's defines; a compile fact of this machine's toolkit, not a GPU measurement).
    Raises ``RuntimeError`` without a compiler or when it fails."""
    import re
    log = compile_spec(spec, compiler, ptxas_report=True)
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    if regs is None or spill is None:
        raise RuntimeError(f"register_usage: no ptxas report for {spec.uri}:\n{log[-2000:]}")
    return int(regs.group(1)), int(spill.group(1))
