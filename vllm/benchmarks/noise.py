"""Whether a benchmark row can be trusted: the statistics of its repeats, its flags, the machine's
load, and how tables, JSON and plots show them; shared by
:mod:`vllm.benchmarks.reshape_and_cache_flash` and :mod:`vllm.benchmarks.attention`.

Every row is measured :data:`~vllm.benchmarks.timing.REPEATS` times (each repeat a median of
timed calls, see :mod:`vllm.benchmarks.timing`). Its times are the medians of the repeats; its
*spread* is their interquartile range / median, in %. Its % of roofline is the median, over the
repeats, of the op's GB/s over the GB/s of the roofline copy timed right before it. A row is
flagged (:data:`FLAGS`) when a spread is over :data:`SPREAD_LIMIT_PCT`, when a cold row is over
:data:`PLAUSIBLE_COLD_PCT` of its roofline, or when this process's threads waited for a CPU for
over :data:`CPU_WAIT_LIMIT_PCT` of the row's time. A run warns (stderr, table notes, JSON) when
the 1-minute load average exceeds the CPU count at its start or its end.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

SPREAD_LIMIT_PCT = 25.0
"""A row whose repeats spread over more than this % of their median is flagged. With the machine
to itself (2 vCPUs), the ops' spreads in ``vllm-kv bench --quick`` were 0-15%, up to ~20% for
the ~10 µs one-token stores; a core taken by another process showed as 30% to over 1000%."""
PLAUSIBLE_COLD_PCT = 100.0
"""Cold-cache rows stream from memory, as the roofline copy does: above this % of it, the copy or
the op was measured in a different machine state (or the data stayed in cache)."""
CPU_WAIT_LIMIT_PCT = 10.0
"""A row during which this process's threads (summed) waited for a CPU for more than this % of
its wall time is flagged ``contended``. Alone on the machine they wait ~0%; with one other busy
process on two cores, 20% to over 100%. This catches what spreads cannot: with two torch threads
and a third process, each parallel call waited for the same ~8 ms time slice, every repeat alike
(a 110 µs row read 7980 µs, spread 0%), while the 1-minute load average stayed below 2."""
FLAGS = {
    "noisy": "the op's repeats spread over {limit:g}% of their median: its time, GB/s, % of "
    "roofline and ratios are unreliable",
    "noisy-baseline": "the baseline's repeats spread over {limit:g}% of their median: the "
    "x baseline / x reference ratio is unreliable",
    "noisy-roofline": "the roofline copies timed next to the op spread over {limit:g}% of their "
    "median: % of roofline is unreliable",
    "over-roofline": "cold cache yet above {cold:g}% of the copy roofline: implausible, the copy "
    "and the op saw different machine states; % of roofline is unreliable",
    "contended": "this process's threads waited in the run queue for over {wait:g}% of the "
    "row's time: other processes (or more threads than CPUs) held the cores, and a thread "
    "waiting for one can add a scheduler time slice to every call, which no spread shows",
}
"""Flag name -> what it means (the legend under a table; filled in by :func:`flag_legend`)."""


def flag_legend() -> dict[str, str]:
    """:data:`FLAGS` with this machine's limits filled in."""
    fill = {"limit": SPREAD_LIMIT_PCT, "cold": PLAUSIBLE_COLD_PCT, "wait": CPU_WAIT_LIMIT_PCT}
    return {name: text.format(**fill) for name, text in FLAGS.items()}


def spread_pct(samples: Sequence[float]) -> float:
    """Interquartile range / median of ``samples``, in %; 0 for fewer than two samples.

    Quartiles by the inclusive method: of five repeats, the 2nd and 4th fastest, so that one
    outlier repeat, which the median ignores, does not flag a row on its own; two on the same
    side, which move the median, do."""
    if len(samples) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return 100 * (q3 - q1) / median if median > 0 else float("inf")


