"""HiSparse settings resolved for one engine, and the host pool's geometry.

Units: ``device_buffer_size`` and ``top_k`` in rows (tokens), strides in bytes.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.platforms import current_platform
from vllm.utils.math_utils import round_up

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = [
    "HOST_BLOCK_ALIGNMENT",
    "MAX_DEVICE_BUFFER_ROWS",
    "ResolvedHiSparseConfig",
    "current_platform",
    "get_hisparse_host_block_stride",
    "hisparse_host_pool_gib",
    "max_decode_query_len",
    "use_shared_hisparse_host_pool",
]

MAX_DEVICE_BUFFER_ROWS = 2**15
"""Hot-buffer rows are addressed by int16 slot indices."""

HOST_BLOCK_ALIGNMENT = mmap.PAGESIZE
"""Bytes a shared (memory-mapped) host pool's blocks are aligned to: one OS page."""


def max_decode_query_len(vllm_config: Any) -> int:
    """Query rows of one decode step: the token plus its speculative tokens."""
    spec = getattr(vllm_config, "speculative_config", None)
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


@dataclass(frozen=True)
class ResolvedHiSparseConfig:
    """``top_k``: rows the indexer picks per query; ``device_buffer_size``: a request's hot
    rows; ``max_union_rows``: most rows one step's decode queries can pick together."""

    top_k: int
    device_buffer_size: int
    max_union_rows: int
    eager_host_mirror: bool = True

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_top_k: int) -> ResolvedHiSparseConfig | None:
        """None when HiSparse is off; ``ValueError`` when the hot buffer cannot hold every
        decode query's top-k or exceeds :data:`MAX_DEVICE_BUFFER_ROWS`."""
        config = vllm_config.attention_config.hisparse_config
        if config is None:
            return None
        queries = max_decode_query_len(vllm_config)
        needed = queries * model_top_k
        # One more top-k than a step can pick leaves LRU slack.
        size = (
            (queries + 1) * model_top_k
            if config.device_buffer_size is None
            else config.device_buffer_size
        )
        if size < needed:
            raise ValueError(
                f"device_buffer_size: expected at least {needed} rows (every decode query's "
                f"index_topk={model_top_k} for {queries} queries), got {size}"
            )
        if size > MAX_DEVICE_BUFFER_ROWS:
            raise ValueError(
                f"device_buffer_size: expected at most {MAX_DEVICE_BUFFER_ROWS} rows (int16 "
                f"slot indices), got {size}"
            )
        return cls(
            top_k=model_top_k,
            device_buffer_size=size,
            max_union_rows=needed,
            eager_host_mirror=config.eager_host_mirror,
        )


def use_shared_hisparse_host_pool(vllm_config: Any) -> bool:
    """True when one node's TP ranks (each holding the same replicated MLA KV) can share one
    memory-mapped host pool: CUDA/ROCm, TP > 1 and no other parallelism."""
    parallel = vllm_config.parallel_config
    return (
        current_platform.is_cuda_alike()
        and parallel.tensor_parallel_size > 1
        and parallel.world_size == parallel.tensor_parallel_size
        and parallel.decode_context_parallel_size == 1
        and parallel.prefill_context_parallel_size == 1
    )


def get_hisparse_host_block_stride(page_size_bytes: int, *, use_shared_host_pool: bool) -> int:
    """Bytes between host blocks: the page, OS-page aligned when the pool is shared."""
    if use_shared_host_pool:
        return round_up(page_size_bytes, HOST_BLOCK_ALIGNMENT)
    return page_size_bytes


def hisparse_host_pool_gib(vllm_config: VllmConfig) -> float | None:
    """The ``host_pool_gib`` option of the one ``HiSparseConnector`` (directly or inside a
    ``MultiConnector``), None without one; ``ValueError`` for two."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        return None
    if transfer.kv_connector == "MultiConnector":
        connectors = transfer.kv_connector_extra_config.get("connectors", [])
    else:
        connectors = [
            {
                "kv_connector": transfer.kv_connector,
                "kv_connector_extra_config": transfer.kv_connector_extra_config,
            }
        ]
    options = [
        c.get("kv_connector_extra_config", {})
        for c in connectors
        if c.get("kv_connector") == "HiSparseConnector"
    ]
    if len(options) > 1:
        raise ValueError(
            f"kv_transfer_config: expected at most one HiSparseConnector, got {len(options)}"
        )
    if not options or options[0].get("host_pool_gib") is None:
        return None
    return float(options[0]["host_pool_gib"])
