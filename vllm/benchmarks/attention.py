"""Benchmark of the CPU attention backend (``CPU_ATTN``) reading each cache format: decode
(batch x context) and prefill, per format; time, GB/s of cache read, % of a copy roofline timed
next to every row, the speed-up over the reference backend measured in the same run, and each
quantized format's time relative to bf16 at equal shape.

Model shape: 32 query heads, 8 KV heads of 128 (GQA 4), pages of 16 tokens, bf16 queries.
Formats: the cache-write benchmark's kinds (one per quantization mode of the registry): ``auto``
(bf16 cache), ``fp8`` (e4m3, per-tensor scale), ``nvfp4`` (the writer's default block-scale
layout, interleave4 at this shape), ``int8_per_token_head`` / ``fp8_per_token_head`` (rows with
their own inline scales), ``int4_per_token_head``; and, when named, the packed-slot formats
(TurboQuant's presets, ``ultraquant_4bit``, Octave's, its block K with 64 rotary dims), whose
caches hold slots the codec wrote (a pool of them repeated: valid norms and scales).
Each query row of a packed layer is rotated into the key frame per call (part of the time).
Encodings with key options (an encoding id such as ``nvfp4_mse+offset+prerope+sink`` or
``fp8_e4m3/head+hadamard+offset``, when named) read caches their own writer filled from random
K / V with a random key offset and a RoPE table of the context's length; their rows also give
the time over their base format's (``nvfp4`` or ``fp8``) at the same shape when it runs too.
Bytes counted per call: the cache bytes of every key position read (K and V, NVFP4 block
scales and per-token-head row scales included) plus the query read and the output written; the
roofline copy counts read + written bytes the same way. Cold cache by default (the last-level
cache is flushed before every timed call, see :mod:`vllm.benchmarks.reshape_and_cache_flash`);
``warm=True`` repeats calls on cache-resident buffers. The reference backend is slow (pure
torch): it is timed only on the shapes whose batch x context is at most
:data:`REFERENCE_MAX_TOKENS`, one call per repeat.

Repeats, medians, spreads, flags and the load warning as for ``reshape_and_cache_flash``
(:mod:`vllm.benchmarks.noise`): each row is :data:`~vllm.benchmarks.timing.REPEATS` repeats of
(roofline copy, op, reference), its times the medians, its % of roofline the median of each
repeat's op against the copy timed just before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm.benchmarks import noise
from vllm.benchmarks.reshape_and_cache_flash import KINDS
from vllm.benchmarks.timing import (
    REPEATS,
    Progress,
    Session,
    Timed,
    flush_bytes,
    run_fields,
    then,
)
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import find_format, lookup
from vllm.kv_quant.formats import formats as registered_formats
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, is_packed, slot_codec

PACKED_FORMATS: tuple[str, ...] = tuple(f.name for f in registered_formats() if is_packed(f))
FORMATS: tuple[str, ...] = (*KINDS, *PACKED_FORMATS)
"""The ``kv_cache_dtype`` strings that can be benchmarked (``fp8`` is e4m3): the cache-write
kinds (the default), then the packed-slot formats."""
PACKED_POOL = 4096
"""Distinct slots the codec writes for a packed cache, repeated over its pages."""
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_SIZE = 16
QUERY_DTYPE = torch.bfloat16

DECODE_SHAPES = ((1, 1024), (1, 8192), (1, 32768), (8, 8192), (8, 32768), (64, 1024), (64, 4096))
"""(batch, context) of the decode rows: batch 1..64, context 1k..32k, at most 256k tokens."""
PREFILL_SHAPES = ((512, 2048), (2048, 2048))
"""(query tokens, context) of the one-sequence prefill rows (chunked: query < context)."""
QUICK_DECODE_SHAPES = ((1, 1024), (1, 8192), (8, 1024))
QUICK_PREFILL_SHAPES = ((128, 512),)
REFERENCE_MAX_TOKENS = 8192
"""The reference backend is timed on shapes of at most this many cached tokens in all."""


@dataclasses.dataclass
class AttentionRow(noise.RepeatStats):
    """One measurement of CPU_ATTN on one (phase, format, batch, context) shape; medians of the
    repeats as in :class:`vllm.benchmarks.reshape_and_cache_flash.Row` (the reference backend is
    its baseline)."""

    phase: str  # "decode" or "prefill"
    format: str
    batch: int
    query_tokens: int  # per sequence
    context: int  # tokens per sequence in the cache
    device: str
    op_us: float
    bytes_moved: int
    op_gbps: float
    roofline_gbps: float
    pct_roofline: float
    reference_us: float | None
    speedup_vs_reference: float | None
    time_vs_bf16: float | None  # op time / the bf16 (auto) op time of the same shape
    threads: int
    time_vs_base: float | None = None  # key options: op time / its base format's, same shape
    mode: str = "cold"
    block_size: int = BLOCK_SIZE  # tokens per page


def transform_encoding(fmt: str) -> KVCacheEncoding | None:
    """The encoding an id with key options names (``ValueError`` for an id that is neither
    one nor a format of :data:`FORMATS`); None for a format of :data:`FORMATS`."""
    if fmt in FORMATS:
        return None
    encoding = KVCacheEncoding.parse(fmt, "formats", include_mla_only=False)
    if encoding.key.is_identity:
        raise ValueError(
            f"formats: expected one of {', '.join(FORMATS)} or an encoding id with key options "
            f"(+hadamard, +offset, +prerope, +sink), got {fmt!r}"
        )
    return encoding


def base_kind(encoding: KVCacheEncoding) -> str:
    """The format of :data:`KINDS` whose reader an encoding with key options extends (``nvfp4``
    for every NVFP4 variant, ``fp8`` for e4m3, ...)."""
    mode = encoding.format.quant_mode
    return next(k for k in KINDS if lookup(k).quant_mode == mode)


def _slot_bytes(fmt: str) -> int | None:
    """Bytes of a packed format's slot at this head size; None for a per-side format."""
    found = find_format(fmt)
    if found is None or not is_packed(found):
        return None
    return slot_codec(found, HEAD_SIZE, OCTAVE_CHECK_ROPE_DIM).slot_bytes


