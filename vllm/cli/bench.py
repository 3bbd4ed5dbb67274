"""``vllm-kv bench``: the ``reshape_and_cache_flash`` kernel benchmark from the command line.

Runs :mod:`vllm.benchmarks.reshape_and_cache_flash` on ``--device`` (default CUDA when available,
else CPU) with a progress bar on stderr, then prints one row per shape, each measured in 5 repeats:
the median time in µs and the repeats' spread (interquartile range / median, %), GB/s, % of the
memory roofline (a large device copy timed right before each repeat; the median of the repeats'
ratios), the ratio to the baseline measured in the same run, and flags saying when a row cannot be
trusted: ``noisy`` (the op's spread is over 25%), ``noisy-baseline`` and ``noisy-roofline`` (the
same for the baseline and the roofline copies), ``over-roofline`` (a cold row above 100% of the
roofline, which a cold row cannot reach) and ``contended`` (this process's threads waited for a CPU
for over 10% of the row's time). A legend under the table explains the flags present; a load
average above the CPU count at the start or end of the run is warned about in one line on stderr,
under the table and in the JSON.
``--json PATH`` writes the rows as JSON (medians under the old names, plus each repeat, spreads and
flags; ``--json`` alone prints it on stdout instead of the table), ``--plot PNG`` draws GB/s
against tokens per kind (log x; bars over the repeats, flagged points circled) with the roofline
as a horizontal line (needs matplotlib: ``pip install "vllm-kvcache[plot]"``). ``--quick`` runs
a small configuration (seconds on a CPU).

Cold cache by default: the last-level cache (CPU L3, GPU L2) is flushed before every timed call,
outside the timed region, so the op, its baseline and the roofline copy all stream from memory.
``--warm`` times repeated calls on cache-resident buffers instead (% of roofline can then exceed
100, the roofline being a DRAM copy, and is not flagged). The table's title and the JSON's
``mode`` say which.

``--op attention`` benchmarks the CPU attention backend instead (:mod:`vllm.benchmarks.attention`):
decode (batch 1..64, context 1k..32k) and prefill per format (``--kinds``: the cache write's by
default, the packed-slot formats and encoding ids with key options such as
``nvfp4_mse+offset+prerope+sink`` when named), with the median µs and spread, GB/s of cache read,
% of the copy roofline, × the reference backend, the time relative to bf16 (and, for an encoding
with key options, to its base format) and the same flags; ``--plot`` draws decode GB/s against
context. ``--block-size N`` sets its page size (tokens per page; default 16).

Threads: ``--threads N``, else torch's default; ``--op attention`` on a contended machine (the
load average at or above the CPU count at the start) runs one thread instead, since more would
wait for CPUs that other work holds (its table's title and JSON give the count).

``--op formats`` times the write and the decode of every format with a reference codec
(:mod:`vllm.benchmarks.formats`; ``--kinds`` picks some), v0.33's new formats included: GB/s and
% of the roofline per stage, with the implementation timed in its own column (``compiled op``,
or ``reference codec`` where no kernel exists yet, which is no kernel figure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from vllm.benchmarks import attention, noise
from vllm.benchmarks import formats as format_bench
from vllm.benchmarks import reshape_and_cache_flash as core
from vllm.cli import args as cli_args
from vllm.cli.args import UsageError, add_json_argument, distinct_outputs
from vllm.cli.output import deliver, writing

OPS = ("reshape_and_cache_flash", "attention", "formats")
"""Values of ``--op``."""
MAX_ATTENTION_BLOCK_SIZE = 4096
"""Largest ``--block-size`` (a page of 4096 bf16 tokens over the attention shapes' 8 KV heads is
32 MiB a side)."""

PLOT_HINT = 'pip install "vllm-kvcache[plot]"  (or: pip install matplotlib)'


class ProgressBar:
    """A :data:`~vllm.benchmarks.reshape_and_cache_flash.Progress` callback drawing a text bar,
    redrawn in place (``\\r``) on ``stream``; :meth:`close` ends the line."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.drawn = False

    def __call__(self, done: int, total: int, message: str) -> None:
        filled = round(self.width * done / total) if total else self.width
        line = f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {message}"
        self.drawn = True  # before writing: a Ctrl-C during the write still ends the line
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def format_table(rows: Sequence[core.Row]) -> str:
    """Fixed-width table: kind, H, tokens, median µs, spread %, GB/s, % of roofline, × baseline,
    baseline, flags; the title names the device, the cache mode and the roofline copies' median
    and range; the notes under it give the statistic, the flags' legend and the load warning."""
    headers = ["kind", "H", "tokens", "median us", "spread %", "GB/s", "% roofline"]
    headers += ["x baseline", "baseline", "flags"]
    body = [
        [
            r.kind,
            str(r.num_heads),
            str(r.num_tokens),
            f"{r.op_us:.2f}",
            f"{r.op_spread_pct:.1f}",
            f"{r.op_gbps:.2f}",
            f"{r.pct_roofline:.1f}",
            f"{r.speedup_vs_baseline:.2f}x",
            r.baseline,
            ",".join(r.flags),
        ]
        for r in rows
    ]
    title = (
        f"reshape_and_cache_flash on {rows[0].device}, {rows[0].mode} cache; "
        f"{noise.roofline_caption(rows)}"
    )
    table = noise.fixed_width(headers, body, left={0, len(headers) - 2, len(headers) - 1})
    return "\n".join([title, "", table, "", *noise.notes(rows)])


