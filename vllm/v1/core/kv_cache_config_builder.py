"""The pluggable part of KV-cache planning: how layers form groups and how groups become a
config for a number of blocks (upstream v0.33's interface, experimental there too).

The cross-worker flow (:func:`vllm.v1.core.kv_cache_planning.get_kv_cache_configs`) stays in
core; the current platform names the builder class
(:meth:`~vllm.platforms.interface.Platform.get_kv_cache_config_builder_cls`, by default
:class:`~vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder`).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

__all__ = ["KVCacheConfigBuilder", "get_kv_cache_config_builder"]


class KVCacheConfigBuilder(ABC):
    """Placement decisions of KV-cache planning. Builders are stateless: every method takes
    the ``vllm_config``."""

    @abstractmethod
    def get_kv_cache_groups(
        self, vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
    ) -> list[KVCacheGroupSpec]:
        """Split the layers into groups; core rejects a split that does not put every layer
        in exactly one group."""

    @abstractmethod
    def get_kv_cache_config_from_groups(
        self, vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], num_blocks: int
    ) -> KVCacheConfig:
        """The config holding exactly ``num_blocks`` device blocks of ``kv_cache_groups``."""

    def _get_pool_bytes_per_block(
        self, vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec]
    ) -> int | None:
        """Device bytes one block id costs, or None to let core measure a one-block config."""
        return None


def _resolve(qualname: str) -> type[KVCacheConfigBuilder]:
    module_name, _, attr = qualname.rpartition(".")
    if not module_name:
        raise ValueError(f"builder: expected a qualified class name, got {qualname!r}")
    cls = getattr(importlib.import_module(module_name), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, KVCacheConfigBuilder)):
        raise TypeError(f"builder: expected a KVCacheConfigBuilder subclass, got {qualname!r}")
    return cls


def get_kv_cache_config_builder(vllm_config: VllmConfig) -> KVCacheConfigBuilder:
    """A fresh builder of the class the current platform selects (builders keep no state)."""
    from vllm.platforms import current_platform

    return _resolve(current_platform.get_kv_cache_config_builder_cls(vllm_config))()
