"""Upstream's ``LoRARequest``, reduced to what the KV-cache block manager reads: the adapter
name keys block hashes, the integer id rides on KV events."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoRARequest"]


@dataclass(eq=False)
class LoRARequest:
    """A LoRA adapter a request runs with. Two requests share cached KV only when their adapter
    names are equal, so equality and hashing go by ``lora_name`` alone."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id: expected an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError(f"lora_path: expected a non-empty path, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
