"""DeepSeek-V2 / V3: one MLA latent of ``kv_lora_rank + qk_rope_head_dim`` per token and layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.core.model_config import positive_int_key
from vllm.v1.core.model_layout import DEFAULT_BLOCK_SIZE, LayerDesc, ParsedLayers


def parse_deepseek_v3(cfg: Mapping[str, Any], tp: int, model_type: str) -> ParsedLayers:
    num_layers = positive_int_key(cfg, "num_hidden_layers")
    head = positive_int_key(cfg, "kv_lora_rank") + positive_int_key(cfg, "qk_rope_head_dim")
    layers = [
        LayerDesc(name=f"model.layers.{i}.self_attn", kind="mla", num_kv_heads=1, head_size=head)
        for i in range(num_layers)
    ]
    notes = []
    if cfg.get("num_nextn_predict_layers"):
        notes.append(
            f"{model_type}: the {cfg['num_nextn_predict_layers']} MTP layer(s) "
            "(num_nextn_predict_layers) are not modelled"
        )
    return layers, notes, DEFAULT_BLOCK_SIZE
