"""Upstream's config classes, reduced to the fields the KV-cache functions read."""

from vllm.config.attention import AttentionConfig, HiSparseConfig
from vllm.config.cache import CacheConfig
from vllm.config.device import DeviceConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.vllm import VllmConfig

__all__ = [
    "AttentionConfig",
    "CacheConfig",
    "DeviceConfig",
    "HiSparseConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "VllmConfig",
]
