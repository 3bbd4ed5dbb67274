"""Model-family parsers: a HF config → a :class:`~vllm.v1.core.model_layout.ModelLayout`.

One module per family; each parser takes ``(config, tensor_parallel_size, model_type)`` and
returns :data:`~vllm.v1.core.model_layout.ParsedLayers`. :func:`parse_model_layout` picks the
parser by ``model_type`` and adds what every family shares (model dtype, context length).
Supporting a new family means adding a module and one entry per ``model_type`` in
:data:`PARSERS`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from vllm.v1.core.model_config import (
    config_model_dtype,
    optional_positive_int_key,
    required_key,
    unwrap_config,
)
from vllm.v1.core.model_families.deepseek_v3 import parse_deepseek_v3
from vllm.v1.core.model_families.deepseek_v4 import parse_deepseek_v4
from vllm.v1.core.model_families.dense import parse_dense
from vllm.v1.core.model_families.nemotron_h import parse_nemotron_h
from vllm.v1.core.model_families.qwen3_next import parse_qwen3_next
from vllm.v1.core.model_layout import ModelLayout, ParsedLayers

__all__ = ["PARSERS", "SUPPORTED_MODEL_TYPES", "parse_model_layout"]

PARSERS: dict[str, Callable[[Mapping[str, Any], int, str], ParsedLayers]] = {
    "llama": parse_dense,
    "mistral": parse_dense,
    "qwen2": parse_dense,
    "qwen3": parse_dense,
    "qwen3_moe": parse_dense,
    "gpt_oss": parse_dense,
    "gemma3": parse_dense,
    "gemma3_text": parse_dense,
    "deepseek_v2": parse_deepseek_v3,
    "deepseek_v3": parse_deepseek_v3,
    "deepseek_v4": parse_deepseek_v4,
    "nemotron_h": parse_nemotron_h,
    "qwen3_next": parse_qwen3_next,
}
"""``model_type`` → its family's parser."""

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(PARSERS))
"""``model_type`` values :func:`parse_model_layout` can map."""


def parse_model_layout(config: Mapping[str, Any], *, tensor_parallel_size: int = 1) -> ModelLayout:
    """The cache-holding layers of ``config`` (a bare HF config or a preset wrapper) on one of
    ``tensor_parallel_size`` ranks.

    KV heads are split across ranks (replicated, one per rank, when fewer than ranks); MLA
    latents are never split; Mamba / linear-attention heads are split. Raises ``ValueError``
    naming the offending key for configs it cannot map.
    """
    if (
        isinstance(tensor_parallel_size, bool)
        or not isinstance(tensor_parallel_size, int)
        or tensor_parallel_size <= 0
    ):
        raise ValueError(
            f"tensor_parallel_size: expected a positive int, got {tensor_parallel_size!r}"
        )
    cfg = unwrap_config(config)
    model_type = required_key(cfg, "model_type")
    if model_type not in PARSERS:
        raise ValueError(
            f"config: cannot map model_type {model_type!r}; expected one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layers, notes, default_block = PARSERS[model_type](cfg, tensor_parallel_size, model_type)
    if not layers:
        raise ValueError(f"config: model_type {model_type!r} config has no cache-holding layers")
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}
    model_dtype, dtype_note = config_model_dtype(cfg, text_cfg)
    if dtype_note:
        notes.insert(0, dtype_note)
    max_pos = _context_length(cfg, text_cfg, notes)
    if max_pos is None and model_type in ("gemma3", "gemma3_text"):
        max_pos = 131072
        notes.append("gemma3: max_position_embeddings absent; using the transformers default")
    num_hidden = cfg.get("num_hidden_layers", text_cfg.get("num_hidden_layers"))
    return ModelLayout(
        model_type=model_type,
        model_dtype=model_dtype,
        num_hidden_layers=int(num_hidden),
        max_position_embeddings=max_pos,
        tensor_parallel_size=tensor_parallel_size,
        default_block_size=default_block,
        layers=tuple(layers),
        notes=tuple(notes),
    )


def _context_length(
    cfg: Mapping[str, Any], text_cfg: Mapping[str, Any], notes: list[str]
) -> int | None:
    """``max_position_embeddings`` (top level, else in ``text_config``). Only the default
    ``max_model_len``, so a value that is no token count (-1, 2**70) is ignored with a note."""
    for source, prefix in ((cfg, ""), (text_cfg, "text_config.")):
        if source.get("max_position_embeddings") is None:
            continue
        try:
            return optional_positive_int_key(source, "max_position_embeddings", prefix)
        except ValueError as exc:
            notes.append(f"{exc}; ignored (pass max_model_len)")
            return None
    return None
