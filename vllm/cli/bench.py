"""``vllm-kv bench``: the ``reshape_and_cache_flash`` kernel benchmark from the command line.

Runs the benchmark on the current device (``--device``, default CUDA when available, else CPU)
with a plain-text progress bar on stderr, then prints one row per (kind, tokens): time in µs,
GB/s, % of the memory roofline measured in the same run (a large device copy) and the ratio to
the baseline measured in the same run. ``--json PATH`` writes the rows as JSON, ``--plot PNG``
draws GB/s against tokens per kind (log x) with the roofline as a horizontal line (needs
matplotlib: ``pip install "vllm-kvcache[plot]"``). ``--quick`` runs a tiny configuration.

The benchmark itself lives in ``benchmarks/kernels/benchmark_reshape_and_cache_flash.py`` (or,
once packaged, ``vllm/benchmarks/``); see :func:`load_benchmark_module` for how it is found and
:func:`run_benchmark` for the interface this command expects of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import vllm

EXIT_USAGE = 2
"""Exit status for bad arguments, a missing benchmark module or a missing optional package."""

BENCH_FILE = Path("benchmarks") / "kernels" / "benchmark_reshape_and_cache_flash.py"
"""The benchmark script, relative to the repository root."""

PACKAGED_MODULES = (
    "vllm.benchmarks.reshape_and_cache_flash",
    "vllm.benchmarks.benchmark_reshape_and_cache_flash",
    "vllm.benchmarks.kernels.benchmark_reshape_and_cache_flash",
)
"""Where the benchmark core is imported from when it ships inside the package."""

RUN_FUNCTIONS = ("run", "run_benchmark", "run_benchmarks", "run_all")
"""Names of the benchmark's entry point, tried in order."""

PLOT_HINT = 'pip install "vllm-kvcache[plot]"  (or: pip install matplotlib)'


class BenchUnavailable(RuntimeError):
    """The benchmark module or an optional package cannot be loaded; the message says why."""


# ----------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class BenchRow:
    """One measurement.

    Attributes:
        kind: what was measured (a cache format / kernel variant, or the baseline).
        tokens: tokens written per call.
        us: time per call in microseconds.
        gbps: bytes moved per call / time, in GB/s (1e9 bytes per second).
        pct_roofline: ``gbps`` as a percentage of the roofline measured in the same run.
        baseline_ratio: speed relative to the baseline of the same run (>1 is faster), or None.
        heads: KV heads of the shape, when the benchmark reports it.
        baseline: what the baseline was (e.g. ``index_copy_``), when reported.
        bytes_moved: bytes read plus written per call, when reported.
        roofline_gbps: the roofline this row was measured against (GB/s), when reported.
    """

    kind: str
    tokens: int
    us: float
    gbps: float
    pct_roofline: float
    baseline_ratio: float | None
    heads: int | None = None
    baseline: str | None = None
    bytes_moved: int | None = None
    roofline_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in dataclasses.asdict(self).items()
        }


_ALIASES: dict[str, tuple[str, ...]] = {
    # our names first, then those of benchmarks/kernels/benchmark_reshape_and_cache_flash.Row
    "kind": ("kind",),
    "tokens": ("tokens", "num_tokens"),
    "us": ("us", "op_us"),
    "gbps": ("gbps", "op_gbps"),
    "pct_roofline": ("pct_roofline",),
    "baseline_ratio": ("baseline_ratio", "speedup_vs_baseline", "ratio_to_baseline"),
}

_OPTIONAL: dict[str, tuple[str, ...]] = {
    "heads": ("heads", "num_heads"),
    "baseline": ("baseline",),
    "bytes_moved": ("bytes_moved",),
    "roofline_gbps": ("roofline_gbps",),
}


def _as_mapping(row: Any) -> Mapping[str, Any] | None:
    if isinstance(row, Mapping):
        return row
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    if hasattr(row, "_asdict"):
        return row._asdict()
    if hasattr(row, "__dict__") and not isinstance(row, (tuple, list)):
        return vars(row)
    return None


