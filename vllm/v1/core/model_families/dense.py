"""Dense attention models: llama, mistral, qwen2, qwen3, qwen3_moe, gpt_oss, gemma3(_text).

Full and sliding-window attention layers; which layers slide comes from ``layer_types`` or
from each family's default pattern.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.core.model_config import (
    attention_heads_per_rank,
    config_layer_types,
    optional_positive_int_key,
    positive_int_key,
    required_key,
)
from vllm.v1.core.model_layout import DEFAULT_BLOCK_SIZE, ParsedLayers, attention_layer


def parse_dense(cfg: Mapping[str, Any], tp: int, model_type: str) -> ParsedLayers:
    """llama / mistral / qwen2 / qwen3 / qwen3_moe / gpt_oss / gemma3(_text)."""
    notes: list[str] = []
    prefix = ""
    if model_type == "gemma3":
        text_cfg = required_key(cfg, "text_config")
        if not isinstance(text_cfg, Mapping):
            raise ValueError("config: key 'text_config' must be a mapping")
        cfg, prefix = text_cfg, "text_config."
    num_layers = positive_int_key(cfg, "num_hidden_layers", prefix)
    heads, head = attention_heads_per_rank(cfg, tp, prefix)
    window = optional_positive_int_key(cfg, "sliding_window", prefix)

    types: list[str]
    if cfg.get("layer_types") is not None:
        types = config_layer_types(cfg, num_layers, ("full_attention", "sliding_attention"), prefix)
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = optional_positive_int_key(cfg, "sliding_window_pattern", prefix)
        if pattern is None:
            pattern = 6
            notes.append(
                "gemma3: sliding_window_pattern absent; using the transformers default 6 "
                "(layer i full iff (i+1) % 6 == 0)"
            )
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    elif model_type == "gpt_oss":
        types = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        ]
        notes.append("gpt_oss: layer_types absent; using the transformers default alternation")
    elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
        use_swa = bool(cfg.get("use_sliding_window", False)) and window is not None
        max_window_layers = cfg.get("max_window_layers", num_layers) if use_swa else num_layers
        types = [
            "sliding_attention" if use_swa and i >= max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    else:  # llama, mistral: one window for every layer when set
        kind = "sliding_attention" if window is not None else "full_attention"
        types = [kind] * num_layers

    if "sliding_attention" in types and window is None:
        raise ValueError(f"config: missing key '{prefix}sliding_window'")
    layers = [
        attention_layer(
            f"model.layers.{i}.self_attn",
            "sliding_window" if kind == "sliding_attention" else "full_attention",
            heads,
            head,
            window if kind == "sliding_attention" else None,
        )
        for i, kind in enumerate(types)
    ]
    return layers, notes, DEFAULT_BLOCK_SIZE
