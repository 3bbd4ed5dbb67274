"""HiSparse's worker side (:mod:`vllm.v1.hisparse.binding`, the host pool of
:mod:`vllm.v1.hisparse.runtime`): spec resolution, binding to stand-in cache handles, and the
error paths upstream's tests/v1/worker/test_attn_utils.py leaves open."""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

import vllm.v1.hisparse.binding as binding
import vllm.v1.hisparse.runtime as runtime
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MLAAttentionSpec,
)

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _mla(block_size: int) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )


def _layer(sizes: list[int]) -> SimpleNamespace:
    backend = SimpleNamespace(
        get_name=lambda: "FAKE", get_supported_kernel_block_sizes=lambda: sizes
    )
    return SimpleNamespace(get_attn_backend=lambda: backend)


def test_resolve_hisparse_specs_adds_derived_specs(monkeypatch):
    resident = HiSparseResidentSpec(block_size=32, page_size=4096)
    seen = {}

    def groups(config, specs):
        seen.update(specs)
        return [KVCacheGroupSpec(["m.hisparse_resident"], resident)]

    monkeypatch.setattr(binding, "get_hisparse_kv_cache_groups", groups)
    dense = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=8, dtype=torch.float32)
    specs = {"m": _mla(64), "d": dense}
    resolved = binding.resolve_hisparse_specs(None, specs, {"m": _layer([32])})
    assert resolved["m"].block_size == 32 and resolved["d"] is dense
    assert resolved["m.hisparse_resident"] is resident
    # Only the MLA specs are laid out by HiSparse.
    assert list(seen) == ["m"]
    assert binding.resolve_hisparse_specs(None, {"d": dense}, {}) == {"d": dense}


def test_resolve_hisparse_specs_rejects_mixed_block_sizes():
    with pytest.raises(ValueError, match=r"one scheduler block size .* got \[32, 64\]"):
        binding.resolve_hisparse_specs(
            None, {"a": _mla(64), "b": _mla(32)}, {"a": _layer([32]), "b": _layer([32])}
        )


def test_allocate_hisparse_kv_caches_needs_one_host_tensor_size():
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=4, dtype=torch.float32)
    page = spec.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=n * page,
            layers=[name],
            layer_stride=n * page,
            block_stride=page,
            host_resident=True,
        )
        for n, name in [(2, "a"), (3, "b")]
    ]
    config = KVCacheConfig(
        num_blocks=4,
        hisparse_host_num_blocks=3,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], spec, host_resident=True)],
    )
    pool = MagicMock()
    with pytest.raises(ValueError, match="host-resident tensors of one size"):
        binding.allocate_hisparse_kv_caches(config, "cpu", KVCacheLayout.LBHNC, [2], pool)
    pool.allocate.assert_not_called()


def test_host_pool_keeps_one_size_and_has_no_shared_mode(monkeypatch):
    pinned = torch.empty(16, dtype=torch.int8)
    monkeypatch.setattr(runtime, "allocate_pinned_host_pool", lambda size: (pinned, pinned))
    monkeypatch.setattr(runtime, "check_hisparse_host_memory", lambda size: None)
    pool = runtime.HiSparseHostPool(None, SimpleNamespace(hisparse_shared_host_pool=False))
    assert pool.allocate(16) is pinned and pool.registered is pinned
    with pytest.raises(ValueError, match="size: expected the host pool's 16 bytes, got 8"):
        pool.allocate(8)
    shared = runtime.HiSparseHostPool(None, SimpleNamespace(hisparse_shared_host_pool=True))
    with pytest.raises(RuntimeError, match="no tensor-parallel group"):
        shared.allocate(16)