def write_plot(rows: Sequence[core.Row], path: str | Path) -> None:
    """GB/s against tokens (log x), one line per (kind, H), a bar over each point's repeats,
    flagged points circled; the roofline copies' median dashed over their range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[tuple[str, int], list[core.Row]] = {}
    for r in rows:
        groups.setdefault((r.kind, r.num_heads), []).append(r)
    for (kind, heads), group in groups.items():
        group.sort(key=lambda r: r.num_tokens)
        style = "-o" if len(group) > 1 else "s"
        noise.plot_rows(ax, [r.num_tokens for r in group], group, style, f"{kind} H={heads}")
    noise.plot_roofline(ax, rows)
    ax.set_xscale("log")
    ax.set_xlabel(f"tokens per call; {noise.PLOT_NOTE}")
    ax.set_ylabel("GB/s")
    ax.set_title(f"reshape_and_cache_flash on {rows[0].device} ({rows[0].mode} cache)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
    plt.close(fig)


BYTES_PER_ELEMENT = 32
"""Host or device bytes a shape needs per K/V element (tokens x heads x head size), estimated:
two copies of the problem in a cold run (bf16 K and V, caches up to bf16) plus the fp32
temporaries of generating the data and of the reference codecs."""


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark reshape_and_cache_flash (GB/s, %% of roofline, vs baseline)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--op",
        choices=OPS,
        default=OPS[0],
        help="what to benchmark: the cache write (default), the CPU attention backend, or "
        "formats: write and decode GB/s of every format with a codec (the new formats too)",
    )
    parser.add_argument(
        "--device",
        default=None,
        type=cli_args.device,
        help="cpu, cuda or cuda:N (default: cuda if any)",
    )
    parser.add_argument("--quick", action="store_true", help="a small configuration (seconds)")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="repeated calls on cache-resident buffers (default: cold cache, flushed per call)",
    )
    add_json_argument(parser, "the rows")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        type=cli_args.file_output,
        help="draw GB/s vs tokens per kind (matplotlib)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        metavar="KIND",
        help="kv_cache_dtype kinds: for the cache write and --op attention one per quantization "
        f"mode of the registry ({', '.join(core.KINDS)}; default all), --op attention also the "
        "packed-slot formats (TurboQuant, ultraquant_4bit, Octave) and encoding ids with key "
        "options (e.g. nvfp4_mse+offset+prerope+sink); for --op formats any format with a "
        "reference codec (default all of them)",
    )
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=cli_args.bounded_int(),  # how many fit in memory is checked before the run
        help=f"tokens per call (default {core.TOKENS}; with --quick {core.QUICK_TOKENS})",
    )
    parser.add_argument(
        "--threads",
        type=cli_args.bounded_int(4 * (os.cpu_count() or 1), "a thread count (4 per CPU)"),
        help="torch CPU threads (default torch's; --op attention: 1 when the load average is "
        "already at the CPU count, as more threads would wait for CPUs held by others)",
    )
    parser.add_argument(
        "--block-size",
        type=cli_args.bounded_int(MAX_ATTENTION_BLOCK_SIZE, "a page size"),
        help=f"--op attention: tokens per page (default {attention.BLOCK_SIZE})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=run)
    return parser


def available_memory_bytes(device: str) -> int:
    """Free memory of ``device``: the GPU's free memory, or the host's MemAvailable."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_tokens_fit(kinds: Sequence[str], tokens: Sequence[int] | None, device: str) -> None:
    """:class:`UsageError` naming ``--tokens`` when a shape's buffers would not fit in the free
    memory of ``device`` (estimated with :data:`BYTES_PER_ELEMENT`)."""
    if not tokens:
        return
    available = available_memory_bytes(device)
    for _, heads, count in core.shapes(kinds, tokens):
        per_token = heads * core.HEAD_SIZE * BYTES_PER_ELEMENT
        if count * per_token > available:
            raise UsageError(
                "--tokens",
                f"expected at most {available // per_token:,} tokens per call on {device} "
                f"({per_token // 1024} KiB each at H={heads}, {available / 2**30:.1f} GiB "
                f"free), got {count}",
            )


