"""The spec registry's built-in entries are filled in on first use even when an out-of-tree spec
was registered before any lookup (a decorator runs at import time)."""

from dataclasses import dataclass

import pytest
import torch

import vllm.v1.kv_cache_spec_registry as registry
from vllm.v1.core.attention_managers import FullAttentionManager, SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTRY_KVCACHESPEC_LIST", {})
    monkeypatch.setattr(registry, "_REGISTRY_ROLE_MANAGERS", {})
    monkeypatch.setattr(registry, "_BUILTINS_REGISTERED", False)


@dataclass(frozen=True, kw_only=True)
class _CustomSpec(FullAttentionSpec):
    pass


def test_custom_spec_registered_first_keeps_builtins(fresh_registry: None) -> None:
    registry.register_kv_cache_spec(FullAttentionManager, FullAttentionSpec)(_CustomSpec)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, sliding_window=128
    )
    assert registry.KVCacheSpecRegistry.get_manager_class(window) is SlidingWindowManager
    assert _CustomSpec in registry.KVCacheSpecRegistry.registered_spec_classes()


def test_builtins_registered_once_and_again_safely(fresh_registry: None) -> None:
    registry.register_all_kvcache_specs()
    before = registry.KVCacheSpecRegistry.registered_spec_classes()
    registry.register_all_kvcache_specs()
    assert registry.KVCacheSpecRegistry.registered_spec_classes() == before
    assert FullAttentionSpec in before
