"""TurboQuant's four presets and the byte sizes of their packed K+V slot (upstream v0.33.0's
``TurboQuantConfig`` / ``TQ_PRESETS``, also importable at upstream's
``vllm.model_executor.layers.quantization.turboquant.config``).

A TurboQuant cache stores one slot per (token, KV head): the packed key, then the packed value,
then one padding byte when the sum is odd. Keys are either FP8 e4m3 bytes (``k8v4``) or
Lloyd-Max codes of the Hadamard-rotated unit key plus its fp16 norm; values are uniform codes
plus an fp16 scale and fp16 minimum (:mod:`vllm.kv_quant.turboquant.codec` has the bytes).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from vllm.kv_quant.modes import KVQuantMode

__all__ = [
    "FP8_KEY_BITS",
    "TQ_PRESETS",
    "TURBOQUANT_MODES",
    "TurboQuantConfig",
    "kernel_config",
    "preset_name",
]

logger = logging.getLogger(__name__)

FP8_KEY_BITS = 8
"""``key_quant_bits`` meaning "keys stored as FP8 e4m3 bytes" rather than Lloyd-Max codes."""

_NORM_BYTES = 2  # fp16 key norm after the key codes
_SCALE_ZERO_BYTES = 4  # fp16 value scale, then fp16 value minimum, after the value codes

# (key bits, value bits, norm correction) of each preset, keyed by its quant mode.
_PRESET_BITS: dict[KVQuantMode, tuple[int, int, bool]] = {
    KVQuantMode.TURBOQUANT_K8V4: (FP8_KEY_BITS, 4, False),
    KVQuantMode.TURBOQUANT_4BIT_NC: (4, 4, True),
    KVQuantMode.TURBOQUANT_K3V4_NC: (3, 4, True),
    KVQuantMode.TURBOQUANT_3BIT_NC: (3, 3, True),
}

TURBOQUANT_MODES: tuple[KVQuantMode, ...] = tuple(_PRESET_BITS)
"""The four TurboQuant quant modes, in upstream's preset order."""


def preset_name(mode: KVQuantMode) -> str:
    """The ``kv_cache_dtype`` string of a TurboQuant mode (the member name, lower-cased, as
    upstream derives it)."""
    if mode not in _PRESET_BITS:
        raise ValueError(f"mode: expected a TurboQuant KVQuantMode, got {mode!r}")
    return mode.name.lower()


TQ_PRESETS: dict[str, dict[str, Any]] = {
    preset_name(mode): {"key_quant_bits": k, "value_quant_bits": v, "norm_correction": nc}
    for mode, (k, v, nc) in _PRESET_BITS.items()
}
"""Preset name → ``key_quant_bits`` (8: FP8 keys, 3/4: Lloyd-Max keys), ``value_quant_bits``
(3/4) and ``norm_correction`` (readers rescale the decoded unit key to norm 1)."""


