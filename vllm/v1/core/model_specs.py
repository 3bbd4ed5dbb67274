"""Model configs → per-layer KV-cache specs.

A HF-style ``config.json`` (or a shipped preset, see :mod:`vllm.model_presets`) is first parsed
into a dtype-independent :class:`ModelLayout` (one :class:`LayerDesc` per cache-holding layer,
heads already divided for tensor parallelism), then turned into ``KVCacheSpec`` objects for a
cache dtype and block size by :func:`build_kv_cache_specs`.

Units: ``block_size`` is in tokens per page; every ``*_bytes`` quantity is in bytes.

Layer kinds (``LayerDesc.kind``) and the names they get:

- ``full_attention`` / ``sliding_window``: ``model.layers.{i}.self_attn``, a
  ``FullAttentionSpec`` / ``SlidingWindowSpec`` with ``num_kv_heads`` K and V heads.
- ``mla`` (DeepSeek-V3): ``model.layers.{i}.self_attn``, ``MLAAttentionSpec`` with one latent of
  ``kv_lora_rank + qk_rope_head_dim`` elements per token, shared by all heads (never split by TP).
- DeepSeek-V4, per main layer i with ``compress_ratios[i]`` r (the rtp-llm / aiconfigurator
  accounting recorded in the presets' ``derived`` block): every layer keeps a sliding-window
  cache of one ``head_dim`` latent per token (``sliding_window_mla``, a ``SlidingWindowMLASpec``);
  r=4 layers add the compressed KV (``compressed_mla``, ``MLAAttentionSpec(compress_ratio=4)``)
  and the indexer keys (``mla_indexer``, ``index_head_dim`` per stored slot, also ratio 4);
  r=128 layers add the compressed KV only. Names: the main cache is
  ``model.layers.{i}.self_attn``, the extra caches ``.self_attn.indexer`` and ``.self_attn.swa``.
  The per-sequence fp32 compressor decode states are not paged KV cache and are not modelled
  (:func:`deepseek_v4_compressor_state_bytes` gives aiconfigurator's estimate). The MTP layers
  (``num_nextn_predict_layers``) of V3/V4 are not modelled.
- ``mamba`` (Nemotron-H ``M``): ``model.layers.{i}.mixer``, ``MambaSpec`` with conv state
  ``(conv_kernel-1, heads*head_dim + 2*n_groups*ssm_state_size)`` and SSM state
  ``(heads, head_dim, ssm_state_size)``.
- ``linear_attention`` (Qwen3-Next Gated DeltaNet): ``model.layers.{i}.linear_attn``,
  ``MambaSpec`` with conv state ``(kernel-1, 2*k_heads*k_dim + v_heads*v_dim)`` and recurrent
  state ``(v_heads, k_dim, v_dim)``.

Dtype policy: attention layers use ``kv_cache_dtype_str_to_dtype(cache_dtype, model dtype)``
and ``get_kv_quant_mode(cache_dtype)``. Mamba / linear-attention states always use the model
dtype (the KV-cache dtype does not apply to them). NVFP4 is not a format for MLA latents: for
``nvfp4`` requests V3 MLA layers fall back to the model dtype (plain fp8 MLA needs a calibrated
per-tensor fp8 scale that an NVFP4 checkpoint does not carry) and DeepSeek-V4 layers fall back to
``fp8_ds_mla`` (its 584-byte record carries its own scales); the indexer falls back to its fp8
entry (132 bytes). Every fallback is recorded in :attr:`ModelKVSpecs.notes`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from vllm.config.cache import validate_cache_dtype
from vllm.model_presets import available_presets, load_preset
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import (
    FP8_DS_MLA_HEAD_SIZE,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    get_kv_quant_mode,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DSV4_BLOCK_SIZE",
    "FP8_DS_MLA_ALIGNMENT",
    "LAYER_KINDS",
    "LayerDesc",
    "ModelKVSpecs",
    "ModelLayout",
    "SUPPORTED_MODEL_TYPES",
    "build_kv_cache_specs",
    "deepseek_v4_compressor_state_bytes",
    "describe_spec",
    "get_kv_cache_specs",
    "kv_bytes_for_tokens",
    "kv_bytes_per_entry",
    "load_model_config",
    "parse_model_layout",
    "spec_bytes_per_token",
    "total_state_bytes",
    "unwrap_config",
]

DEFAULT_BLOCK_SIZE = 16
"""Tokens per page when none is given (models without compressed layers)."""

DSV4_BLOCK_SIZE = 256
"""Default tokens per page for DeepSeek-V4 (docs/design.md §4 worked example; a multiple of 128)."""

FP8_DS_MLA_ALIGNMENT = 576
"""Page alignment (bytes) of compressed ``fp8_ds_mla`` pages (docs/design.md §4)."""

DSV4_INDEXER_FP8_SCALE_GROUP = 128
"""fp8 indexer keys carry one 4-byte fp32 scale per this many values: index_head_dim 128 gives
the 132-byte entry of rtp-llm's ``fp8_indexer_entry``."""

