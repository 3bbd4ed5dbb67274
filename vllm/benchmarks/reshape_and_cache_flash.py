"""Benchmark of reshape_and_cache_flash: time, bytes moved, GB/s, % of a memory roofline (a large
``dst.copy_(src)``) timed next to every row, and the speed-up over a baseline measured in the same
run (``index_copy_`` into the cache for unquantized caches, the pure-torch reference writer of
vllm.kv_quant for FP8, NVFP4 and the per-token-head INT8 / FP8 rows).

Every row is measured in :data:`~vllm.benchmarks.timing.REPEATS` repeats, each a roofline copy,
then the op, then the baseline (:func:`~vllm.benchmarks.timing.time_repeats`), each of them the
median of several timed calls. The row reports the medians of the repeats, their spread
(interquartile range / median, %), the median over the repeats of the op's % of the copy timed
just before it, and flags when it cannot be trusted (:mod:`vllm.benchmarks.noise`: a spread over
25%, a cold row above 100% of the roofline, this process's threads waiting for a CPU). A load
average above the CPU count at the run's start or end is warned about on stderr, under the table
and in the JSON.

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

``run()`` returns the rows and prints nothing but the load warning (progress goes to an optional
callback, called as ``progress(done, total, message)``); ``main()`` is the command line, also
reachable as ``python benchmarks/kernels/benchmark_reshape_and_cache_flash.py --device cpu
--threads 2 --markdown out.md --json out.json``; ``vllm-kv bench`` wraps the same ``run()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.benchmarks import noise
from vllm.benchmarks.timing import (
    REPEATS,
    Progress,
    Session,
    Timed,
    flush_bytes,
    run_fields,
    then,
)
from vllm.kv_quant import (
    fp8_format_from_cache_dtype,
    fp8_write_cache,
    nvfp4_write_cache,
    per_token_head_write_cache,
)
from vllm.kv_quant.formats import AUTO, CacheKind, lookup, quant_mode_formats
from vllm.kv_quant.int4_per_token_head import int4_per_token_head_write_cache

KINDS: tuple[str, ...] = (AUTO.name, *(f.accepted_names[0] for f in quant_mode_formats()))
"""The benchmarked ``kv_cache_dtype`` strings: ``auto`` (the model dtype, bf16), then one format
of each quantization mode of the registry (``fp8``, ``nvfp4``, ``int8_per_token_head``,
``fp8_per_token_head``, ``int4_per_token_head``)."""
TOKENS = (1, 16, 256, 4096, 16384)
QUICK_TOKENS = (1, 16, 256)
"""Token counts of a ``quick`` run when none are given."""
HEAD_SIZE = 128
BLOCK_SIZE = 16
SOURCE_DTYPE = torch.bfloat16
# (num_heads, tokens): the H=8 sweep over TOKENS, plus H=1 and H=32 rows at 4096 tokens.
EXTRA_HEADS = ((1, 4096), (32, 4096))


@dataclasses.dataclass
class Row(noise.RepeatStats):
    """One measurement: our op against its baseline for one shape. Times are the medians of the
    repeats, ``roofline_gbps`` the median of the copies timed next to them, ``pct_roofline`` the
    median of each repeat's % of its copy, ``speedup_vs_baseline`` the ratio of the medians."""

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
    # scales read (not by the per-token-head writers); the cache rows (data and, for NVFP4 and
    # the per-token-head rows, their scales) written.
    written = 2 * num_tokens * num_heads * last_dim * key_cache.element_size()
    read = sum(t.numel() * t.element_size() for t in (key, value, slots))
    if not fmt.is_per_token_head:
        read += 2 * scale.numel() * scale.element_size()
    return _Setup(key, value, key_cache, value_cache, slots, scale, read + written)


