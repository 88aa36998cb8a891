"""bench/sass_loops.py's reading of SASS listings (nvdisasm's labels, cuobjdump's
addresses): the loop it reports must be the backward branch with the most HMMA, counted
from its target to the branch, or the figures it prints for a kernel are wrong."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "sass_loops.py"
_SPEC = importlib.util.spec_from_file_location("sass_loops", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
sass_loops = importlib.util.module_from_spec(_SPEC)
sys.modules["sass_loops"] = sass_loops    # its dataclass looks its module up by name
_SPEC.loader.exec_module(sass_loops)

# nvdisasm -c: labels stand before the instruction at their address; two loops, the
# inner (0x40-0x70) with two HMMA, the outer (0x10-0x90) with the same two plus more
# instructions: the HMMA count ties, so the longer body wins.
NVDISASM = """\
\t.section\t.text._Z1kv,"ax",@progbits
.text._Z1kv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64] ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   IADD3 R6, R6, 0x1, RZ ;
.L_x_0:
        /*0040*/                   LDSM.16.M88.4 R8, [R9] ;
        /*0050*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0060*/               @!P1 HMMA.16816.F32 R16, R8, R10, R16 ;
        /*0070*/               @P0 BRA `(.L_x_0) ;
        /*0080*/                   ISETP.GE.AND P2, PT, R6, R7, PT ;
        /*0090*/              @!P2 BRA `(.L_x_1) ;
        /*00a0*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00b0*/                   EXIT ;
\t.section\t.text._Z1jv,"ax",@progbits
.text._Z1jv:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   EXIT ;
"""

# cuobjdump -sass: absolute targets; the loop with HMMA (0x20-0x50) beats a longer one
# without (0x60-0xb0)
CUOBJDUMP = """\
\t\tFunction : _Z2fiv
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;   /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;   /* 0x0000000000007919 */
        /*0020*/                   HMMA.16816.F32 R4, R8, R10, R4 ;   /* 0x0000000a0804723c */
        /*0030*/                   FMUL R4, R4, R5 ;   /* 0x0000000504047220 */
        /*0040*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;   /* 0x000000ff0000720c */
        /*0050*/               @P0 BRA 0x20 ;   /* 0xfffffffc00f00947 */
        /*0060*/                   IADD3 R0, R0, -0x1, RZ ;   /* 0xffffffff00007810 */
        /*0070*/                   IADD3 R1, R1, -0x1, RZ ;   /* 0xffffffff01017810 */
        /*0080*/                   IADD3 R2, R2, -0x1, RZ ;   /* 0xffffffff02027810 */
        /*0090*/                   IADD3 R3, R3, -0x1, RZ ;   /* 0xffffffff03037810 */
        /*00a0*/                   ISETP.NE.AND P0, PT, R0, RZ, PT ;   /* 0x000000ff0000720c */
        /*00b0*/               @P0 BRA 0x60 ;   /* 0xfffffffc00f00947 */
        /*00c0*/                   EXIT ;   /* 0x000000000000794d */
"""


def test_nvdisasm_labels_resolve_and_ties_go_to_the_longer_loop() -> None:
    found = sass_loops.loops(NVDISASM)
    assert [lp.function for lp in found] == ["_Z1kv"]      # _Z1jv has no loop
    lp = found[0]
    assert lp.instructions == 9 and lp.hmma == 2
    assert lp.mix == {"LDGSTS": 1, "BAR": 1, "IADD3": 1, "LDSM": 1, "HMMA": 2, "BRA": 2,
                      "ISETP": 1}


def test_cuobjdump_addresses_and_hmma_beats_length() -> None:
    (lp,) = sass_loops.loops(CUOBJDUMP, match="_Z2f")
    assert (lp.function, lp.instructions, lp.hmma) == ("_Z2fiv", 4, 1)
    assert sass_loops.loops(CUOBJDUMP, match="nothing") == []


def test_a_loop_without_hmma_is_the_longest_backward_branch() -> None:
    listing = CUOBJDUMP.replace("HMMA.16816.F32 R4, R8, R10, R4", "FADD R4, R8, R10")
    (lp,) = sass_loops.loops(listing)
    assert (lp.instructions, lp.hmma) == (6, 0)


def test_forward_branches_are_not_loops() -> None:
    listing = NVDISASM.replace("@P0 BRA `(.L_x_0)", "NOP").replace("@!P2 BRA `(.L_x_1)", "NOP")
    assert sass_loops.loops(listing) == []


@pytest.mark.parametrize("text,op", [("@!P0 HMMA.16816.F32 R4, R8, R10, R4", "HMMA"),
                                     ("LDGSTS.E.BYPASS.LTC128B.128 [R1], desc[UR4][R2.64]",
                                      "LDGSTS"), ("EXIT", "EXIT")])
def test_opcode(text: str, op: str) -> None:
    assert sass_loops.opcode(text) == op
