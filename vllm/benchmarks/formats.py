"""Write and decode throughput of every cache format with a reference codec (``vllm-kv bench
--op formats``), v0.33's formats included.

For each format and shape, two rows: ``write`` (bf16 K/V ``[T, H, 128]`` into scattered cache
slots) and ``decode`` (the written slots back to K/V). Each row times the implementation that
exists for the format on this machine and names it in its ``impl`` column:

- ``compiled op``: ``reshape_and_cache_flash`` of the extension, for a format it writes
  (:attr:`~vllm.kv_quant.formats.KVCacheFormat.has_kernel`), or the extension's packed-slot
  store (TurboQuant's four presets, ``ultraquant_4bit``: :mod:`vllm._packed_cache_ops`);
- ``reference codec``: the pure-torch codec (:mod:`vllm.kv_quant.codecs`, or the packed K+V
  slot codecs of :mod:`vllm.kv_quant.slot_codecs`): a correctness reference, far from what a
  kernel reaches, so that nobody reads its GB/s as a kernel's.

Decoding is always the reference codec's (no compiled reader is exposed per format). Bytes are
counted as the roofline copy counts them, read plus written: for a write the bf16 K/V and the
slot mapping read and the cache bytes written; for a decode the cache bytes read and the fp32
K/V written (whole pages for the per-side formats, whose block scales may span a page).
Timing, the roofline copy next to every row, the flags and the cold/warm modes are
:mod:`vllm.benchmarks.timing`'s and :mod:`vllm.benchmarks.noise`'s, as for the other benches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm.benchmarks import noise
from vllm.benchmarks.timing import REPEATS, Progress, Session, Timed, run_fields
from vllm.kv_quant.codecs import codec_for, has_codec
from vllm.kv_quant.formats import formats, lookup
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM, is_packed, slot_codec

__all__ = ["FORMAT_KINDS", "Row", "format_table", "run", "to_json"]

FORMAT_KINDS: tuple[str, ...] = tuple(
    f.name
    for f in formats()
    if f.is_quantized and not f.mla_only and (has_codec(f) or is_packed(f))
)
"""Every quantized format with a reference codec, per side or packed (``nvfp4_ds_mla``'s MLA
record excluded), in the registry's order."""

HEAD_SIZE = 128
BLOCK_SIZE = 16
NUM_HEADS = 8
TOKENS = (16, 256, 4096)
QUICK_TOKENS = (16, 256)
COMPILED = "compiled op"
REFERENCE = "reference codec"


@dataclasses.dataclass
class Row(noise.RepeatStats):
    """One stage (``write`` or ``decode``) of one format and shape; times are medians (µs)."""

    kind: str
    stage: str
    impl: str
    num_tokens: int
    num_heads: int
    head_size: int
    device: str
    op_us: float
    bytes_moved: int
    op_gbps: float
    roofline_gbps: float
    pct_roofline: float
    mode: str = "cold"


@dataclasses.dataclass
class _Problem:
    """Callables of one shape: ``write`` fills the cache, ``decode`` reads it back; the bytes
    each moves (read + written) and the writer's implementation."""

    write: Callable[[], None]
    decode: Callable[[], Any]
    write_bytes: int
    decode_bytes: int
    impl: str


