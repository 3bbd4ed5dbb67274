"""Nemotron-H: a ``hybrid_override_pattern`` of Mamba-2 (``M``), attention (``*``), MLP (``-``)
and MoE (``E``) layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.core.model_config import (
    attention_heads_per_rank,
    conv_kernel_key,
    kv_heads_per_rank,
    optional_positive_int_key,
    positive_int_key,
    required_key,
    split_evenly,
)
from vllm.v1.core.model_layout import DEFAULT_BLOCK_SIZE, LayerDesc, ParsedLayers, attention_layer


def parse_nemotron_h(cfg: Mapping[str, Any], tp: int, model_type: str) -> ParsedLayers:
    num_layers = positive_int_key(cfg, "num_hidden_layers")
    pattern = required_key(cfg, "hybrid_override_pattern")
    if not isinstance(pattern, str) or len(pattern) != num_layers:
        raise ValueError(
            f"config: key 'hybrid_override_pattern' must have one character per layer "
            f"({num_layers}), got {pattern!r:.80}"
        )
    layers: list[LayerDesc] = []
    attn: tuple[int, int, int | None] | None = None
    mamba_shapes: tuple[tuple[int, ...], ...] | None = None
    for i, char in enumerate(pattern):
        if char == "*":
            if attn is None:
                attn = (
                    *attention_heads_per_rank(cfg, tp),
                    optional_positive_int_key(cfg, "sliding_window"),
                )
            heads, head, window = attn
            kind = "sliding_window" if window is not None else "full_attention"
            layers.append(attention_layer(f"model.layers.{i}.self_attn", kind, heads, head, window))
        elif char == "M":
            if mamba_shapes is None:
                num_heads = split_evenly(
                    positive_int_key(cfg, "mamba_num_heads"), tp, "mamba_num_heads"
                )
                head_dim = positive_int_key(cfg, "mamba_head_dim")
                state = positive_int_key(cfg, "ssm_state_size")
                groups = kv_heads_per_rank(positive_int_key(cfg, "n_groups"), tp, "n_groups")
                kernel = conv_kernel_key(cfg, "conv_kernel")
                conv_dim = num_heads * head_dim + 2 * groups * state
                mamba_shapes = ((kernel - 1, conv_dim), (num_heads, head_dim, state))
            layers.append(
                LayerDesc(
                    name=f"model.layers.{i}.mixer",
                    kind="mamba",
                    state_shapes=mamba_shapes,
                    mamba_type="mamba2",
                )
            )
        elif char in "-E":
            continue  # MLP / MoE: no cache
        else:
            raise ValueError(
                f"config: key 'hybrid_override_pattern[{i}]' is {char!r}; expected 'M' (Mamba-2), "
                "'*' (attention), '-' (MLP) or 'E' (MoE)"
            )
    return layers, [], DEFAULT_BLOCK_SIZE
