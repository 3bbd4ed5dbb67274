"""Offloading to CPU memory."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from vllm.utils import check_positive_int
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers, SwapBlocksFn
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.kv_offload.worker.page_views import (
    LayerKVCache,
    canonicalize_kv_caches,
    kv_cache_tensor_page_sizes,
)
from vllm.v1.kv_offload.worker.worker import OffloadingHandler


class CPUOffloadingSpec(OffloadingSpec):
    """Offload KV-cache pages to (pinned, on CUDA machines) CPU memory.

    ``extra_config`` (besides the block-size options of :class:`OffloadingSpec`):
    ``"cpu_bytes_to_use"``, the CPU memory budget in bytes, or ``"num_cpu_blocks"``, the number
    of offloaded blocks. ``num_blocks = cpu_bytes_to_use // bytes_per_offloaded_block`` where
    ``bytes_per_offloaded_block = block_size_factor * Σ page_size_bytes`` over the KV-cache
    buffers (one page per :class:`KVCacheTensor`; shared buffers count once).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        block_size: int,
        extra_config: Mapping[str, Any] | None = None,
        cp_size: int = 1,
        swap_blocks: SwapBlocksFn | None = None,
    ):
        super().__init__(kv_cache_config, block_size, extra_config, cp_size)
        self.swap_blocks = swap_blocks
        self.bytes_per_offloaded_block = self.block_size_factor * sum(
            kv_cache_tensor_page_sizes(kv_cache_config)
        )
        num_blocks = self.extra_config.get("num_cpu_blocks")
        cpu_bytes = self.extra_config.get("cpu_bytes_to_use")
        if (num_blocks is None) == (cpu_bytes is None):
            raise ValueError(
                "extra_config: set exactly one of 'cpu_bytes_to_use' (bytes) and "
                f"'num_cpu_blocks', got {num_blocks=!r}, {cpu_bytes=!r}"
            )
        if cpu_bytes is not None:
            num_blocks = int(cpu_bytes) // self.bytes_per_offloaded_block
            if num_blocks <= 0:
                raise ValueError(
                    f"extra_config['cpu_bytes_to_use']: {cpu_bytes} bytes hold no offloaded "
                    f"block of {self.bytes_per_offloaded_block} bytes"
                )
        self.num_blocks: int = check_positive_int("extra_config['num_cpu_blocks']", num_blocks)
        self._handlers: CpuGpuOffloadingHandlers | None = None

    @property
    def handlers(self) -> CpuGpuOffloadingHandlers | None:
        """The handlers built by :meth:`get_handlers` (None before)."""
        return self._handlers

    def get_handlers(
        self,
        kv_caches: Mapping[str, LayerKVCache],
        kv_cache_config: KVCacheConfig | None = None,
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        if self._handlers is None:
            self._handlers = CpuGpuOffloadingHandlers(
                canonicalize_kv_caches(kv_caches, kv_cache_config or self.kv_cache_config),
                block_size_factor=self.block_size_factor,
                num_cpu_blocks=self.num_blocks,
                swap_blocks=self.swap_blocks,
            )
        yield GPULoadStoreSpec, CPULoadStoreSpec, self._handlers.gpu_to_cpu_handler
        yield CPULoadStoreSpec, GPULoadStoreSpec, self._handlers.cpu_to_gpu_handler
