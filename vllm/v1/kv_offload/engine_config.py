"""The :class:`~vllm.v1.kv_offload.config.OffloadingConfig` of an engine, for specs built the
v0.22 way (from a ``VllmConfig`` and a ``KVCacheConfig``).

Upstream v0.33 builds this record in its offloading connector; this is the library's own
derivation, conservative where the engine's config does not say enough: no layout is claimed
parallelism-agnostic or replicated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.utils import check_positive_int
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.worker.page_views import kv_cache_tensor_page_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def blocks_per_chunk_from_extra_config(
    extra_config: dict[str, Any], tokens_per_block: tuple[int, ...]
) -> int:
    """GPU blocks per offloaded chunk: ``extra_config["blocks_per_chunk"]`` (v0.22:
    ``"block_size_factor"``), or ``"block_size"`` tokens (one GPU block size for all groups,
    of which it is a multiple); at most one of them; default 1."""
    options = ("blocks_per_chunk", "block_size_factor", "block_size")
    given = [name for name in options if name in extra_config]
    if len(given) > 1:
        raise ValueError(f"extra_config: expected at most one of {list(options)}, got {given}")
    if not given:
        return 1
    (name,) = given
    value = check_positive_int(f"extra_config[{name!r}]", int(extra_config[name]))
    if name != "block_size":
        return value
    sizes = set(tokens_per_block)
    if len(sizes) != 1:
        raise ValueError(
            "extra_config['block_size']: expected one block size for all KV-cache groups, got "
            f"{list(tokens_per_block)}"
        )
    (gpu,) = sizes
    if value % gpu:
        raise ValueError(
            f"extra_config['block_size']: expected a multiple of the GPU block size {gpu} "
            f"tokens, got {value}"
        )
    return value // gpu


def offloading_config_from_engine(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> OffloadingConfig:
    """What an offloading backend is told about the engine ``vllm_config`` runs with the KV
    cache ``kv_cache_config`` (see :class:`OffloadingConfig`)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        raise ValueError("vllm_config.kv_transfer_config: offloading needs one, got None")
    extra_config = dict(transfer.kv_connector_extra_config or {})
    parallel = vllm_config.parallel_config
    cp = parallel.decode_context_parallel_size * parallel.prefill_context_parallel_size
    groups = kv_cache_config.kv_cache_groups
    tokens_per_block = tuple(group.kv_cache_spec.block_size * cp for group in groups)
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    for size in tokens_per_block:
        if size % tokens_per_hash:
            raise ValueError(
                f"tokens_per_block={size} not divisible by tokens_per_hash={tokens_per_hash}. "
                "Hybrid models (e.g. Mamba+Attention) need --enable-prefix-caching to align "
                "block sizes."
            )
    model = vllm_config.model_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype == "auto" and model is not None:
        cache_dtype = str(model.dtype)
    events = vllm_config.kv_events_config
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(size, tuple(group.layer_names), index)
            for index, (group, size) in enumerate(zip(groups, tokens_per_block, strict=True))
        ),
        worker_kv_bytes_per_block=sum(kv_cache_tensor_page_sizes(kv_cache_config)),
        enable_kv_cache_events=events is not None and events.enable_kv_cache_events,
        extra_config=extra_config,
        engine_id=vllm_config.instance_id,
        # Without a model config (tests, tools) the model is unnamed and its length unknown.
        model=OffloadingModelConfig(
            name=model.model if model is not None else "unknown",
            dtype=cache_dtype.removeprefix("torch."),
            max_model_len=(model.max_model_len or 0) if model is not None else 0,
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash,
            blocks_per_chunk=blocks_per_chunk_from_extra_config(extra_config, tokens_per_block),
        ),
        parallel=OffloadingParallelConfig(
            rank=parallel.rank,
            world_size=parallel.world_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            pcp_size=parallel.prefill_context_parallel_size,
            dcp_size=parallel.decode_context_parallel_size,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )
