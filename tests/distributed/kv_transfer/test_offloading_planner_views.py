"""Offloading the KV cache exactly as the worker builds it: planner groups and tensors,
``_allocate_kv_cache`` buffers and ``_reshape_kv_cache`` views (REFERENCE backend)."""

from __future__ import annotations

import pytest
import torch
from kv_offload_test_utils import (
    DEVICE,
    WorkerKVCache,
    make_connector,
    round_trip,
    write_kv,
)

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_offload.worker.page_views import get_layer_kv_cache_specs

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
attn_utils = pytest.importorskip("vllm.v1.worker.gpu.attn_utils")
reference_backend = pytest.importorskip("vllm.v1.attention.backends.reference")

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def worker_kv_cache(
    specs: dict[str, KVCacheSpec], blocks: int
) -> tuple[WorkerKVCache, dict[str, object]]:
    vllm_config = kv_cache_utils.planner_vllm_config(max_model_len=1)
    groups = kv_cache_utils.get_kv_cache_groups(
        vllm_config, dict(specs), policy=kv_cache_utils.PLANNER_LAYOUT
    )
    per_block = kv_cache_utils.bytes_per_block(groups)
    config: KVCacheConfig = kv_cache_utils.get_kv_cache_config_from_groups(
        vllm_config, groups, per_block * blocks
    )
    assert config.num_blocks == blocks
    raw = attn_utils._allocate_kv_cache(config, DEVICE)
    g = torch.Generator().manual_seed(3)
    buffers = [raw[t.shared_by[0]] for t in config.kv_cache_tensors]
    for buf in buffers:
        buf.copy_(torch.randint(-128, 128, buf.shape, dtype=torch.int8, generator=g))
    backends = [reference_backend.ReferenceAttentionBackend] * len(config.kv_cache_groups)
    views = attn_utils._reshape_kv_cache(config, raw, backends)
    return WorkerKVCache(config, buffers, raw, views), views


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8", "nvfp4"])
def test_uniform_type_specs_with_worker_views(impl: str, kv_cache_dtype: str) -> None:
    quant = {"fp8": KVQuantMode.FP8_PER_TENSOR, "nvfp4": KVQuantMode.NVFP4}.get(
        kv_cache_dtype, KVQuantMode.NONE
    )
    dtype = torch.bfloat16 if quant == KVQuantMode.NONE else torch.uint8

    def spec(head_size: int, quantized: bool = True) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=head_size,
            dtype=dtype if quantized else torch.bfloat16,
            kv_quant_mode=quant if quantized else KVQuantMode.NONE,
        )

    specs: dict[str, KVCacheSpec] = {
        "model.layers.0.self_attn": spec(64),
        "model.layers.1.self_attn": spec(128),
        "model.layers.2.self_attn": spec(128, quantized=False),  # a skipped layer
    }
    kv, views = worker_kv_cache(specs, blocks=9)
    group_spec = kv.config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(group_spec, UniformTypeKVCacheSpecs)
    connector = make_connector(kv.config, impl, block_size_factor=1)
    connector.register_kv_caches(views, kv.config)
    handlers = connector.spec.handlers
    assert handlers is not None and handlers.num_gpu_blocks == 9
    for seed, (name, layer_spec) in enumerate(specs.items()):
        view = views[name]
        assert isinstance(view, torch.Tensor) and isinstance(layer_spec, FullAttentionSpec)
        dtype_str = kv_cache_dtype if layer_spec.kv_quant_mode.is_quantized else "bfloat16"
        write_kv(impl, view, layer_spec, dtype_str, [6, 1, 4], seed)
    page_sizes = [s.page_size_bytes for s in specs.values()]
    assert [t.shape[1] for t in handlers.gpu_tensors] == page_sizes
    round_trip(connector, kv, page_sizes, 1, [6, 1, 4])
    connector.shutdown()


def test_mamba_attention_hybrid_with_worker_views(impl: str) -> None:
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=16, shapes=((3, 192), (4, 16, 32)), dtypes=(torch.bfloat16, torch.float32)
    )
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4):
        specs[f"model.layers.{i}.mixer" if i % 2 else f"model.layers.{i}.self_attn"] = (
            mamba if i % 2 else attn
        )
    kv, views = worker_kv_cache(specs, blocks=8)
    layer_specs = get_layer_kv_cache_specs(kv.config)
    # The planner pads one of the two to a common page size and shares buffers.
    assert any(len(t.shared_by) == 2 for t in kv.config.kv_cache_tensors)
    assert len({s.page_size_bytes for s in layer_specs.values()}) == 1
    block_sizes = {g.kv_cache_spec.block_size for g in kv.config.kv_cache_groups}
    assert len(block_sizes) == 1
    (gpu_block_size,) = block_sizes
    connector = make_connector(kv.config, impl, block_size_factor=1, gpu_block_size=gpu_block_size)
    connector.register_kv_caches(views, kv.config)
    handlers = connector.spec.handlers
    assert handlers is not None and handlers.num_gpu_blocks == 8
    assert len(handlers.gpu_tensors) == len(kv.config.kv_cache_tensors)
    page_sizes = [t.shape[1] for t in handlers.gpu_tensors]
    round_trip(connector, kv, page_sizes, 1, [2, 7, 0])
    connector.shutdown()
