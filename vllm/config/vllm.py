"""``VllmConfig``: the configs the KV-cache functions read, in upstream's shape."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from vllm.config.attention import AttentionConfig
from vllm.config.cache import CacheConfig
from vllm.config.compilation import CompilationConfig
from vllm.config.device import DeviceConfig
from vllm.config.kv_events import KVEventsConfig
from vllm.config.kv_transfer import KVTransferConfig
from vllm.config.load import LoadConfig
from vllm.config.model import ModelConfig
from vllm.config.observability import ObservabilityConfig
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
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    scheduler_config: SchedulerConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    attention_config: AttentionConfig = field(default_factory=AttentionConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    """CUDA-graph mode and the model's attention layers by name (``static_forward_context``)."""
    load_config: LoadConfig = field(default_factory=LoadConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    """KV-cache residency metrics (``kv_cache_metrics``) and their histogram buckets."""
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

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight at once: one per pipeline stage, two with async scheduling on a
        single stage."""
        assert self.scheduler_config is not None  # set by __post_init__
        stages = self.parallel_config.pipeline_parallel_size
        if self.scheduler_config.async_scheduling and stages <= 1:
            return 2
        return stages

    @property
    def max_in_flight_tokens(self) -> int:
        """Most tokens scheduled but not yet freed: a full batch (``max_num_batched_tokens``)
        per concurrent batch."""
        assert self.scheduler_config is not None  # set by __post_init__
        return self.max_concurrent_batches * self.scheduler_config.max_num_batched_tokens

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0 without speculative decoding)."""
        spec = self.speculative_config
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def num_prefill_lookahead_tokens(self) -> int:
        """Prompt tokens past the computed range an EAGLE-family drafter reads mid-prefill:
        one, or ``num_speculative_tokens`` for a chain of MTP modules; 0 otherwise."""
        spec = self.speculative_config
        if spec is None or not spec.use_eagle():
            return 0
        if spec.use_multi_module_mtp():
            return self.num_speculative_tokens
        return 1

    @property
    def num_hash_lookahead_tokens(self) -> int:
        """Tokens after each block that its prefix-cache hash also covers (0: v0.22's hashes):
        the drafter's lookahead when an EAGLE-style drafter would otherwise drop the trailing
        block, prefix caching is on and no KV connector (which keeps the old hashes) is set."""
        spec = self.speculative_config
        if (
            spec is None
            or not spec.use_eagle_block_drop()
            or spec.disable_lookahead_block_hashes
            or not self.cache_config.enable_prefix_caching
            or self.kv_transfer_config is not None
        ):
            return 0
        return self.num_prefill_lookahead_tokens
