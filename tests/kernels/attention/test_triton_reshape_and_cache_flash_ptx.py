"""The Triton cache writer's GPU code holds no float conversion and no flushing or approximate
float operation, so a GPU writes the bytes the interpreter writes in the CPU tests.

A GPU conversion differs from the interpreter's (numpy) and from the codecs at the edges: CUDA's
fp32 -> fp16 / bf16 conversion writes the canonical NaN 0x7FFF whatever the sign or payload,
``.ftz`` flushes subnormals, ``.approx`` rounds differently. The writer rounds on integer bits
instead (:mod:`vllm.v1.attention.ops.triton_kv_encode`); this test compiles every case of
``triton_compile_cases()`` for sm_90 without a GPU and checks that each float instruction of the
PTX is one of the exactly rounded IEEE fp32 operations the interpreter reproduces. The compile
runs in a subprocess without TRITON_INTERPRET (tests/conftest.py sets it here).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from vllm.triton_utils import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

# Each is one IEEE fp32 operation rounded to nearest even (no .ftz, no .approx, no fused
# multiply-add), an exact comparison / select / sign operation (copysign: nvfp4_4over6's
# signed-zero flush, a sign-bit move), or an unsigned integer to fp32
# conversion (exact: the writer converts mantissas below 2^24). f32x2 is sm_100's paired form.
ALLOWED = {
    *(f"{op}.rn.f32{pair}" for op in ("add", "sub", "mul", "div") for pair in ("", "x2")),
    *(f"setp.{cmp}.f32" for cmp in ("eq", "ne", "lt", "le", "gt", "ge")),
    "selp.f32", "abs.f32", "neg.f32", "copysign.f32", "min.f32", "max.f32", "cvt.rn.f32.u32",
}  # fmt: skip
# An instruction with a floating-point type anywhere in its name.
FLOAT_TYPE = re.compile(r"\.(f16|bf16|f32|f64|tf32|e4m3|e5m2|e2m1|e3m2|e2m3|ue8m0)(x\d)?(\.|$)")

# The PTX opcodes (the first word of each instruction, predicate dropped) per compile case.
_SCRIPT = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm.v1.attention.ops.triton_reshape_and_cache_flash_cases import triton_compile_cases

opcodes = {}
for case in triton_compile_cases():
    signature = {**case.signature, **{name: "constexpr" for name in case.constexprs}}
    compiled = triton.compile(
        ASTSource(case.kernel, signature, dict(case.constexprs)),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": case.num_warps, "enable_fp_fusion": case.enable_fp_fusion},
    )
    found = re.findall(r"^\\s*(?:@!?%p\\d+\\s+)?([a-z][\\w.]*)", compiled.asm["ptx"], re.M)
    opcodes[case.name] = sorted(set(found))
print(json.dumps(opcodes))
"""


@pytest.fixture(scope="module")
def opcodes() -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_float_instructions_are_exact(opcodes: dict[str, list[str]]) -> None:
    assert len(opcodes) >= 22  # every format, layout and cast of the writer
    bad = {
        name: [op for op in ops if FLOAT_TYPE.search(op) and op not in ALLOWED]
        for name, ops in opcodes.items()
    }
    assert not any(bad.values()), {name: ops for name, ops in bad.items() if ops}
    # The check sees the kernels' float work (not a vacuous pass on an empty listing).
    assert "div.rn.f32" in opcodes["reshape_and_cache_flash/fp8_e4m3"]


@pytest.mark.parametrize(
    "op,allowed",
    [
        ("cvt.rn.f16.f32", False),  # the conversion that canonicalizes NaN on CUDA
        ("cvt.rn.satfinite.e4m3x2.f32", False),
        ("cvt.rn.bf16x2.f32", False),
        ("div.rn.ftz.f32", False),
        ("div.full.f32", False),
        ("ex2.approx.f32", False),
        ("fma.rn.f32", False),
        ("mul.rn.f32", True),
        ("mul.rn.f32x2", True),
        ("cvt.u16.u32", True),  # integer: not a float instruction
    ],
)
def test_classifier(op: str, allowed: bool) -> None:
    """The instruction check itself: conversions, flushing, approximate and fused operations
    are caught, exact fp32 and integer operations pass."""
    assert (not FLOAT_TYPE.search(op) or op in ALLOWED) == allowed
