"""The CPU medium's load/store spec."""

from __future__ import annotations

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Offloaded block ids in the CPU-side buffers."""

    @staticmethod
    def medium() -> str:
        return "CPU"
