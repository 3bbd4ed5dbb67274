"""The normalized offloading config (upstream v0.33's ``vllm.v1.kv_offload.config``): the
records keep what they are given and refuse a bad field by name when built."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

PARALLEL = dict(
    rank=1,
    world_size=2,
    tp_size=2,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    data_parallel_index=0,
    data_parallel_size=1,
    data_parallel_rank_local=None,
    is_parallelism_agnostic=False,
)


def config(**changes: Any) -> OffloadingConfig:
    fields: dict[str, Any] = dict(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0, 4),),
        worker_kv_bytes_per_block=65536,
        enable_kv_cache_events=True,
        extra_config={"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 20},
        engine_id="engine-0",
        model=OffloadingModelConfig("org/model", "bfloat16", 4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig(**PARALLEL),
    )
    fields.update(changes)
    return OffloadingConfig(**fields)


def test_a_config_keeps_its_fields_and_is_frozen() -> None:
    c = config(kv_cache_layout="HND")
    assert c.groups[0].sliding_window_size_in_chunks == 4 and c.cache.blocks_per_chunk == 2
    assert c.parallel.rank == 1 and c.model.max_model_len == 4096
    assert not c.replicated_layout and not c.canonical_layout and c.kv_cache_layout == "HND"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.engine_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: OffloadingGroupConfig(0, ("l",), 0), "tokens_per_block: expected a positive"),
        (lambda: OffloadingGroupConfig(16, ["l"], 0), "layer_names: expected a tuple of str"),
        (lambda: OffloadingGroupConfig(16, ("l",), -1), "group_id: expected an int >= 0"),
        (
            lambda: OffloadingGroupConfig(16, ("l",), 0, 0),
            "sliding_window_size_in_chunks: expected a positive int",
        ),
        (lambda: OffloadingModelConfig("", "fp8"), "name: expected a non-empty str"),
        (lambda: OffloadingModelConfig("m", "fp8", -1), "max_model_len: expected an int >= 0"),
        (lambda: OffloadingCacheConfig(16, 0), "blocks_per_chunk: expected a positive int"),
        (lambda: OffloadingCacheConfig(True, 1), "tokens_per_hash: expected a positive int"),
        (
            lambda: OffloadingParallelConfig(**{**PARALLEL, "rank": -1}),
            "rank: expected an int >= 0",
        ),
        (
            lambda: OffloadingParallelConfig(**{**PARALLEL, "data_parallel_index": 1}),
            "data_parallel_index: expected a replica index below data_parallel_size=1, got 1",
        ),
        (
            lambda: OffloadingParallelConfig(**{**PARALLEL, "tp_size": 0}),
            "tp_size: expected a positive int",
        ),
        (lambda: config(groups=[]), "groups: expected a tuple of OffloadingGroupConfig"),
        (lambda: config(worker_kv_bytes_per_block=-1), "worker_kv_bytes_per_block: expected"),
        (lambda: config(extra_config=None), "extra_config: expected a mapping"),
        (lambda: config(engine_id=""), "engine_id: expected a non-empty str"),
        (lambda: config(cache=None), "cache: expected an OffloadingCacheConfig"),
        (lambda: config(kv_cache_layout=1), "kv_cache_layout: expected None or a layout name"),
    ],
)
def test_a_bad_field_is_refused_by_name(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
