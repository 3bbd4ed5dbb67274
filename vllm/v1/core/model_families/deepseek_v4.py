"""DeepSeek-V4: a sliding-window latent cache on every layer, plus compressed KV (ratio 4 or
128) and, at ratio 4, indexer keys (layout in :mod:`vllm.v1.core.model_layout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.core.model_config import positive_int_key, required_key, unwrap_config
from vllm.v1.core.model_layout import LayerDesc, ParsedLayers

DSV4_BLOCK_SIZE = 256
"""Default tokens per page for DeepSeek-V4 (docs/design.md §4 worked example; a multiple of 128)."""

DSV4_CSA_RATIO = 4
"""Compressed sparse attention (with indexer) ratio."""

DSV4_HCA_RATIO = 128
"""Heavily compressed attention ratio."""


def parse_deepseek_v4(cfg: Mapping[str, Any], tp: int, model_type: str) -> ParsedLayers:
    num_layers = positive_int_key(cfg, "num_hidden_layers")
    head = positive_int_key(cfg, "head_dim")
    window = positive_int_key(cfg, "sliding_window")
    kv_heads = positive_int_key(cfg, "num_key_value_heads")  # one shared latent: never split
    ratios = required_key(cfg, "compress_ratios")
    if not isinstance(ratios, list) or len(ratios) < num_layers:
        raise ValueError(
            f"config: key 'compress_ratios' must list at least num_hidden_layers "
            f"({num_layers}) ratios, got {ratios!r:.80}"
        )
    layers: list[LayerDesc] = []
    index_head: int | None = None
    for i, ratio in enumerate(ratios[:num_layers]):
        prefix = f"model.layers.{i}.self_attn"
        swa = LayerDesc(
            name=prefix if ratio == 0 else f"{prefix}.swa",
            kind="sliding_window_mla",
            num_kv_heads=kv_heads,
            head_size=head,
            sliding_window=window,
        )
        if ratio == 0:
            layers.append(swa)
            continue
        if ratio not in (DSV4_CSA_RATIO, DSV4_HCA_RATIO):
            raise ValueError(
                f"config: key 'compress_ratios[{i}]' is {ratio!r}; expected 0 (sliding window "
                f"only), {DSV4_CSA_RATIO} (CSA) or {DSV4_HCA_RATIO} (HCA)"
            )
        layers.append(
            LayerDesc(
                name=prefix,
                kind="compressed_mla",
                num_kv_heads=kv_heads,
                head_size=head,
                compress_ratio=ratio,
            )
        )
        if ratio == DSV4_CSA_RATIO:
            if index_head is None:
                index_head = positive_int_key(cfg, "index_head_dim")
            layers.append(
                LayerDesc(
                    name=f"{prefix}.indexer",
                    kind="mla_indexer",
                    num_kv_heads=1,
                    head_size=index_head,
                    compress_ratio=ratio,
                )
            )
        layers.append(swa)
    notes = [
        "deepseek_v4: every layer keeps a sliding-window latent cache (window "
        f"{window}); ratio-{DSV4_CSA_RATIO} layers add compressed KV + indexer keys, "
        f"ratio-{DSV4_HCA_RATIO} layers add compressed KV; per-sequence compressor states "
        f"({deepseek_v4_compressor_state_bytes(cfg)} bytes fp32, aiconfigurator's model) are "
        "not paged and not modelled"
    ]
    if cfg.get("num_nextn_predict_layers"):
        notes.append(
            f"deepseek_v4: the {cfg['num_nextn_predict_layers']} MTP layer(s) "
            "(trailing compress_ratios entries) are not modelled"
        )
    return layers, notes, DSV4_BLOCK_SIZE


def deepseek_v4_compressor_state_bytes(config: Mapping[str, Any]) -> int:
    """aiconfigurator's estimate of DeepSeek-V4's per-sequence fp32 compressor states (bytes):
    per ratio-r layer ``2*r*c*head_dim*4`` (c=2 for r=4, else 1) plus ``2*4*2*index_head_dim*4``
    for the ratio-4 indexer compressor."""
    cfg = unwrap_config(config)
    num_layers = positive_int_key(cfg, "num_hidden_layers")
    head = positive_int_key(cfg, "head_dim")
    total = 0
    for ratio in required_key(cfg, "compress_ratios")[:num_layers]:
        if ratio == 0:
            continue
        c = 2 if ratio == DSV4_CSA_RATIO else 1
        total += 2 * ratio * c * head * 4
        if ratio == DSV4_CSA_RATIO:
            total += 2 * 4 * 2 * positive_int_key(cfg, "index_head_dim") * 4
    return total
