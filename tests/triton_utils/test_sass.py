"""vllm.triton_utils.sass: the resource and loop-body parsers on listings in the disassembler's
format (the compiled path runs in tests/tools/test_compile_triton_kernels.py, in a process
without the interpreter)."""

from __future__ import annotations

import pytest

from vllm.triton_utils.sass import KernelResources, parse_loop_body, parse_resource_usage

USAGE = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function paged_attention_kernel:
  REG:90 STACK:16 SHARED:1024 LOCAL:0 CONSTANT[0]:808 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

# Prologue, a 2-instruction loop, a 4-instruction loop (the longest), a forward branch, exit.
LISTING = """
paged_attention_kernel:
.text.paged_attention_kernel:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_3) ;
.L_x_0:
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0030*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
.L_x_2:
        /*0040*/                   LDS.64 R4, [R6+UR8] ;
        /*0050*/                   HMMA.16816.F32.BF16 R8, R4, R12, R8 ;
        /*0060*/              @!P2 LDS.64 R4, [R6+UR8+0x80] ;
        /*0070*/               @P3 BRA `(.L_x_1) ;
.L_x_3:
        /*0080*/                   EXIT ;
        /*0090*/                   BRA `(.L_x_4);
.L_x_4:
        /*00a0*/                   NOP;
"""


def test_resource_usage() -> None:
    assert parse_resource_usage(USAGE) == (90, 16)


def test_resource_usage_rejects_other_output() -> None:
    with pytest.raises(ValueError, match=r"cuobjdump output: expected REG:<n> and STACK:<n>, got"):
        parse_resource_usage("no kernel here")


def test_longest_loop_body() -> None:
    body = parse_loop_body(LISTING)
    assert body == {"LDS": 2, "HMMA": 1, "BRA": 1}  # opcodes without modifiers, predicated too


def test_loop_conversions_count_type_conversions_only() -> None:
    listing = LISTING.replace("HMMA.16816.F32.BF16 R8, R4, R12, R8", "I2F.F16 R9, R5")
    body = parse_loop_body(listing)
    resources = KernelResources(64, 0, sum(body.values()), tuple(body.most_common()))
    assert resources.loop_conversions == 1
    assert KernelResources(64, 0, 4, (("LDS", 2), ("HMMA", 1), ("BRA", 1))).loop_conversions == 0


def test_no_backward_branch_no_loop() -> None:
    straight = LISTING.replace("`(.L_x_0)", "`(.L_x_3)").replace("`(.L_x_1)", "`(.L_x_4)")
    assert parse_loop_body(straight) == {}
