"""``vllm-kv plan``: layer specs, page sizes, bytes per token and a KV-cache memory plan.

Without ``--memory`` it prints each distinct layer type of the model with its page size for
bfloat16, fp8, nvfp4 and the per-token-head int8 / fp8 rows (or the ``--kv-cache-dtype`` ones),
and the KV bytes per token of the
whole model with the ratio to bfloat16. With ``--memory`` it also plans the cache for that
per-rank budget: groups, page sizes, ``num_blocks``, token capacity and the maximum concurrency
at ``--max-model-len``, side by side. ``--json`` prints the same as JSON instead of the tables;
``--json PATH`` writes it to PATH and still prints the tables.
"""

from __future__ import annotations

import argparse
import json
import re
from fractions import Fraction
from typing import Any

from vllm.cli.args import add_json_argument, bounded_int
from vllm.cli.output import deliver
from vllm.cli.plan_formats import check_formats, register_model_rope_dims
from vllm.cli.plan_model import check_tp_fits_heads, load_model_argument, planner_usage_error
from vllm.cli.plan_report import REFERENCE_DTYPE, plan_report
from vllm.cli.plan_text import render_text
from vllm.config.cache import validate_cache_dtype
from vllm.kv_quant.encoding import ENCODING_GRAMMAR
from vllm.kv_quant.formats import BFLOAT16, quant_mode_formats
from vllm.model_presets import DEFAULT_PRESET, available_presets, load_preset
from vllm.v1.core.cache_dtype_comparison import compare_cache_dtypes
from vllm.v1.core.kv_bytes import kv_footprint
from vllm.v1.core.kv_cache_utils import DEFAULT_MAX_NUM_BATCHED_TOKENS
from vllm.v1.core.model_families import parse_model_layout
from vllm.v1.core.model_specs import build_kv_cache_specs

DEFAULT_COLUMNS: tuple[str, ...] = (
    BFLOAT16.name,
    *(fmt.accepted_names[0] for fmt in quant_mode_formats()),
)
"""Cache dtypes compared side by side when ``--kv-cache-dtype`` is not given: bfloat16, then one
format of each quantization mode of the registry that the compiled kernels write, by its first
name (``fp8``, ``nvfp4``, ``int8_per_token_head``, ``fp8_per_token_head``). Formats without a
kernel yet (TurboQuant, UltraQuant, Octave, INT4) are planned on request, so that the default
table stays within a terminal's width."""

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

MAX_MEMORY = 2**60
"""Largest ``--memory`` (1 EiB): far above any device, and the plan's GiB figures stay floats."""
MAX_TOKENS = 2**40
"""Largest ``--max-model-len`` and ``--max-num-batched-tokens``."""
MAX_BLOCK_SIZE = 2**20
MAX_TP = 2**16

_tokens_arg = bounded_int(MAX_TOKENS)


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
        size = parse_memory_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("memory: ")) from exc
    if not 1 <= size <= MAX_MEMORY:
        raise argparse.ArgumentTypeError(
            f"expected a positive size such as 80GiB, at most 1 EiB, got {text!r}"
        )
    return size


def _encodings_arg(text: str) -> list[str]:
    """Comma-separated dtype strings or encoding ids (the encoding's grammar), each returned as
    given, repeats dropped."""
    names = list(dict.fromkeys(item.strip() for item in text.split(",")))
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated cache dtypes or encodings, got {text!r}"
        )
    try:
        return [validate_cache_dtype(name, "kv_cache_dtype") for name in names]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("kv_cache_dtype: ")) from exc


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
        type=_tokens_arg,
        help="tokens per request (default: the config's max_position_embeddings)",
    )
    parser.add_argument(
        "--tp",
        type=bounded_int(MAX_TP),
        default=1,
        help="tensor-parallel size; must divide the model's attention heads (default 1)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        type=_encodings_arg,
        help=f"plan only these dtypes or encodings, comma-separated, side by side "
        f"({ENCODING_GRAMMAR}, e.g. nvfp4_mse+offset+prerope+sink or "
        f"int4_per_token_head,turboquant_k3v4_nc,octave_k3v3; default: "
        f"{', '.join(DEFAULT_COLUMNS)})",
    )
    parser.add_argument(
        "--block-size",
        type=bounded_int(MAX_BLOCK_SIZE),
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
        type=_tokens_arg,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help=f"tokens per scheduler step; bounds sliding-window pages "
        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    add_json_argument(parser, "the report")
    # Read "-5GiB" (and "-1") as a value, so that --memory can say why it is wrong instead of
    # argparse reporting a missing argument; no option of this parser looks like a number.
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.set_defaults(func=run)
    return parser


# --------------------------------------------------------------------------------------------
# Entry point


def run(args: argparse.Namespace) -> int:
    """Handle ``vllm-kv plan``; returns the exit status (0 ok, 1 nothing fits); a bad argument
    raises :class:`~vllm.cli.args.UsageError`."""
    name, config = load_model_argument(args.model)
    check_tp_fits_heads(config, args.tp, args.model)
    dtypes = args.kv_cache_dtype or list(DEFAULT_COLUMNS)
    try:  # the planner checks the config and the flags against each other as it goes
        layout = parse_model_layout(config, tensor_parallel_size=args.tp)
        register_model_rope_dims(config, layout, dtypes)
        skip = [s.strip() for s in args.skip_layers.split(",") if s.strip()]
        check_formats(name, layout, dtypes, args.block_size, skip)
        columns = compare_cache_dtypes(
            name,
            layout,
            dtypes,
            args.block_size,
            skip,
            args.memory,
            args.max_model_len,
            args.max_num_batched_tokens,
        )
        reference = kv_footprint(
            build_kv_cache_specs(layout, REFERENCE_DTYPE, args.block_size).specs
        )
    except ValueError as exc:
        raise planner_usage_error(exc, args.model) from None
    title = config.get("_name_or_path")
    if title is None and args.model in available_presets():
        title = load_preset(args.model).get("name")
    report = plan_report(name, title, layout, columns, reference)
    deliver(lambda: render_text(report, columns), lambda: json.dumps(report, indent=2), args.json)
    if args.memory is not None and not any(c.plan is not None and c.plan.fits for c in columns):
        return 1
    return 0
