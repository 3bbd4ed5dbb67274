"""Upstream v0.33's path of :class:`KVCacheLayout` (defined with the configs, which name it)."""

from vllm.config.kv_cache_layout import LAYOUT_ALIASES, KVCacheLayout, layout_from_name

__all__ = ["LAYOUT_ALIASES", "KVCacheLayout", "layout_from_name"]
