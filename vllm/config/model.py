"""The model settings the KV-cache functions read (upstream's ``ModelConfig``, reduced).

Nothing here loads a model or reaches a hub: ``model`` is a name kept for display, and
``max_model_len`` (tokens) must be given where a function needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch

__all__ = ["ModelConfig", "ModelDType"]

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
        if length is not None and (
            isinstance(length, bool) or not isinstance(length, int) or length <= 0
        ):
            raise ValueError(
                f"max_model_len: expected a positive int (tokens), got {length!r}; to fit it to "
                "the memory give the model's own maximum and set original_max_model_len=-1 (this "
                "library does not load the model to find that maximum)"
            )