DSV4_CSA_RATIO = 4
"""Compressed sparse attention (with indexer) ratio."""

DSV4_HCA_RATIO = 128
"""Heavily compressed attention ratio."""

LAYER_KINDS: dict[str, tuple[str, ...]] = {
    "full_attention": ("full_attention",),
    "sliding_window": ("sliding_window",),
    "mla": ("mla",),
    "compressed_mla": ("compressed_mla", "mla"),
    "mla_indexer": ("mla_indexer", "compressed_mla", "mla"),
    "sliding_window_mla": ("sliding_window_mla", "sliding_window", "mla"),
    "mamba": ("mamba",),
    "linear_attention": ("linear_attention", "mamba"),
}
"""Each layer kind and the tags ``kv_cache_dtype_skip_layers`` entries match it by."""

_SKIP_TAGS = frozenset(tag for tags in LAYER_KINDS.values() for tag in tags)

_MLA_KINDS = frozenset({"mla", "compressed_mla", "mla_indexer", "sliding_window_mla"})
_STATE_KINDS = frozenset({"mamba", "linear_attention"})


# --------------------------------------------------------------------------------------------
# Layout: what each layer caches, independent of dtype and block size


@dataclass(frozen=True, kw_only=True)
class LayerDesc:
    """One cache-holding layer, heads already per tensor-parallel rank.

    ``head_size`` is in elements; ``sliding_window`` in tokens; ``compress_ratio`` is tokens per
    stored slot (1 = uncompressed); ``state_shapes`` are the Mamba state tensor shapes.
    """

    name: str
    kind: str
    num_kv_heads: int = 1
    head_size: int = 0
    sliding_window: int | None = None
    compress_ratio: int = 1
    state_shapes: tuple[tuple[int, ...], ...] = ()
    mamba_type: str | None = None

    @property
    def tags(self) -> tuple[str, ...]:
        """Kind tags matched by ``kv_cache_dtype_skip_layers``."""
        return LAYER_KINDS[self.kind]


@dataclass(frozen=True, kw_only=True)
class ModelLayout:
    """The cache-holding layers of a model, in model order, for one tensor-parallel rank."""

    model_type: str
    model_dtype: str
    """Model dtype string (``torch_dtype``; ``bfloat16`` when the config has none)."""
    num_hidden_layers: int
    max_position_embeddings: int | None
    tensor_parallel_size: int
    default_block_size: int
    """Tokens per page used when the caller gives none."""
    layers: tuple[LayerDesc, ...]
    notes: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """Distinct layer kinds, in order of first appearance."""
        return tuple(dict.fromkeys(layer.kind for layer in self.layers))

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """Distinct compress ratios > 1 of the layers."""
        return tuple(sorted({lyr.compress_ratio for lyr in self.layers if lyr.compress_ratio > 1}))


@dataclass(frozen=True, kw_only=True)
class ModelKVSpecs:
    """Per-layer KV-cache specs of a model for one cache dtype and block size.

    ``specs`` and ``kinds`` are ordered like the model's layers. ``cache_dtypes`` holds the dtype
    string each layer's spec was built for after skip-layer and fallback rules (``auto`` = the
    model dtype). ``notes`` explains every fallback or assumption.
    """

    layout: ModelLayout
    cache_dtype: str
    block_size: int
    specs: dict[str, KVCacheSpec]
    kinds: dict[str, str]
    cache_dtypes: dict[str, str]
    notes: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------------------------
