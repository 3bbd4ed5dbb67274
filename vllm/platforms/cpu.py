"""The CPU platform: no compute capability, so capability-gated (GPU-only) cases skip."""

from __future__ import annotations

from typing import ClassVar

from vllm.platforms.interface import Platform


class CpuPlatform(Platform):
    device_type: ClassVar[str] = "cpu"
