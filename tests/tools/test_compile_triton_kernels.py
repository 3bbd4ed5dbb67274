"""tools/compile_triton_kernels.py: the writer's kernel compiles for a GPU target on this CPU
machine (Triton's compiler, no driver), and a kernel the GPU compiler rejects but Triton's
interpreter runs (an 8x8 ``tl.dot``) fails the tool, naming the kernel and the target.

The tool runs in a subprocess without TRITON_INTERPRET (tests/conftest.py sets it here, and
under the interpreter ``@triton.jit`` gives functions the compiler cannot take).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "compile_triton_kernels.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (the dev extra)"
)

# A kernel module outside vllm/: interpreted, the 8x8 dot runs; compiled, tl.dot needs K >= 16.
BAD_MODULE = """
import triton
import triton.language as tl

from vllm.triton_utils.aot import TritonCompileCase


@triton.jit
def dot8x8(a_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a = tl.load(a_ptr + offs[:, None] * N + offs[None, :])
    tl.store(c_ptr + offs[:, None] * N + offs[None, :], tl.dot(a, a))


def triton_compile_cases():
    signature = {"a_ptr": "*fp16", "c_ptr": "*fp32"}
    return [
        TritonCompileCase("dot16x16", dot8x8, signature, {"N": 16}),
        TritonCompileCase("dot8x8", dot8x8, signature, {"N": 8}),
    ]
"""


# A loop over rows of a strided matrix: with the stride (and pointers) hinted as multiples of
# 16, as a launch with such values specialises them, the loads vectorise and the loop shrinks.
HINT_MODULE = """
import triton
import triton.language as tl

from vllm.triton_utils.aot import TritonCompileCase


@triton.jit
def row_sums(x_ptr, out_ptr, stride_row, num_rows, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(num_rows):
        acc += tl.load(x_ptr + row * stride_row + cols).to(tl.float32)
    tl.store(out_ptr + cols, acc)


def triton_compile_cases():
    signature = {"x_ptr": "*fp16", "out_ptr": "*fp32", "stride_row": "i32", "num_rows": "i32"}
    hints = ("x_ptr", "out_ptr", "stride_row")
    return [
        TritonCompileCase("plain", row_sums, signature, {"BLOCK": 1024}),
        TritonCompileCase("hinted", row_sums, signature, {"BLOCK": 1024}, divisible_by_16=hints),
    ]
"""


# A pipelined dot whose stages need 128 KB of shared memory at M = K = 128 (32 KB at 64):
# sm_80 has 163 KB, but sm_86 / sm_89, which Triton compiles the same way, give 99 KB.
SMEM_MODULE = """
import triton
import triton.language as tl

from vllm.triton_utils.aot import TritonCompileCase


@triton.jit
def staged_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr):
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    acc = tl.zeros([M, M], dtype=tl.float32)
    for i in tl.range(0, 4, num_stages=3):
        a = tl.load(a_ptr + i * M * K + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + i * M * K + k[:, None] * M + m[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + m[:, None] * M + m[None, :], acc)


def triton_compile_cases():
    signature = {"a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp32"}
    hints = {"divisible_by_16": ("a_ptr", "b_ptr", "c_ptr")}
    return [
        TritonCompileCase("fits", staged_dot, signature, {"M": 64, "K": 64}, **hints),
        TritonCompileCase("big", staged_dot, signature, {"M": 128, "K": 128}, **hints),
    ]
"""


def run_tool(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_lists_the_writer_cases() -> None:
    result = run_tool("--list")
    assert result.returncode == 0, result.stderr
    for case in ("fp32->bf16", "fp8_e5m2/per_head", "nvfp4_mse/interleave4", "int8_per_token_head"):
        assert f"reshape_and_cache_flash/{case}" in result.stdout


def run_module(
    tmp_path: Path, name: str, source: str, archs: str
) -> subprocess.CompletedProcess[str]:
    """The tool over the cases of a module ``name`` written from ``source`` alone."""
    (tmp_path / f"{name}.py").write_text(source)
    return run_tool("--module", name, "--only", name, "--arch", archs, pythonpath=tmp_path)


def test_compiles_a_writer_case() -> None:
    result = run_tool("--only", "reshape_and_cache_flash/fp8_e4m3/per_head", "--arch", "90")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if "fp8_e4m3/per_head" in line]
    assert len(rows) == 1 and "sm_90" in rows[0] and " ok " in rows[0], result.stdout
    assert "1 cases x 1 targets" in result.stdout


def test_fails_on_a_kernel_the_gpu_compiler_rejects(tmp_path: Path) -> None:
    result = run_module(tmp_path, "bad_triton_kernels", BAD_MODULE, "80,100")
    assert result.returncode == 1, result.stdout + result.stderr
    ok = [line for line in result.stdout.splitlines() if "dot16x16" in line]
    assert len(ok) == 2 and all(" ok " in line for line in ok), result.stdout
    for arch in (80, 100):
        assert f"FAILED: bad_triton_kernels:dot8x8 for sm_{arch}:" in result.stderr
    assert "K >= 16" in result.stderr


def test_rejects_a_bad_arch() -> None:
    result = run_tool("--arch", "sm90")
    assert result.returncode == 2
    assert "--arch: expected compute capabilities such as 80,90,100, got 'sm90'" in result.stderr


def _columns(stdout: str, case: str) -> dict[str, int]:
    """The registers, stack bytes, loop instructions and loop conversions printed for
    ``case``."""
    rows = [line.split() for line in stdout.splitlines() if f" {case} " in line]
    assert len(rows) == 1, stdout
    regs, stack, loop, cvt = (int(v) for v in rows[0][-4:])
    return {"regs": regs, "stack": stack, "loop": loop, "cvt": cvt}


def test_reports_resources_and_compiles_the_launch_hints(tmp_path: Path) -> None:
    result = run_module(tmp_path, "hint_triton_kernels", HINT_MODULE, "90")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "regs stack   loop  cvt" in result.stdout
    plain, hinted = _columns(result.stdout, "plain"), _columns(result.stdout, "hinted")
    for columns in (plain, hinted):
        assert columns["regs"] > 0 and columns["stack"] == 0 and columns["loop"] > 0, columns
    # 1024 fp16 per row over 128 threads: 8 scalar loads per thread, or one 16-byte load.
    assert hinted["loop"] < plain["loop"], (plain, hinted)


def test_fails_an_sm8x_kernel_that_needs_more_shared_memory_than_sm86_has(tmp_path: Path) -> None:
    result = run_module(tmp_path, "smem_triton_kernels", SMEM_MODULE, "80,90")
    assert result.returncode == 1, result.stdout + result.stderr
    ok = [line for line in result.stdout.splitlines() if " ok " in line]
    assert len(ok) == 3 and not any(" big " in line and "sm_80" in line for line in ok), ok
    assert (
        "FAILED: smem_triton_kernels:big for sm_80: shared memory: expected at most 101376 bytes "
        "per block (what sm_86 / sm_89 give), got 131072"
    ) in result.stderr