# Config access helpers


def unwrap_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The bare HF config of a preset wrapper (``{"config": {...}, "derived": ...}``) or of a
    bare config (returned as a copy)."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config: expected a mapping (a config.json dict), got {type(config)}")
    inner = config.get("config")
    if "model_type" not in config and isinstance(inner, Mapping):
        return dict(inner)
    return dict(config)


def load_model_config(model: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[str, dict]:
    """``(display name, bare config)`` for a preset name, a JSON file path or a config mapping.

    A JSON file may be a raw ``config.json`` or a preset wrapper. An unknown name that is not a
    file raises ``ValueError`` listing the available presets.
    """
    if isinstance(model, Mapping):
        name = str(model.get("name", unwrap_config(model).get("model_type", "config")))
        return name, unwrap_config(model)
    text = os.fspath(model)
    if text in available_presets():
        preset = load_preset(text)
        return text, unwrap_config(preset)
    path = Path(text)
    if path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"model: {text} is not valid JSON: {exc}") from exc
        return path.stem if path.name != "config.json" else text, unwrap_config(data)
    raise ValueError(
        f"model: {text!r} is neither a shipped preset nor a JSON file; available presets: "
        f"{', '.join(available_presets())}"
    )


def _require(cfg: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config: missing key '{prefix}{key}'")
    return cfg[key]


def _positive_int(cfg: Mapping[str, Any], key: str, prefix: str = "") -> int:
    value = _require(cfg, key, prefix)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config: key '{prefix}{key}' must be a positive int, got {value!r}")
    return value


def _optional_positive_int(cfg: Mapping[str, Any], key: str, prefix: str = "") -> int | None:
    if cfg.get(key) is None:
        return None
    return _positive_int(cfg, key, prefix)


def _head_size(cfg: Mapping[str, Any], prefix: str = "") -> int:
    """``head_dim``, else ``attention_head_dim``, else ``hidden_size // num_attention_heads``."""
    for key in ("head_dim", "attention_head_dim"):
        if cfg.get(key) is not None:
            return _positive_int(cfg, key, prefix)
    hidden = _positive_int(cfg, "hidden_size", prefix)
    heads = _positive_int(cfg, "num_attention_heads", prefix)
    if hidden % heads != 0:
        raise ValueError(
            f"config: cannot derive the head size: '{prefix}hidden_size' {hidden} is not a "
            f"multiple of '{prefix}num_attention_heads' {heads}; set '{prefix}head_dim'"
        )
    return hidden // heads


def _model_dtype(*cfgs: Mapping[str, Any]) -> tuple[str, str | None]:
    """Model dtype string and a note when it was assumed."""
    for cfg in cfgs:
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if value is None:
                continue
            if not isinstance(value, str) or value not in STR_DTYPE_TO_TORCH_DTYPE:
                raise ValueError(
                    f"config: key '{key}' must be one of float16, bfloat16, float32, got {value!r}"
                )
            if value in ("fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"):
                raise ValueError(f"config: key '{key}' is not a model dtype: {value!r}")
            return value, None
    return "bfloat16", "config has no torch_dtype; assuming bfloat16 for the model dtype"


def _kv_heads_per_rank(num_kv_heads: int, tp: int, key: str = "num_key_value_heads") -> int:
    """KV heads on one rank: split evenly, or replicated (1 per rank) when fewer than ranks."""
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ValueError(
        f"tensor_parallel_size: {tp} must divide config '{key}' ({num_kv_heads}) or be a "
        f"multiple of it"
    )


def _split_evenly(value: int, tp: int, key: str) -> int:
    if value % tp != 0:
        raise ValueError(
            f"tensor_parallel_size: {tp} must divide config '{key}' ({value}) to shard it"
        )
    return value // tp


# --------------------------------------------------------------------------------------------
# Per-architecture parsers. Each returns (layers, notes, default block size).

_Parsed = tuple[list[LayerDesc], list[str], int]


def _attention_layer(name: str, kind: str, heads: int, head: int, window: int | None) -> LayerDesc:
    return LayerDesc(
        name=name, kind=kind, num_kv_heads=heads, head_size=head, sliding_window=window
    )


def _layer_types_pattern(
    cfg: Mapping[str, Any], num_layers: int, allowed: Iterable[str], prefix: str = ""
) -> list[str]:
    types = cfg["layer_types"]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(
            f"config: key '{prefix}layer_types' must list one type per layer "
            f"({num_layers}), got {types!r:.80}"
        )
    allowed = tuple(allowed)
    for i, kind in enumerate(types):
        if kind not in allowed:
            raise ValueError(
                f"config: key '{prefix}layer_types[{i}]' is {kind!r}; expected one of "
                f"{', '.join(allowed)}"
            )
    return list(types)


def _parse_dense(cfg: Mapping[str, Any], tp: int, model_type: str) -> _Parsed:
    """llama / mistral / qwen2 / qwen3 / qwen3_moe / gpt_oss / gemma3(_text)."""
    notes: list[str] = []
    prefix = ""
    if model_type == "gemma3":
        text_cfg = _require(cfg, "text_config")
        if not isinstance(text_cfg, Mapping):
            raise ValueError("config: key 'text_config' must be a mapping")
        cfg, prefix = text_cfg, "text_config."
    num_layers = _positive_int(cfg, "num_hidden_layers", prefix)
    _positive_int(cfg, "num_attention_heads", prefix)
    heads = _kv_heads_per_rank(
        _positive_int(cfg, "num_key_value_heads", prefix), tp, f"{prefix}num_key_value_heads"
    )
    head = _head_size(cfg, prefix)
    window = _optional_positive_int(cfg, "sliding_window", prefix)

    types: list[str]
    if cfg.get("layer_types") is not None:
        types = _layer_types_pattern(
            cfg, num_layers, ("full_attention", "sliding_attention"), prefix
        )
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = _optional_positive_int(cfg, "sliding_window_pattern", prefix)
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
        _attention_layer(
            f"model.layers.{i}.self_attn",
            "sliding_window" if kind == "sliding_attention" else "full_attention",
            heads,
            head,
            window if kind == "sliding_attention" else None,
        )
        for i, kind in enumerate(types)
    ]
    return layers, notes, DEFAULT_BLOCK_SIZE


