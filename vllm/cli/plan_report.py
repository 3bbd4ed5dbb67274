"""The ``vllm-kv plan`` report as a JSON-ready document (``--json`` prints it; the text
renderer, :mod:`vllm.cli.plan_text`, formats it).

Every number comes from the core objects (:mod:`vllm.v1.core.cache_dtype_comparison`,
:class:`~vllm.v1.core.kv_cache_utils.KVCachePlan`, :mod:`vllm.v1.core.kv_bytes`); this module
only chooses labels and arranges them.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from vllm.v1.core.cache_dtype_comparison import CacheDtypePlan
from vllm.v1.core.kv_bytes import KVFootprint
from vllm.v1.core.kv_cache_utils import KVCachePlan
from vllm.v1.core.model_layout import LayerDesc, ModelLayout
from vllm.v1.core.spec_display import describe_spec, spec_format_label
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs

__all__ = ["REFERENCE_DTYPE", "group_label", "plan_report"]

REFERENCE_DTYPE = "bfloat16"
"""The dtype that ratios (bytes per token, concurrency) are taken against."""


def _describe_layer(layer: LayerDesc) -> str:
    if layer.state_shapes:
        names = ("conv", "ssm" if layer.kind == "mamba" else "recurrent")
        return ", ".join(
            f"{label} {'x'.join(map(str, shape))}"
            for label, shape in zip(names, layer.state_shapes, strict=False)
        )
    text = f"H={layer.num_kv_heads} D={layer.head_size}"
    if layer.sliding_window is not None:
        text += f" window={layer.sliding_window}"
    if layer.compress_ratio > 1:
        text += f" ratio={layer.compress_ratio}"
    return text


def _layer_kind_label(layer: LayerDesc) -> str:
    return layer.kind if layer.compress_ratio <= 1 else f"{layer.kind} r{layer.compress_ratio}"


def _layer_rows(layout: ModelLayout, columns: Sequence[CacheDtypePlan]) -> list[dict[str, Any]]:
    """One row per distinct layer type (and per effective dtype when skip layers differ)."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for layer in layout.layers:
        specs = [col.specs.specs[layer.name] for col in columns]
        key = (layer.kind, _describe_layer(layer), tuple(spec_format_label(s) for s in specs))
        row = rows.get(key)
        if row is None:
            row = rows[key] = {
                "kind": _layer_kind_label(layer),
                "layers": 0,
                "shape": _describe_layer(layer),
                "first_layer": layer.name,
                "block_size": specs[0].block_size,
                "page_size_bytes": {
                    c.dtype: s.page_size_bytes for c, s in zip(columns, specs, strict=True)
                },
                "format": {
                    c.dtype: spec_format_label(s) for c, s in zip(columns, specs, strict=True)
                },
                "spec": {c.dtype: describe_spec(s) for c, s in zip(columns, specs, strict=True)},
            }
        row["layers"] += 1
    return list(rows.values())


def group_label(
    group: KVCacheGroupSpec, kinds: dict[str, str], specs: dict[str, KVCacheSpec]
) -> str:
    """A group's label: its layer kinds joined by ``+``, ``rN`` for compressed layers and
    ``(per-layer pages)`` for a group of one slot type but several page sizes."""
    names = group.layer_names
    labels = dict.fromkeys(kinds[n] for n in names)
    label = "+".join(labels)
    ratio = getattr(specs[names[0]], "compress_ratio", 1)
    if ratio > 1:
        label += f" r{ratio}"
    if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
        label += " (per-layer pages)"
    return label


def _plan_json(plan: KVCachePlan) -> dict[str, Any]:
    config = plan.kv_cache_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        layer_specs = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        groups.append(
            {
                "kind": group_label(group, plan.base.kinds, plan.specs),
                "num_layers": len(group.layer_names),
                "layer_names": list(group.layer_names),
                "spec_type": type(spec).__name__,
                "block_size": spec.block_size,
                "page_size_bytes": sorted({s.page_size_bytes for s in layer_specs}),
                "page_size_padded": any(
                    getattr(s, "page_size_padded", None) is not None for s in layer_specs
                ),
            }
        )
    return {
        "kv_cache_dtype": plan.cache_dtype,
        "fits": plan.fits,
        "bytes_per_request": plan.bytes_per_request,
        "max_model_len_that_fits": plan.max_model_len
        if plan.fits
        else plan.max_model_len_that_fits(),
        "available_memory_bytes": plan.available_memory,
        "memory_used_bytes": plan.memory_used,
        "num_blocks": config.num_blocks,
        "bytes_per_block": plan.bytes_per_block,
        "blocks_per_request": plan.blocks_per_request,
        "max_concurrency": plan.max_concurrency,
        "token_capacity": plan.token_capacity,
        "page_padding_fraction": plan.page_padding_fraction,
        "group_padding_fraction": plan.group_padding_fraction,
        "groups": groups,
        "kv_cache_tensors": [
            {"size_bytes": t.size, "shared_by": list(t.shared_by)} for t in config.kv_cache_tensors
        ],
    }


def _number(value: Fraction | int | float) -> int | float:
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else float(value)
    return value


def plan_report(
    name: str,
    title: str | None,
    layout: ModelLayout,
    columns: Sequence[CacheDtypePlan],
    reference: KVFootprint,
) -> dict[str, Any]:
    """The report of ``columns`` (one per cache dtype, planned or not) of the model ``name``
    (display ``title``); ratios are to the ``reference`` (bfloat16) footprint."""
    ref = reference
    notes: list[str] = []
    for col in columns:
        for note in col.specs.notes:
            if note not in notes:
                notes.append(note)
    per_dtype: dict[str, Any] = {}
    for col in columns:
        fp = col.footprint
        per_dtype[col.dtype] = {
            "kv_bytes_per_token": _number(fp.per_token),
            "ratio_to_bfloat16": float(fp.per_token / ref.per_token) if ref.per_token else None,
            "growing_kv_bytes_per_token": _number(fp.growing_per_token),
            "window_cap_bytes_per_sequence": fp.window_cap_per_sequence,
            "state_bytes_per_sequence": fp.state_per_sequence,
        }
    report: dict[str, Any] = {
        "model": name,
        "name": title,
        "model_type": layout.model_type,
        "model_dtype": layout.model_dtype,
        "num_hidden_layers": layout.num_hidden_layers,
        "num_cache_layers": len(layout.layers),
        "tensor_parallel_size": layout.tensor_parallel_size,
        "block_size": columns[0].specs.block_size,
        "kv_cache_dtypes": [c.dtype for c in columns],
        "layer_types": _layer_rows(layout, columns),
        "kv_bytes": per_dtype,
        "notes": notes,
    }
    plans = [c.plan for c in columns if c.plan is not None]
    if plans:
        report["plan"] = {
            "available_memory_bytes": plans[0].available_memory,
            "max_model_len": plans[0].max_model_len,
            "max_num_batched_tokens": plans[0].max_num_batched_tokens,
            "per_dtype": {c.dtype: _plan_json(c.plan) for c in columns if c.plan is not None},
        }
    return report