def normalize_row(row: Any) -> BenchRow:
    """A :class:`BenchRow` from whatever the benchmark returns for one row: a mapping, a
    dataclass, a named tuple or a plain sequence ``(kind, tokens, µs, GB/s, % roofline,
    baseline ratio)``. Fields are found under our names or those of the benchmark's ``Row``
    (``num_tokens``, ``op_us``, ``op_gbps``, ``speedup_vs_baseline``, ``num_heads``, ...)."""
    mapping = _as_mapping(row)
    values: dict[str, Any] = {}
    if mapping is not None:
        for field, names in _ALIASES.items():
            for name in names:
                if name in mapping:
                    values[field] = mapping[name]
                    break
    elif isinstance(row, (tuple, list)) and len(row) >= 5:
        values = dict(zip(_ALIASES, row, strict=False))
    missing = [f for f in ("kind", "tokens", "us", "gbps", "pct_roofline") if f not in values]
    if missing:
        raise ValueError(f"benchmark row: cannot find {', '.join(missing)} in {row!r}")
    ratio = values.get("baseline_ratio")
    extra: dict[str, Any] = {}
    if mapping is not None:
        for field, names in _OPTIONAL.items():
            value = next((mapping[n] for n in names if n in mapping), None)
            if value is not None:
                kind = {"heads": int, "baseline": str, "bytes_moved": int}.get(field, float)
                extra[field] = kind(value)
    return BenchRow(
        kind=str(values["kind"]),
        tokens=int(values["tokens"]),
        us=float(values["us"]),
        gbps=float(values["gbps"]),
        pct_roofline=float(values["pct_roofline"]),
        baseline_ratio=None if ratio is None else float(ratio),
        **extra,
    )


@dataclass
class BenchResult:
    """Normalized rows plus the roofline (GB/s) they were measured against."""

    rows: list[BenchRow]
    roofline_gbps: float | None
    device: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": "vllm-kv bench",
            "version": vllm.__version__,
            "device": self.device,
            "roofline_gbps": self.roofline_gbps,
            "seconds": round(self.seconds, 3),
            "units": {
                "us": "microseconds per call",
                "gbps": "GB/s (1e9 bytes/s) of bytes moved per call",
                "pct_roofline": "percent of the roofline measured in the same run",
                "baseline_ratio": "speed relative to the baseline of the same run (>1 faster)",
            },
            "rows": [r.to_dict() for r in self.rows],
        }


def derive_roofline(rows: Sequence[BenchRow]) -> float | None:
    """Roofline GB/s of the rows: the one they report, else the one their percentages imply
    (``gbps / (pct / 100)``); median over rows."""
    implied = [
        r.roofline_gbps if r.roofline_gbps is not None else r.gbps * 100.0 / r.pct_roofline
        for r in rows
        if r.roofline_gbps is not None or r.pct_roofline > 0
    ]
    return statistics.median(implied) if implied else None


# ------------------------------------------------------------------------------ progress


class ProgressBar:
    """A plain-text progress bar, redrawn in place (``\\r``) on a stream (stderr).

    Call it as ``bar(done, total, label)``, ``bar(done, total)`` or ``bar(label)`` (one more
    step of an unknown total); :meth:`close` ends the line.
    """

    def __init__(self, stream: IO[str] | None = None, width: int = 30) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.done = 0
        self.total: int | None = None
        self._start = time.monotonic()
        self._drawn = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        label = str(kwargs.get("label", ""))
        ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        texts = [str(a) for a in args if not isinstance(a, int) or isinstance(a, bool)]
        if "done" in kwargs:
            ints = [int(kwargs["done"]), *([int(kwargs["total"])] if "total" in kwargs else [])]
        if len(ints) >= 2:
            self.done, self.total = ints[0], ints[1]
        elif len(ints) == 1:
            self.done = ints[0]
        else:
            self.done += 1
        label = label or " ".join(texts)
        self.draw(label)

    def draw(self, label: str = "") -> None:
        elapsed = time.monotonic() - self._start
        if self.total:
            frac = min(max(self.done / self.total, 0.0), 1.0)
            filled = int(round(frac * self.width))
            bar = "#" * filled + "." * (self.width - filled)
            text = f"[{bar}] {self.done}/{self.total}"
        else:
            text = f"[{self.done} done]"
        line = f"\r{text} {elapsed:5.1f}s {label}"[:120]
        self.stream.write(line.ljust(100))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()


# ------------------------------------------------------------------------- the benchmark