def _parse_deepseek_v3(cfg: Mapping[str, Any], tp: int, model_type: str) -> _Parsed:
    num_layers = _positive_int(cfg, "num_hidden_layers")
    head = _positive_int(cfg, "kv_lora_rank") + _positive_int(cfg, "qk_rope_head_dim")
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


def _parse_deepseek_v4(cfg: Mapping[str, Any], tp: int, model_type: str) -> _Parsed:
    num_layers = _positive_int(cfg, "num_hidden_layers")
    head = _positive_int(cfg, "head_dim")
    window = _positive_int(cfg, "sliding_window")
    kv_heads = _positive_int(cfg, "num_key_value_heads")  # one shared latent: never split
    ratios = _require(cfg, "compress_ratios")
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
                index_head = _positive_int(cfg, "index_head_dim")
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


def _parse_nemotron_h(cfg: Mapping[str, Any], tp: int, model_type: str) -> _Parsed:
    num_layers = _positive_int(cfg, "num_hidden_layers")
    pattern = _require(cfg, "hybrid_override_pattern")
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
                _positive_int(cfg, "num_attention_heads")
                attn = (
                    _kv_heads_per_rank(_positive_int(cfg, "num_key_value_heads"), tp),
                    _head_size(cfg),
                    _optional_positive_int(cfg, "sliding_window"),
                )
            heads, head, window = attn
            kind = "sliding_window" if window is not None else "full_attention"
            layers.append(
                _attention_layer(f"model.layers.{i}.self_attn", kind, heads, head, window)
            )
        elif char == "M":
            if mamba_shapes is None:
                num_heads = _split_evenly(
                    _positive_int(cfg, "mamba_num_heads"), tp, "mamba_num_heads"
                )
                head_dim = _positive_int(cfg, "mamba_head_dim")
                state = _positive_int(cfg, "ssm_state_size")
                groups = _kv_heads_per_rank(_positive_int(cfg, "n_groups"), tp, "n_groups")
                kernel = _positive_int(cfg, "conv_kernel")
                if kernel < 2:
                    raise ValueError(f"config: key 'conv_kernel' must be ≥ 2, got {kernel}")
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


