"""``current_platform``, as upstream vLLM names it: CUDA when torch sees a CUDA device, else
CPU (chosen once, at import)."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import CpuArchEnum, DeviceCapability, Platform
from vllm.utils.torch_runtime import on_cuda


def _detect() -> Platform:
    return CudaPlatform() if on_cuda() else CpuPlatform()


current_platform: Platform = _detect()

__all__ = [
    "CpuArchEnum",
    "CpuPlatform",
    "CudaPlatform",
    "DeviceCapability",
    "Platform",
    "current_platform",
]
