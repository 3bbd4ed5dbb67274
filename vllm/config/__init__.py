"""Upstream's config classes, reduced to the fields the KV-cache functions read."""

from vllm.config.attention import AttentionConfig, HiSparseConfig
from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig, CUDAGraphMode, get_layers_from_vllm_config
from vllm.config.device import DeviceConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.config.load import LoadConfig
from vllm.config.model import ModelConfig
from vllm.config.observability import ObservabilityConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.vllm import VllmConfig

__all__ = [
    "AttentionConfig",
    "CUDAGraphMode",
    "CacheConfig",
    "CompilationConfig",
    "DeviceConfig",
    "HiSparseConfig",
    "KVEventsConfig",
    "KVTransferConfig",
    "LoadConfig",
    "ModelConfig",
    "ObservabilityConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "VllmConfig",
    "get_layers_from_vllm_config",
]