def _parse_qwen3_next(cfg: Mapping[str, Any], tp: int, model_type: str) -> _Parsed:
    num_layers = _positive_int(cfg, "num_hidden_layers")
    if cfg.get("layer_types") is not None:
        types = _layer_types_pattern(cfg, num_layers, ("full_attention", "linear_attention"))
    else:
        interval = _positive_int(cfg, "full_attention_interval")
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
                _positive_int(cfg, "num_attention_heads")
                attn = (
                    _kv_heads_per_rank(_positive_int(cfg, "num_key_value_heads"), tp),
                    _head_size(cfg),
                )
            layers.append(
                _attention_layer(f"model.layers.{i}.self_attn", "full_attention", *attn, None)
            )
            continue
        if gdn_shapes is None:
            k_heads = _split_evenly(
                _positive_int(cfg, "linear_num_key_heads"), tp, "linear_num_key_heads"
            )
            v_heads = _split_evenly(
                _positive_int(cfg, "linear_num_value_heads"), tp, "linear_num_value_heads"
            )
            k_dim = _positive_int(cfg, "linear_key_head_dim")
            v_dim = _positive_int(cfg, "linear_value_head_dim")
            kernel = _positive_int(cfg, "linear_conv_kernel_dim")
            if kernel < 2:
                raise ValueError(f"config: key 'linear_conv_kernel_dim' must be ≥ 2, got {kernel}")
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


_PARSERS = {
    "llama": _parse_dense,
    "mistral": _parse_dense,
    "qwen2": _parse_dense,
    "qwen3": _parse_dense,
    "qwen3_moe": _parse_dense,
    "gpt_oss": _parse_dense,
    "gemma3": _parse_dense,
    "gemma3_text": _parse_dense,
    "deepseek_v2": _parse_deepseek_v3,
    "deepseek_v3": _parse_deepseek_v3,
    "deepseek_v4": _parse_deepseek_v4,
    "nemotron_h": _parse_nemotron_h,
    "qwen3_next": _parse_qwen3_next,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_PARSERS))
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
    model_type = _require(cfg, "model_type")
    if model_type not in _PARSERS:
        raise ValueError(
            f"config: cannot map model_type {model_type!r}; expected one of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layers, notes, default_block = _PARSERS[model_type](cfg, tensor_parallel_size, model_type)
    if not layers:
        raise ValueError(f"config: model_type {model_type!r} config has no cache-holding layers")
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), Mapping) else {}
    model_dtype, dtype_note = _model_dtype(cfg, text_cfg)
    if dtype_note:
        notes.insert(0, dtype_note)
    max_pos = cfg.get("max_position_embeddings", text_cfg.get("max_position_embeddings"))
    if max_pos is None and model_type in ("gemma3", "gemma3_text"):
        max_pos = 131072
        notes.append("gemma3: max_position_embeddings absent; using the transformers default")
    num_hidden = cfg.get("num_hidden_layers", text_cfg.get("num_hidden_layers"))
    return ModelLayout(
        model_type=model_type,
        model_dtype=model_dtype,
        num_hidden_layers=int(num_hidden),
        max_position_embeddings=int(max_pos) if isinstance(max_pos, int) else None,
        tensor_parallel_size=tensor_parallel_size,
        default_block_size=default_block,
        layers=tuple(layers),
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------------------------
# Specs for a cache dtype


def _skip_matcher(
    layout: ModelLayout, skip_layers: Iterable[str]
) -> tuple[frozenset[str], tuple[str, ...]]:
    entries = list(skip_layers)
    if isinstance(skip_layers, str):
        raise ValueError(
            f"kv_cache_dtype_skip_layers: expected a list of layer kinds or names, got {entries!r}"
        )
    tags: set[str] = set()
    names: list[str] = []
    layer_names = [layer.name for layer in layout.layers]
    for entry in entries:
        if entry in _SKIP_TAGS:
            tags.add(entry)
        elif any(n == entry or n.startswith(entry + ".") for n in layer_names):
            names.append(entry)
        else:
            raise ValueError(
                f"kv_cache_dtype_skip_layers: {entry!r} is neither a layer kind "
                f"({', '.join(sorted(_SKIP_TAGS))}) nor a layer name of this "
                f"{layout.model_type} model (e.g. {layer_names[0]!r})"
            )
    return frozenset(tags), tuple(names)


def _is_skipped(layer: LayerDesc, tags: frozenset[str], names: tuple[str, ...]) -> bool:
    if tags.intersection(layer.tags):
        return True
    return any(layer.name == n or layer.name.startswith(n + ".") for n in names)


def _attention_kwargs(
    layer: LayerDesc, block_size: int, cache_dtype: str, model_dtype: str
) -> dict[str, Any]:
    """Page, head and dtype fields of an attention spec of ``layer`` cached as ``cache_dtype``."""
    return dict(
        block_size=block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model_dtype),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )


