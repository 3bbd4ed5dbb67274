"""The tiering manager's primary tier: the CPU manager over a shared offload region.

The GPU-facing operations keep their names (``prepare_load`` / ``prepare_store`` ...); the
same operations seen from a secondary tier are named ``prepare_read`` / ``complete_read``
(pin rows a cascade copies out of) and ``prepare_write`` / ``complete_write`` (reserve and
publish rows a promotion copies into), so the tiering code never calls a "load" on a store
path.
"""

from __future__ import annotations

from collections.abc import Collection

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """:class:`CPUOffloadingManager` whose chunks live in ``mmap_region`` (which it cleans up
    on shutdown), exposed to secondary tiers by :meth:`get_kv_memoryview`."""

    def __init__(
        self,
        num_chunks: int,
        mmap_region: SharedOffloadRegion,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        info: CPUOffloadingInfo | None = None,
    ):
        super().__init__(
            num_chunks=num_chunks,
            cache_policy=cache_policy,
            cache_policy_module_path=cache_policy_module_path,
            enable_events=enable_events,
            info=info,
        )
        self._mmap_region = mmap_region
        self.complete_read = self.complete_load
        self.prepare_write = self.prepare_store
        self.complete_write = self.complete_store
        self._kv_memoryview: memoryview = mmap_region.create_kv_memoryview()

    def prepare_read(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        """Pin ``keys`` (stored, ready) for a copy into a secondary tier.

        Unlike :meth:`prepare_load`, records no access for the request: a cascade is tiering's
        own work, not a use of the chunks, and may run after the request finished.
        """
        return self._prepare_load(keys, req_context, record_access=False)

    def get_kv_memoryview(self) -> memoryview:
        """The primary chunks: a ``[num_chunks, chunk bytes]`` memoryview of the shared region,
        row ``c`` being chunk ``c``."""
        return self._kv_memoryview

    def shutdown(self) -> None:
        super().shutdown()
        self._kv_memoryview.release()
        self._mmap_region.cleanup()


__all__ = ["CPUPrimaryTierOffloadingManager"]