def _problem(kind: str, num_tokens: int, device: torch.device) -> _Problem:
    fmt = lookup(kind)
    gen = torch.Generator().manual_seed(0)
    shape = (num_tokens, NUM_HEADS, HEAD_SIZE)
    key = torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    value = torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)
    num_blocks = -(-num_tokens // BLOCK_SIZE) + 1
    pages = torch.randperm(num_blocks, generator=gen)
    t = torch.arange(num_tokens)
    slots = (pages[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE).to(device)
    block, offset = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    inputs = 2 * key.numel() * key.element_size() + slots.numel() * slots.element_size()
    outputs = 2 * key.numel() * 4  # decoded fp32 K and V
    if is_packed(fmt):
        codec = slot_codec(fmt, HEAD_SIZE, OCTAVE_CHECK_ROPE_DIM)
        cache = torch.zeros(
            num_blocks, BLOCK_SIZE, NUM_HEADS, codec.slot_bytes, dtype=torch.uint8, device=device
        )

        def write_packed() -> None:
            encoded = codec.encode(key, value)
            cache[block, offset, :, : encoded.shape[-1]] = encoded

        from vllm._packed_cache_ops import compiled_packed_store  # loads the extension

        store = compiled_packed_store(fmt, HEAD_SIZE, device)
        compiled = (lambda: store(key, value, cache, slots)) if store else None
        cache_bytes = num_tokens * NUM_HEADS * codec.slot_bytes
        return _Problem(
            compiled or write_packed,
            lambda: codec.decode(cache[block, offset]),
            inputs + cache_bytes,
            cache_bytes + outputs,
            COMPILED if compiled else REFERENCE,
        )
    side_codec = codec_for(fmt)
    assert fmt.storage_dtype is not None
    side_shape = (num_blocks, BLOCK_SIZE, NUM_HEADS, fmt.last_dim(HEAD_SIZE))
    key_cache = torch.zeros(side_shape, dtype=fmt.storage_dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    scale = torch.full((1,), 0.01, device=device)
    compiled = fmt.has_kernel and fmt.cache_kind is not None

    def write_sides() -> None:
        if compiled:
            from vllm import _custom_ops as ops  # the extension, loaded on the first call

            ops.reshape_and_cache_flash(
                key, value, key_cache, value_cache, slots, kind, scale, scale
            )
        else:
            side_codec.write(key, key_cache, slots, scale, None)
            side_codec.write(value, value_cache, slots, scale, None)

    def decode_sides() -> tuple[torch.Tensor, torch.Tensor]:
        # Whole pages: block scales may be interleaved over a page's tokens.
        return tuple(  # type: ignore[return-value]
            side_codec.read(side, scale, HEAD_SIZE, None, torch.float32)
            for side in (key_cache, value_cache)
        )

    row_bytes = NUM_HEADS * side_shape[-1] * key_cache.element_size()
    slots_held = num_blocks * BLOCK_SIZE
    return _Problem(
        write_sides,
        decode_sides,
        inputs + 2 * num_tokens * row_bytes,
        2 * slots_held * (row_bytes + NUM_HEADS * HEAD_SIZE * 4),
        COMPILED if compiled else REFERENCE,
    )


def run(
    device: str = "cpu",
    kinds: Sequence[str] = FORMAT_KINDS,
    tokens: Sequence[int] | None = None,
    quick: bool = False,
    progress: Progress | None = None,
    warm: bool = False,
    repeats: int = REPEATS,
) -> list[Row]:
    """Measure the write and the decode of each of ``kinds`` at ``H = 8``, ``D = 128`` for each
    token count (default :data:`TOKENS`, :data:`QUICK_TOKENS` when ``quick``); returns two
    :class:`Row` per (kind, token count). ``ValueError`` for a kind not in
    :data:`FORMAT_KINDS` or a non-positive token count."""
    if tokens is None:
        tokens = QUICK_TOKENS if quick else TOKENS
    if unknown := [k for k in kinds if k not in FORMAT_KINDS]:
        raise ValueError(f"kinds: expected some of {', '.join(FORMAT_KINDS)}, got {unknown}")
    if any(t <= 0 for t in tokens):
        raise ValueError(f"tokens: expected positive token counts, got {list(tokens)}")
    dev = torch.device(device)
    todo = [(kind, count) for kind in kinds for count in tokens]
    session = Session(
        dev,
        2 * len(todo),
        quick=quick,
        warm=warm,
        repeats=repeats,
        row_time_s=0.05 if quick else 0.3,
        progress=progress,
    )
    rows = []
    for kind, count in todo:
        problem = _problem(kind, count, dev)
        problem.write()  # the decode reads what the write stored
        stages = (
            ("write", problem.write, problem.write_bytes, problem.impl),
            ("decode", problem.decode, problem.decode_bytes, REFERENCE),
        )
        for stage, fn, nbytes, impl in stages:
            # The reference codecs are slow: a few calls per repeat give the median.
            m = session.measure(Timed(fn, 2000 if impl == COMPILED else 3), nbytes, None)
            row = Row(
                kind=kind,
                stage=stage,
                impl=impl,
                num_tokens=count,
                num_heads=NUM_HEADS,
                head_size=HEAD_SIZE,
                device=str(dev),
                op_us=m.op_s * 1e6,
                bytes_moved=nbytes,
                op_gbps=nbytes / m.op_s / 1e9,
                roofline_gbps=m.roofline_gbps,
                pct_roofline=m.pct_roofline,
                mode=session.mode,
                **noise.stats_of(m),
            )
            rows.append(row)
            session.row_done(
                f"{kind} {stage} T={count} {row.op_gbps:.3f} GB/s ({impl})",
            )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """Fixed-width table: kind, stage, implementation, tokens, median µs, spread %, GB/s, % of
    the roofline copy, flags; the notes under it say what a reference codec's figure is."""
    headers = ["kind", "stage", "impl", "tokens", "median us", "spread %", "GB/s", "% roofline"]
    headers.append("flags")
    body = [
        [
            r.kind,
            r.stage,
            r.impl,
            str(r.num_tokens),
            f"{r.op_us:.1f}",
            f"{r.op_spread_pct:.1f}",
            f"{r.op_gbps:.3f}",
            f"{r.pct_roofline:.2f}",
            ",".join(r.flags),
        ]
        for r in rows
    ]
    title = (
        f"cache formats, write and decode, H={NUM_HEADS} D={HEAD_SIZE}, on {rows[0].device}, "
        f"{rows[0].mode} cache; {noise.roofline_caption(rows)}"
    )
    table = noise.fixed_width(headers, body, left={0, 1, 2, len(headers) - 1})
    caveat = (
        f"'{REFERENCE}' rows time the pure-torch reference codec, a correctness reference, not "
        "a kernel's throughput: every decode, and the writes no compiled kernel takes yet."
    )
    return "\n".join([title, "", table, "", caveat, *noise.notes(rows)])


def to_json(rows: Sequence[Row]) -> dict[str, Any]:
    """The rows with the run's device, cache mode, torch version and the noise fields."""
    return {
        "benchmark": "cache formats: write and decode",
        "device": rows[0].device if rows else None,
        **run_fields(rows, "read + written"),
        "rows": [noise.row_json(r) for r in rows],
    }