def _layer_spec(
    layer: LayerDesc, cache_dtype: str, model_dtype: str, block_size: int
) -> tuple[KVCacheSpec, str, str | None]:
    """Spec of ``layer`` for ``cache_dtype`` (already skip-resolved): (spec, effective dtype
    string, fallback note or None)."""
    mode = get_kv_quant_mode(cache_dtype)
    kind = layer.kind
    if kind in _STATE_KINDS:
        dtype = kv_cache_dtype_str_to_dtype("auto", model_dtype)
        note = None
        if mode.is_quantized:
            note = (
                f"{kind} layers keep their recurrent state in the model dtype ({model_dtype}); "
                "a quantized kv_cache_dtype applies to attention layers only"
            )
        spec = MambaSpec(
            block_size=block_size,
            shapes=layer.state_shapes,
            dtypes=(dtype,) * len(layer.state_shapes),
            mamba_type=layer.mamba_type or "mamba2",
        )
        return spec, "auto", note
    if kind in ("full_attention", "sliding_window"):
        common = _attention_kwargs(layer, block_size, cache_dtype, model_dtype)
        if kind == "full_attention":
            return FullAttentionSpec(**common), cache_dtype, None
        assert layer.sliding_window is not None
        return SlidingWindowSpec(sliding_window=layer.sliding_window, **common), cache_dtype, None
    if kind == "mla":
        note = None
        effective = cache_dtype
        if mode.is_nvfp4:
            effective = "auto"
            note = (
                f"mla layers: nvfp4 is not an MLA cache format; kept in the model dtype "
                f"({model_dtype}) since plain fp8 MLA needs a calibrated fp8 scale"
            )
        latent = _attention_kwargs(layer, block_size, effective, model_dtype)
        spec = MLAAttentionSpec(
            cache_dtype_str=effective if latent["kv_quant_mode"].is_quantized else None, **latent
        )
        return spec, effective, note
    # DeepSeek-V4 kinds: quantized requests use the self-scaled fp8 formats.
    note = None
    if mode.is_quantized:
        if cache_dtype not in ("fp8", "fp8_e4m3"):
            note = (
                f"deepseek_v4: {cache_dtype} is not a DeepSeek-V4 cache format; latent caches "
                "use fp8_ds_mla (584 B per slot) and indexer keys the fp8 entry (128 values + "
                "fp32 scale), both e4m3 with their own scales"
            )
        if kind == "mla_indexer":
            spec = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=layer.head_size + 4 * -(-layer.head_size // DSV4_INDEXER_FP8_SCALE_GROUP),
                dtype=STR_DTYPE_TO_TORCH_DTYPE["fp8"],
                kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
                compress_ratio=layer.compress_ratio,
            )
            return spec, "fp8", note
        if layer.head_size != FP8_DS_MLA_HEAD_SIZE:
            raise ValueError(
                f"config: key 'head_dim' must be {FP8_DS_MLA_HEAD_SIZE} for the fp8_ds_mla "
                f"cache, got {layer.head_size}"
            )
        quant = dict(
            block_size=block_size,
            num_kv_heads=layer.num_kv_heads,
            head_size=layer.head_size,
            dtype=STR_DTYPE_TO_TORCH_DTYPE["fp8"],
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
            cache_dtype_str="fp8_ds_mla",
        )
        if kind == "sliding_window_mla":
            assert layer.sliding_window is not None
            return SlidingWindowMLASpec(sliding_window=layer.sliding_window, **quant), "fp8", note
        spec = MLAAttentionSpec(
            compress_ratio=layer.compress_ratio, alignment=FP8_DS_MLA_ALIGNMENT, **quant
        )
        return spec, "fp8_ds_mla", note
    plain = _attention_kwargs(layer, block_size, cache_dtype, model_dtype)
    if kind == "sliding_window_mla":
        assert layer.sliding_window is not None
        return SlidingWindowMLASpec(sliding_window=layer.sliding_window, **plain), cache_dtype, None
    return MLAAttentionSpec(compress_ratio=layer.compress_ratio, **plain), cache_dtype, None


