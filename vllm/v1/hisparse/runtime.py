"""HiSparse settings resolved for one engine, the host pool's geometry, and the engine's
pinned host pool (kept from the profiling run to the real KV cache).

Units: ``device_buffer_size`` and ``top_k`` in rows (tokens), sizes and strides in bytes.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm.platforms import current_platform
from vllm.utils.math_utils import round_up

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = [
    "HOST_BLOCK_ALIGNMENT",
    "MAX_DEVICE_BUFFER_ROWS",
    "HiSparseHostPool",
    "ResolvedHiSparseConfig",
    "allocate_pinned_host_pool",
    "check_hisparse_host_memory",
    "current_platform",
    "drop_hisparse_host_pool",
    "get_hisparse_host_block_stride",
    "get_hisparse_host_pool",
    "hisparse_host_pool_gib",
    "initialize_hisparse_runtime_buffers",
    "max_decode_query_len",
    "release_pinned_state",
    "use_shared_hisparse_host_pool",
]

logger = logging.getLogger(__name__)

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


HOST_MEMORY_HEADROOM = 0.95
"""Share of the available RAM a private host pool may take (the rest is left to co-tenants)."""


def check_hisparse_host_memory(pool_bytes: int) -> None:
    """``ValueError`` when a host pool of ``pool_bytes`` bytes does not fit in the RAM free now
    (less headroom)."""
    import psutil  # only the worker's HiSparse path needs it (the planner imports this module)

    available = psutil.virtual_memory().available
    if pool_bytes > available * HOST_MEMORY_HEADROOM:
        raise ValueError(
            f"host_pool_gib: expected a HiSparse host pool that fits the "
            f"{available / 2**30:.1f} GiB of free RAM, got {pool_bytes / 2**30:.1f} GiB"
        )


def allocate_pinned_host_pool(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool, registered)``: ``size`` bytes of page-locked host memory, and the OS-page
    aligned range registered with CUDA (what :func:`release_pinned_state` unregisters).
    ``RuntimeError`` off CUDA (the pool exists for device copies) or when registering fails."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"size: expected a positive int (bytes), got {size!r}")
    if not current_platform.is_cuda_alike() or not torch.cuda.is_available():
        raise RuntimeError("HiSparse's host pool is pinned for device copies and needs a CUDA GPU")
    page = mmap.PAGESIZE
    padded = round_up(size, page)
    backing = torch.empty(padded + page, dtype=torch.int8, device="cpu")
    start = (-backing.data_ptr()) % page
    registered = backing[start : start + padded]
    error = torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), padded, 0)
    if getattr(error, "value", error) != 0:
        raise RuntimeError(f"cudaHostRegister of {padded} bytes failed (code {error})")
    return registered[:size], registered


class HiSparseHostPool:
    """The engine's one host pool: ``backing`` (the source caches' bytes), ``registered`` (the
    CUDA-registered range holding it) or ``shared_region`` (a memory map shared by the TP
    ranks)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.backing: torch.Tensor | None = None
        self.registered: torch.Tensor | None = None
        self.shared_region: Any | None = None

    def allocate(self, size: int) -> torch.Tensor:
        """The pool's ``size`` bytes, allocated and pinned on the first call, the same tensor
        afterwards (``ValueError`` if ``size`` changed)."""
        if self.backing is not None:
            if self.backing.numel() != size:
                raise ValueError(
                    f"size: expected the host pool's {self.backing.numel()} bytes, got {size}"
                )
            return self.backing
        if getattr(self.kv_cache_config, "hisparse_shared_host_pool", False):
            # Sharing needs the TP group's barrier to create and map the region together.
            raise RuntimeError(
                "kv_cache_config.hisparse_shared_host_pool: the library has no tensor-parallel "
                "group to share a HiSparse host pool with; plan with a private pool"
            )
        check_hisparse_host_memory(size)
        self.backing, self.registered = allocate_pinned_host_pool(size)
        return self.backing


_host_pools: dict[str, HiSparseHostPool] = {}


def get_hisparse_host_pool(vllm_config: Any, kv_cache_config: Any) -> HiSparseHostPool:
    """The host pool of the engine ``vllm_config.instance_id`` names (made on first use): it
    outlives the profiling KV cache, so the real one reuses its pinned memory."""
    instance_id = vllm_config.instance_id
    if instance_id not in _host_pools:
        _host_pools[instance_id] = HiSparseHostPool(vllm_config, kv_cache_config)
    return _host_pools[instance_id]


def drop_hisparse_host_pool(vllm_config: Any) -> None:
    """Forget the engine's host pool (the next lookup makes a new one)."""
    _host_pools.pop(vllm_config.instance_id, None)


def release_pinned_state(
    runtimes: list[Any],
    pinned_host_pools: list[torch.Tensor],
    shared_host_region: Any | None = None,
) -> None:
    """Unregister ``pinned_host_pools`` (after the device is idle), detach each runtime's host
    cache, registration and hot backing, then release ``shared_host_region``. If the device
    cannot synchronize, the pools stay registered (the OS reclaims them at exit)."""
    if pinned_host_pools or shared_host_region is not None:
        try:
            torch.accelerator.synchronize()
        except RuntimeError as error:
            logger.warning(
                "HiSparse: device unusable at teardown (%s); leaving %d host pools pinned",
                error,
                len(pinned_host_pools) + int(shared_host_region is not None),
            )
            return
        if pinned_host_pools:
            cudart = torch.cuda.cudart()
            while pinned_host_pools:
                error = cudart.cudaHostUnregister(pinned_host_pools[-1].data_ptr())
                if error.value != 0:
                    logger.warning(
                        "HiSparse: cudaHostUnregister failed (code %d); leaving %d host pools "
                        "pinned",
                        error.value,
                        len(pinned_host_pools),
                    )
                    cudart.cudaGetLastError()
                    break
                pinned_host_pools.pop()
    for runtime in runtimes:
        del runtime._host_cache
        del runtime.registered_host_pool
        del runtime.hot_backing
    if shared_host_region is not None:
        shared_host_region.cleanup()


def initialize_hisparse_runtime_buffers(cache_handles: list[Any], *, max_num_reqs: int) -> None:
    """Give every bound runtime the one request-state index table (``max_num_reqs`` rows, -1:
    no state), on the device of the first handle's resident cache."""
    if not cache_handles:
        raise ValueError("cache_handles: expected the bound HiSparse cache handles, got none")
    resident = cache_handles[0].view
    if resident is None:
        raise ValueError("cache_handles[0]: expected a handle with a bound resident cache")
    indices = torch.full((max_num_reqs,), -1, dtype=torch.int32, device=resident.cache.device)
    for handle in cache_handles:
        handle.runtime.request_state_indices = indices
