"""Model configs → per-layer KV-cache specs.

A HF-style ``config.json`` (or a shipped preset, see :mod:`vllm.model_presets`) is first parsed
into a dtype-independent :class:`ModelLayout` (one :class:`LayerDesc` per cache-holding layer,
heads already divided for tensor parallelism), then turned into ``KVCacheSpec`` objects for a
cache dtype and block size by :func:`build_kv_cache_specs`.

Units: ``block_size`` is in tokens per page; every ``*_bytes`` quantity is in bytes.

The steps live in their own modules; this one builds the specs and keeps every name of the
pipeline importable from one place:

- :mod:`vllm.v1.core.model_config`: find and read a config (presets, files, mappings);
- :mod:`vllm.v1.core.model_layout`: the layout types and the layer kinds;
- :mod:`vllm.v1.core.model_families`: one parser per model family, :func:`parse_model_layout`;
- :mod:`vllm.v1.core.cache_format_policy`: which format each layer kind gets for a requested
  cache dtype, and the fallbacks (recorded in :attr:`ModelKVSpecs.notes`);
- :mod:`vllm.v1.core.kv_bytes`: byte counting over specs;
- :mod:`vllm.v1.core.spec_display`: short descriptions of specs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.config.cache import validate_cache_dtype
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import AUTO
from vllm.v1.core.cache_format_policy import (
    DSV4_INDEXER_FP8_SCALE_GROUP,
    FP8_DS_MLA_ALIGNMENT,
    layer_spec,
)
from vllm.v1.core.kv_bytes import (
    kv_bytes_for_tokens,
    kv_bytes_per_entry,
    spec_bytes_per_token,
    total_state_bytes,
)
from vllm.v1.core.model_config import load_model_config, unwrap_config
from vllm.v1.core.model_families import SUPPORTED_MODEL_TYPES, parse_model_layout
from vllm.v1.core.model_families.deepseek_v4 import (
    DSV4_BLOCK_SIZE,
    DSV4_CSA_RATIO,
    DSV4_HCA_RATIO,
    deepseek_v4_compressor_state_bytes,
)
from vllm.v1.core.model_layout import (
    DEFAULT_BLOCK_SIZE,
    LAYER_KINDS,
    SKIP_TAGS,
    LayerDesc,
    ModelLayout,
)
from vllm.v1.core.spec_display import describe_spec
from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DSV4_BLOCK_SIZE",
    "DSV4_CSA_RATIO",
    "DSV4_HCA_RATIO",
    "DSV4_INDEXER_FP8_SCALE_GROUP",
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
        if entry in SKIP_TAGS:
            tags.add(entry)
        elif any(n == entry or n.startswith(entry + ".") for n in layer_names):
            names.append(entry)
        else:
            raise ValueError(
                f"kv_cache_dtype_skip_layers: {entry!r} is neither a layer kind "
                f"({', '.join(sorted(SKIP_TAGS))}) nor a layer name of this "
                f"{layout.model_type} model (e.g. {layer_names[0]!r})"
            )
    return frozenset(tags), tuple(names)


def _is_skipped(layer: LayerDesc, tags: frozenset[str], names: tuple[str, ...]) -> bool:
    if tags.intersection(layer.tags):
        return True
    return any(layer.name == n or layer.name.startswith(n + ".") for n in names)


def build_kv_cache_specs(
    layout: ModelLayout,
    cache_dtype: str = "auto",
    block_size: int | None = None,
    skip_layers: Iterable[str] = (),
) -> ModelKVSpecs:
    """Per-layer specs of ``layout`` for ``cache_dtype`` (a dtype string or an encoding id) with
    pages of ``block_size`` tokens (default: ``layout.default_block_size``).

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
        requested = AUTO.name if skipped else cache_dtype
        spec, eff, note = layer_spec(layer, requested, layout.model_dtype, block_size)
        specs[layer.name] = spec
        kinds[layer.name] = layer.kind
        effective[layer.name] = eff
        if note and note not in notes:
            notes.append(note)
    if num_skipped and KVCacheEncoding.parse(cache_dtype).is_quantized:
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