def build_kv_cache_specs(
    layout: ModelLayout,
    cache_dtype: str = "auto",
    block_size: int | None = None,
    skip_layers: Iterable[str] = (),
) -> ModelKVSpecs:
    """Per-layer specs of ``layout`` for ``cache_dtype`` with pages of ``block_size`` tokens
    (default: ``layout.default_block_size``).

    ``skip_layers`` entries are layer kinds/tags (see :data:`LAYER_KINDS`) or layer names (a
    name also covers its sub-caches, e.g. ``model.layers.3.self_attn`` covers ``.swa``);
    matching layers stay in the model dtype. An entry that matches neither raises ``ValueError``.
    """
    validate_cache_dtype(cache_dtype, "cache_dtype")
    if block_size is None:
        block_size = layout.default_block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(
            f"block_size: expected a positive int (tokens per page), got {block_size!r}"
        )
    for ratio in layout.compress_ratios:
        if block_size % ratio != 0:
            raise ValueError(
                f"block_size: {layout.model_type} has layers compressed {ratio}x, so pages must "
                f"hold a multiple of {max(layout.compress_ratios)} tokens, got {block_size}"
            )
    tags, names = _skip_matcher(layout, skip_layers)
    specs: dict[str, KVCacheSpec] = {}
    kinds: dict[str, str] = {}
    effective: dict[str, str] = {}
    notes = list(layout.notes)
    num_skipped = 0
    for layer in layout.layers:
        skipped = _is_skipped(layer, tags, names)
        num_skipped += skipped
        requested = "auto" if skipped else cache_dtype
        spec, eff, note = _layer_spec(layer, requested, layout.model_dtype, block_size)
        specs[layer.name] = spec
        kinds[layer.name] = layer.kind
        effective[layer.name] = eff
        if note and note not in notes:
            notes.append(note)
    if num_skipped and get_kv_quant_mode(cache_dtype).is_quantized:
        notes.append(
            f"kv_cache_dtype_skip_layers: {num_skipped} layer(s) kept in the model dtype "
            f"({layout.model_dtype})"
        )
    return ModelKVSpecs(
        layout=layout,
        cache_dtype=cache_dtype,
        block_size=block_size,
        specs=specs,
        kinds=kinds,
        cache_dtypes=effective,
        notes=tuple(notes),
    )


def get_kv_cache_specs(
    config: Mapping[str, Any],
    cache_dtype: str = "auto",
    block_size: int | None = None,
    *,
    tensor_parallel_size: int = 1,
    skip_layers: Iterable[str] = (),
) -> dict[str, KVCacheSpec]:
    """Ordered ``layer name → KVCacheSpec`` for a HF config dict (bare or preset wrapper).

    See :func:`parse_model_layout` and :func:`build_kv_cache_specs`.
    """
    layout = parse_model_layout(config, tensor_parallel_size=tensor_parallel_size)
    return build_kv_cache_specs(layout, cache_dtype, block_size, skip_layers).specs