def test_host_pool_checks_free_ram_and_size():
    with pytest.raises(ValueError, match="host_pool_gib: expected a HiSparse host pool that fits"):
        runtime.check_hisparse_host_memory(2**62)
    runtime.check_hisparse_host_memory(1)
    with pytest.raises(ValueError, match="size: expected a positive int"):
        runtime.allocate_pinned_host_pool(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_host_pool_needs_cuda():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        runtime.allocate_pinned_host_pool(4096)


@_NEEDS_CUDA
def test_pinned_host_pool_registers_and_releases():
    pool, registered = runtime.allocate_pinned_host_pool(5000)
    assert pool.numel() == 5000 and registered.data_ptr() % 4096 == 0
    assert registered.numel() % 4096 == 0 and registered.is_pinned()
    pinned = [registered]
    runtime.release_pinned_state([], pinned)
    assert pinned == [] and not registered.is_pinned()


def test_release_pinned_state_keeps_pools_when_device_unusable(monkeypatch):
    def broken():
        raise RuntimeError("device lost")

    monkeypatch.setattr(torch.accelerator, "synchronize", broken)
    pools = [torch.empty(4, dtype=torch.int8)]
    state = SimpleNamespace(_host_cache=1, registered_host_pool=2, hot_backing=3)
    runtime.release_pinned_state([state], pools)
    assert len(pools) == 1 and hasattr(state, "_host_cache")


def test_release_pinned_state_stops_at_failed_unregister(monkeypatch):
    cudart = MagicMock()
    cudart.cudaHostUnregister.return_value.value = 1
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    pools = [torch.empty(4, dtype=torch.int8), torch.empty(4, dtype=torch.int8)]
    region = MagicMock()
    runtime.release_pinned_state([], pools, region)
    assert len(pools) == 2
    cudart.cudaHostUnregister.assert_called_once_with(pools[1].data_ptr())
    cudart.cudaGetLastError.assert_called_once()
    region.cleanup.assert_called_once()


def test_runtime_buffers_shared_by_every_handle():
    with pytest.raises(ValueError, match="cache_handles: expected the bound HiSparse"):
        runtime.initialize_hisparse_runtime_buffers([], max_num_reqs=2)
    unbound = SimpleNamespace(view=None, runtime=SimpleNamespace())
    with pytest.raises(ValueError, match=r"cache_handles\[0\]: expected a handle with a bound"):
        runtime.initialize_hisparse_runtime_buffers([unbound], max_num_reqs=2)
    view = SimpleNamespace(cache=torch.zeros(1))
    handles = [SimpleNamespace(view=view, runtime=SimpleNamespace()) for _ in range(2)]
    runtime.initialize_hisparse_runtime_buffers(handles, max_num_reqs=3)
    indices = handles[0].runtime.request_state_indices
    assert indices.tolist() == [-1, -1, -1] and handles[1].runtime.request_state_indices is indices


class _Runtime:
    def bind_hot_cache(
        self, raw, *, byte_offset, block_stride, num_blocks, block_size, block_table
    ):
        self.hot = SimpleNamespace(cache=raw[byte_offset:].view(num_blocks, -1))
        self.hot_table = block_table

    def bind_source_cache(self, source, *, registered_host_pool):
        self.source = source


class _Handle:
    def __init__(self) -> None:
        self.runtime = _Runtime()
        self.view = None

    def bind_cache(
        self, raw, *, byte_offset, block_stride, num_blocks, block_size, block_table, slot_mapping
    ):
        self.view = SimpleNamespace(cache=raw[byte_offset:].view(num_blocks, -1))
        self.table = block_table


def _bind_config(page: int) -> KVCacheConfig:
    source = _mla(4)
    return KVCacheConfig(
        num_blocks=2,
        hisparse_host_num_blocks=2,
        kv_cache_tensors=[
            KVCacheTensor(
                size=2 * source.page_size_bytes,
                layers=["m"],
                layer_stride=2 * source.page_size_bytes,
                block_stride=source.page_size_bytes,
                host_resident=True,
            ),
            KVCacheTensor(
                size=2 * page, layers=["m.hisparse_resident"], layer_stride=0, block_stride=page
            ),
            KVCacheTensor(
                size=2 * page, layers=["m.hisparse_hot"], layer_stride=0, block_stride=page
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["m"], source, host_resident=True),
            KVCacheGroupSpec(
                ["m.hisparse_resident"], HiSparseResidentSpec(block_size=4, page_size=page)
            ),
            KVCacheGroupSpec(
                ["m.hisparse_hot"],
                HiSparseHotSpec(block_size=4, page_size=page, blocks_per_request=1),
            ),
        ],
    )


def test_bind_hisparse_kv_caches_binds_resident_hot_and_source():
    page = 64
    config = _bind_config(page)
    device = torch.zeros(2 * page, dtype=torch.int8)
    registered = torch.zeros(4096, dtype=torch.int8)
    host_pool = SimpleNamespace(registered=registered, shared_region=None)
    kv_caches = {"m": registered[:16], "m.hisparse_resident": device, "m.hisparse_hot": device}
    handle = _Handle()
    forward_context = {"m": SimpleNamespace(hisparse_cache=handle, is_draft_layer=False)}
    tables = [torch.full((2, 3), g, dtype=torch.int32) for g in range(3)]
    block_tables = SimpleNamespace(input_block_tables=tables, slot_mappings=tables)
    handles = binding.bind_hisparse_kv_caches(
        forward_context=forward_context,
        kv_cache_config=config,
        kv_caches=kv_caches,
        block_tables=block_tables,
        host_pool=host_pool,
    )
    assert handles == [handle]
    assert "m.hisparse_hot" not in kv_caches
    assert kv_caches["m.hisparse_resident"] is handle.view.cache
    assert handle.residency.shape == (1, 2, 3) and handle.runtime.resident_source_index == 0
    assert handle.runtime.source is kv_caches["m"] and handle.draft_layer is False
    assert handle.source_block_table is tables[0] and handle.mirror_slot_mapping is tables[0]


def test_bind_hisparse_kv_caches_rejects_missing_pool_and_hot_caches():
    config = _bind_config(64)
    args = dict(forward_context={}, kv_cache_config=config, kv_caches={}, block_tables=None)
    with pytest.raises(ValueError, match="host_pool: expected an allocated host pool"):
        binding.bind_hisparse_kv_caches(
            **args, host_pool=SimpleNamespace(registered=None, shared_region=None)
        )
    no_hot = KVCacheConfig(
        num_blocks=2,
        hisparse_host_num_blocks=2,
        kv_cache_tensors=config.kv_cache_tensors[:1],
        kv_cache_groups=config.kv_cache_groups[:1],
    )
    pool = SimpleNamespace(registered=torch.zeros(8, dtype=torch.int8), shared_region=None)
    with pytest.raises(RuntimeError, match="found no hot caches"):
        binding.bind_hisparse_kv_caches(
            forward_context={},
            kv_cache_config=no_hot,
            kv_caches={},
            block_tables=None,
            host_pool=pool,
        )
