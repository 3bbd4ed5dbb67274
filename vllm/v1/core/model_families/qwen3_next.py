"""Qwen3-Next: full attention every ``full_attention_interval`` layers, Gated DeltaNet linear
attention (a recurrent state) in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.core.model_config import (
    attention_heads_per_rank,
    config_layer_types,
    conv_kernel_key,
    positive_int_key,
    split_evenly,
)
from vllm.v1.core.model_layout import DEFAULT_BLOCK_SIZE, LayerDesc, ParsedLayers, attention_layer


def parse_qwen3_next(cfg: Mapping[str, Any], tp: int, model_type: str) -> ParsedLayers:
    num_layers = positive_int_key(cfg, "num_hidden_layers")
    if cfg.get("layer_types") is not None:
        types = config_layer_types(cfg, num_layers, ("full_attention", "linear_attention"))
    else:
        interval = positive_int_key(cfg, "full_attention_interval")
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    layers: list[LayerDesc] = []
    attn: tuple[int, int] | None = None
    gdn_shapes: tuple[tuple[int, ...], ...] | None = None
    for i, kind in enumerate(types):
        if kind == "full_attention":
            if attn is None:
                attn = attention_heads_per_rank(cfg, tp)
            layers.append(
                attention_layer(f"model.layers.{i}.self_attn", "full_attention", *attn, None)
            )
            continue
        if gdn_shapes is None:
            k_heads = split_evenly(
                positive_int_key(cfg, "linear_num_key_heads"), tp, "linear_num_key_heads"
            )
            v_heads = split_evenly(
                positive_int_key(cfg, "linear_num_value_heads"), tp, "linear_num_value_heads"
            )
            k_dim = positive_int_key(cfg, "linear_key_head_dim")
            v_dim = positive_int_key(cfg, "linear_value_head_dim")
            kernel = conv_kernel_key(cfg, "linear_conv_kernel_dim")
            conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
            gdn_shapes = ((kernel - 1, conv_dim), (v_heads, k_dim, v_dim))
        layers.append(
            LayerDesc(
                name=f"model.layers.{i}.linear_attn",
                kind="linear_attention",
                state_shapes=gdn_shapes,
                mamba_type="gdn_attention",
            )
        )
    return layers, [], DEFAULT_BLOCK_SIZE
