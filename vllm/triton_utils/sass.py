"""What a compiled Triton kernel costs, read from its cubin without a GPU.

``kernel_resources(cubin)`` runs the disassembler and object dumper that ship with Triton's
NVIDIA backend (``triton.knobs.nvidia``) over the cubin of an ahead-of-time compile
(:mod:`vllm.triton_utils.aot`) and reports registers per thread, the per-thread stack frame
(register spills and local arrays live there, in slow local memory) and the SASS instructions
of the longest loop body: for a kernel whose work is one loop over tiles (paged attention's
key loop), that count per tile is a static proxy for its issue cost, comparable between
kernel variants and formats on a machine with no GPU to time them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KernelResources", "kernel_resources", "parse_loop_body", "parse_resource_usage"]

_TIMEOUT_S = 120
# "/*1a40*/   @!P0 F2F.BF16.F16 R57, R49 ;": address, optional predicate, opcode, operands.
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
# Type conversions (int <-> float, between float widths): a quarter of the integer rate on
# sm_80 to sm_100, so one per decoded element bounds a decoder.
_CONVERSIONS = ("F2F", "I2F", "F2I", "I2FP", "F2IP")


@dataclass(frozen=True)
class KernelResources:
    """Per-thread resources of one compiled kernel and its hottest loop."""

    registers: int
    """Registers per thread."""
    stack_bytes: int
    """Per-thread stack frame in bytes (local memory: spills, local arrays); 0 is the goal."""
    loop_instructions: int
    """SASS instructions in the longest loop body (one trip); 0 when the kernel has no loop."""
    loop_opcodes: tuple[tuple[str, int], ...]
    """The loop body's opcodes (without modifiers) and their counts, most frequent first."""

    @property
    def loop_conversions(self) -> int:
        """Type-conversion instructions (``F2F``, ``I2F``, ...) in the loop body."""
        return sum(count for opcode, count in self.loop_opcodes if opcode in _CONVERSIONS)


def parse_resource_usage(text: str) -> tuple[int, int]:
    """``(registers, stack bytes)`` from ``cuobjdump --dump-resource-usage`` output of a cubin
    holding one kernel."""
    registers = re.search(r"\bREG:(\d+)", text)
    stack = re.search(r"\bSTACK:(\d+)", text)
    if registers is None or stack is None:
        raise ValueError(f"cuobjdump output: expected REG:<n> and STACK:<n>, got {text!r}")
    return int(registers.group(1)), int(stack.group(1))


def parse_loop_body(sass: str) -> Counter[str]:
    """Opcode counts of the longest loop body in ``nvdisasm -c`` output: the instructions from
    a backward branch's target label to the branch itself (empty without a backward branch)."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    instructions: list[tuple[int, str, str]] = []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label is not None:
            pending.append(label.group(1))
            continue
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            continue
        address = int(instruction.group(1), 16)
        labels.update(dict.fromkeys(pending, address))
        pending = []
        instructions.append((address, instruction.group(2), instruction.group(3)))
    loops = []
    for address, opcode, operands in instructions:
        target = _BRANCH_TARGET.search(operands) if opcode.startswith("BRA") else None
        if target is not None and labels.get(target.group(1), address + 1) <= address:
            loops.append((labels[target.group(1)], address))
    if not loops:
        return Counter()
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return Counter(op.split(".")[0] for address, op, _ in instructions if first <= address <= last)


def _run(tool: str, *args: str) -> str:
    result = subprocess.run(
        [tool, *args], capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{Path(tool).name} {' '.join(args)}: exit {result.returncode}: "
            f"{result.stderr.strip()[:500]}"
        )
    return result.stdout


def kernel_resources(cubin: bytes) -> KernelResources:
    """Registers, stack frame and hottest-loop instructions of the one kernel in ``cubin``,
    through the ``cuobjdump`` and ``nvdisasm`` that Triton ships."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = _run(knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path))
        sass = _run(knobs.nvidia.nvdisasm.path, "-c", str(path))
    registers, stack = parse_resource_usage(usage)
    body = parse_loop_body(sass)
    return KernelResources(registers, stack, sum(body.values()), tuple(body.most_common()))