def _check_extension(op: str) -> None:
    try:
        from vllm import _custom_ops  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            "--op",
            f"expected the compiled extension for {op} (pip install --no-build-isolation -e .), "
            f"got {exc}",
        ) from None


def _attention_encoding(args: argparse.Namespace, kind: str) -> bool:
    """``kind`` is an encoding id with key options that ``--op attention`` measures."""
    if args.op != "attention":
        return False
    try:
        return attention.transform_encoding(kind) is not None
    except ValueError:
        return False


def default_threads() -> int | None:
    """1 when the machine is contended (the 1-minute load average at or above its CPUs: torch's
    threads would wait for CPUs others hold, and every call would pay for it), else None
    (torch's default)."""
    load = noise.load_average()
    return 1 if load is not None and load >= noise.cpu_count() else None


def check_arguments(args: argparse.Namespace) -> str:
    """Checks of ``args`` that need more than one value or the machine, before the run;
    returns the device to run on."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot", f"needs matplotlib: {PLOT_HINT}")
    distinct_outputs((("--json", args.json), ("--plot", args.plot)))
    kinds = {"formats": format_bench.FORMAT_KINDS, "attention": attention.FORMATS}.get(
        args.op, core.KINDS
    )
    if args.kinds is None:
        args.kinds = list(core.KINDS if args.op == "attention" else kinds)
    elif wrong := [k for k in args.kinds if k not in kinds and not _attention_encoding(args, k)]:
        also = " or an encoding id with key options" if args.op == "attention" else ""
        raise UsageError(
            "--kinds",
            f"expected some of {', '.join(kinds)}{also} with --op {args.op}, got {wrong[0]}",
        )
    if args.op == "formats" and args.plot:
        raise UsageError("--plot", "not drawn for --op formats (see its table or --json)")
    if args.op != "attention" and args.block_size is not None:
        raise UsageError(
            "--block-size",
            f"not used by --op {args.op} (pages of {core.BLOCK_SIZE} tokens), got "
            f"{args.block_size}",
        )
    if args.op == "attention":
        for flag, value in (("--tokens", args.tokens), ("--device", args.device)):
            if value is not None and not (flag == "--device" and value == "cpu"):
                raise UsageError(
                    flag, f"not used by --op attention (CPU, fixed shapes), got {value}"
                )
        device = "cpu"
    else:
        device = args.device or core.default_device()
        check_tokens_fit(args.kinds if args.op != "formats" else ["auto"], args.tokens, device)
    if args.op != "formats":  # its reference codecs run without the extension
        _check_extension(args.op)
    return device


def run(args: argparse.Namespace) -> int:
    """Handler of ``vllm-kv bench``; returns the exit status; a bad argument raises
    :class:`~vllm.cli.args.UsageError` before the run."""
    device = check_arguments(args)
    threads = args.threads or (default_threads() if args.op == "attention" else None)
    if threads:  # the table's title and the JSON say how many ran
        torch.set_num_threads(threads)
    if args.op == "attention":

        def measure(bar: ProgressBar | None) -> Sequence[Any]:
            return attention.run(
                args.kinds,
                args.quick,
                bar,
                warm=args.warm,
                block_size=args.block_size or attention.BLOCK_SIZE,
            )

        table, to_json, plot = attention.format_table, attention.to_json, attention.write_plot
    elif args.op == "formats":

        def measure(bar: ProgressBar | None) -> Sequence[Any]:
            return format_bench.run(device, args.kinds, args.tokens, args.quick, bar, args.warm)

        table, to_json, plot = format_bench.format_table, format_bench.to_json, None
    else:

        def measure(bar: ProgressBar | None) -> Sequence[Any]:
            return core.run(device, args.kinds, args.tokens, args.quick, bar, warm=args.warm)

        table, to_json, plot = format_table, core.to_json, write_plot
    bar = None if args.no_progress else ProgressBar()
    try:
        rows = measure(bar)
    finally:  # end the bar's line, also on Ctrl-C
        if bar is not None:
            bar.close()
    deliver(lambda: table(rows), lambda: json.dumps(to_json(rows), indent=2), args.json)
    if args.plot and plot is not None:
        with writing("--plot", args.plot):
            plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
