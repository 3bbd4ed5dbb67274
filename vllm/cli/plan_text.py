"""Text rendering of the ``vllm-kv plan`` report (:mod:`vllm.cli.plan_report`): the layer
table, the KV bytes table and, with a budget, the plan and group tables."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from vllm.cli.plan_report import REFERENCE_DTYPE, group_label
from vllm.v1.core.cache_dtype_comparison import CacheDtypePlan
from vllm.v1.core.kv_cache_utils import KVCachePlan
from vllm.v1.core.spec_display import short_dtype_name
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

__all__ = ["render_text"]


def _fmt_int(value: int | float | Fraction) -> str:
    if isinstance(value, Fraction) and value.denominator != 1:
        return f"{float(value):,.2f}"
    return f"{int(value):,}"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def _table(rows: Sequence[Sequence[str]], right: Sequence[bool], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if right[i] else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def render_text(report: dict[str, Any], columns: Sequence[CacheDtypePlan]) -> str:
    dtypes = [c.dtype for c in columns]
    out: list[str] = []
    title = f" ({report['name']})" if report["name"] else ""
    out.append(f"Model: {report['model']}{title}")
    out.append(
        f"  model_type {report['model_type']}, {report['num_hidden_layers']} hidden layers, "
        f"{report['num_cache_layers']} cache layers, model dtype {report['model_dtype']}, "
        f"TP {report['tensor_parallel_size']}"
        + (" (per-rank numbers)" if report["tensor_parallel_size"] > 1 else "")
    )
    out.append("")
    out.append(f"Layer types (page = one block of {report['block_size']} tokens, in bytes):")
    rows = [["kind", "layers", "shape per rank", *(f"{d} page" for d in dtypes)]]
    for row in report["layer_types"]:
        cells = []
        for d in dtypes:
            cell = _fmt_int(row["page_size_bytes"][d])
            fmt = row["format"][d]
            if fmt != short_dtype_name(d):
                cell += f" ({fmt})"
            cells.append(cell)
        rows.append([row["kind"], str(row["layers"]), row["shape"], *cells])
    out += _table(rows, [False, True, False, *([True] * len(dtypes))])
    out.append("")

    kv = report["kv_bytes"]
    out.append("KV bytes (whole model, one rank):")
    rows = [["", *dtypes]]
    rows.append(
        [
            "per token, all attention layers",
            *(_fmt_bytes(kv[d]["kv_bytes_per_token"]) for d in dtypes),
        ]
    )
    rows.append(
        [
            "  ratio to bfloat16",
            *(
                f"{kv[d]['ratio_to_bfloat16']:.3f}x" if kv[d]["ratio_to_bfloat16"] else "-"
                for d in dtypes
            ),
        ]
    )
    first = kv[dtypes[0]]
    if first["window_cap_bytes_per_sequence"]:
        rows.append(
            [
                "per token, full-context layers",
                *(_fmt_bytes(kv[d]["growing_kv_bytes_per_token"]) for d in dtypes),
            ]
        )
    if first["window_cap_bytes_per_sequence"]:
        rows.append(
            [
                "sliding windows, cap per sequence",
                *(_fmt_bytes(kv[d]["window_cap_bytes_per_sequence"]) for d in dtypes),
            ]
        )
    if first["state_bytes_per_sequence"]:
        rows.append(
            [
                "recurrent state per sequence",
                *(_fmt_bytes(kv[d]["state_bytes_per_sequence"]) for d in dtypes),
            ]
        )
    out += _table(rows, [False, *([True] * len(dtypes))])

    if "plan" in report:
        plan = report["plan"]
        out.append("")
        out.append(
            f"KV-cache plan per rank: budget {_gib(plan['available_memory_bytes'])} "
            f"({plan['available_memory_bytes']:,} bytes)"
        )
        out.append(
            f"  max_model_len {plan['max_model_len']:,} tokens, max_num_batched_tokens "
            f"{plan['max_num_batched_tokens']:,}, TP {report['tensor_parallel_size']}"
        )
        out += _plan_table(columns, plan["max_model_len"])
        out += _group_lines(columns)
    if report["notes"]:
        out.append("")
        out.append("Notes:")
        out += [f"  - {note}" for note in report["notes"]]
    if "plan" not in report:
        out.append("")
        out.append("Pass --memory 80GiB (and --max-model-len, --tp) to plan the cache.")
    return "\n".join(out) + "\n"


def _fmt_bytes(value: int | float) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}"


def _plan_table(columns: Sequence[CacheDtypePlan], max_model_len: int) -> list[str]:
    plans = [c.plan for c in columns]
    ref = next((c.plan for c in columns if c.dtype == REFERENCE_DTYPE), None)
    rows = [["", *(c.dtype for c in columns)]]

    def add(label: str, fn: Any) -> None:
        rows.append([label, *(fn(p) for p in plans)])

    add("groups", lambda p: str(len(p.kv_cache_config.kv_cache_groups)))
    add("tensors", lambda p: str(len(p.kv_cache_config.kv_cache_tensors)))
    add("block sizes (tokens)", lambda p: ", ".join(map(str, p.block_sizes)))
    add("page sizes (bytes)", lambda p: _page_range(p))
    add("bytes per block id", lambda p: f"{p.bytes_per_block:,}")
    add("num_blocks", lambda p: f"{p.kv_cache_config.num_blocks:,}")
    add(
        "KV memory used",
        lambda p: f"{_gib(p.memory_used)} ({p.memory_used / max(p.available_memory, 1):.1%})",
    )
    add(f"blocks per {max_model_len:,}-token request", lambda p: f"{p.blocks_per_request:,}")
    add("bytes per request", lambda p: _gib(p.bytes_per_request))
    add(f"max concurrency @ {max_model_len:,}", lambda p: f"{p.max_concurrency:,.2f}")
    add("token capacity", lambda p: f"{p.token_capacity:,}")
    if ref is not None and ref.max_concurrency > 0:
        add("concurrency vs bfloat16", lambda p: f"{p.max_concurrency / ref.max_concurrency:.2f}x")
    add(
        "padding (pages / group slots)",
        lambda p: f"{p.page_padding_fraction:.1%} / {p.group_padding_fraction:.1%}",
    )
    add(
        "one request fits",
        lambda p: "yes" if p.fits else f"NO: max_model_len {p.max_model_len_that_fits():,} fits",
    )
    lines = _table(rows, [False, *([True] * len(columns))])
    lines.append(
        "  (token capacity = context tokens held when the cache is full of max_model_len "
        "requests; blocks are shared by all groups)"
    )
    for col in columns:
        plan = col.plan
        assert plan is not None
        if not plan.fits:
            lines.append(
                f"  {col.dtype}: one {max_model_len:,}-token request needs "
                f"{_gib(plan.bytes_per_request)} ({plan.bytes_per_request:,} bytes), more than "
                f"the {_gib(plan.available_memory)} budget; raise --memory, lower "
                "--max-model-len, quantize or raise --tp"
            )
    return lines


def _page_range(plan: KVCachePlan) -> str:
    pages = plan.page_sizes
    if len(pages) == 1:
        return f"{pages[0]:,}"
    return f"{pages[0]:,}-{pages[-1]:,}"


def _group_structure(plan: KVCachePlan) -> list[tuple[tuple[str, ...], int]]:
    return [
        (tuple(g.layer_names), g.kv_cache_spec.block_size)
        for g in plan.kv_cache_config.kv_cache_groups
    ]


def _group_page(plan: KVCachePlan, group: KVCacheGroupSpec) -> str:
    if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
        return _page_range(plan)
    spec = plan.specs[group.layer_names[0]]
    page = _fmt_int(spec.page_size_bytes)
    real = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    if real != spec.page_size_bytes:
        page += f" (real {real:,})"
    return page


def _group_lines(columns: Sequence[CacheDtypePlan]) -> list[str]:
    """Group tables: one shared table when every dtype has the same groups, else one each."""
    planned = [c for c in columns if c.plan is not None]
    if not planned:
        return []
    structures = {tuple(_group_structure(c.plan)) for c in planned}  # type: ignore[arg-type]
    sets = [planned] if len(structures) == 1 else [[c] for c in planned]
    out: list[str] = []
    for cols in sets:
        first = cols[0].plan
        assert first is not None
        config = first.kv_cache_config
        dtypes = ", ".join(c.dtype for c in cols)
        out.append("")
        out.append(
            f"Groups ({dtypes}): {len(config.kv_cache_groups)} group(s) sharing "
            f"{len(config.kv_cache_tensors)} tensor(s); blocks/req at max_model_len"
        )
        header = ["#", "kind", "layers", "block", "blocks/req"]
        header += [f"{c.dtype} page" for c in cols] + ["first layer"]
        rows = [header]
        for i, group in enumerate(config.kv_cache_groups):
            pages = []
            for c in cols:
                assert c.plan is not None
                pages.append(_group_page(c.plan, c.plan.kv_cache_config.kv_cache_groups[i]))
            rows.append(
                [
                    str(i),
                    group_label(group, first.base.kinds, first.specs),
                    str(len(group.layer_names)),
                    str(group.kv_cache_spec.block_size),
                    f"{first.group_blocks_per_request(group):,}",
                    *pages,
                    group.layer_names[0],
                ]
            )
        out += _table(rows, [True, False, True, True, True, *([True] * len(cols)), False])
    return out