@dataclasses.dataclass(kw_only=True)
class RepeatStats:
    """What a benchmark row says about its repeats; the rows of both benchmarks extend it.

    Times in µs, the per-repeat values in the order measured."""

    repeats: int = 1
    op_us_samples: list[float] = dataclasses.field(default_factory=list)
    op_spread_pct: float = 0.0
    baseline_us_samples: list[float] | None = None
    baseline_spread_pct: float | None = None
    roofline_gbps_samples: list[float] = dataclasses.field(default_factory=list)
    """The roofline copy's GB/s, each timed right before the op repeat of the same index."""
    roofline_spread_pct: float = 0.0
    flags: list[str] = dataclasses.field(default_factory=list)
    load_avg: list[float | None] = dataclasses.field(default_factory=list)
    """The 1-minute load average before and after the row was measured."""
    cpu_wait_pct: float | None = None
    """Run-queue wait of this process's threads during the row, % of its wall time (Linux)."""


@dataclasses.dataclass(frozen=True)
class Summary:
    """The medians of a row's repeats (seconds, GB/s, %) and its :class:`RepeatStats`."""

    op_s: float
    roofline_gbps: float
    pct_roofline: float
    baseline_s: float | None
    stats: RepeatStats


def flags_for(stats: RepeatStats, pct_roofline: float, mode: str) -> list[str]:
    """The :data:`FLAGS` names that apply to a row, in their order."""
    over = {
        "noisy": stats.op_spread_pct,
        "noisy-baseline": stats.baseline_spread_pct or 0.0,
        "noisy-roofline": stats.roofline_spread_pct,
    }
    flags = [name for name, spread in over.items() if spread > SPREAD_LIMIT_PCT]
    if mode == "cold" and pct_roofline > PLAUSIBLE_COLD_PCT:
        flags.append("over-roofline")
    if stats.cpu_wait_pct is not None and stats.cpu_wait_pct > CPU_WAIT_LIMIT_PCT:
        flags.append("contended")
    return flags


def summarize(
    op_s: Sequence[float],
    roofline_gbps: Sequence[float],
    nbytes: int,
    baseline_s: Sequence[float] | None,
    mode: str,
    machine: RowMachine,
) -> Summary:
    """Medians, spreads and flags of one row from its repeats: the op's seconds, the GB/s of the
    roofline copy paired with each, the bytes the op moves, the baseline's seconds (``None`` when
    not timed), the cache mode and what :class:`MachineWatch` saw during the row."""
    paired_pct = [100 * nbytes / s / 1e9 / r for s, r in zip(op_s, roofline_gbps, strict=True)]
    stats = RepeatStats(
        repeats=len(op_s),
        op_us_samples=[s * 1e6 for s in op_s],
        op_spread_pct=spread_pct(op_s),
        baseline_us_samples=None if baseline_s is None else [s * 1e6 for s in baseline_s],
        baseline_spread_pct=None if baseline_s is None else spread_pct(baseline_s),
        roofline_gbps_samples=list(roofline_gbps),
        roofline_spread_pct=spread_pct(roofline_gbps),
        load_avg=machine.load_avg,
        cpu_wait_pct=machine.cpu_wait_pct,
    )
    pct = statistics.median(paired_pct)
    stats.flags = flags_for(stats, pct, mode)
    return Summary(
        op_s=statistics.median(op_s),
        roofline_gbps=statistics.median(roofline_gbps),
        pct_roofline=pct,
        baseline_s=None if baseline_s is None else statistics.median(baseline_s),
        stats=stats,
    )


def stats_of(summary: Summary) -> dict[str, Any]:
    """The :class:`RepeatStats` fields of ``summary`` as keyword arguments of a row."""
    return {f.name: getattr(summary.stats, f.name) for f in dataclasses.fields(RepeatStats)}


# --- machine load -------------------------------------------------------------------------------


def cpu_count() -> int:
    """CPUs of the machine: the load average counts runnable threads machine-wide, so it is
    compared with every CPU (``os.cpu_count()``), not only those this process may use."""
    return os.cpu_count() or len(os.sched_getaffinity(0))


