"""``DeviceConfig``: the device the engine runs on (upstream's config, its KV-cache fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DeviceConfig"]


@dataclass
class DeviceConfig:
    """``device``: ``"auto"`` (the machine's accelerator, else the CPU), a device type name
    (``"cpu"``, ``"cuda"``) or a ``torch.device``; after construction a ``torch.device``.
    ``device_type``: the type name."""

    device: str | torch.device | None = "auto"
    device_type: str = field(init=False)

    def __post_init__(self) -> None:
        if self.device == "auto":
            # torch's accelerator probe (vllm.platforms sits above the configs).
            accelerator = torch.accelerator.current_accelerator()
            self.device_type = "cpu" if accelerator is None else accelerator.type
        elif isinstance(self.device, torch.device):
            self.device_type = self.device.type
        elif isinstance(self.device, str) and self.device:
            self.device_type = self.device
        else:
            raise TypeError(
                f"device: expected 'auto', a device type name or a torch.device, got "
                f"{self.device!r}"
            )
        self.device = torch.device(self.device_type)
