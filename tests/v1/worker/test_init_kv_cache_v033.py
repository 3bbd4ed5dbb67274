"""Upstream v0.33's runner entry point ``attn_utils.init_kv_cache(forward_context, ...)``: the
caches are allocated inside the caller's allocation scope, KV-sharing layers get their target's
tensor, every forward-context layer is bound to its cache (in kernel blocks where its attention
group splits blocks) and the caches come back by layer name. Also the two per-layer helpers it
brings, ``bind_kv_cache_to_layers`` and ``build_slot_mappings_by_layer``, and the error paths
upstream's tests leave open."""

from __future__ import annotations

import dataclasses
import inspect
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kv_cache_test_utils import attn_spec, one_group

from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.vllm import VllmConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.gpu.attn_utils import (
    bind_kv_cache_to_layers,
    build_slot_mappings_by_layer,
    init_kv_cache,
)

SPEC = attn_spec(num_kv_heads=2, head_size=8, dtype=torch.float32)
OWNERS = ("model.layers.0.attn", "model.layers.1.attn")
SHARER = "model.layers.2.attn"
CPU = torch.device("cpu")


class _Scope(AbstractContextManager):
    """Records whether the allocation runs inside it."""

    def __init__(self) -> None:
        self.active = False
        self.entered = 0

    def __enter__(self) -> _Scope:
        self.active = True
        self.entered += 1
        return self

    def __exit__(self, *args: Any) -> None:
        self.active = False


class _UnpackingLayer:
    """A layer that takes its cache through ``bind_kv_cache`` (as Mamba layers do)."""

    def __init__(self) -> None:
        self.bound: list[torch.Tensor] = []

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.bound.append(kv_cache)


def _config(num_blocks: int = 4) -> KVCacheConfig:
    config = one_group(SPEC, num_blocks * SPEC.page_size_bytes, layers=OWNERS)
    return dataclasses.replace(config, num_blocks=num_blocks)


def _model(share: bool = True) -> dict[str, Any]:
    layers: dict[str, Any] = {name: SimpleNamespace() for name in OWNERS}
    if share:
        layers[SHARER] = SimpleNamespace(kv_sharing_target_layer_name=OWNERS[0])
    return layers


def _vllm_config(layers: dict[str, Any], layout: str | None = "NHD") -> VllmConfig:
    cache_config = CacheConfig()
    cache_config.kv_cache_layout = layout
    return VllmConfig(
        cache_config=cache_config,
        compilation_config=CompilationConfig(static_forward_context=layers),
    )


def test_signature_is_upstreams() -> None:
    params = inspect.signature(init_kv_cache).parameters
    assert list(params) == [
        "forward_context",
        "kv_cache_config",
        "device",
        "kernel_block_sizes",
        "vllm_config",
        "kv_cache_allocation_context",
        "block_tables",
        "attn_groups",
    ]
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["block_tables", "attn_groups"]
    assert params["kv_cache_allocation_context"].default is None


def test_binds_every_layer_and_returns_the_caches_by_name() -> None:
    layers = _model()
    scope = _Scope()
    caches = init_kv_cache(
        layers, _config(), CPU, [16], _vllm_config(layers), kv_cache_allocation_context=scope
    )
    assert set(caches) == {*OWNERS, SHARER}
    assert scope.entered == 1 and not scope.active
    for name, layer in layers.items():
        assert layer.kv_cache is caches[name]
    # The sharing layer reads its target's tensor; the owners have a buffer each.
    assert caches[SHARER] is caches[OWNERS[0]]
    storages = {caches[name].untyped_storage().data_ptr() for name in OWNERS}
    assert len(storages) == 2
    assert caches[OWNERS[1]].shape[0] == 4  # one page per block: kernel block = block size


