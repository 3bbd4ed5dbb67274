"""Benchmark of reshape_and_cache_flash: time, bytes moved, GB/s, % of a memory roofline measured
in the same run (a large ``dst.copy_(src)``), and the speed-up over a baseline measured in the same
run (``index_copy_`` into the cache for unquantized caches, the pure-torch reference writer of
vllm.kv_quant for FP8 and NVFP4).

Cold cache by default: before every timed call (of the op, of its baseline and of the roofline
copy) a flush buffer larger than the last-level cache (the CPU's L3, a GPU's L2) is written outside
the timed region, so every timed call streams its inputs and cache pages from memory, as the
roofline copy does. The op and its baseline are then called once, still untimed, on a second,
independent copy of the same problem: that brings the code, the dispatch tables and the thread
pool back into cache (on a CPU the flush evicts them too, which would otherwise add ~100 µs of
misses to a one-token call) without touching the timed call's data. ``warm=True`` (``--warm``)
times repeated calls on the same cache-resident buffers instead, where "% of roofline" can exceed
100 since the roofline is a DRAM copy. Bytes are counted the same way for the op and the copy:
bytes read plus bytes written.

``run()`` returns the rows and prints nothing (progress goes to an optional callback, called as
``progress(done, total, message)``); ``main()`` is the command line, also reachable as
``python benchmarks/kernels/benchmark_reshape_and_cache_flash.py --device cpu --threads 2
--markdown out.md --json out.json``; ``vllm-kv bench`` wraps the same ``run()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.kv_quant import fp8_format_from_cache_dtype, fp8_write_cache, nvfp4_write_cache
from vllm.v1.kv_cache_format import lookup

KINDS = ("auto", "fp8", "nvfp4")
TOKENS = (1, 16, 256, 4096, 16384)
QUICK_TOKENS = (1, 16, 256)
"""Token counts of a ``quick`` run when none are given."""
HEAD_SIZE = 128
BLOCK_SIZE = 16
SOURCE_DTYPE = torch.bfloat16
# (num_heads, tokens): the H=8 sweep over TOKENS, plus H=1 and H=32 rows at 4096 tokens.
EXTRA_HEADS = ((1, 4096), (32, 4096))
ROOFLINE_BYTES = 256 << 20
"""Bytes of each buffer of the roofline copy (a quarter with ``quick``; at least 4x the last-level
cache either way)."""
MODES = ("cold", "warm")
CUDA_FLUSH_BYTES = 256 << 20
"""Flush buffer on a GPU (as triton's ``do_bench``): larger than any GPU's L2."""
CPU_FLUSH_FALLBACK_BYTES = 256 << 20
"""Flush buffer on a CPU whose last-level cache size cannot be read from sysfs."""

Progress = Callable[[int, int, str], None]
"""``progress(done, total, message)``: ``done`` of ``total`` steps (the roofline, then one per
shape) are finished; ``message`` says what was just measured or is starting."""


@dataclasses.dataclass
class Row:
    """One measurement: our op against its baseline for one shape."""

    kind: str
    num_tokens: int
    num_heads: int
    head_size: int
    device: str
    op_us: float
    baseline: str
    baseline_us: float
    bytes_moved: int
    op_gbps: float
    roofline_gbps: float
    pct_roofline: float
    speedup_vs_baseline: float
    mode: str = "cold"
    """``cold``: caches flushed before every timed call; ``warm``: repeated cache-resident calls."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
) -> float:
    """Median seconds of one call of ``fn``: CUDA events on a GPU, perf_counter on a CPU;
    runs until ``min_time_s`` has passed (at least 3 runs, at most ``max_runs``). ``before``,
    when given (a cache flush), runs before every call (the warm-up too), outside the timed
    region."""
    if before is not None:
        before()
    fn()  # warm-up
    _sync(device)
    samples: list[float] = []
    start_all = time.perf_counter()
    while len(samples) < 3 or (
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


def measure_roofline_gbps(
    device: torch.device,
    nbytes: int,
    min_time_s: float,
    flush: Callable[[], None] | None = None,
) -> float:
    """GB/s of a copy of ``nbytes`` on ``device``, counting the bytes read plus the bytes
    written (``2 * nbytes``), as the rows count theirs; ``flush`` as in :func:`time_call`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), device, min_time_s, max_runs=50, before=flush)
    return 2 * nbytes / seconds / 1e9


@dataclasses.dataclass
class _Setup:
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slots: torch.Tensor
    scale: torch.Tensor
    bytes_moved: int


def _setup(kind: str, num_tokens: int, num_heads: int, device: torch.device) -> _Setup:
    gen = torch.Generator().manual_seed(0)
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    shape = (num_tokens, num_heads, HEAD_SIZE)
    key = torch.randn(shape, generator=gen).to(device=device, dtype=SOURCE_DTYPE)
    value = torch.randn(shape, generator=gen).to(device=device, dtype=SOURCE_DTYPE)
    # Prefill-like: each sequence run fills whole pages, pages scattered over the cache.
    pages = torch.randperm(num_blocks, generator=gen)
    t = torch.arange(num_tokens)
    slots = (pages[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE).to(device)
    fmt = lookup(kind)
    last_dim = fmt.last_dim(HEAD_SIZE)
    cache_dtype = fmt.resolve_storage_dtype(SOURCE_DTYPE)
    cache_shape = (num_blocks, BLOCK_SIZE, num_heads, last_dim)
    key_cache = torch.zeros(cache_shape, dtype=cache_dtype, device=device)
    value_cache = torch.zeros(cache_shape, dtype=cache_dtype, device=device)
    scale = torch.full((1,), 0.01, device=device)
    # Read + written, as the roofline copy counts its bytes: K/V, the slot mapping and the two
    # scales read; the cache rows (data and, for NVFP4, block scales) written.
    written = 2 * num_tokens * num_heads * last_dim * key_cache.element_size()
    read = sum(t.numel() * t.element_size() for t in (key, value, slots))
    read += 2 * scale.numel() * scale.element_size()
    return _Setup(key, value, key_cache, value_cache, slots, scale, read + written)


def _op(ops: Any, kind: str, s: _Setup) -> Callable[[], None]:
    def op() -> None:
        ops.reshape_and_cache_flash(
            s.key, s.value, s.key_cache, s.value_cache, s.slots, kind, s.scale, s.scale
        )

    return op


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


def _baseline(kind: str, s: _Setup) -> tuple[str, Callable[[], None]]:
    fmt = lookup(kind)
    if not fmt.is_quantized:
        k_flat = s.key_cache.view(-1, *s.key_cache.shape[2:])
        v_flat = s.value_cache.view(-1, *s.value_cache.shape[2:])

        def index_copy() -> None:
            k_flat.index_copy_(0, s.slots, s.key)
            v_flat.index_copy_(0, s.slots, s.value)

        return "index_copy_", index_copy
    if fmt.is_nvfp4:

        def nvfp4_reference() -> None:
            nvfp4_write_cache(s.key, s.key_cache, s.slots, s.scale)
            nvfp4_write_cache(s.value, s.value_cache, s.slots, s.scale)

        return "reference nvfp4_write_cache", nvfp4_reference
    fp8 = fp8_format_from_cache_dtype(kind)

    def fp8_reference() -> None:
        fp8_write_cache(s.key, s.key_cache, s.slots, s.scale, fp8)
        fp8_write_cache(s.value, s.value_cache, s.slots, s.scale, fp8)

    return "reference fp8_write_cache", fp8_reference


def roofline_bytes(device: torch.device, quick: bool = False) -> int:
    """Size of each buffer of the roofline copy: :data:`ROOFLINE_BYTES` (a quarter if ``quick``),
    at least four times the last-level cache so that the copy streams from memory."""
    llc = last_level_cache_bytes(device) or 0
    return max(ROOFLINE_BYTES // (4 if quick else 1), 4 * llc)


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


def shapes(kinds: Sequence[str], tokens: Sequence[int]) -> list[tuple[str, int, int]]:
    """(kind, num_heads, num_tokens) of every row: the H=8 sweep, then the H=1 / H=32 rows."""
    heads_tokens = [(8, t) for t in tokens] + [ht for ht in EXTRA_HEADS if ht[1] in tokens]
    return [(kind, h, t) for kind in kinds for h, t in heads_tokens]


def run(
    device: str = "cpu",
    kinds: Sequence[str] = KINDS,
    tokens: Sequence[int] | None = None,
    quick: bool = False,
    progress: Progress | None = None,
    warm: bool = False,
) -> list[Row]:
    """Measure every shape of :func:`shapes` on ``device``; returns one :class:`Row` each.

    ``tokens`` defaults to :data:`TOKENS`, or :data:`QUICK_TOKENS` when ``quick`` (which also
    shortens the timing and the roofline copy). Cold cache unless ``warm``: a
    :class:`CacheFlusher` runs before every timed call of the op, the baseline and the roofline
    copy. Raises ``ValueError`` for an unknown kind, a non-positive token count or a CUDA device
    without CUDA, ``ImportError`` when the compiled extension is not built.
    """
    if tokens is None:
        tokens = QUICK_TOKENS if quick else TOKENS
    if unknown := sorted(set(kinds) - set(KINDS)):
        raise ValueError(f"unknown kinds {unknown}: expected some of {', '.join(KINDS)}")
    if any(t <= 0 for t in tokens):
        raise ValueError(f"token counts must be positive, got {list(tokens)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device")
    from vllm import _custom_ops as ops  # loads the extension; ImportError when not built

    todo = shapes(kinds, tokens)
    total = 1 + len(todo)
    report = progress or (lambda _done, _total, _msg: None)
    min_time_s = 0.05 if quick else 0.3
    mode = "warm" if warm else "cold"
    flush = None if warm else CacheFlusher(dev)
    report(0, total, f"measuring the copy roofline on {dev} ({mode} cache) ...")
    roofline = measure_roofline_gbps(dev, roofline_bytes(dev, quick), min_time_s, flush)
    report(1, total, f"copy roofline: {roofline:.1f} GB/s")
    rows = []
    for kind, num_heads, num_tokens in todo:
        s = _setup(kind, num_tokens, num_heads, dev)
        op = _op(ops, kind, s)
        baseline_name, baseline = _baseline(kind, s)
        before_op = before_baseline = None
        if flush is not None:
            # An independent copy of the problem: calling it after the flush re-warms the code
            # path, not the timed call's buffers.
            other = _setup(kind, num_tokens, num_heads, dev)
            before_op = _then(flush, _op(ops, kind, other))
            before_baseline = _then(flush, _baseline(kind, other)[1])
        op_s = time_call(op, dev, min_time_s, max_runs=2000, before=before_op)
        # The reference codecs are slow: a few runs are enough for a median.
        base_runs = 5 if lookup(kind).is_quantized else 2000
        base_s = time_call(baseline, dev, min_time_s, max_runs=base_runs, before=before_baseline)
        gbps = s.bytes_moved / op_s / 1e9
        row = Row(
            kind=kind,
            num_tokens=num_tokens,
            num_heads=num_heads,
            head_size=HEAD_SIZE,
            device=str(dev),
            op_us=op_s * 1e6,
            baseline=baseline_name,
            baseline_us=base_s * 1e6,
            bytes_moved=s.bytes_moved,
            op_gbps=gbps,
            roofline_gbps=roofline,
            pct_roofline=100 * gbps / roofline,
            speedup_vs_baseline=base_s / op_s,
            mode=mode,
        )
        rows.append(row)
        report(
            1 + len(rows),
            total,
            f"{kind:6s} H={num_heads:<3d} T={num_tokens:<6d} {row.op_us:10.1f} us "
            f"{gbps:7.2f} GB/s {row.pct_roofline:5.1f}% roofline "
            f"{row.speedup_vs_baseline:7.1f}x {baseline_name}",
        )
    return rows


def to_markdown(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table; the header names the cache mode (``cold`` / ``warm``)."""
    mode = rows[0].mode if rows else "cold"
    lines = [
        f"| kind | H | tokens | op (µs, {mode}) | baseline | baseline (µs, {mode}) "
        "| MB moved (read + written) | GB/s | % of copy roofline | × baseline |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.num_heads} | {r.num_tokens} | {r.op_us:.1f} | {r.baseline} "
            f"| {r.baseline_us:.1f} | {r.bytes_moved / 1e6:.3f} | {r.op_gbps:.2f} "
            f"| {r.pct_roofline:.1f} | {r.speedup_vs_baseline:.1f} |"
        )
    return "\n".join(lines) + "\n"


def to_json(rows: Sequence[Row]) -> dict[str, Any]:
    """The rows with the run's device, cache mode, torch version, CPU threads and roofline
    (GB/s, read + written bytes of a device copy)."""
    mode = rows[0].mode if rows else None
    return {
        "benchmark": "reshape_and_cache_flash",
        "device": rows[0].device if rows else None,
        "mode": mode,
        "mode_description": mode_caption(mode) if mode else None,
        "bytes_counted": "read + written",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "roofline_gbps": rows[0].roofline_gbps if rows else None,
        "flush_bytes": flush_bytes(torch.device(rows[0].device)) if mode == "cold" else None,
        "rows": [dataclasses.asdict(r) for r in rows],
    }


def write_json(rows: Sequence[Row], path: str | Path) -> None:
    """Write :func:`to_json` of ``rows`` to ``path``."""
    Path(path).write_text(json.dumps(to_json(rows), indent=2) + "\n")


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def default_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=default_device())
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument(
        "--tokens",
        nargs="+",
        type=positive_int,
        help=f"tokens per call (default {TOKENS}; with --quick {QUICK_TOKENS})",
    )
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--quick", action="store_true", help="shorter timing, smaller roofline, fewer tokens"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="time repeated calls on cache-resident buffers (default: cold cache, caches flushed "
        "before every timed call)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the rows as a Markdown table")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(done: int, total: int, msg: str) -> None:
        print(f"[{done}/{total}] {msg}", file=sys.stderr, flush=True)

    rows = run(args.device, args.kinds, args.tokens, args.quick, progress, warm=args.warm)
    table = to_markdown(rows)
    print(table, end="")
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
