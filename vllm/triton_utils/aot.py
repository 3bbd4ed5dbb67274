"""Ahead-of-time compilation of Triton kernels for GPU targets, on a machine without a GPU.

Convention: every module holding Triton kernels defines

    def triton_compile_cases() -> list[TritonCompileCase]

covering each kernel and each constexpr specialisation that matters (every format, layout).
``tools/compile_triton_kernels.py`` finds those modules under ``vllm/``, compiles every case for
sm_80, sm_90 and sm_100 (PTX and cubin, through Triton's own compiler; no driver is needed) and
fails naming the kernel and target that do not compile. Triton's interpreter, which runs the
kernels in the CPU tests, accepts code the GPU compiler rejects (``tl.dot`` tiles under 16, a
loop-carried variable changing dtype), so this check is what proves the kernels build for a GPU.

It must run in a process without ``TRITON_INTERPRET``: under the interpreter ``@triton.jit``
returns an interpreted function that Triton's compiler cannot take.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from vllm.triton_utils.sass import KernelResources, kernel_resources

__all__ = [
    "DEFAULT_ARCHS",
    "SM8X_MAX_SHARED_BYTES",
    "CompileResult",
    "TritonCompileCase",
    "case_from_launch",
    "compile_case",
    "find_case_modules",
    "runtime_arg_names",
]

# Compute capabilities the kernels must build for: Ampere, Hopper, Blackwell.
DEFAULT_ARCHS: tuple[int, ...] = (80, 90, 100)
# Shared memory one block may use on sm_86 / sm_87 / sm_89 (99 KB), the least of the sm_8x
# parts: Triton compiles them as it does sm_80 (163 KB), so an sm_80 compile above this builds
# but cannot launch on those GPUs.
SM8X_MAX_SHARED_BYTES = 101376
# The hook name every kernel module defines.
CASES_HOOK = "triton_compile_cases"


@dataclass(frozen=True)
class TritonCompileCase:
    """One kernel specialisation to compile.

    ``signature`` maps every argument name to a Triton type string (``"*fp32"``, ``"*u8"``,
    ``"i32"``, ``"i64"``, ``"fp32"``) or ``"constexpr"``; ``constexprs`` gives each constexpr
    argument's value. ``name`` is unique within its module and says what is specialised (e.g.
    ``"writer/nvfp4/interleave4"``).
    """

    name: str
    kernel: Any  # a @triton.jit function (triton.runtime.JITFunction)
    signature: dict[str, str]
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4
    enable_fp_fusion: bool = True
    """Compile option of the same name: ``False`` for kernels whose bytes depend on every fp32
    multiply being rounded on its own (no FMA contraction), as they are launched."""
    divisible_by_16: tuple[str, ...] = ()
    """Arguments that launches pass as multiples of 16 (pointers: 16-byte aligned addresses;
    integers: values). Triton specialises a launch on exactly that (and vectorises loads with
    it), so hinting them here compiles the code those launches run."""


# Triton's pointer type per tensor dtype (the name after "torch.").
_POINTER_TYPES = {
    "int8": "*i8",
    "uint8": "*u8",
    "int16": "*i16",
    "int32": "*i32",
    "int64": "*i64",
    "float16": "*fp16",
    "bfloat16": "*bf16",
    "float32": "*fp32",
}


def runtime_arg_names(kernel: Any) -> list[str]:
    """A ``@triton.jit`` kernel's non-constexpr parameters, in order (with Triton or its
    placeholder, which leaves the function as it is)."""
    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if "constexpr" not in str(p.annotation)]


def case_from_launch(
    name: str,
    kernel: Any,
    args: Sequence[Any],
    constexprs: dict[str, object],
    *,
    num_warps: int,
    enable_fp_fusion: bool = True,
) -> TritonCompileCase:
    """The compile case of a launch of ``kernel`` with runtime ``args`` (tensors for pointers,
    ints) and ``constexprs``, as Triton specialises it: pointers typed by their tensor's
    dtype, integers ``i32`` (``i64`` past 2^31), an integer equal to 1 a constant, and pointers
    at 16-byte boundaries and integers that are multiples of 16 (0 too) hinted."""
    signature: dict[str, str] = {}
    case_constexprs = dict(constexprs)
    hints = []
    for arg_name, arg in zip(runtime_arg_names(kernel), args, strict=True):
        if hasattr(arg, "data_ptr"):
            signature[arg_name] = _POINTER_TYPES[str(arg.dtype).removeprefix("torch.")]
            place = arg.data_ptr()
        elif arg == 1:
            case_constexprs[arg_name] = 1
            continue
        else:
            signature[arg_name] = "i32" if -(2**31) <= arg < 2**31 else "i64"
            place = arg
        if place % 16 == 0:
            hints.append(arg_name)
    return TritonCompileCase(
        name,
        kernel,
        signature,
        case_constexprs,
        num_warps=num_warps,
        enable_fp_fusion=enable_fp_fusion,
        divisible_by_16=tuple(hints),
    )


@dataclass(frozen=True)
class CompileResult:
    """What compiling one case for one target gave: ``error`` is ``None`` when it compiled."""

    module: str
    case: str
    arch: int
    error: str | None
    seconds: float
    cubin_bytes: int = 0
    shared_bytes: int = 0
    resources: KernelResources | None = None
    """Registers, stack frame and hottest-loop SASS of the cubin (:mod:`.sass`)."""


def _check_not_interpreted() -> None:
    value = os.environ.get("TRITON_INTERPRET", "0")
    if value not in ("", "0"):
        raise RuntimeError(
            "TRITON_INTERPRET: expected unset or 0 for ahead-of-time compilation (under the "
            f"interpreter @triton.jit gives interpreted functions), got {value!r}"
        )


def compile_case(module: str, case: TritonCompileCase, arch: int) -> CompileResult:
    """Compile ``case`` for ``GPUTarget("cuda", arch, 32)``; any compiler error is captured in
    the result, not raised, and so is an sm_8x compile that needs more shared memory than
    :data:`SM8X_MAX_SHARED_BYTES`. ``seconds`` is wall time."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _check_not_interpreted()
    start = time.perf_counter()
    try:
        # Every constexpr must be in the signature as "constexpr" for ASTSource.
        signature = dict(case.signature)
        for name in case.constexprs:
            signature.setdefault(name, "constexpr")
        names = list(case.kernel.arg_names)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in case.divisible_by_16}
        source = ASTSource(case.kernel, signature, dict(case.constexprs), attrs)
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": case.num_warps, "enable_fp_fusion": case.enable_fp_fusion},
        )
        cubin = compiled.asm["cubin"]
        resources = kernel_resources(cubin)
    except Exception as exc:  # the compiler raises many types; report, do not stop the run
        first_line = f"{type(exc).__name__}: {exc}".strip()
        return CompileResult(module, case.name, arch, first_line, time.perf_counter() - start)
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    error = None
    if 80 <= arch < 90 and shared > SM8X_MAX_SHARED_BYTES:
        error = (
            f"shared memory: expected at most {SM8X_MAX_SHARED_BYTES} bytes per block (what "
            f"sm_86 / sm_89 give), got {shared}"
        )
    return CompileResult(
        module,
        case.name,
        arch,
        error,
        time.perf_counter() - start,
        cubin_bytes=len(cubin),
        shared_bytes=shared,
        resources=resources,
    )


def _walk(package: ModuleType) -> Iterator[str]:
    yield package.__name__
    for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
        yield info.name


def find_case_modules(
    package: str = "vllm", *, only: Sequence[str] = ()
) -> list[tuple[str, Callable[[], list[TritonCompileCase]]]]:
    """``(module name, triton_compile_cases)`` for every module under ``package`` that defines the
    hook. Only modules whose source defines it are imported (so an optional dependency of an
    unrelated module is never needed); an import error of one that does is raised.
    ``only``, when given, keeps the modules whose name contains one of its strings."""
    _check_not_interpreted()
    root = importlib.import_module(package)
    found = []
    for name in _walk(root):
        if only and not any(part in name for part in only):
            continue
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(".py"):
            continue
        with open(origin, encoding="utf-8") as source:
            if f"def {CASES_HOOK}(" not in source.read():
                continue
        module = importlib.import_module(name)
        hook = getattr(module, CASES_HOOK, None)
        if callable(hook):
            found.append((name, hook))
    return found