def _op(ops: Any, kind: str, s: _Setup) -> Callable[[], None]:
    def op() -> None:
        ops.reshape_and_cache_flash(
            s.key, s.value, s.key_cache, s.value_cache, s.slots, kind, s.scale, s.scale
        )

    return op


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
    if fmt.cache_kind is CacheKind.INT4_PER_TOKEN_HEAD:

        def int4_reference() -> None:
            int4_per_token_head_write_cache(s.key, s.key_cache, s.slots)
            int4_per_token_head_write_cache(s.value, s.value_cache, s.slots)

        return "reference int4_per_token_head_write_cache", int4_reference
    if fmt.is_per_token_head:

        def per_token_head_reference() -> None:
            per_token_head_write_cache(s.key, s.key_cache, s.slots, fmt)
            per_token_head_write_cache(s.value, s.value_cache, s.slots, fmt)

        return "reference per_token_head_write_cache", per_token_head_reference
    fp8 = fp8_format_from_cache_dtype(kind)

    def fp8_reference() -> None:
        fp8_write_cache(s.key, s.key_cache, s.slots, s.scale, fp8)
        fp8_write_cache(s.value, s.value_cache, s.slots, s.scale, fp8)

    return "reference fp8_write_cache", fp8_reference


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
    repeats: int = REPEATS,
    warn: Callable[[str], None] | None = None,
) -> list[Row]:
    """Measure every shape of :func:`shapes` on ``device``; returns one :class:`Row` each.

    ``tokens`` defaults to :data:`TOKENS`, or :data:`QUICK_TOKENS` when ``quick`` (which also
    shortens the timing and the roofline copy). Each row is ``repeats`` repeats of (roofline copy,
    op, baseline). Cold cache unless ``warm``: a :class:`~vllm.benchmarks.timing.CacheFlusher`
    runs before every timed call of the op, the baseline and the roofline copy. The load warning,
    if any, goes to ``warn`` (default: one line on stderr). Raises ``ValueError`` for an unknown
    kind, a non-positive token count or repeat count, or a CUDA device without CUDA,
    ``ImportError`` when the compiled extension is not built.
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
    session = Session(
        dev,
        len(todo),
        quick=quick,
        warm=warm,
        repeats=repeats,
        row_time_s=0.05 if quick else 0.3,
        progress=progress,
        warn=warn,
    )
    rows = []
    for kind, num_heads, num_tokens in todo:
        s = _setup(kind, num_tokens, num_heads, dev)
        op = _op(ops, kind, s)
        baseline_name, baseline = _baseline(kind, s)
        before_op = before_baseline = None
        if session.flush is not None:
            # An independent copy of the problem: calling it after the flush re-warms the code
            # path, not the timed call's buffers.
            other = _setup(kind, num_tokens, num_heads, dev)
            before_op = then(session.flush, _op(ops, kind, other))
            before_baseline = then(session.flush, _baseline(kind, other)[1])
        # The reference codecs are slow: three calls per repeat are enough for a median.
        base_runs = 3 if lookup(kind).is_quantized else 2000
        m = session.measure(
            Timed(op, 2000, before_op), s.bytes_moved, Timed(baseline, base_runs, before_baseline)
        )
        assert m.baseline_s is not None
        row = Row(
            kind=kind,
            num_tokens=num_tokens,
            num_heads=num_heads,
            head_size=HEAD_SIZE,
            device=str(dev),
            op_us=m.op_s * 1e6,
            baseline=baseline_name,
            baseline_us=m.baseline_s * 1e6,
            bytes_moved=s.bytes_moved,
            op_gbps=s.bytes_moved / m.op_s / 1e9,
            roofline_gbps=m.roofline_gbps,
            pct_roofline=m.pct_roofline,
            speedup_vs_baseline=m.baseline_s / m.op_s,
            mode=session.mode,
            **noise.stats_of(m),
        )
        rows.append(row)
        session.row_done(
            f"{kind:6s} H={num_heads:<3d} T={num_tokens:<6d} {row.op_us:10.1f} us "
            f"±{row.op_spread_pct:.0f}% {row.op_gbps:7.2f} GB/s {row.pct_roofline:5.1f}% roofline "
            f"{row.speedup_vs_baseline:7.1f}x {baseline_name} {' '.join(row.flags)}".rstrip(),
        )
    return rows


def to_markdown(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, then the notes of :func:`~vllm.benchmarks.noise.notes`
    (statistic, flags' legend, load warning); the header names the cache mode."""
    mode = rows[0].mode if rows else "cold"
    lines = [
        f"| kind | H | tokens | op (µs, {mode}, median) | spread % | baseline "
        f"| baseline (µs, {mode}) | MB moved (read + written) | GB/s | % of copy roofline "
        "| × baseline | flags |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.num_heads} | {r.num_tokens} | {r.op_us:.1f} | {r.op_spread_pct:.1f} "
            f"| {r.baseline} | {r.baseline_us:.1f} | {r.bytes_moved / 1e6:.3f} | {r.op_gbps:.2f} "
            f"| {r.pct_roofline:.1f} | {r.speedup_vs_baseline:.1f} | {', '.join(r.flags)} |"
        )
    return "\n".join([*lines, "", *noise.notes(rows)]) + "\n"


def to_json(rows: Sequence[Row]) -> dict[str, Any]:
    """The rows with the run's device, cache mode, torch version, CPU threads, roofline (median
    GB/s of every copy, read + written bytes) and :func:`~vllm.benchmarks.noise.run_json`'s
    repeats, flags and load."""
    mode = rows[0].mode if rows else None
    return {
        "benchmark": "reshape_and_cache_flash",
        "device": rows[0].device if rows else None,
        **run_fields(rows, "read + written"),
        "flush_bytes": flush_bytes(torch.device(rows[0].device)) if mode == "cold" else None,
        "rows": [noise.row_json(r) for r in rows],
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
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=REPEATS,
        help=f"repeats per row, each a roofline copy, the op and the baseline (default {REPEATS})",
    )
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the rows as a Markdown table")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(done: int, total: int, msg: str) -> None:
        print(f"[{done}/{total}] {msg}", file=sys.stderr, flush=True)

    rows = run(args.device, args.kinds, args.tokens, args.quick, progress, args.warm, args.repeats)
    table = to_markdown(rows)
    print(table, end="")
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
