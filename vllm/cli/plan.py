"""``vllm-kv plan``: layer specs, page sizes, bytes per token and a KV-cache memory plan.

Without ``--memory`` it prints each distinct layer type of the model with its page size for
bfloat16, fp8 and nvfp4 (or the one ``--kv-cache-dtype``), and the KV bytes per token of the
whole model with the ratio to bfloat16. With ``--memory`` it also plans the cache for that
per-rank budget: groups, page sizes, ``num_blocks``, token capacity and the maximum concurrency
at ``--max-model-len``, side by side. ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vllm.config.cache import CACHE_DTYPES
from vllm.model_presets import DEFAULT_PRESET, available_presets
from vllm.v1.core.kv_cache_utils import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KVCachePlan,
    blocks_per_request,
    plan_kv_cache_for_specs,
)
from vllm.v1.core.model_specs import (
    LayerDesc,
    ModelKVSpecs,
    ModelLayout,
    build_kv_cache_specs,
    describe_spec,
    kv_bytes_per_entry,
    load_model_config,
    parse_model_layout,
)
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec, UniformTypeKVCacheSpecs

DEFAULT_COLUMNS = ("bfloat16", "fp8", "nvfp4")
"""Cache dtypes compared side by side when ``--kv-cache-dtype`` is not given."""

REFERENCE_DTYPE = "bfloat16"

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_size(text: str) -> int:
    """Bytes in ``text``: a plain integer (bytes) or a number with a unit B, KB, MB, GB, TB
    (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), case-insensitive: ``80GiB``,
    ``70 GB``, ``512MiB``, ``1.5GiB``. Fractions of a byte are dropped."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or (unit and unit not in _UNITS):
        raise ValueError(
            f"memory: cannot read {text!r}; expected bytes or a number with one of the units "
            "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 80GiB)"
        )
    value = Fraction(match.group(1)) * _UNITS[unit or "b"]
    return int(value)


def _memory_arg(text: str) -> int:
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"expected a positive size such as 80GiB, got {text!r}")
    try:
        return parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("memory: ")) from exc


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="page sizes, bytes per token and a KV-cache memory plan for a model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_PRESET,
        help=f"a shipped preset ({', '.join(available_presets())}) or a path to a config.json "
        f"(raw or preset wrapper); default {DEFAULT_PRESET}",
    )
    parser.add_argument(
        "--memory",
        type=_memory_arg,
        help="KV-cache budget per GPU (tensor-parallel rank): 80GiB, 70GB, 512MiB or bytes",
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int_arg,
        help="tokens per request (default: the config's max_position_embeddings)",
    )
    parser.add_argument(
        "--tp", type=_positive_int_arg, default=1, help="tensor-parallel size (default 1)"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=CACHE_DTYPES,
        help=f"plan only this dtype (default: {', '.join(DEFAULT_COLUMNS)} side by side)",
    )
    parser.add_argument(
        "--block-size",
        type=_positive_int_arg,
        help="tokens per page (default 16; 256 for DeepSeek-V4)",
    )
    parser.add_argument(
        "--skip-layers",
        default="",
        help="comma-separated layer kinds (full_attention, sliding_window, mla, ...) or layer "
        "names kept unquantized (kv_cache_dtype_skip_layers)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int_arg,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help=f"tokens per scheduler step; bounds sliding-window pages "
        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    # Read "-5GiB" (and "-1") as a value, so that --memory can say why it is wrong instead of
    # argparse reporting a missing argument; no option of this parser looks like a number.
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.set_defaults(func=run)
    return parser


# --------------------------------------------------------------------------------------------
# Computation


@dataclass
class _Column:
    dtype: str
    specs: ModelKVSpecs
    plan: KVCachePlan | None = None


def _format_label(spec: KVCacheSpec) -> str:
    """Short storage-format name of a spec: bf16, fp16, fp32, fp8, fp8_ds_mla or nvfp4."""
    if isinstance(spec, MambaSpec):
        return _short_dtype(str(spec.dtypes[0]).removeprefix("torch."))
    if getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla":
        return "fp8_ds_mla"
    mode = spec.kv_quant_mode  # type: ignore[attr-defined]
    if mode.is_nvfp4:
        return "nvfp4"
    if mode.is_fp8:
        return "fp8"
    return _short_dtype(str(spec.dtype).removeprefix("torch."))  # type: ignore[attr-defined]


def _short_dtype(name: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}.get(
        name, "fp8" if name.startswith("fp8") else name
    )


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


def _entry_bytes_per_token(spec: KVCacheSpec) -> Fraction:
    """Exact bytes one more token adds to an attention layer (compressed: entry / ratio)."""
    return Fraction(kv_bytes_per_entry(spec), getattr(spec, "compress_ratio", 1))


@dataclass(frozen=True)
class _Footprint:
    per_token: Fraction
    growing_per_token: Fraction
    window_cap_per_sequence: int
    state_per_sequence: int


def _footprint(specs: dict[str, KVCacheSpec]) -> _Footprint:
    per_token = growing = Fraction(0)
    window_cap = state = 0
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            state += spec.real_page_size_bytes
            continue
        rate = _entry_bytes_per_token(spec)
        per_token += rate
        window = getattr(spec, "sliding_window", None)
        if window is None:
            growing += rate
        else:
            window_cap += window * kv_bytes_per_entry(spec)
    return _Footprint(per_token, growing, window_cap, state)


def _layer_rows(layout: ModelLayout, columns: Sequence[_Column]) -> list[dict[str, Any]]:
    """One row per distinct layer type (and per effective dtype when skip layers differ)."""
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    for layer in layout.layers:
        specs = [col.specs.specs[layer.name] for col in columns]
        key = (layer.kind, _describe_layer(layer), tuple(_format_label(s) for s in specs))
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
                "format": {c.dtype: _format_label(s) for c, s in zip(columns, specs, strict=True)},
                "spec": {c.dtype: describe_spec(s) for c, s in zip(columns, specs, strict=True)},
            }
        row["layers"] += 1
    return list(rows.values())


