"""Source rewriting: ``__shared__`` storage, checked pointer casts and the launcher.

``__shared__`` cannot be a macro: a C++ ``static`` is shared by every OS thread and
block, and ``thread_local`` is slow. Each declaration inside a function body becomes a
reference into the running block's per-OS-thread arena, at an offset reserved once per
declaration site and template instantiation (a local ``struct`` tags the site)::

    __shared__ float buf[W][D];
 -> struct pd_emu_site_0 {}; using pd_emu_t_0 = float[W][D];
    pd_emu_t_0& buf = pd_emu::shared_var<pd_emu_t_0, pd_emu_site_0>("buf");

``extern __shared__ T name[];`` (dynamic shared memory) becomes an object converting to
``T*`` (the block's dynamic region). Limits: one declarator per statement; static
``__shared__`` at namespace scope is rejected.

Pointer ``reinterpret_cast``s and ``static_cast``s (both dialects) become
alignment-checked casts.
"""

from __future__ import annotations

import re

from .errors import CompileError, EmulatorError

_TYPE = r"[A-Za-z_][\w:<>, ]*?"
_EXTERN = re.compile(
    rf"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?(?P<type>{_TYPE})\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_STATIC = re.compile(
    rf"(?<![\w])__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?(?P<type>{_TYPE})\s+"
    r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*);")


def rewrite_shared(src: str) -> str:
    """``src`` with every ``__shared__`` declaration turned into arena storage."""
    src = _EXTERN.sub(
        lambda m: (f"[[maybe_unused]] static pd_emu::DynamicShared<{m['type'].strip()}> "
                   f"{m['name']};"), src)
    out: list[str] = []
    last = 0
    for i, m in enumerate(_STATIC.finditer(src)):
        if _namespace_scope(src, m.start()):
            raise EmulatorError(
                f"emulator: static __shared__ '{m['name']}' at namespace scope is not "
                "supported; declare it inside the kernel or device function")
        t, name, dims = m["type"].strip(), m["name"], re.sub(r"\s+", "", m["dims"])
        out.append(src[last:m.start()])
        out.append(f"struct pd_emu_site_{i} {{}}; using pd_emu_t_{i} = {t}{dims}; "
                   f"pd_emu_t_{i}& {name} = pd_emu::shared_var<pd_emu_t_{i}, "
                   f"pd_emu_site_{i}>(\"{name}\");")
        last = m.end()
    out.append(src[last:])
    return "".join(out)


_POINTER_CAST = re.compile(
    r"(?<![\w:])(?P<kind>reinterpret|static)_cast\s*<(?P<type>[^<>;(){}]*\*)\s*>")
_CHECKED = {"reinterpret": "pd_emu::vector_cast", "static": "pd_emu::vector_static_cast"}


# a C-style cast to a pointer type, followed by the start of its operand (which tells it
# from an unnamed parameter such as ``void f(float*);``); ``sizeof(T*)`` is excluded
_C_POINTER_CAST = re.compile(
    r"(?<!sizeof)(?<!alignof)(?<!__alignof__)\(\s*(?P<type>(?:(?:const|volatile|device|"
    r"threadgroup|constant|thread)\s+)*[A-Za-z_][\w:<>, ]*?(?:\s*\*\s*(?:const\s*)?)+)\)"
    r"\s*(?=[A-Za-z_&(*])")
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def refuse_c_style_pointer_casts(src: str) -> None:
    """Raise ``CompileError`` naming the line of the first C-style cast to a pointer type
    in ``src`` (comments ignored): the emulator checks the alignment of ``reinterpret_cast``
    and ``static_cast`` results (``rewrite_casts``) but cannot see a ``(float4*)p``, so a
    kernel's misaligned vector access through one would pass here and fault on a GPU."""
    code = _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), src)
    m = _C_POINTER_CAST.search(code)
    if m is not None:
        line = code.count("\n", 0, m.start()) + 1
        raise CompileError(
            f"emulator: kernel source line {line}: C-style cast "
            f"'({m['type'].strip()})'; write reinterpret_cast<{m['type'].strip()}> (or "
            "static_cast), whose alignment the emulator checks where the bytes sit on a GPU")


def rewrite_casts(src: str) -> str:
    """``src`` with every ``reinterpret_cast`` and ``static_cast`` to a pointer type made a
    checked one (``pd_emu::vector_cast`` / ``vector_static_cast``, the same cast and then
    the check): an access through it must be aligned to its type's size where the bytes
    sit on a GPU. A GPU faults on a misaligned ``float4`` load; g++'s instruction for it
    may not, so without this the emulator passes such a kernel. A C-style pointer cast,
    which the check would not see, is refused (``refuse_c_style_pointer_casts``)."""
    refuse_c_style_pointer_casts(src)
    return _POINTER_CAST.sub(lambda m: f"{_CHECKED[m['kind']]}<{m['type']}>", src)


def _namespace_scope(src: str, pos: int) -> bool:
    """Whether ``pos`` lies outside every function body: every enclosing ``{`` opens a
    namespace (a heuristic good enough for kernel sources)."""
    depth = 0
    opened: list[bool] = []   # per open brace: is it a namespace?
    for m in re.finditer(r"namespace\s*\w*\s*\{|\{|\}", src[:pos]):
        tok = m.group(0)
        if tok == "}":
            if opened:
                opened.pop()
            depth -= 1
        else:
            opened.append(tok.startswith("namespace"))
            depth += 1
    return all(opened)


def wrap_cuda(source: str, name_expression: str) -> str:
    """The translation unit the emulator compiles: prelude, the kernel source with its
    shared memory rewritten, and an ``extern "C"`` launcher of ``name_expression``."""
    body = rewrite_casts(rewrite_shared(source))
    return (
        '#include "pd_emu_cuda.h"\n'
        "#line 1 \"kernel.cu\"\n"
        f"{body}\n"
        "// ---- emulator launcher\n"
        'extern "C" int pd_emu_launch(const pd_emu::LaunchDesc* d, void** args, char* err,\n'
        "                             std::size_t errlen) {\n"
        "  return pd_emu::run_launch(d, [](void** a) {\n"
        f"    pd_emu::invoke(&{name_expression}, a);\n"
        "  }, args, &pd_emu::g_static_smem, err, errlen);\n"
        "}\n")
