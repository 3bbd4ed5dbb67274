"""Scheduler settings the KV-cache functions read (upstream's ``SchedulerConfig``, reduced)."""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import ClassVar

from vllm.utils import check_positive_int

__all__ = ["SchedulerConfig"]


@dataclass
class SchedulerConfig:
    """``max_num_batched_tokens``: tokens scheduled per step (a sliding window holds at most
    ``window - 1 + max_num_batched_tokens`` of them); ``max_num_encoder_input_tokens``: the
    encoder tokens a cross-attention layer caches (set to ``max_num_batched_tokens``).
    ``disable_hybrid_kv_cache_manager`` None is resolved by ``VllmConfig`` (to False).
    ``max_model_len`` and ``is_encoder_decoder`` are init-only, as upstream."""

    DEFAULT_MAX_NUM_BATCHED_TOKENS: ClassVar[int] = 2048
    DEFAULT_MAX_NUM_SEQS: ClassVar[int] = 128

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    enable_chunked_prefill: bool = True
    disable_hybrid_kv_cache_manager: bool | None = None
    async_scheduling: bool = False
    """Schedule the next step while the current one runs (two batches in flight); off here,
    the library has no engine loop to overlap."""
    max_num_encoder_input_tokens: int = field(init=False)
    max_model_len: InitVar[int] = 8192
    is_encoder_decoder: InitVar[bool] = False

    def __post_init__(self, max_model_len: int, is_encoder_decoder: bool) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            check_positive_int(name, getattr(self, name))
        self.max_num_encoder_input_tokens = self.max_num_batched_tokens
