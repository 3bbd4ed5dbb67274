"""The CUDA platform: capabilities come from the CUDA runtime."""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.platforms.interface import DeviceCapability, Platform


class CudaPlatform(Platform):
    device_type: ClassVar[str] = "cuda"

    @classmethod
    def device_count(cls) -> int:
        return torch.cuda.device_count()

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))