@dataclass
class TurboQuantConfig:
    """One TurboQuant layout. Sizes are bytes per (token, KV head); ``head_dim`` is elements.

    ``seed`` is kept for upstream compatibility and unused (the rotation is the fixed Hadamard
    matrix).
    """

    head_dim: int = 128
    key_quant_bits: int = 3
    value_quant_bits: int = 4
    seed: int = 42
    norm_correction: bool = False

    @property
    def key_fp8(self) -> bool:
        """Keys are FP8 e4m3 bytes (no rotation, no codes)."""
        return self.key_quant_bits == FP8_KEY_BITS

    @property
    def key_mse_bits(self) -> int:
        """Bits per Lloyd-Max key code; 0 for FP8 keys."""
        return 0 if self.key_fp8 else self.key_quant_bits

    @property
    def mse_bits(self) -> int:
        """Bits of the centroid table readers use: the key code bits, or for FP8 keys the value
        bits (upstream still builds a table there)."""
        return self.value_quant_bits if self.key_fp8 else self.key_quant_bits

    @property
    def centroid_bits(self) -> int:
        """Bits of the centroid table (never 0)."""
        return self.mse_bits

    @property
    def n_centroids(self) -> int:
        return 2**self.mse_bits

    @property
    def key_packed_size(self) -> int:
        """Key bytes: ``head_dim`` FP8 bytes, or ``ceil(head_dim * bits / 8)`` code bytes plus
        the fp16 norm."""
        if self.key_fp8:
            return self.head_dim
        return math.ceil(self.head_dim * self.key_mse_bits / 8) + _NORM_BYTES

    @property
    def effective_value_quant_bits(self) -> int:
        """Bits per stored value code."""
        return self.value_quant_bits

    @property
    def value_packed_size(self) -> int:
        """Value bytes: ``ceil(head_dim * bits / 8)`` code bytes, fp16 scale, fp16 minimum."""
        return math.ceil(self.head_dim * self.value_quant_bits / 8) + _SCALE_ZERO_BYTES

    @property
    def slot_size(self) -> int:
        """Key bytes then value bytes."""
        return self.key_packed_size + self.value_packed_size

    @property
    def slot_size_aligned(self) -> int:
        """``slot_size`` rounded up to even, so that half of it is a whole per-side row."""
        return self.slot_size + self.slot_size % 2

    @staticmethod
    def get_boundary_skip_layers(model_config: Any, n: int = 2) -> list[str]:
        """Layer indices (as strings) left unquantized: the first and last ``n`` layers of a
        dense model (at most half of them); none for hybrid models, whose few full-attention
        layers would mostly be skipped. ``NotImplementedError`` for a hybrid model whose
        config names no full-attention layer (upstream's error)."""
        if model_config.is_hybrid:
            attention = _get_full_attention_layer_indices(model_config)
            if not attention:
                raise NotImplementedError(
                    "TurboQuant KV cache requires identifiable full-attention layers, but "
                    "none were found in the hybrid model config."
                )
            logger.info("TurboQuant on a hybrid model: full-attention layers %s", attention)
            return []
        num_layers = model_config.hf_text_config.num_hidden_layers
        if n <= 0 or num_layers <= 0:
            return []
        n = min(n, num_layers // 2)
        skipped = set(range(n)) | set(range(num_layers - n, num_layers))
        return [str(i) for i in sorted(skipped)]

    @staticmethod
    def from_cache_dtype(cache_dtype: str, head_dim: int) -> TurboQuantConfig:
        """The config of preset ``cache_dtype`` for heads of ``head_dim`` elements."""
        preset = TQ_PRESETS.get(cache_dtype)
        if preset is None:
            raise ValueError(
                f"Unknown TurboQuant cache dtype: {cache_dtype!r}. "
                f"Valid presets: {', '.join(TQ_PRESETS)}"
            )
        return TurboQuantConfig(head_dim=head_dim, **preset)


def kernel_config(
    head_dim: int,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool,
    norm_correction: bool = False,
) -> TurboQuantConfig:
    """The :class:`TurboQuantConfig` that upstream's kernel arguments describe (the store's and
    the decode's); ``ValueError`` when they describe none (bit widths, ``key_packed_size``)."""
    key_bits = FP8_KEY_BITS if key_fp8 else mse_bits
    if key_bits not in (3, 4, FP8_KEY_BITS) or value_quant_bits not in (3, 4):
        raise ValueError(
            f"mse_bits/value_quant_bits: expected 3 or 4 (mse_bits 0 with key_fp8), got "
            f"{mse_bits}/{value_quant_bits} (key_fp8={key_fp8})"
        )
    cfg = TurboQuantConfig(
        head_dim=head_dim,
        key_quant_bits=key_bits,
        value_quant_bits=value_quant_bits,
        norm_correction=norm_correction,
    )
    if key_packed_size != cfg.key_packed_size:
        raise ValueError(
            f"key_packed_size: expected {cfg.key_packed_size} for head dim {head_dim}, got "
            f"{key_packed_size}"
        )
    return cfg


def _get_full_attention_layer_indices(model_config: Any) -> list[int]:
    """Global indices of a hybrid model's full-attention layers, from whichever convention its
    config uses: ``layer_types`` (Qwen3-Next), ``layers_block_type`` (Jamba, Zamba2) or
    ``attn_type_list`` (MiniMax, 1 = full attention); empty when none is present."""
    text = model_config.hf_text_config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return [i for i, t in enumerate(layer_types) if t in ("full_attention", "attention")]
    block_types = getattr(text, "layers_block_type", None)
    if block_types is not None:
        return [i for i, t in enumerate(block_types) if t in ("attention", "hybrid")]
    attn_types = getattr(model_config.hf_config, "attn_type_list", None)
    if attn_types is not None:
        return [i for i, t in enumerate(attn_types) if t == 1]
    return []