def _load_file(path: Path) -> ModuleType:
    name = "_vllm_kv_bench_reshape_and_cache_flash"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BenchUnavailable(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while executing it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_benchmark_module() -> ModuleType:
    """Import the ``reshape_and_cache_flash`` benchmark.

    Tried in order: the packaged core (:data:`PACKAGED_MODULES`), the module
    ``benchmarks.kernels.benchmark_reshape_and_cache_flash`` (importable from the repository
    root), then the file :data:`BENCH_FILE` under the current directory or any parent of the
    ``vllm`` package (an editable install or a source checkout). A non-editable install without
    a packaged core cannot find it and raises :class:`BenchUnavailable` saying so.
    """
    for name in (*PACKAGED_MODULES, "benchmarks.kernels.benchmark_reshape_and_cache_flash"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise  # the module exists but one of its imports is missing
    roots = [Path.cwd(), *Path(vllm.__file__).resolve().parents]
    for root in roots:
        path = root / BENCH_FILE
        if path.is_file():
            return _load_file(path)
    raise BenchUnavailable(
        f"the reshape_and_cache_flash benchmark was not found: looked for "
        f"{', '.join(PACKAGED_MODULES)} and {BENCH_FILE} under the current directory and the "
        "parents of the vllm package. Run from a source checkout (or an editable install: "
        "pip install --no-build-isolation -e .)"
    )


def _find_run_function(module: ModuleType) -> Callable[..., Any]:
    for name in RUN_FUNCTIONS:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    raise BenchUnavailable(
        f"{module.__name__}: no entry point (expected one of {', '.join(RUN_FUNCTIONS)})"
    )


def _call_with_supported(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Call ``fn`` with the keyword arguments it accepts (aliases tried per argument)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn()
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    aliases = {
        "device": ("device",),
        "quick": ("quick", "tiny", "small"),
        "progress": ("progress", "progress_cb", "on_progress", "callback"),
    }
    call: dict[str, Any] = {}
    for key, value in kwargs.items():
        for name in aliases.get(key, (key,)):
            if name in params:
                call[name] = value
                break
        else:
            if takes_any:
                call[key] = value
    return fn(**call)


def _rows_and_roofline(result: Any) -> tuple[list[Any], float | None]:
    roofline = None
    rows: Any = result
    if isinstance(result, Mapping) and "rows" in result:
        rows, roofline = result["rows"], result.get("roofline_gbps", result.get("roofline"))
    elif hasattr(result, "rows") and not isinstance(result, (list, tuple)):
        rows = result.rows
        roofline = getattr(result, "roofline_gbps", getattr(result, "roofline", None))
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], list):
        rows, roofline = result
    if not isinstance(rows, Iterable):
        raise ValueError(f"benchmark: expected rows, got {type(result).__name__}")
    if roofline is not None and not isinstance(roofline, (int, float)):
        roofline = getattr(roofline, "gbps", None)
    return list(rows), None if roofline is None else float(roofline)


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


QUICK_TOKENS: tuple[int, ...] = (1, 16, 256)
"""Token counts of ``--quick`` (with the benchmark's own kinds), a run of seconds."""


def _expected_steps(
    mod: ModuleType, kinds: Sequence[str] | None, tokens: Sequence[int] | None
) -> int | None:
    """Progress messages the benchmark will send: one per shape plus two for the roofline,
    when it exposes ``shapes(kinds, tokens)``."""
    shapes = getattr(mod, "shapes", None)
    if not callable(shapes):
        return None
    try:
        kinds = kinds if kinds is not None else mod.KINDS
        tokens = tokens if tokens is not None else mod.TOKENS
        return len(shapes(kinds, tokens)) + 2
    except Exception:
        return None


def run_benchmark(
    device: str | None = None,
    quick: bool = False,
    progress: Callable[..., None] | None = None,
    module: ModuleType | None = None,
    kinds: Sequence[str] | None = None,
    tokens: Sequence[int] | None = None,
) -> BenchResult:
    """Run the benchmark and normalize its rows.

    The benchmark module (:func:`load_benchmark_module` unless ``module`` is given) must have
    an entry point named in :data:`RUN_FUNCTIONS`; it is called with whichever of ``device``,
    ``quick``, ``kinds``, ``tokens`` and ``progress`` it accepts (``progress`` gets a message
    string per step, or ``(done, total, label)``) and returns rows (see :func:`normalize_row`),
    optionally as ``{"rows": ..., "roofline_gbps": ...}`` or an object with those attributes.
    ``quick`` without ``tokens`` also limits the sweep to :data:`QUICK_TOKENS`. Without a
    reported roofline the one implied by the rows' percentages is used. When ``progress`` is a
    :class:`ProgressBar` its total is set from the benchmark's ``shapes()`` when it has one.
    """
    device = device or default_device()
    mod = load_benchmark_module() if module is None else module
    fn = _find_run_function(mod)
    if quick and tokens is None:
        tokens = QUICK_TOKENS
    if isinstance(progress, ProgressBar) and progress.total is None:
        progress.total = _expected_steps(mod, kinds, tokens)
    call: dict[str, Any] = {"device": device, "quick": quick, "progress": progress}
    if kinds is not None:
        call["kinds"] = tuple(kinds)
    if tokens is not None:
        call["tokens"] = tuple(tokens)
    start = time.monotonic()
    raw = _call_with_supported(fn, **call)
    rows_raw, roofline = _rows_and_roofline(raw)
    rows = [normalize_row(r) for r in rows_raw]
    if not rows:
        raise ValueError("benchmark: returned no rows")
    return BenchResult(
        rows=rows,
        roofline_gbps=roofline if roofline is not None else derive_roofline(rows),
        device=device,
        seconds=time.monotonic() - start,
    )


# ---------------------------------------------------------------------------- rendering


def format_table(result: BenchResult) -> str:
    """Fixed-width table: kind, (heads,) tokens, µs, GB/s, % of roofline, ratio to baseline
    (the baseline named in the last column when the benchmark reports it)."""
    with_heads = any(r.heads is not None for r in result.rows)
    with_base = any(r.baseline is not None for r in result.rows)
    headers = [
        "kind",
        *(["H"] if with_heads else []),
        "tokens",
        "us",
        "GB/s",
        "% roofline",
        "vs baseline",
        *(["baseline"] if with_base else []),
    ]
    body = [
        [
            r.kind,
            *([str(r.heads) if r.heads is not None else "-"] if with_heads else []),
            str(r.tokens),
            f"{r.us:.2f}",
            f"{r.gbps:.1f}",
            f"{r.pct_roofline:.1f}",
            "-" if r.baseline_ratio is None else f"{r.baseline_ratio:.2f}x",
            *([r.baseline or "-"] if with_base else []),
        ]
        for r in result.rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        last = len(cells) - 1 if with_base else -1
        return "  ".join(
            c.ljust(w) if i in (0, last) else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    roof = "n/a" if result.roofline_gbps is None else f"{result.roofline_gbps:.1f} GB/s"
    head = [
        f"reshape_and_cache_flash on {result.device}; roofline (device copy, same run): {roof}",
        "",
        line(headers),
        line(["-" * w for w in widths]),
    ]
    return "\n".join(head + [line(row) for row in body])


def write_json(result: BenchResult, path: str | Path) -> None:
    """Write ``result`` as JSON (see :meth:`BenchResult.to_dict`) to ``path``."""
    Path(path).write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Draw GB/s against tokens (log x), one line per kind, the roofline as a horizontal line,
    into the PNG ``path``. Needs matplotlib (:class:`BenchUnavailable` otherwise)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchUnavailable(
            f"--plot needs matplotlib, which is not installed: {PLOT_HINT}"
        ) from None
    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[tuple[str, int | None], list[BenchRow]] = {}
    for r in result.rows:
        groups.setdefault((r.kind, r.heads), []).append(r)
    for (kind, heads), rows in groups.items():
        rows = sorted(rows, key=lambda r: r.tokens)
        label = kind if heads is None else f"{kind} H={heads}"
        style = "-o" if len(rows) > 1 else "s"
        ax.plot([r.tokens for r in rows], [r.gbps for r in rows], style, label=label)
    if result.roofline_gbps is not None:
        ax.axhline(
            result.roofline_gbps,
            color="black",
            linestyle="--",
            label=f"roofline {result.roofline_gbps:.0f} GB/s",
        )
    ax.set_xscale("log")
    ax.set_xlabel("tokens per call")
    ax.set_ylabel("GB/s")
    ax.set_title(f"reshape_and_cache_flash on {result.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark reshape_and_cache_flash (GB/s, %% of roofline, vs baseline)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if any)")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration (seconds)")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the rows as JSON")
    parser.add_argument(
        "--plot", metavar="PNG", default=None, help="draw GB/s vs tokens per kind (matplotlib)"
    )
    parser.add_argument(
        "--kinds", nargs="+", default=None, help="cache kinds (benchmark's default)"
    )
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=int,
        default=None,
        help="tokens per call (default: the benchmark's; with --quick: "
        + " ".join(map(str, QUICK_TOKENS))
        + ")",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Handler of ``vllm-kv bench``; returns the exit status."""
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        print(f"vllm-kv bench: error: --plot needs matplotlib: {PLOT_HINT}", file=sys.stderr)
        return EXIT_USAGE
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    bar = None if args.no_progress else ProgressBar(sys.stderr)
    try:
        result = run_benchmark(
            device=args.device,
            quick=args.quick,
            progress=bar,
            kinds=args.kinds,
            tokens=args.tokens,
        )
    except (BenchUnavailable, ValueError, ImportError) as e:
        if bar is not None:
            bar.close()
        print(f"vllm-kv bench: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if bar is not None:
        bar.total = bar.total or bar.done or 1
        bar.done = bar.total
        bar.draw("done")
        bar.close()
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        write_plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