def load_average() -> float | None:
    """The 1-minute load average, ``None`` where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@dataclasses.dataclass(frozen=True)
class Load:
    """The load average at a run's start and end against the machine's CPUs."""

    cores: int
    start: float | None
    end: float | None

    @property
    def overloaded(self) -> bool:
        return any(v is not None and v > self.cores for v in (self.start, self.end))

    def warning(self) -> str | None:
        """One line when :attr:`overloaded`, else ``None``."""
        if not self.overloaded:
            return None

        def text(v: float | None) -> str:
            return "?" if v is None else f"{v:.2f}"

        return (
            f"warning: load average {text(self.start)} at start, {text(self.end)} at end, above "
            f"the {self.cores} CPUs: more threads wanted to run than there were CPUs, timings "
            "are unreliable (see spread % and flags)"
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "overloaded": self.overloaded}


def print_warning(text: str, over_bar: bool = False) -> None:
    """Write ``text`` as one line on stderr; ``over_bar``: over a progress bar drawn in place
    there (``\\r``, padded to the bar's 120 columns), so that the bar's next frame goes below."""
    print(f"\r{text:<120}" if over_bar else text, file=sys.stderr, flush=True)


def cpu_wait_ns() -> int | None:
    """Nanoseconds this process's threads have spent runnable but waiting for a CPU: the sum of
    the run-queue delays in ``/proc/self/task/*/schedstat`` (Linux); ``None`` where unavailable."""
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    total, found = 0, False
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile, or no schedstat
        found = True
    return total if found else None


@dataclasses.dataclass(frozen=True)
class RowMachine:
    """What the machine did while one row was measured."""

    load_avg: list[float | None]
    """The 1-minute load average before and after the row."""
    cpu_wait_pct: float | None
    """This process's threads' run-queue wait, % of the row's wall time; ``None`` if unknown."""


class MachineWatch:
    """Watches the machine over a run: the load average at its start and around each row, the
    run-queue wait of this process's threads during each row (:meth:`start_row`,
    :meth:`end_row`); :meth:`finish` warns once when the load was above the CPUs."""

    def __init__(self, warn: Callable[[str], None] | None = None, over_bar: bool = False) -> None:
        self.warn = warn or (lambda text: print_warning(text, over_bar))
        self.start = self.last = load_average()
        self._wall = time.perf_counter()
        self._wait = cpu_wait_ns()

    def start_row(self) -> None:
        self._wall = time.perf_counter()
        self._wait = cpu_wait_ns()

    def end_row(self) -> RowMachine:
        wall = time.perf_counter() - self._wall
        wait, start_wait = cpu_wait_ns(), self._wait
        pct = None
        if wait is not None and start_wait is not None and wall > 0:
            # Threads that ended during the row take their delay with them: never below 0.
            pct = max(0.0, 100 * (wait - start_wait) / 1e9 / wall)
        before, self.last = self.last, load_average()
        return RowMachine([before, self.last], pct)

    def finish(self) -> Load:
        """The run's :class:`Load`; its warning, if any, goes to ``warn``."""
        load = Load(cpu_count(), self.start, self.last)
        if (line := load.warning()) is not None:
            self.warn(line)
        return load


def run_load(rows: Sequence[RepeatStats]) -> Load:
    """The :class:`Load` of a run from its first and last rows."""
    first = rows[0].load_avg if rows else []
    last = rows[-1].load_avg if rows else []
    return Load(cpu_count(), first[0] if first else None, last[-1] if last else None)


# --- rendering ----------------------------------------------------------------------------------


def legend(rows: Sequence[RepeatStats]) -> list[str]:
    """One line per flag present in ``rows`` (in :data:`FLAGS` order), or one saying none is."""
    present = {flag for r in rows for flag in r.flags}
    if not present:
        return [
            f"flags: none (every spread within {SPREAD_LIMIT_PCT:g}%, no cold row above "
            f"{PLAUSIBLE_COLD_PCT:g}% of the roofline, CPU wait within {CPU_WAIT_LIMIT_PCT:g}%)"
        ]
    return [f"{name}: {text}" for name, text in flag_legend().items() if name in present]


def notes(rows: Sequence[RepeatStats]) -> list[str]:
    """The lines under a table: how medians and spreads are taken, the flags' legend, and the
    load warning when the machine was overloaded."""
    repeats = rows[0].repeats if rows else 0
    lines = [
        f"median of {repeats} repeats, each a median of timed calls; spread % = interquartile "
        "range / median of the repeats; % roofline against the copy timed before each repeat",
        *legend(rows),
    ]
    if (warning := run_load(rows).warning()) is not None:
        lines.append(warning)
    return lines


def roofline_range(rows: Sequence[RepeatStats]) -> tuple[float, float, float] | None:
    """(median, min, max) GB/s of every roofline copy of the run; ``None`` without any. A row
    built without repeats (by hand, by older code) counts its ``roofline_gbps`` once."""
    samples = [
        g
        for r in rows
        for g in r.roofline_gbps_samples or [getattr(r, "roofline_gbps", None)]
        if g is not None
    ]
    return (statistics.median(samples), min(samples), max(samples)) if samples else None


def roofline_caption(rows: Sequence[RepeatStats]) -> str:
    """``roofline (copy, next to each row): M GB/s median, A-B`` for a table's title."""
    found = roofline_range(rows)
    if found is None:
        return "roofline: not measured"
    median, low, high = found
    return f"roofline (copy, next to each row): {median:.1f} GB/s median, {low:.1f}-{high:.1f}"


def fixed_width(
    headers: Sequence[str], body: Sequence[Sequence[str]], left: Collection[int]
) -> str:
    """A terminal table: columns in ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, body)])


def run_json(rows: Sequence[RepeatStats]) -> dict[str, Any]:
    """The run-level JSON fields about repeats, flags and load."""
    found = roofline_range(rows)
    load = run_load(rows)
    return {
        "roofline_gbps": found[0] if found else None,
        "roofline_gbps_range": list(found[1:]) if found else None,
        "repeats": rows[0].repeats if rows else None,
        "statistic": "median of the repeats; spread = interquartile range / median, in %",
        "spread_limit_pct": SPREAD_LIMIT_PCT,
        "cpu_wait_limit_pct": CPU_WAIT_LIMIT_PCT,
        "flag_legend": flag_legend(),
        "flagged_rows": sum(1 for r in rows if r.flags),
        "load": load.to_json(),
        "warnings": [w for w in [load.warning()] if w is not None],
    }


def row_json(row: RepeatStats) -> dict[str, Any]:
    """A row as JSON: its own fields first, then the :class:`RepeatStats` ones."""
    data = dataclasses.asdict(row)
    shared = [f.name for f in dataclasses.fields(RepeatStats)]
    return {**{k: v for k, v in data.items() if k not in shared}, **{k: data[k] for k in shared}}


def plot_rows(ax: Any, xs: Sequence[float], rows: Sequence[Any], style: str, label: str) -> None:
    """GB/s of ``rows`` (each with ``bytes_moved``, ``op_gbps`` and the repeats) against ``xs``:
    the medians, a bar over the repeats' range, flagged rows circled in red."""
    ys = [r.op_gbps for r in rows]
    # GB/s = bytes / µs / 1e3: the slowest repeat gives the bar's bottom, the fastest its top.
    below = [
        max(0.0, y - r.bytes_moved / max(r.op_us_samples) / 1e3) if r.op_us_samples else 0.0
        for y, r in zip(ys, rows, strict=True)
    ]
    above = [
        max(0.0, r.bytes_moved / min(r.op_us_samples) / 1e3 - y) if r.op_us_samples else 0.0
        for y, r in zip(ys, rows, strict=True)
    ]
    ax.errorbar(xs, ys, yerr=[below, above], fmt=style, capsize=3, label=label)
    flagged = [(x, y) for x, y, r in zip(xs, ys, rows, strict=True) if r.flags]
    if flagged:
        xs_flagged, ys_flagged = [x for x, _ in flagged], [y for _, y in flagged]
        ax.scatter(xs_flagged, ys_flagged, s=140, facecolors="none", edgecolors="red", zorder=3)


PLOT_NOTE = "bars: range of the repeats; red circles: flagged rows"


def plot_roofline(ax: Any, rows: Sequence[RepeatStats]) -> None:
    """The run's median roofline as a dashed line over a band of its range."""
    found = roofline_range(rows)
    if found is None:
        return
    median, low, high = found
    ax.axhline(median, color="black", linestyle="--", label=f"copy roofline {median:.0f} GB/s")
    ax.axhspan(low, high, color="black", alpha=0.08)
