"""Decode benchmark of the Triton attention backend (``TRITON_ATTN``) reading each cache format.

Rows: decode (one query token per sequence) at 8k context, batch 1 and 32, for every format of
the CPU attention benchmark (:data:`vllm.benchmarks.attention.FORMATS`: bf16, FP8 e4m3, NVFP4,
INT8 / FP8 per-token-head) at its model shape (32 query heads, 8 KV heads of 128, pages of 16
tokens, bf16 queries). Per row: median µs, GB/s of bytes moved (the cache bytes of every key read,
K and V with their scales, plus query read and output written:
:func:`vllm.benchmarks.attention.bytes_moved`), % of the device's copy bandwidth measured next
to the row in the same run, time relative to the bf16 row of the same shape, and FlashInfer's
batch decode on the same cache as the baseline where ``flashinfer`` imports (bf16 and FP8
e4m3). Cold L2 by default (flushed before every timed call), repeats, spreads and flags as in
:mod:`vllm.benchmarks.timing` / :mod:`vllm.benchmarks.noise`. The kernels are timed through
:func:`~vllm.v1.attention.ops.triton_unified_attention.plan_paged_attention` (launches prepared
once), so host-side checks stay out of the numbers.

Goal on an H100: >= 80% of the copy bandwidth at batch 32, NVFP4 at <= 0.35x the bf16 time.

Usage: ``python benchmarks/kernels/benchmark_triton_attention.py --json out.json --markdown
out.md``; ``--quick`` runs a tiny shape (context 64) on the CPU under Triton's interpreter (or
on the GPU), which the tests use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm.benchmarks import attention, noise  # noqa: E402
from vllm.benchmarks.timing import REPEATS, Session, Timed, mode_caption, then  # noqa: E402

CONTEXT = 8192
SHAPES = ((1, CONTEXT), (32, CONTEXT))
"""(batch, context) of the rows."""
QUICK_SHAPES = ((1, 64),)


@dataclasses.dataclass(kw_only=True)
class TritonDecodeRow(noise.RepeatStats):
    """One (format, batch, context) decode measurement; ``baseline`` is FlashInfer's decode."""

    format: str
    batch: int
    context: int
    device: str
    num_splits: int
    op_us: float
    bytes_moved: int
    op_gbps: float
    roofline_gbps: float
    pct_roofline: float
    flashinfer_us: float | None
    time_vs_flashinfer: float | None
    time_vs_bf16: float | None
    mode: str = "cold"


@dataclasses.dataclass
class _Problem:
    launch: Callable[[], None]
    num_splits: int
    flashinfer: Callable[[], None] | None


def _flashinfer_decode(
    fmt: str, kv_cache: torch.Tensor, table: torch.Tensor, query: torch.Tensor, context: int
) -> Callable[[], None] | None:
    """FlashInfer's paged decode on the same NHD cache (bf16 and FP8 e4m3 only), or ``None``
    when flashinfer does not import or cannot run it here."""
    if fmt not in ("auto", "fp8") or query.device.type != "cuda":
        return None
    try:
        import flashinfer

        batch, pages = table.shape
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=query.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=query.device) * pages
        last = torch.full((batch,), (context - 1) % attention.BLOCK_SIZE + 1, dtype=torch.int32)
        cache = kv_cache if fmt == "auto" else kv_cache.view(torch.float8_e4m3fn)
        wrapper.plan(
            indptr,
            table.flatten(),
            last.to(query.device),
            attention.NUM_HEADS,
            attention.NUM_KV_HEADS,
            attention.HEAD_SIZE,
            attention.BLOCK_SIZE,
            q_data_type=query.dtype,
            kv_data_type=cache.dtype,
        )

        def run() -> None:
            wrapper.run(query, cache)

        run()
        return run
    except Exception as exc:  # an optional baseline: any failure leaves the row without it
        print(f"flashinfer baseline unavailable for {fmt}: {type(exc).__name__}: {exc}")
        return None


def _problem(fmt: str, batch: int, context: int, device: torch.device) -> _Problem:
    """The CPU attention benchmark's random cache (valid codes) moved to ``device``, and the
    prepared Triton launches over it."""
    from vllm.v1.attention.backends import TritonAttentionMetadata
    from vllm.v1.attention.ops.triton_unified_attention import plan_paged_attention

    cpu = attention._problem(fmt, batch, 1, context)
    kv_cache = cpu.kv_cache.to(device)
    table = cpu.metadata.block_table.to(device)
    metadata = TritonAttentionMetadata.build(
        [context] * batch, [1] * batch, table, attention.BLOCK_SIZE
    )
    # The interpreter's bf16 arithmetic is wrong: fp16 queries there (timing only).
    query_dtype = attention.QUERY_DTYPE if device.type == "cuda" else torch.float16
    query = cpu.query.to(device, query_dtype)
    out = torch.empty_like(query)
    key_cache, value_cache = kv_cache.unbind(1)
    scale = cpu.layer._k_scale.to(device)
    launch = plan_paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        table,
        metadata.seq_lens,
        metadata.query_start_loc,
        fmt,
        scale,
        scale,
        attention.HEAD_SIZE**-0.5,
        1,
        context,
    )
    launch()  # compile / first touch outside the timed calls
    return _Problem(
        launch, launch.num_splits, _flashinfer_decode(fmt, kv_cache, table, query, context)
    )


