"""Upstream's ``turboquant.config`` path for :mod:`vllm.kv_quant.turboquant.config`."""

from vllm.kv_quant.turboquant.config import (
    TQ_PRESETS,
    TurboQuantConfig,
    _get_full_attention_layer_indices,
)

__all__ = ["TQ_PRESETS", "TurboQuantConfig", "_get_full_attention_layer_indices"]
