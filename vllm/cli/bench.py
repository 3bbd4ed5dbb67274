"""``vllm-kv bench``: the ``reshape_and_cache_flash`` kernel benchmark from the command line.

Runs :mod:`vllm.benchmarks.reshape_and_cache_flash` on ``--device`` (default CUDA when available,
else CPU) with a progress bar on stderr, then prints one row per shape: time in µs, GB/s, % of the
memory roofline measured in the same run (a large device copy) and the ratio to the baseline
measured in the same run. ``--json PATH`` writes the rows as JSON, ``--plot PNG`` draws GB/s
against tokens per kind (log x) with the roofline as a horizontal line (needs matplotlib:
``pip install "vllm-kvcache[plot]"``). ``--quick`` runs a small configuration (seconds on a CPU).

Cold cache by default: the last-level cache (CPU L3, GPU L2) is flushed before every timed call,
outside the timed region, so the op, its baseline and the roofline copy all stream from memory.
``--warm`` times repeated calls on cache-resident buffers instead (% of roofline can then exceed
100, the roofline being a DRAM copy). The table's title and the JSON's ``mode`` say which.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from vllm.benchmarks import reshape_and_cache_flash as core

EXIT_USAGE = 2
"""Exit status for bad arguments, a missing extension or a missing optional package."""

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
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def format_table(rows: Sequence[core.Row]) -> str:
    """Fixed-width table: kind, H, tokens, µs, GB/s, % of roofline, × baseline, baseline; the
    title names the device, the cache mode and the roofline."""
    headers = ["kind", "H", "tokens", "us", "GB/s", "% roofline", "x baseline", "baseline"]
    body = [
        [
            r.kind,
            str(r.num_heads),
            str(r.num_tokens),
            f"{r.op_us:.2f}",
            f"{r.op_gbps:.2f}",
            f"{r.pct_roofline:.1f}",
            f"{r.speedup_vs_baseline:.2f}x",
            r.baseline,
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in (0, len(cells) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    title = (
        f"reshape_and_cache_flash on {rows[0].device}, {rows[0].mode} cache; "
        f"roofline (device copy, same run): {rows[0].roofline_gbps:.1f} GB/s"
    )
    return "\n".join(
        [title, "", line(headers), line(["-" * w for w in widths])] + list(map(line, body))
    )


def write_plot(rows: Sequence[core.Row], path: str | Path) -> None:
    """GB/s against tokens (log x), one line per (kind, H), the roofline as a horizontal line."""
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
        xs, ys = [r.num_tokens for r in group], [r.op_gbps for r in group]
        ax.plot(xs, ys, style, label=f"{kind} H={heads}")
    roofline = rows[0].roofline_gbps
    ax.axhline(roofline, color="black", linestyle="--", label=f"roofline {roofline:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_xlabel("tokens per call")
    ax.set_ylabel("GB/s")
    ax.set_title(f"reshape_and_cache_flash on {rows[0].device} ({rows[0].mode} cache)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
    plt.close(fig)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark reshape_and_cache_flash (GB/s, %% of roofline, vs baseline)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if any)")
    parser.add_argument("--quick", action="store_true", help="a small configuration (seconds)")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="repeated calls on cache-resident buffers (default: cold cache, flushed per call)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--plot", metavar="PNG", help="draw GB/s vs tokens per kind (matplotlib)")
    parser.add_argument("--kinds", nargs="+", default=list(core.KINDS), choices=core.KINDS)
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=core.positive_int,
        help=f"tokens per call (default {core.TOKENS}; with --quick {core.QUICK_TOKENS})",
    )
    parser.add_argument("--threads", type=core.positive_int, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=run)
    return parser


def output_path_error(flag: str, path: str) -> str | None:
    """Why ``path`` cannot be written as ``flag``'s output file, or None when it can.

    Checked before the benchmark runs, so that a typo costs no benchmark time."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        return f"{flag}: expected a file path, got the directory {path!r}"
    if not folder.is_dir():
        return (
            f"{flag}: expected a path in an existing directory, got {path!r} "
            f"({folder} does not exist)"
        )
    if target.exists() and not os.access(target, os.W_OK):
        return f"{flag}: expected a writable file, got {path!r} (not writable)"
    if not target.exists() and not os.access(folder, os.W_OK | os.X_OK):
        return (
            f"{flag}: expected a path in a writable directory, got {path!r} "
            f"({folder} is not writable)"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Handler of ``vllm-kv bench``; returns the exit status."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"vllm-kv bench: error: --plot needs matplotlib: {PLOT_HINT}", file=sys.stderr)
        return EXIT_USAGE
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = output_path_error(flag, path) if path else None
        if problem is not None:
            print(f"vllm-kv bench: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    if args.threads:
        torch.set_num_threads(args.threads)
    bar = None if args.no_progress else ProgressBar()
    device = args.device or core.default_device()
    try:
        rows = core.run(device, args.kinds, args.tokens, args.quick, bar, warm=args.warm)
    except (ValueError, ImportError) as e:
        error: Exception | None = e
    else:
        error = None
    if bar is not None:
        bar.close()
    if error is not None:
        print(f"vllm-kv bench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(format_table(rows))
    if args.json:
        core.write_json(rows, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(rows, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
