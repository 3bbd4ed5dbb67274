"""The CPU medium's load/store spec, metric names and published facts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, ConfigInfo
from vllm.v1.kv_offload.config import OffloadingConfig


class CPUOffloadingMetrics:
    """Names of the metrics the CPU manager reports."""

    STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
    CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
    CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
    CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
    CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Chunk ids (slots) of the CPU-side buffers; ``block_ids`` is v0.22's name."""

    @staticmethod
    def medium() -> str:
        return "CPU"

    @property
    def chunk_ids(self) -> np.ndarray:
        return self.block_ids


@dataclass(frozen=True)
class CPUOffloadingInfo(ConfigInfo):
    """Fixed facts of a CPU tier, published as info-metric labels."""

    cpu_num_chunks: int
    """Chunk slots of the tier."""
    cpu_blocks_per_chunk: int
    """GPU blocks per chunk."""
    cpu_kv_cache_size_bytes: int
    """The tier's bytes, chunk padding included."""
    cpu_kv_cache_size_tokens: int | None
    """KV tokens the tier holds for requests of ``max_model_len`` tokens; None when that
    length or the cache groups are unknown."""

    @classmethod
    def from_config(
        cls, config: OffloadingConfig, num_chunks: int, kv_bytes_per_chunk: int
    ) -> CPUOffloadingInfo:
        """The facts of a tier of ``num_chunks`` chunks of ``kv_bytes_per_chunk`` bytes."""
        return cls(
            cpu_num_chunks=num_chunks,
            cpu_blocks_per_chunk=config.cache.blocks_per_chunk,
            cpu_kv_cache_size_bytes=num_chunks * kv_bytes_per_chunk,
            cpu_kv_cache_size_tokens=kv_cache_size_tokens(config, num_chunks),
        )


def kv_cache_size_tokens(config: OffloadingConfig, num_chunks: int) -> int | None:
    """Tokens ``num_chunks`` chunks hold when every request is ``max_model_len`` tokens long.

    One such request takes, per group, a chunk per ``tokens_per_block * blocks_per_chunk``
    tokens (rounded up), at most the group's window; the chunks go round that many times.
    """
    max_model_len = config.model.max_model_len
    if max_model_len <= 0 or not config.groups:
        return None
    chunks_per_request = 0
    for group in config.groups:
        tokens_per_chunk = group.tokens_per_block * config.cache.blocks_per_chunk
        chunks = -(-max_model_len // tokens_per_chunk)
        if group.sliding_window_size_in_chunks is not None:
            chunks = min(chunks, group.sliding_window_size_in_chunks)
        chunks_per_request += chunks
    return num_chunks * max_model_len // chunks_per_request
