"""Triton under upstream vLLM's import path (``vllm.triton_utils``): ``triton`` and ``tl`` are the
real modules when Triton is installed, placeholders otherwise (:data:`TRITON_INSTALLED` says
which); :data:`HAS_TRITON` says whether Triton can also launch kernels in this process.

Kernel modules import them from here so that the library imports without Triton. Every module
holding Triton kernels also defines ``triton_compile_cases()`` (see :mod:`vllm.triton_utils.aot`):
``tools/compile_triton_kernels.py`` compiles those cases for sm_80/90/100 on a machine without a
GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.triton_utils.importing import (
    HAS_TRITON,
    TRITON_INSTALLED,
    TritonLanguagePlaceholder,
    TritonPlaceholder,
    triton_interpreted,
)

# The real modules even where no kernel can launch: ahead-of-time compiles need only them.
if TYPE_CHECKING or TRITON_INSTALLED:
    import triton
    import triton.language as tl
else:
    triton = TritonPlaceholder()
    tl = TritonLanguagePlaceholder()

LOG2E = 1.4426950408889634
LOGE2 = 0.6931471805599453


def row_alignment(*places: int) -> int:
    """The ``ROW_ALIGN`` of rows of bytes whose start and pieces lie at ``places`` (addresses,
    strides and offsets, in bytes): 4 when every one is a multiple of 4, else 1. Kernels move
    4-byte-aligned rows a word at a time; per-token-head rows (``D + 4`` bytes) are not all
    16-byte aligned, so without it each byte is its own access."""
    return 4 if all(place % 4 == 0 for place in places) else 1


__all__ = [
    "HAS_TRITON",
    "LOG2E",
    "LOGE2",
    "TRITON_INSTALLED",
    "row_alignment",
    "tl",
    "triton",
    "triton_interpreted",
]