def cache_bytes_per_token(fmt: str, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of K plus V per cached token (all KV heads; an encoding's key sink rows shared by
    the ``block_size`` tokens of a page)."""
    if (encoding := transform_encoding(fmt)) is not None:
        page = encoding.page_bytes(block_size, NUM_KV_HEADS, HEAD_SIZE, HEAD_SIZE)
        return -(-page // block_size)
    if (slot := _slot_bytes(fmt)) is not None:
        return NUM_KV_HEADS * slot
    cache_format = lookup(fmt)
    element_bytes = cache_format.resolve_storage_dtype(QUERY_DTYPE).itemsize
    return 2 * NUM_KV_HEADS * cache_format.last_dim(HEAD_SIZE) * element_bytes


def bytes_moved(
    fmt: str, batch: int, query_tokens: int, context: int, block_size: int = BLOCK_SIZE
) -> int:
    """Cache bytes read plus query read plus output written by one call."""
    io = 2 * batch * query_tokens * NUM_HEADS * HEAD_SIZE * QUERY_DTYPE.itemsize
    return batch * context * cache_bytes_per_token(fmt, block_size) + io


@dataclasses.dataclass
class _Problem:
    impl: Any
    reference: Any
    layer: Any
    kv_cache: torch.Tensor
    metadata: Any
    query: torch.Tensor

    def op(self) -> None:
        self.impl.forward(self.layer, self.query, None, None, self.kv_cache, self.metadata)

    def reference_op(self) -> None:
        self.reference.forward(self.layer, self.query, None, None, self.kv_cache, self.metadata)


def _problem(
    fmt: str, batch: int, query_tokens: int, context: int, block_size: int = BLOCK_SIZE
) -> _Problem:
    """Random cache contents (valid codes: no NaN bytes) for ``batch`` sequences of ``context``
    tokens on shuffled pages of ``block_size`` tokens, and their last ``query_tokens`` queries."""
    from vllm.v1.attention.backends import AttentionLayerScales, ReferenceAttentionImpl
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionImpl

    pages = (context + block_size - 1) // block_size
    num_blocks = batch * pages
    table = torch.randperm(num_blocks).reshape(batch, pages).to(torch.int32)
    metadata = CPUAttentionBackend.get_metadata_cls().build(
        [context] * batch, [query_tokens] * batch, table, block_size
    )
    query = torch.randn(batch * query_tokens, NUM_HEADS, HEAD_SIZE, dtype=QUERY_DTYPE)
    if transform_encoding(fmt) is not None:
        return _transform_problem(fmt, batch, context, table, metadata, query, block_size)
    cache_format = lookup(fmt)
    shape = CPUAttentionBackend.get_kv_cache_shape(
        num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE, fmt
    )
    if is_packed(cache_format):
        kv_cache = _packed_cache(fmt, shape)
    elif not cache_format.is_quantized:
        kv_cache = torch.randn(shape, dtype=QUERY_DTYPE)
    else:
        kv_cache = torch.randint(0, 256, shape, dtype=torch.uint8)
        if cache_format.is_nvfp4:
            data = NUM_KV_HEADS * block_size * HEAD_SIZE // 2
            pages_view = kv_cache.view(num_blocks, 2, -1)
            pages_view[:, :, data:] = torch.randint(0x30, 0x40, pages_view[:, :, data:].shape)
        else:
            kv_cache[(kv_cache & 0x7F) == 0x7F] = 0x38
        if cache_format.is_per_token_head:  # each row's scale (word): a finite positive fp32
            row_scales = torch.rand(shape[:-1]) * 0.02 + 0.005
            kv_cache[..., shape[-1] - 4 :] = row_scales.unsqueeze(-1).view(torch.uint8)
        kv_cache = kv_cache.view(cache_format.storage_dtype)  # int8 for int8_per_token_head
    kwargs = dict(num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=fmt)
    impl = CPUAttentionImpl(NUM_HEADS, HEAD_SIZE, **kwargs)
    reference = ReferenceAttentionImpl(NUM_HEADS, HEAD_SIZE, **kwargs)
    scale = torch.tensor([0.05])
    return _Problem(impl, reference, AttentionLayerScales(scale, scale), kv_cache, metadata, query)


def _transform_problem(
    fmt: str,
    batch: int,
    context: int,
    table: torch.Tensor,
    metadata: Any,
    query: torch.Tensor,
    block_size: int,
) -> _Problem:
    """An encoding with key options: the cache its own writer filled from random K / V (a
    random key offset, a RoPE table of the context's length), every page valid."""
    from vllm.accuracy.cache_io import allocate_cache
    from vllm.accuracy.formats import parse_format
    from vllm.kv_quant import KeyRope
    from vllm.v1.attention.backends import AttentionLayerScales, ReferenceAttentionImpl
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionImpl

    encoding = transform_encoding(fmt)
    assert encoding is not None
    rope = KeyRope.from_base(HEAD_SIZE, context) if encoding.key.prerope else None
    kwargs = dict(num_kv_heads=NUM_KV_HEADS, kv_cache_dtype=fmt, key_rope=rope)
    impl = CPUAttentionImpl(NUM_HEADS, HEAD_SIZE, **kwargs)
    reference = ReferenceAttentionImpl(NUM_HEADS, HEAD_SIZE, **kwargs)
    if encoding.key.offset:
        offset = torch.randn(NUM_KV_HEADS, HEAD_SIZE)
        impl.set_key_offset(offset)
        reference.set_key_offset(offset)
    scale = torch.tensor(0.05)
    layer = AttentionLayerScales(scale, scale)
    kv_cache = allocate_cache(parse_format(fmt), table.numel(), block_size, NUM_KV_HEADS, HEAD_SIZE)
    positions = torch.arange(context).repeat(batch)
    pages = table.to(torch.int64)[:, positions[:context] // block_size]  # [batch, context]
    slots = (pages * block_size + positions[:context] % block_size).reshape(-1)
    for start in range(0, slots.numel(), 16384):  # the writer's own bytes, in chunks
        part = slice(start, start + 16384)
        n = slots[part].numel()
        key = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, dtype=QUERY_DTYPE)
        value = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, dtype=QUERY_DTYPE)
        impl.do_kv_cache_update(layer, key, value, kv_cache, slots[part], positions=positions[part])
    return _Problem(impl, reference, layer, kv_cache, metadata, query)


def _packed_cache(fmt: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A logical ``(B, H, N, slot)`` cache stored block, token, head, slot (TURBOQUANT's order),
    each slot one of :data:`PACKED_POOL` the codec wrote from random K / V, drawn at random."""
    codec = slot_codec(lookup(fmt), HEAD_SIZE, OCTAVE_CHECK_ROPE_DIM)
    pool = codec.encode(
        torch.randn(PACKED_POOL, 1, HEAD_SIZE), torch.randn(PACKED_POOL, 1, HEAD_SIZE)
    ).reshape(PACKED_POOL, -1)
    blocks, heads, tokens, slot = shape
    picks = torch.randint(0, PACKED_POOL, (blocks * tokens * heads,))
    return pool[picks].reshape(blocks, tokens, heads, slot).transpose(1, 2)


def shapes(quick: bool = False) -> list[tuple[str, int, int, int]]:
    """(phase, batch, query tokens, context) of every row, each run for every format."""
    decode = QUICK_DECODE_SHAPES if quick else DECODE_SHAPES
    prefill = QUICK_PREFILL_SHAPES if quick else PREFILL_SHAPES
    return [("decode", b, 1, c) for b, c in decode] + [("prefill", 1, q, c) for q, c in prefill]


def run(
    formats: Sequence[str] = KINDS,
    quick: bool = False,
    progress: Progress | None = None,
    warm: bool = False,
    with_reference: bool = True,
    repeats: int = REPEATS,
    warn: Callable[[str], None] | None = None,
    block_size: int = BLOCK_SIZE,
) -> list[AttentionRow]:
    """Measure every shape of :func:`shapes` for every format on the CPU, over pages of
    ``block_size`` tokens; one row each, from ``repeats`` repeats of (roofline copy, op,
    reference). The load warning, if any, goes to ``warn`` (default: one line on stderr).

    Raises ``ValueError`` for an unknown format, a non-positive repeat count or page size,
    ``ImportError`` when the extension is not built."""
    if block_size < 1:
        raise ValueError(f"block_size: expected a positive number of tokens, got {block_size}")
    transforms = [f for f in dict.fromkeys(formats) if transform_encoding(f) is not None]
    from vllm import _custom_ops  # noqa: F401  (ImportError when the extension is not built)

    device = torch.device("cpu")
    ordered = [f for f in FORMATS if f in formats] + transforms
    todo = [(shape, fmt) for shape in shapes(quick) for fmt in ordered]
    session = Session(
        device,
        len(todo),
        quick=quick,
        warm=warm,
        repeats=repeats,
        row_time_s=0.05 if quick else 0.2,
        progress=progress,
        warn=warn,
    )
    rows: list[AttentionRow] = []
    bf16_us: dict[tuple[str, int, int, int], float] = {}
    for (phase, batch, q_tokens, context), fmt in todo:
        problem = _problem(fmt, batch, q_tokens, context, block_size)
        before = before_ref = None
        if session.flush is not None:
            # Re-warm the code path on a small independent problem, not the timed buffers.
            other = _problem(fmt, 1, 1, block_size, block_size)
            before = then(session.flush, other.op)
            before_ref = then(session.flush, other.reference_op)
        reference = None
        if with_reference and batch * context <= REFERENCE_MAX_TOKENS:
            # Slow (pure torch): one call per repeat and no warm-up call, a slow first call
            # being one repeat of several, which the median and the spread ignore.
            reference = Timed(problem.reference_op, 1, before_ref, warmup=False)
        nbytes = bytes_moved(fmt, batch, q_tokens, context, block_size)
        m = session.measure(Timed(problem.op, 500, before), nbytes, reference)
        key = (phase, batch, q_tokens, context)
        if fmt == KINDS[0]:  # auto: the bf16 cache
            bf16_us[key] = m.op_s * 1e6
        row = AttentionRow(
            phase=phase,
            format=fmt,
            batch=batch,
            query_tokens=q_tokens,
            context=context,
            device=str(device),
            op_us=m.op_s * 1e6,
            bytes_moved=nbytes,
            op_gbps=nbytes / m.op_s / 1e9,
            roofline_gbps=m.roofline_gbps,
            pct_roofline=m.pct_roofline,
            reference_us=None if m.baseline_s is None else m.baseline_s * 1e6,
            speedup_vs_reference=None if m.baseline_s is None else m.baseline_s / m.op_s,
            time_vs_bf16=m.op_s * 1e6 / bf16_us[key] if key in bf16_us else None,
            threads=torch.get_num_threads(),
            time_vs_base=_time_vs_base(rows, fmt, key, m.op_s * 1e6),
            mode=session.mode,
            block_size=block_size,
            **noise.stats_of(m),
        )
        rows.append(row)
        ref = "" if row.speedup_vs_reference is None else f" {row.speedup_vs_reference:.0f}x ref"
        session.row_done(
            f"{phase} {fmt:5s} b={batch} q={q_tokens} ctx={context}: {row.op_us:.0f} us "
            f"±{row.op_spread_pct:.0f}% {row.op_gbps:.1f} GB/s {row.pct_roofline:.0f}%{ref} "
            f"{' '.join(row.flags)}".rstrip(),
        )
        del problem
    return rows


def _time_vs_base(
    rows: Sequence[AttentionRow], fmt: str, shape: tuple[str, int, int, int], op_us: float
) -> float | None:
    """An encoding with key options: its time over its base format's row of the same shape."""
    encoding = transform_encoding(fmt)
    if encoding is None:
        return None
    base = base_kind(encoding)
    for row in rows:
        if row.format == base and (row.phase, row.batch, row.query_tokens, row.context) == shape:
            return op_us / row.op_us
    return None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def to_markdown(rows: Sequence[AttentionRow]) -> str:
    """The rows as a Markdown table, then :func:`~vllm.benchmarks.noise.notes`; the header names
    the cache mode."""
    mode = rows[0].mode if rows else "cold"
    lines = [
        f"| phase | format | batch | query | context | µs ({mode}, median) | spread % "
        "| MB read + written | GB/s | % of copy roofline | × reference | time / bf16 "
        "| time / base | flags |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.phase} | {r.format} | {r.batch} | {r.query_tokens} | {r.context} "
            f"| {r.op_us:.1f} | {r.op_spread_pct:.1f} | {r.bytes_moved / 1e6:.2f} "
            f"| {r.op_gbps:.2f} | {r.pct_roofline:.1f} | {_fmt(r.speedup_vs_reference, '.0f')} "
            f"| {_fmt(r.time_vs_bf16, '.2f')} | {_fmt(r.time_vs_base, '.2f')} "
            f"| {', '.join(r.flags)} |"
        )
    return "\n".join([*lines, "", *noise.notes(rows)]) + "\n"


def format_table(rows: Sequence[AttentionRow]) -> str:
    """Fixed-width table for the terminal, titled with the threads, the cache mode and the
    roofline copies' median and range, followed by :func:`~vllm.benchmarks.noise.notes`."""
    headers = [
        "phase",
        "format",
        "batch",
        "query",
        "context",
        "median us",
        "spread %",
        "GB/s",
        "% roofline",
        "x reference",
        "time/bf16",
        "time/base",
        "flags",
    ]
    body = [
        [
            r.phase,
            r.format,
            str(r.batch),
            str(r.query_tokens),
            str(r.context),
            f"{r.op_us:.1f}",
            f"{r.op_spread_pct:.1f}",
            f"{r.op_gbps:.2f}",
            f"{r.pct_roofline:.1f}",
            _fmt(r.speedup_vs_reference, ".0f"),
            _fmt(r.time_vs_bf16, ".2f"),
            _fmt(r.time_vs_base, ".2f"),
            ",".join(r.flags),
        ]
        for r in rows
    ]
    title = (
        f"CPU_ATTN on cpu ({rows[0].threads} threads), {rows[0].mode} cache, pages of "
        f"{rows[0].block_size} tokens; "
        f"{noise.roofline_caption(rows)}"
    )
    table = noise.fixed_width(headers, body, left={0, 1, len(headers) - 1})
    return "\n".join([title, "", table, "", *noise.notes(rows)])


def to_json(rows: Sequence[AttentionRow]) -> dict[str, Any]:
    """The rows with the run's settings (model shape, mode, threads, roofline) and
    :func:`~vllm.benchmarks.noise.run_json`'s repeats, flags and load."""
    mode = rows[0].mode if rows else None
    return {
        "benchmark": "attention",
        "backend": "CPU_ATTN",
        "baseline": "REFERENCE",
        "model": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_size": HEAD_SIZE,
            "block_size": rows[0].block_size if rows else BLOCK_SIZE,
            "query_dtype": str(QUERY_DTYPE),
        },
        **run_fields(rows, "cache read + query read + output written"),
        "flush_bytes": flush_bytes(torch.device("cpu")) if mode == "cold" else None,
        "rows": [noise.row_json(r) for r in rows],
    }


def write_plot(rows: Sequence[AttentionRow], path: str | Path) -> None:
    """Decode GB/s against context (log x), one line per (format, batch), a bar over each point's
    repeats, flagged points circled; the roofline copies' median dashed over their range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[tuple[str, int], list[AttentionRow]] = {}
    for r in rows:
        if r.phase == "decode":
            groups.setdefault((r.format, r.batch), []).append(r)
    for (fmt, batch), group in groups.items():
        group.sort(key=lambda r: r.context)
        style = "-o" if len(group) > 1 else "s"
        noise.plot_rows(ax, [r.context for r in group], group, style, f"{fmt} batch {batch}")
    noise.plot_roofline(ax, rows)
    ax.set_xscale("log")
    ax.set_xlabel(f"context (tokens per sequence); {noise.PLOT_NOTE}")
    ax.set_ylabel("GB/s (cache read)")
    ax.set_title(f"CPU_ATTN decode ({rows[0].mode if rows else 'cold'} cache)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=110)
    plt.close(fig)