def _group_label(group: Any, kinds: dict[str, str], specs: dict[str, KVCacheSpec]) -> str:
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
                "kind": _group_label(group, plan.base.kinds, plan.specs),
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


def _report(
    name: str,
    title: str | None,
    layout: ModelLayout,
    columns: Sequence[_Column],
    reference: ModelKVSpecs,
    args: argparse.Namespace,
    max_model_len: int | None,
) -> dict[str, Any]:
    ref = _footprint(reference.specs)
    notes: list[str] = []
    for col in columns:
        for note in col.specs.notes:
            if note not in notes:
                notes.append(note)
    per_dtype: dict[str, Any] = {}
    for col in columns:
        fp = _footprint(col.specs.specs)
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
    if args.memory is not None:
        report["plan"] = {
            "available_memory_bytes": args.memory,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "per_dtype": {c.dtype: _plan_json(c.plan) for c in columns if c.plan is not None},
        }
    return report


# --------------------------------------------------------------------------------------------
# Text output


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


def _text(report: dict[str, Any], columns: Sequence[_Column]) -> str:
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
            if fmt != _short_dtype(d):
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


def _plan_table(columns: Sequence[_Column], max_model_len: int) -> list[str]:
    plans = [c.plan for c in columns]
    ref = next((c.plan for c in columns if c.dtype == REFERENCE_DTYPE), None)
    rows = [["", *(c.dtype for c in columns)]]

    def add(label: str, fn: Any) -> None:
        rows.append([label, *(fn(p) for p in plans)])

    add("groups", lambda p: str(len(p.kv_cache_config.kv_cache_groups)))
    add("tensors", lambda p: str(len(p.kv_cache_config.kv_cache_tensors)))
    add("block sizes (tokens)", lambda p: ", ".join(map(str, _block_sizes(p))))
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


def _block_sizes(plan: KVCachePlan) -> list[int]:
    return sorted({g.kv_cache_spec.block_size for g in plan.kv_cache_config.kv_cache_groups})


def _page_range(plan: KVCachePlan) -> str:
    pages = sorted({s.page_size_bytes for s in plan.specs.values()})
    if len(pages) == 1:
        return f"{pages[0]:,}"
    return f"{pages[0]:,}-{pages[-1]:,}"


def _group_structure(plan: KVCachePlan) -> list[tuple[tuple[str, ...], int]]:
    return [
        (tuple(g.layer_names), g.kv_cache_spec.block_size)
        for g in plan.kv_cache_config.kv_cache_groups
    ]


def _group_page(plan: KVCachePlan, group: Any) -> str:
    if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs):
        return _page_range(plan)
    spec = plan.specs[group.layer_names[0]]
    page = _fmt_int(spec.page_size_bytes)
    real = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
    if real != spec.page_size_bytes:
        page += f" (real {real:,})"
    return page


def _group_blocks(plan: KVCachePlan, group: Any) -> int:
    return blocks_per_request([group], plan.max_model_len, plan.max_num_batched_tokens)


def _group_lines(columns: Sequence[_Column]) -> list[str]:
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
                    _group_label(group, first.base.kinds, first.specs),
                    str(len(group.layer_names)),
                    str(group.kv_cache_spec.block_size),
                    f"{_group_blocks(first, group):,}",
                    *pages,
                    group.layer_names[0],
                ]
            )
        out += _table(rows, [True, False, True, True, True, *([True] * len(cols)), False])
    return out


# --------------------------------------------------------------------------------------------
# Entry point


def run(args: argparse.Namespace) -> int:
    """Handle ``vllm-kv plan``; returns the exit status (0 ok, 1 nothing fits, 2 bad input)."""
    try:
        name, config = load_model_config(args.model)
        layout = parse_model_layout(config, tensor_parallel_size=args.tp)
        skip = [s.strip() for s in args.skip_layers.split(",") if s.strip()]
        dtypes = [args.kv_cache_dtype] if args.kv_cache_dtype else list(DEFAULT_COLUMNS)
        columns = [
            _Column(dtype=d, specs=build_kv_cache_specs(layout, d, args.block_size, skip))
            for d in dtypes
        ]
        reference = build_kv_cache_specs(layout, REFERENCE_DTYPE, args.block_size)
        max_model_len = args.max_model_len or layout.max_position_embeddings
        if args.memory is not None:
            if max_model_len is None:
                raise ValueError("max_model_len: the config has no max_position_embeddings")
            for col in columns:
                col.plan = plan_kv_cache_for_specs(
                    name,
                    col.specs,
                    args.memory,
                    max_model_len,
                    args.max_num_batched_tokens,
                    require_fit=False,
                )
    except ValueError as exc:
        print(f"vllm-kv plan: error: {exc}", file=sys.stderr)
        return 2
    title = config.get("_name_or_path")
    if title is None and args.model in available_presets():
        from vllm.model_presets import load_preset

        title = load_preset(args.model).get("name")
    report = _report(name, title, layout, columns, reference, args, max_model_len)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        sys.stdout.write(_text(report, columns))
    if args.memory is not None and not any(c.plan is not None and c.plan.fits for c in columns):
        return 1
    return 0
