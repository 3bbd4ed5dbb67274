"""``VllmConfig``: the configs the KV-cache functions read, in upstream's shape."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from vllm.config.cache import CacheConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig

__all__ = ["VllmConfig"]


@dataclass
class VllmConfig:
    """All settings of one engine. The KV-cache planner reads only whether
    ``kv_transfer_config`` is set (a KV connector then consumes block hashes); offloading
    specs read its connector options."""

    model_config: ModelConfig | None = None
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    instance_id: str = ""
    """This engine's id (names its shared offload region); empty: five random hex digits."""

    def __post_init__(self) -> None:
        if not self.instance_id:
            self.instance_id = uuid.uuid4().hex[:5]
        if self.scheduler_config is None:
            model = self.model_config
            if model is not None and model.max_model_len is not None:
                self.scheduler_config = SchedulerConfig(
                    max_model_len=model.max_model_len,
                    is_encoder_decoder=model.is_encoder_decoder,
                )
            else:
                self.scheduler_config = SchedulerConfig()
        if self.scheduler_config.disable_hybrid_kv_cache_manager is None:
            # Nothing this library models forces the single-group layout (KV events do not).
            self.scheduler_config.disable_hybrid_kv_cache_manager = False
