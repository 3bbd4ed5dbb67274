"""Model config I/O: find a model's HF ``config.json`` (a shipped preset, a file or a mapping)
and read its keys with the errors the parsers share (``config: missing key 'x'`` ...).

Each reader takes an optional ``prefix`` (e.g. ``text_config.``) that error messages put in front
of the key, so a nested config reports the full key path. The integer readers bound what they
read (:data:`MAX_CONFIG_INT`, :data:`MAX_LAYERS`); keys the planner never reads are not checked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm.kv_quant.formats import find_dtype_name, formats
from vllm.model_presets import available_presets, load_preset

__all__ = [
    "MAX_CONFIG_INT",
    "MAX_LAYERS",
    "attention_heads_per_rank",
    "config_head_size",
    "config_layer_types",
    "config_model_dtype",
    "conv_kernel_key",
    "kv_heads_per_rank",
    "load_model_config",
    "optional_positive_int_key",
    "positive_int_key",
    "required_key",
    "split_evenly",
    "unwrap_config",
]

MAX_CONFIG_INT = 2**53
"""Largest integer key a reader here accepts (sizes, token counts): beyond it a value is no size
of anything, and float conversions of the plan's byte counts overflow."""
MAX_LAYERS = 10_000
"""Largest ``num_hidden_layers`` (the deepest real models have under 200): parsers build one entry
per layer, so 10**12 would exhaust memory."""
_KEY_LIMITS = {"num_hidden_layers": MAX_LAYERS}


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


def required_key(cfg: Mapping[str, Any], key: str, prefix: str = "") -> Any:
    """``cfg[key]``; ``ValueError`` when it is absent or null."""
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config: missing key '{prefix}{key}'")
    return cfg[key]


def positive_int_key(cfg: Mapping[str, Any], key: str, prefix: str = "") -> int:
    """``cfg[key]``, which must be a positive int of at most :data:`MAX_CONFIG_INT`
    (:data:`MAX_LAYERS` for ``num_hidden_layers``)."""
    value = required_key(cfg, key, prefix)
    limit = _KEY_LIMITS.get(key, MAX_CONFIG_INT)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= limit:
        bound = f"2**{limit.bit_length() - 1}" if limit.bit_count() == 1 else f"{limit:,}"
        raise ValueError(
            f"config: key '{prefix}{key}' must be a positive int up to {bound}, got {_shown(value)}"
        )
    return value


def _shown(value: Any) -> str:
    """``value`` for an error message; a huge integer by its size."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) < 10**20:
        return repr(value)
    try:
        return f"a {len(str(abs(value)))}-digit number"
    except ValueError:  # over the interpreter's int-to-str digit limit
        return f"a {value.bit_length()}-bit number"


def conv_kernel_key(cfg: Mapping[str, Any], key: str) -> int:
    """``cfg[key]``, a causal-conv kernel width: an int ≥ 2 (its state keeps ``kernel - 1``
    rows)."""
    kernel = positive_int_key(cfg, key)
    if kernel < 2:
        raise ValueError(f"config: key '{key}' must be ≥ 2, got {kernel}")
    return kernel


def optional_positive_int_key(cfg: Mapping[str, Any], key: str, prefix: str = "") -> int | None:
    """``cfg[key]`` as a positive int, or None when it is absent or null."""
    if cfg.get(key) is None:
        return None
    return positive_int_key(cfg, key, prefix)


def config_head_size(cfg: Mapping[str, Any], prefix: str = "") -> int:
    """``head_dim``, else ``attention_head_dim``, else ``hidden_size // num_attention_heads``."""
    for key in ("head_dim", "attention_head_dim"):
        if cfg.get(key) is not None:
            return positive_int_key(cfg, key, prefix)
    hidden = positive_int_key(cfg, "hidden_size", prefix)
    heads = positive_int_key(cfg, "num_attention_heads", prefix)
    if hidden % heads != 0:
        raise ValueError(
            f"config: cannot derive the head size: '{prefix}hidden_size' {hidden} is not a "
            f"multiple of '{prefix}num_attention_heads' {heads}; set '{prefix}head_dim'"
        )
    return hidden // heads


def attention_heads_per_rank(cfg: Mapping[str, Any], tp: int, prefix: str = "") -> tuple[int, int]:
    """(KV heads on one of ``tp`` ranks, head size) of the config's attention layers."""
    positive_int_key(cfg, "num_attention_heads", prefix)
    key = f"{prefix}num_key_value_heads"
    heads = kv_heads_per_rank(positive_int_key(cfg, "num_key_value_heads", prefix), tp, key)
    return heads, config_head_size(cfg, prefix)


def config_model_dtype(*cfgs: Mapping[str, Any]) -> tuple[str, str | None]:
    """Model dtype string and a note when it was assumed."""
    for cfg in cfgs:
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if value is None:
                continue
            fmt = find_dtype_name(value) if isinstance(value, str) else None
            if fmt is None or fmt.is_auto:
                model_dtypes = [f.name for f in formats() if not f.is_quantized and not f.is_auto]
                raise ValueError(
                    f"config: key '{key}' must be one of {', '.join(model_dtypes)}, got {value!r}"
                )
            if fmt.is_quantized:
                raise ValueError(f"config: key '{key}' is not a model dtype: {value!r}")
            return value, None
    return "bfloat16", "config has no torch_dtype; assuming bfloat16 for the model dtype"


def kv_heads_per_rank(num_kv_heads: int, tp: int, key: str = "num_key_value_heads") -> int:
    """KV heads on one rank: split evenly, or replicated (1 per rank) when fewer than ranks."""
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ValueError(
        f"tensor_parallel_size: {tp} must divide config '{key}' ({num_kv_heads}) or be a "
        f"multiple of it"
    )


def split_evenly(value: int, tp: int, key: str) -> int:
    """``value`` (heads of config ``key``) on one of ``tp`` ranks; they must divide evenly."""
    if value % tp != 0:
        raise ValueError(
            f"tensor_parallel_size: {tp} must divide config '{key}' ({value}) to shard it"
        )
    return value // tp


def config_layer_types(
    cfg: Mapping[str, Any], num_layers: int, allowed: Iterable[str], prefix: str = ""
) -> list[str]:
    """``cfg["layer_types"]``: one entry per layer, each one of ``allowed``."""
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
