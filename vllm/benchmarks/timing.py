"""How the kernel benchmarks time a call: cache flushes, the per-call timer, the roofline copy and
the interleaved repeats that the benchmarks of :mod:`vllm.benchmarks` share, and the
:class:`Session` of a run that holds them together.

A *repeat* is one :func:`time_call` (the median of at least three timed calls, or of ``max_runs``
when fewer). :func:`time_repeats` runs several repeats of several callables in alternation (the
roofline copy, the op, its baseline, the roofline copy, the op, ...), so that each op repeat has
a roofline copy measured right before it, in the same machine state; what the repeats say about
the trustworthiness of a row is :mod:`vllm.benchmarks.noise`'s business.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.benchmarks import noise

ROOFLINE_BYTES = 256 << 20
"""Bytes of each buffer of the roofline copy (a quarter with ``quick``; at least 4x the last-level
cache either way)."""
MODES = ("cold", "warm")
CUDA_FLUSH_BYTES = 256 << 20
"""Flush buffer on a GPU (as triton's ``do_bench``): larger than any GPU's L2."""
CPU_FLUSH_FALLBACK_BYTES = 256 << 20
"""Flush buffer on a CPU whose last-level cache size cannot be read from sysfs."""
REPEATS = 5
"""Repeats per row, quick or not: enough for a median and a spread that one outlier cannot make,
few enough that ``vllm-kv bench --quick`` stays within seconds on two cores."""

Progress = Callable[[int, int, str], None]
"""``progress(done, total, message)``: ``done`` of ``total`` steps (the roofline copy's set-up,
then one per shape) are finished; ``message`` says what was just measured or is starting."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    """``first()`` followed by ``second()``: a flush, then a re-warming call."""

    def both() -> None:
        first()
        second()

    return both


def last_level_cache_bytes(device: torch.device) -> int | None:
    """Size of the last-level cache in front of ``device``'s memory: a GPU's L2, the largest CPU
    cache listed in sysfs (the L3 of CPU 0); ``None`` when unknown."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return int(size) or None
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except ValueError:
            continue
    return max(sizes, default=None)


def flush_bytes(device: torch.device) -> int:
    """Bytes of the buffer written between timed calls in cold mode: 256 MiB on a GPU (as triton's
    ``do_bench``), twice the last-level cache on a CPU (at least 64 MiB)."""
    if device.type == "cuda":
        return max(CUDA_FLUSH_BYTES, 2 * (last_level_cache_bytes(device) or 0))
    llc = last_level_cache_bytes(device)
    return CPU_FLUSH_FALLBACK_BYTES if llc is None else max(64 << 20, 2 * llc)


class CacheFlusher:
    """Evicts the device's caches by writing a buffer larger than the last-level cache; called
    before each timed call, outside the timed region. On a GPU ``zero_()`` (stream-ordered, so
    the flush kernel finishes before the start event is recorded); on a CPU ``add_(1)``, which
    reads every line into the cache and dirties it (``zero_`` may become a ``memset`` with
    non-temporal stores that bypass the cache)."""

    def __init__(self, device: torch.device, nbytes: int | None = None) -> None:
        self.nbytes = flush_bytes(device) if nbytes is None else nbytes
        self.device = device
        self.buffer = torch.zeros(self.nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        if self.device.type == "cuda":
            self.buffer.zero_()
        else:
            self.buffer.add_(1)


def time_call(
    fn: Callable[[], None],
    device: torch.device,
    min_time_s: float,
    max_runs: int,
    before: Callable[[], None] | None = None,
    warmup: bool = True,
) -> float:
    """Median seconds of one call of ``fn``: CUDA events on a GPU, perf_counter on a CPU;
    runs until ``min_time_s`` has passed (at least ``min(3, max_runs)`` runs, at most
    ``max_runs``). ``before``, when given (a cache flush), runs before every call (the warm-up
    too), outside the timed region. ``warmup=False`` skips the untimed first call (a later repeat
    of something already called)."""
    if warmup:
        if before is not None:
            before()
        fn()
    sync(device)
    samples: list[float] = []
    start_all = time.perf_counter()
    while len(samples) < min(3, max_runs) or (
        len(samples) < max_runs and time.perf_counter() - start_all < min_time_s
    ):
        if before is not None:
            before()
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Stream order: the kernels of ``before`` complete before ``begin`` is recorded.
            begin.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@dataclasses.dataclass(frozen=True)
class Timed:
    """One callable that :func:`time_repeats` times once per repeat, as :func:`time_call` does."""

    fn: Callable[[], None]
    max_runs: int
    before: Callable[[], None] | None = None
    warmup: bool = True
    """Whether the first repeat starts with an untimed call."""


def time_repeats(
    timed: Sequence[Timed], device: torch.device, repeats: int, min_time_s: float
) -> list[list[float]]:
    """Seconds of each of ``timed``, one :func:`time_call` per repeat, the callables taking turns
    within each repeat (all of repeat 1, then all of repeat 2, ...): each sees the machine state
    its neighbours saw, so a burst of load lands on a whole repeat rather than on one callable.
    ``min_time_s`` is per repeat; only the first repeat has a warm-up call."""
    samples: list[list[float]] = [[] for _ in timed]
    for i in range(repeats):
        for t, out in zip(timed, samples, strict=True):
            warmup = t.warmup and i == 0
            out.append(time_call(t.fn, device, min_time_s, t.max_runs, t.before, warmup))
    return samples


def roofline_bytes(device: torch.device, quick: bool = False) -> int:
    """Size of each buffer of the roofline copy: :data:`ROOFLINE_BYTES` (a quarter if ``quick``),
    at least four times the last-level cache so that the copy streams from memory."""
    llc = last_level_cache_bytes(device) or 0
    return max(ROOFLINE_BYTES // (4 if quick else 1), 4 * llc)


class RooflineCopy:
    """A ``dst.copy_(src)`` of ``nbytes`` on ``device``, allocated once per run and timed next to
    every row (:meth:`timed`); its GB/s count the bytes read plus the bytes written
    (``2 * nbytes``), as the rows count theirs."""

    RUNS = 3
    """Copies per repeat: a median of three, one repeat costing tens of milliseconds."""

    def __init__(
        self, device: torch.device, nbytes: int, flush: Callable[[], None] | None = None
    ) -> None:
        self.device = device
        self.nbytes = nbytes
        self.flush = flush
        self.src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
        self.dst = torch.empty_like(self.src)
        self.copy()  # first touch of ``dst``: its page faults stay out of every timed copy
        sync(device)

    def copy(self) -> None:
        self.dst.copy_(self.src)

    def timed(self) -> Timed:
        return Timed(self.copy, self.RUNS, self.flush, warmup=False)

    def gbps(self, seconds: float) -> float:
        return 2 * self.nbytes / seconds / 1e9


def mode_caption(mode: str) -> str:
    """One line saying how the rows of ``mode`` were timed."""
    if mode == "warm":
        return (
            "warm cache: repeated calls on the same buffers, which may stay in the last-level "
            "cache (% of the DRAM copy roofline can exceed 100)"
        )
    return (
        "cold cache: last-level cache flushed before every timed call (op, baseline, roofline), "
        "then the code path re-warmed on an independent copy of the problem"
    )


def run_fields(rows: Sequence[noise.RepeatStats], bytes_counted: str) -> dict[str, Any]:
    """The JSON fields every benchmark's run shares: the cache mode and its caption, what the
    byte counts count, torch's version and threads, and :func:`~vllm.benchmarks.noise.run_json`'s
    repeats, flags and load."""
    mode = getattr(rows[0], "mode", None) if rows else None
    return {
        "mode": mode,
        "mode_description": mode_caption(mode) if mode else None,
        "bytes_counted": bytes_counted,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        **noise.run_json(rows),
    }


class Session:
    """What the rows of one run share: the cache flush (cold mode), the roofline copy timed next to
    every row, the :class:`~vllm.benchmarks.noise.MachineWatch`, the timing budget and the
    progress steps (the roofline copy's set-up, then one per row).

    ``row_time_s`` is the least time spent timing the op of one row, split over its repeats.
    Raises ``ValueError`` for a non-positive ``repeats``."""

    def __init__(
        self,
        device: torch.device,
        rows: int,
        *,
        quick: bool,
        warm: bool,
        repeats: int,
        row_time_s: float,
        progress: Progress | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        if repeats <= 0:
            raise ValueError(f"repeats must be positive, got {repeats}")
        self.device = device
        self.mode = "warm" if warm else "cold"
        self.repeats = repeats
        self.min_time_s = row_time_s / repeats
        self.flush = None if warm else CacheFlusher(device)
        self.total = 1 + rows
        self.done = 0
        self.report: Progress = progress or (lambda _done, _total, _msg: None)
        self.report(0, self.total, f"allocating the roofline copy on {device} ({self.mode} cache)")
        self.roofline = RooflineCopy(device, roofline_bytes(device, quick), self.flush)
        mib = self.roofline.nbytes >> 20
        self.report(1, self.total, f"copy roofline: {mib} MiB, timed next to every row")
        self.watch = noise.MachineWatch(warn, over_bar=progress is not None)

    def measure(self, op: Timed, nbytes: int, baseline: Timed | None) -> noise.Summary:
        """:attr:`repeats` repeats of (roofline copy, ``op``, ``baseline``) and their summary;
        ``nbytes``: the bytes ``op`` moves; ``baseline=None``: no baseline timed."""
        timed = [self.roofline.timed(), op, *([baseline] if baseline is not None else [])]
        self.watch.start_row()
        copy_s, op_s, *base_s = time_repeats(timed, self.device, self.repeats, self.min_time_s)
        machine = self.watch.end_row()
        copy_gbps = [self.roofline.gbps(t) for t in copy_s]
        baseline_s = base_s[0] if base_s else None
        return noise.summarize(op_s, copy_gbps, nbytes, baseline_s, self.mode, machine)

    def row_done(self, message: str) -> None:
        """Report a finished row; after the last one the load warning, if any, comes first, so
        that on a terminal the progress bar's last frame is drawn below it."""
        self.done += 1
        if self.done == self.total - 1:
            self.watch.finish()
        self.report(1 + self.done, self.total, message)
