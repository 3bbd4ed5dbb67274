"""Compiles every Triton kernel of the library for GPU targets, on a machine without a GPU, and
exits 1 naming each (kernel case, target) that fails.

    python tools/compile_triton_kernels.py [--arch 80,90,100] [--only SUBSTRING ...] [--jobs N]
                                           [--module NAME ...] [--list]

Finds every module under ``vllm/`` that defines ``triton_compile_cases()`` (the convention of
:mod:`vllm.triton_utils.aot`), imports it and compiles each case with Triton's own compiler for
``GPUTarget("cuda", cc, 32)`` (PTX and cubin; no driver needed), then prints one row per case and
target: seconds, cubin bytes, shared memory. ``--jobs`` compiles in that many worker processes
(default: the CPU count), each importing the kernel modules itself. ``--module`` adds a module
outside ``vllm/`` by its import name (one defining ``triton_compile_cases``). Triton's
interpreter, which runs the kernels in the CPU tests, accepts code the GPU compiler rejects, so
this is the check that the kernels build.
``TRITON_INTERPRET`` is removed from the environment before Triton is imported (under the
interpreter ``@triton.jit`` gives functions the compiler cannot take). ``--list`` prints the
cases without compiling.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Before anything imports Triton: kernels decorated under the interpreter cannot be compiled.
os.environ.pop("TRITON_INTERPRET", None)
# The writer kernels pass enable_fp_fusion themselves; this only silences Triton 3.9's notice.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm.triton_utils.aot import (  # noqa: E402
    CASES_HOOK,
    DEFAULT_ARCHS,
    CompileResult,
    compile_case,
    find_case_modules,
)


def _compile_named(module: str, name: str, arch: int) -> CompileResult:
    """Worker: the case ``name`` of ``module`` compiled for ``arch`` (kernels do not pickle, so
    each worker imports the module and looks the case up by its unique name)."""
    hook = getattr(importlib.import_module(module), CASES_HOOK)
    case = next(c for c in hook() if c.name == name)
    return compile_case(module, case, arch)


def _archs(text: str) -> tuple[int, ...]:
    try:
        archs = tuple(int(a) for a in text.split(",") if a.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--arch: expected compute capabilities such as 80,90,100, got {text!r}"
        ) from None
    if not archs or any(a < 70 for a in archs):
        raise argparse.ArgumentTypeError(
            f"--arch: expected compute capabilities >= 70 such as 80,90,100, got {text!r}"
        )
    return archs


def _row(r: CompileResult) -> str:
    status = "ok" if r.error is None else "FAILED"
    res = r.resources
    usage = ""
    if res is not None:
        usage = f" {res.registers:>4} {res.stack_bytes:>5} {res.loop_instructions:>6}"
        usage += f" {res.loop_conversions:>4}"
    return (
        f"{r.module:<52} {r.case:<64} sm_{r.arch:<4} {status:<6} {r.seconds:7.2f} "
        f"{r.cubin_bytes:>9} {r.shared_bytes:>7}{usage}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch",
        type=_archs,
        default=DEFAULT_ARCHS,
        help="comma-separated compute capabilities (default: 80,90,100)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="keep modules or cases whose name contains this (repeatable)",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)"
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        help="also compile the cases of this importable module (repeatable)",
    )
    parser.add_argument("--list", action="store_true", help="list the cases, compile nothing")
    args = parser.parse_args(argv)

    modules = find_case_modules("vllm")
    for name in args.module:
        hook = getattr(importlib.import_module(name), CASES_HOOK, None)
        if not callable(hook):
            print(f"--module: expected a module defining {CASES_HOOK}(), got {name!r}")
            return 2
        modules.append((name, hook))
    cases = [
        (module, case)
        for module, hook in modules
        for case in hook()
        if not args.only or any(s in module or s in case.name for s in args.only)
    ]
    if not cases:
        print("no Triton compile cases found", file=sys.stderr)
        return 1
    if args.list:
        for module, case in cases:
            print(f"{module}  {case.name}  ({len(case.constexprs)} constexprs)")
        print(f"{len(cases)} cases in {len(modules)} modules")
        return 0

    header = f"{'module':<52} {'case':<64} {'target':<7} {'status':<6} {'seconds':>7} "
    print(header + f"{'cubin B':>9} {'smem B':>7} {'regs':>4} {'stack':>5} {'loop':>6} {'cvt':>4}")
    start = time.perf_counter()
    failures = []
    jobs = [(module, case.name, arch) for module, case in cases for arch in args.arch]
    names = [(module, case.name) for module, case in cases]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        print(f"case names must be unique within a module, got repeats {duplicates}")
        return 1
    # Spawned, not forked: the case hooks run torch ops in this process (a forked child can
    # deadlock in torch's thread pool) and each worker imports the kernel modules itself anyway.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=spawn) as pool:
        for result in pool.map(_compile_named, *zip(*jobs, strict=True)):
            print(_row(result), flush=True)
            if result.error is not None:
                failures.append(result)
    total = time.perf_counter() - start
    print(f"{len(cases)} cases x {len(args.arch)} targets compiled in {total:.1f} s")
    for r in failures:
        print(f"FAILED: {r.module}:{r.case} for sm_{r.arch}: {r.error}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
