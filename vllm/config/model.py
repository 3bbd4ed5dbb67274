"""The model settings the KV-cache functions read (upstream's ``ModelConfig``, reduced).

Nothing here loads a model or reaches a hub: ``model`` is a name kept for display, and
``max_model_len`` (tokens) must be given where a function needs it. ``max_model_len=-1`` (fit
it to the KV-cache memory) starts from the model's own maximum, read from the config values
given in ``hf_config``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from vllm.config.parallel import ParallelConfig

__all__ = ["ModelConfig", "ModelDType", "derive_max_model_len"]

logger = logging.getLogger(__name__)

# Hugging Face config keys that bound a model's context (tokens); the smallest one given wins,
# and ``model_max_length`` overrides them all (Command-R's convention).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# Upstream's assumption when a config names no maximum (tokens).
_DEFAULT_MAX_LEN = 2048
# RoPE types whose ``max_position_embeddings`` is already scaled, so ``factor`` is not applied.
_PRESCALED_ROPE_TYPES = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)

ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | torch.dtype
"""What ``ModelConfig.dtype`` accepts: upstream's names, or a torch dtype."""


@dataclass
class ModelConfig:
    """``max_model_len``: the longest request in tokens (prompt plus output);
    ``original_max_model_len`` is -1 when the user asked for the length to be fitted to the
    KV-cache memory (``get_kv_cache_configs`` then lowers ``max_model_len`` in place).
    ``runner`` and ``dtype`` are upstream's strings, kept as given."""

    model: str = "Qwen/Qwen3-0.6B"
    runner: str = "auto"
    dtype: ModelDType = "auto"
    max_model_len: int | None = None
    original_max_model_len: int | None = None
    is_encoder_decoder: bool = False
    hf_config: Any = field(default_factory=SimpleNamespace)
    """The model's Hugging Face config values that planning reads (e.g. ``index_topk`` of
    sparse MLA models), as attributes; upstream holds the whole loaded config here."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ValueError(f"model: expected a model name (str), got {self.model!r}")
        length = self.max_model_len
        if length == -1 and not isinstance(length, bool):
            self.original_max_model_len = -1
            self.max_model_len = derive_max_model_len(self.hf_config)
            return
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int) or length <= 0
        ):
            raise ValueError(
                f"max_model_len: expected a positive int (tokens), or -1 to fit it to the "
                f"KV-cache memory, got {length!r}"
            )

    def get_num_attention_heads(
        self, parallel_config: ParallelConfig, arch_config: Any | None = None
    ) -> int:
        """Query heads of one tensor-parallel rank (at least 1): ``num_attention_heads`` of
        ``arch_config`` (one layer's config) or of ``hf_config``, over the ranks."""
        source = self.hf_config if arch_config is None else arch_config
        heads = getattr(source, "num_attention_heads", 0)
        return max(1, heads // parallel_config.tensor_parallel_size)


def derive_max_model_len(hf_config: Any) -> int:
    """The model's own maximum length (tokens) from its config values: the smallest of the
    context keys given (``model_max_length`` overriding), times the RoPE scaling factor
    unless the RoPE type's maximum is already scaled; 2048, with a warning, when the config
    names none (upstream's assumption)."""
    given = {k: getattr(hf_config, k) for k in _MAX_LEN_KEYS if getattr(hf_config, k, None)}
    if not given:
        logger.warning(
            "hf_config gives none of %s; assuming the model's maximum length is %d tokens",
            ", ".join(_MAX_LEN_KEYS),
            _DEFAULT_MAX_LEN,
        )
        return _DEFAULT_MAX_LEN
    derived = given.get("model_max_length", min(given.values()))
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    # One dict, or one per layer type; Gemma 3 states its maximum already scaled.
    if isinstance(rope, dict) and "gemma3" not in str(getattr(hf_config, "model_type", "")):
        per_type = [v for v in rope.values() if isinstance(v, dict)] or [rope]
        for params in per_type:
            rope_type = params.get("rope_type", params.get("type", "default"))
            if rope_type not in _PRESCALED_ROPE_TYPES and params.get("factor") is not None:
                derived *= params["factor"]
                break
    return int(derived)