def test_allocates_inside_the_scope_and_binds_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    scope = _Scope()
    seen: list[tuple[str, bool]] = []
    allocate = attn_utils.allocate_kv_cache
    bind = attn_utils.bind_kv_cache_to_layers

    def recording_allocate(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        seen.append(("allocate", scope.active))
        return allocate(*args, **kwargs)

    def recording_bind(*args: Any, **kwargs: Any) -> None:
        seen.append(("bind", scope.active))
        bind(*args, **kwargs)

    monkeypatch.setattr(attn_utils, "allocate_kv_cache", recording_allocate)
    monkeypatch.setattr(attn_utils, "bind_kv_cache_to_layers", recording_bind)
    layers = _model()
    init_kv_cache(layers, _config(), CPU, [16], _vllm_config(layers), scope)
    assert seen == [("allocate", True), ("bind", False)]


def test_a_layer_with_bind_kv_cache_unpacks_its_own_cache() -> None:
    layers = _model(share=False)
    layers[OWNERS[1]] = _UnpackingLayer()
    caches = init_kv_cache(layers, _config(), CPU, [16], _vllm_config(layers))
    unpacking = layers[OWNERS[1]]
    assert len(unpacking.bound) == 1 and unpacking.bound[0] is caches[OWNERS[1]]
    assert not hasattr(unpacking, "kv_cache")


def test_caches_of_layers_outside_the_forward_context_are_returned_unbound() -> None:
    model = _model()
    # This rank's forward context holds only some of the layers the config allocates.
    forward_context = {OWNERS[0]: model[OWNERS[0]]}
    caches = init_kv_cache(forward_context, _config(), CPU, [16], _vllm_config(model))
    assert set(caches) == {*OWNERS, SHARER}
    assert model[OWNERS[0]].kv_cache is caches[OWNERS[0]]
    assert not hasattr(model[OWNERS[1]], "kv_cache")
    assert not hasattr(model[SHARER], "kv_cache")


def test_split_groups_bind_kernel_block_views_and_return_manager_views() -> None:
    layers = _model()
    mapped: dict[str, torch.Tensor] = {}

    def to_kernel_blocks(cache: torch.Tensor) -> torch.Tensor:
        view = cache.unflatten(0, (cache.shape[0], 1)).flatten(0, 1)
        mapped[str(len(mapped))] = view
        return view

    group = SimpleNamespace(
        kernel_block_size=8,
        layer_names=[OWNERS[1], SHARER],
        map_kv_cache_to_kernel_blocks=to_kernel_blocks,
    )
    unsplit = SimpleNamespace(kernel_block_size=None, layer_names=[OWNERS[0]])
    # A generator, as upstream's runner passes its (target + draft) groups.
    caches = init_kv_cache(
        layers,
        _config(),
        CPU,
        [16],
        _vllm_config(layers),
        attn_groups=(g for g in (group, unsplit)),
    )
    assert layers[OWNERS[0]].kv_cache is caches[OWNERS[0]]
    for name in (OWNERS[1], SHARER):
        assert layers[name].kv_cache is not caches[name]
        assert any(layers[name].kv_cache is view for view in mapped.values())
    assert len(mapped) == 2


def test_hisparse_allocates_and_binds_through_its_own_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = _model(share=False)
    vllm_config = _vllm_config(layers)
    vllm_config.attention_config.hisparse_config = object()  # type: ignore[assignment]
    scope = _Scope()
    block_tables = SimpleNamespace()
    config = _config()
    returned = {name: torch.zeros(4, 1) for name in OWNERS}
    calls: list[tuple[Any, ...]] = []

    def hisparse_init(*args: Any) -> dict[str, torch.Tensor]:
        assert scope.active
        calls.append(args)
        return returned

    def no_plain_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("HiSparse allocates through its own init")

    monkeypatch.setattr(attn_utils, "init_hisparse_kv_cache", hisparse_init)
    monkeypatch.setattr(attn_utils, "allocate_kv_cache", no_plain_allocation)
    caches = init_kv_cache(layers, config, CPU, [16], vllm_config, scope, block_tables=block_tables)
    assert caches is returned
    assert calls == [(config, CPU, [16], vllm_config, layers, block_tables)]
    assert all(layers[name].kv_cache is returned[name] for name in OWNERS)


def test_hisparse_without_block_tables_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layers = _model(share=False)
    vllm_config = _vllm_config(layers)
    vllm_config.attention_config.hisparse_config = object()  # type: ignore[assignment]
    scope = _Scope()

    def must_not_run(*args: Any) -> None:
        raise AssertionError("allocated without block tables")

    monkeypatch.setattr(attn_utils, "init_hisparse_kv_cache", must_not_run)
    with pytest.raises(ValueError, match="block_tables: expected the runner's block tables"):
        init_kv_cache(layers, _config(), CPU, [16], vllm_config, scope)
    assert scope.entered == 0


def test_a_sharing_target_without_a_cache_is_refused_before_binding() -> None:
    layers = _model(share=False)
    layers[SHARER] = SimpleNamespace(kv_sharing_target_layer_name="model.layers.9.attn")
    with pytest.raises(ValueError, match="kv_sharing_target_layer_name: expected target"):
        init_kv_cache(layers, _config(), CPU, [16], _vllm_config(layers))
    assert not any(hasattr(layer, "kv_cache") for layer in layers.values())


def test_an_unresolved_layout_fails_inside_the_scope_and_leaves_it() -> None:
    layers = _model()
    scope = _Scope()
    with pytest.raises(ValueError, match="kv_cache_layout: expected a resolved layout"):
        init_kv_cache(layers, _config(), CPU, [16], _vllm_config(layers, layout=None), scope)
    assert scope.entered == 1 and not scope.active
    assert not any(hasattr(layer, "kv_cache") for layer in layers.values())


# ------------------------------------------------------------------ bind_kv_cache_to_layers


def test_bind_checks_every_layer_before_binding_any() -> None:
    layers = {"a": SimpleNamespace()}
    caches = {"a": torch.zeros(1), "b": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"kv_caches: expected a forward_context layer .*'b'"):
        bind_kv_cache_to_layers(caches, layers)
    assert not hasattr(layers["a"], "kv_cache")


def test_bind_checks_upstreams_tracker_arguments() -> None:
    layers = {"a": SimpleNamespace()}
    caches = {"a": torch.zeros(1)}
    with pytest.raises(ValueError, match="num_attn_module"):
        bind_kv_cache_to_layers(caches, layers, 0)
    with pytest.raises(TypeError, match="kv_cache_groups: expected KV-cache groups"):
        bind_kv_cache_to_layers(caches, layers, kv_cache_groups=[["a"]])  # type: ignore[list-item]
    assert not hasattr(layers["a"], "kv_cache")
    bind_kv_cache_to_layers(caches, layers, 2, [KVCacheGroupSpec(["a"], SPEC)])
    assert layers["a"].kv_cache is caches["a"]


# ------------------------------------------------------------- build_slot_mappings_by_layer


def _two_groups() -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["a", "b"], SPEC), KVCacheGroupSpec(["c"], SPEC)],
    )


def test_slot_mappings_by_layer_are_their_groups_rows() -> None:
    slot_mappings = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    by_layer = build_slot_mappings_by_layer(slot_mappings, _two_groups())
    assert set(by_layer) == {"a", "b", "c"}
    assert by_layer["a"].tolist() == by_layer["b"].tolist() == [0, 1, 2, 3]
    assert by_layer["c"].tolist() == [4, 5, 6, 7]  # the third row has no group
    slot_mappings[1, 0] = 40  # rows are views of the caller's tensor, not copies
    assert by_layer["c"][0].item() == 40


def test_slot_mappings_need_a_row_per_group() -> None:
    with pytest.raises(ValueError, match="slot_mappings: expected a row for each of the 2"):
        build_slot_mappings_by_layer(torch.zeros(1, 4, dtype=torch.int64), _two_groups())