def run(
    formats: Sequence[str] = attention.FORMATS,
    quick: bool = False,
    warm: bool = False,
    repeats: int = REPEATS,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[TritonDecodeRow]:
    """Measure every shape for every format on the GPU (the CPU under the interpreter when
    there is none); ``ValueError`` for an unknown format or a non-positive repeat count."""
    if unknown := sorted(set(formats) - set(attention.FORMATS)):
        raise ValueError(
            f"formats: unknown {unknown}, expected some of {', '.join(attention.FORMATS)}"
        )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ordered = [f for f in attention.FORMATS if f in formats]
    todo = [(shape, fmt) for shape in (QUICK_SHAPES if quick else SHAPES) for fmt in ordered]
    session = Session(
        device,
        len(todo),
        quick=quick,
        warm=warm,
        repeats=repeats,
        row_time_s=0.05 if quick else 0.2,
        progress=progress,
    )
    rows: list[TritonDecodeRow] = []
    bf16_us: dict[tuple[int, int], float] = {}
    for (batch, context), fmt in todo:
        problem = _problem(fmt, batch, context, device)
        before = before_base = None
        if session.flush is not None:  # re-warm the code path on an independent small problem
            other = _problem(fmt, 1, attention.BLOCK_SIZE, device)
            before = then(session.flush, other.launch)
            before_base = session.flush
        baseline = None
        if problem.flashinfer is not None:
            baseline = Timed(problem.flashinfer, 3 if quick else 200, before_base)
        nbytes = attention.bytes_moved(fmt, batch, 1, context)
        m = session.measure(Timed(problem.launch, 3 if quick else 200, before), nbytes, baseline)
        if fmt == "auto":
            bf16_us[(batch, context)] = m.op_s * 1e6
        base_us = None if m.baseline_s is None else m.baseline_s * 1e6
        row = TritonDecodeRow(
            format=fmt,
            batch=batch,
            context=context,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            num_splits=problem.num_splits,
            op_us=m.op_s * 1e6,
            bytes_moved=nbytes,
            op_gbps=nbytes / m.op_s / 1e9,
            roofline_gbps=m.roofline_gbps,
            pct_roofline=m.pct_roofline,
            flashinfer_us=base_us,
            time_vs_flashinfer=None if base_us is None else m.op_s * 1e6 / base_us,
            time_vs_bf16=(
                m.op_s * 1e6 / bf16_us[(batch, context)] if (batch, context) in bf16_us else None
            ),
            mode=session.mode,
            **noise.stats_of(m),
        )
        rows.append(row)
        session.row_done(
            f"{fmt} b={batch} ctx={context}: {row.op_us:.0f} us {row.op_gbps:.1f} GB/s "
            f"{row.pct_roofline:.0f}% {' '.join(row.flags)}".rstrip()
        )
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def to_markdown(rows: Sequence[TritonDecodeRow]) -> str:
    """The rows as a Markdown table, then the flag and load notes."""
    mode = rows[0].mode if rows else "cold"
    lines = [
        f"| format | batch | context | splits | µs ({mode}, median) | spread % | MB moved "
        "| GB/s | % of copy roofline | time / bf16 | FlashInfer µs | time / FlashInfer | flags |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.format} | {r.batch} | {r.context} | {r.num_splits} | {r.op_us:.1f} "
            f"| {r.op_spread_pct:.1f} | {r.bytes_moved / 1e6:.2f} | {r.op_gbps:.1f} "
            f"| {r.pct_roofline:.1f} | {_fmt(r.time_vs_bf16, '.2f')} "
            f"| {_fmt(r.flashinfer_us, '.1f')} | {_fmt(r.time_vs_flashinfer, '.2f')} "
            f"| {', '.join(r.flags)} |"
        )
    return "\n".join([*lines, "", *noise.notes(rows)]) + "\n"


def to_json(rows: Sequence[TritonDecodeRow]) -> dict[str, Any]:
    """The rows with the run's settings and :func:`~vllm.benchmarks.noise.run_json`."""
    mode = rows[0].mode if rows else None
    return {
        "benchmark": "triton_attention_decode",
        "backend": "TRITON_ATTN",
        "baseline": "flashinfer BatchDecodeWithPagedKVCacheWrapper (where it imports)",
        "model": {
            "num_heads": attention.NUM_HEADS,
            "num_kv_heads": attention.NUM_KV_HEADS,
            "head_size": attention.HEAD_SIZE,
            "block_size": attention.BLOCK_SIZE,
            "query_dtype": str(attention.QUERY_DTYPE),
        },
        "mode": mode,
        "mode_description": mode_caption(mode) if mode else None,
        "bytes_counted": "cache read + query read + output written",
        "torch": torch.__version__,
        "interpreted": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        **noise.run_json(rows),
        "rows": [noise.row_json(r) for r in rows],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", nargs="+", default=list(attention.FORMATS))
    parser.add_argument("--quick", action="store_true", help="a tiny shape (tests, CPU)")
    parser.add_argument("--warm", action="store_true", help="no cache flush between calls")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table here")
    args = parser.parse_args(argv)
    try:
        rows = run(args.formats, quick=args.quick, warm=args.warm, repeats=args.repeats)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = to_markdown(rows)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table)
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(rows), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