# --------------------------------------------------------------------------------------------
# Byte accounting


def kv_bytes_per_entry(spec: KVCacheSpec) -> int:
    """Bytes of one stored slot (one token, or one compressed group of tokens) of an attention
    spec, all heads, K and V, without page padding."""
    if isinstance(spec, MambaSpec):
        raise ValueError("spec: a MambaSpec holds a fixed state, not per-token entries")
    return spec.real_page_size_bytes // spec.storage_block_size  # type: ignore[attr-defined]


def spec_bytes_per_token(spec: KVCacheSpec) -> Fraction:
    """Allocated bytes per token of sequence (``page_size_bytes / block_size``, padding
    included); 0 for Mamba specs, whose state does not grow with the sequence."""
    if isinstance(spec, MambaSpec):
        return Fraction(0)
    return Fraction(spec.page_size_bytes, spec.block_size)


def kv_bytes_for_tokens(specs: Mapping[str, KVCacheSpec], num_tokens: int) -> int:
    """Logical cache bytes one sequence of ``num_tokens`` tokens holds across ``specs``:
    full/MLA layers ``num_tokens // ratio`` entries, sliding layers ``min(num_tokens, window)``
    entries, Mamba layers their whole state. Pages and padding are not counted."""
    total = 0
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            total += spec.real_page_size_bytes
            continue
        window = getattr(spec, "sliding_window", None)
        ratio = getattr(spec, "compress_ratio", 1)
        entries = min(num_tokens, window) if window is not None else num_tokens // ratio
        total += entries * kv_bytes_per_entry(spec)
    return total


def deepseek_v4_compressor_state_bytes(config: Mapping[str, Any]) -> int:
    """aiconfigurator's estimate of DeepSeek-V4's per-sequence fp32 compressor states (bytes):
    per ratio-r layer ``2*r*c*head_dim*4`` (c=2 for r=4, else 1) plus ``2*4*2*index_head_dim*4``
    for the ratio-4 indexer compressor."""
    cfg = unwrap_config(config)
    num_layers = _positive_int(cfg, "num_hidden_layers")
    head = _positive_int(cfg, "head_dim")
    total = 0
    for ratio in _require(cfg, "compress_ratios")[:num_layers]:
        if ratio == 0:
            continue
        c = 2 if ratio == DSV4_CSA_RATIO else 1
        total += 2 * ratio * c * head * 4
        if ratio == DSV4_CSA_RATIO:
            total += 2 * 4 * 2 * _positive_int(cfg, "index_head_dim") * 4
    return total


def describe_spec(spec: KVCacheSpec) -> str:
    """A short human-readable description of a spec (heads, head size, dtype, window, ratio)."""
    if isinstance(spec, MambaSpec):
        parts = [
            f"{'x'.join(map(str, shape))} {str(dtype).removeprefix('torch.')}"
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
        ]
        return f"{spec.mamba_type} state " + " + ".join(parts)
    fmt = getattr(spec, "cache_dtype_str", None)
    mode = spec.kv_quant_mode  # type: ignore[attr-defined]
    if fmt == "fp8_ds_mla":
        dtype = "fp8_ds_mla"
    elif mode.is_nvfp4:
        dtype = "nvfp4"
    elif mode.is_fp8:
        dtype = "fp8"
    else:
        dtype = str(spec.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    text = f"H={spec.num_kv_heads} D={spec.head_size} {dtype}"  # type: ignore[attr-defined]
    window = getattr(spec, "sliding_window", None)
    if window is not None:
        text += f" window={window}"
    ratio = getattr(spec, "compress_ratio", 1)
    if ratio > 1:
        text += f" ratio={ratio}"
    return text


def total_state_bytes(specs: Mapping[str, KVCacheSpec]) -> int:
    """Sum of Mamba state bytes (unpadded) over ``specs``: the fixed per-sequence state."""
    return sum(s.real_page_size_bytes for s in specs.values() if isinstance(s, MambaSpec))
