"""Write K/V into a paged cache and read them back, for every format of the check.

The cache is FlashInfer-shaped: logical ``(B, 2, N, H, D')`` (``D' = F(D)`` for NVFP4,
docs/design.md §7), NHD or HND physical order; a packed-slot format's is the REFERENCE and
TURBOQUANT backends' logical ``(B, H, N, slot_bytes)`` stored block, token, head, slot. Each
sequence gets its own pages, drawn in a
seeded random order so that logical and physical page order differ. Unwritten bytes hold seeded
random garbage, so a writer that misses a slot or a reader that looks at the wrong one shows up as
an error.

Writers (``writer=``): ``op`` is the extension's ``vllm._custom_ops.reshape_and_cache_flash``, or
a packed-slot format's own compiled store (:func:`vllm._packed_cache_ops.compiled_packed_store`);
``reference`` the pure-torch codecs of :mod:`vllm.kv_quant`; ``auto`` the op when the extension
is loaded and has a kernel for the device, else the codecs.

Readers (``reader=``, :func:`make_reader`) implement :class:`CacheReader`
(:mod:`vllm.accuracy.paged_cache`): they return the dequantized K/V of the written tokens and the
paged-attention output. :class:`CodecReader` (:mod:`vllm.accuracy.codec_reader`) dequantizes
with :mod:`vllm.kv_quant`; :class:`BackendReader` (:mod:`vllm.accuracy.backend_reader`) runs the
reference attention backend. The reader trusts what the :class:`PagedCache` says (scales, scale
layouts), so a test can corrupt the bytes or those fields between writing and reading.
"""

from __future__ import annotations

import math

import torch

from vllm.accuracy.backend_reader import BackendReader, backend_status
from vllm.accuracy.codec_reader import CodecReader, dequantize_side
from vllm.accuracy.formats import CacheFormat
from vllm.accuracy.paged_cache import CacheReader, PagedCache
from vllm.accuracy.samples import KVSample
from vllm.kv_quant.slot_codecs import compiled_store_op

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "READERS",
    "WRITERS",
    "CacheReader",
    "CodecReader",
    "PagedCache",
    "allocate_cache",
    "assign_slots",
    "dequantize_side",
    "extension_status",
    "make_reader",
    "resolve_writer",
    "write_cache",
]

WRITERS: tuple[str, ...] = ("auto", "op", "reference")
READERS: tuple[str, ...] = ("auto", "backend", "codec")
DEFAULT_BLOCK_SIZE = 16
"""Tokens per page."""


def extension_status() -> tuple[bool, str]:
    """Whether ``reshape_and_cache_flash`` of the compiled extension can be called, and why
    not when it cannot."""
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # ImportError, or the extension failing to load
        return False, f"vllm._custom_ops not importable ({type(e).__name__}: {e})"
    if not hasattr(ops, "reshape_and_cache_flash"):
        return False, "vllm._custom_ops has no reshape_and_cache_flash"
    try:
        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018
    except (AttributeError, RuntimeError) as e:
        return False, f"extension op _C_cache_ops.reshape_and_cache_flash not registered ({e})"
    return True, "extension op loaded"


def resolve_writer(writer: str) -> str:
    """``op`` or ``reference`` for a ``writer`` choice; ``op`` without the extension raises."""
    if writer not in WRITERS:
        raise ValueError(f"writer: expected one of {', '.join(WRITERS)}, got {writer!r}")
    if writer == "reference":
        return writer
    ok, why = extension_status()
    if writer == "op" and not ok:
        raise RuntimeError(
            f"writer: 'op' needs the compiled extension, but {why}; build it with "
            "`pip install --no-build-isolation -e .` or use --writer reference"
        )
    return "op" if ok else "reference"


def _cache_shape(fmt: CacheFormat, num_blocks: int, block_size: int, h: int, d: int) -> tuple:
    return (num_blocks, 2, block_size, h, fmt.cache_last_dim(d))


def has_kernel(fmt: CacheFormat) -> bool:
    """Whether a compiled op writes ``fmt`` (else its codec does): ``reshape_and_cache_flash``,
    or for a packed-slot format its own store (TurboQuant, UltraQuant)."""
    if fmt.is_packed:
        return compiled_store_op(fmt.format) is not None
    return fmt.format.has_kernel and fmt.format.cache_kind is not None


def _packed_cache(
    fmt: CacheFormat,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    device: torch.device | str,
    seed: int,
) -> torch.Tensor:
    """Logical ``(B, H, N, slot_bytes)`` uint8 view of seeded random ``(B, N, H, slot_bytes)``
    pages: the packed-slot cache of the REFERENCE and TURBOQUANT backends."""
    slot = fmt.slot_codec(head_size).slot_bytes
    gen = torch.Generator().manual_seed(seed + 1)
    shape = (num_blocks, block_size, num_kv_heads, slot)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    return raw.to(device).transpose(1, 2)


def _write_packed(
    sample: KVSample,
    fmt: CacheFormat,
    num_blocks: int,
    block_size: int,
    slots: torch.Tensor,
    seed: int,
    writer: str,
) -> tuple[torch.Tensor, str]:
    """A packed-slot cache (:func:`_packed_cache`) with the sample's slots written (one slot per
    token and head holds K and V), and the writer used: the format's compiled store for ``op``
    where the extension has one for the device, else its codec."""
    cache = _packed_cache(
        fmt, num_blocks, block_size, sample.num_kv_heads, sample.head_size, slots.device, seed
    )
    physical = cache.transpose(1, 2)  # (B, N, H, slot), as the stores take it
    if writer == "op":
        from vllm._packed_cache_ops import compiled_packed_store

        store = compiled_packed_store(fmt.format, sample.head_size, slots.device)
        if store is not None:
            store(sample.key, sample.value, physical, slots)
            return cache, "op"
    encoded = fmt.slot_codec(sample.head_size).encode(sample.key, sample.value)
    physical[slots // block_size, slots % block_size] = encoded
    return cache, "reference"


def allocate_cache(
    fmt: CacheFormat,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    layout: str = "NHD",
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> torch.Tensor:
    """A logical ``(B, 2, N, H, D')`` cache in ``layout`` (``NHD`` or ``HND``) order over whole
    pages of the format's encoding (key sink rows after each page's K and V rows), filled with
    seeded random bytes. A packed-slot format has one page order whatever ``layout`` says: the
    backends' logical ``(B, H, N, slot_bytes)`` stored block, token, head, slot."""
    if layout == "NHD":
        order = (0, 1, 2, 3, 4)
    elif layout == "HND":
        order = (0, 1, 3, 2, 4)
    else:
        raise ValueError(f"layout: expected 'NHD' or 'HND', got {layout!r}")
    if fmt.is_packed:
        return _packed_cache(fmt, num_blocks, block_size, num_kv_heads, head_size, device, seed)
    shape = _cache_shape(fmt, num_blocks, block_size, num_kv_heads, head_size)
    physical = tuple(shape[i] for i in order)
    itemsize = 1 if fmt.is_quantized else 2
    page = fmt.page_bytes(num_kv_heads, head_size, head_size, block_size)
    gen = torch.Generator().manual_seed(seed + 1)
    raw = torch.randint(0, 256, (num_blocks * page,), dtype=torch.uint8, generator=gen)
    if not fmt.is_quantized:
        # Random bf16 bits would include NaN/Inf; keep garbage finite but conspicuous.
        raw = (torch.randn(raw.numel() // 2, generator=gen) * 1e3).to(torch.bfloat16)
        raw = raw.view(torch.uint8)
    pages = raw.to(device).view(fmt.storage_dtype).view(num_blocks, page // itemsize)
    rows = math.prod(physical[1:])
    buf = pages[:, :rows].view(physical)
    inverse = [order.index(i) for i in range(5)]
    return buf.permute(*inverse)


def assign_slots(
    seq_lens: tuple[int, ...],
    block_size: int,
    spare_blocks: int = 2,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Pages for each sequence, in a seeded random order.

    Returns ``(num_blocks, slot_mapping int64 [sum(seq_lens)], block_tables)``."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    gen = torch.Generator().manual_seed(seed + 2)
    pages = torch.randperm(num_blocks, generator=gen)
    tables, slots, start = [], [], 0
    for n, k in zip(seq_lens, needed, strict=True):
        table = pages[start : start + k]
        start += k
        pos = torch.arange(n)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables.append(table.to(device))
    return num_blocks, torch.cat(slots).to(torch.int64).to(device), tables


def _write_with_op(
    sample: KVSample,
    fmt: CacheFormat,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    fallback: bool,
) -> bool:
    """Write through the compiled ``reshape_and_cache_flash``. Returns False (nothing written)
    when the extension has no kernel for the device and ``fallback`` allows the codecs."""
    from vllm import _custom_ops as ops  # loads the extension; imported once the writer is "op"

    layout_kw = {}
    if fmt.is_nvfp4:
        scale_layout = fmt.scale_layout_for(key_cache.shape[1], sample.head_size).value
        layout_kw = {"k_scale_layout": scale_layout, "v_scale_layout": scale_layout}
    try:
        ops.reshape_and_cache_flash(
            sample.key,
            sample.value,
            key_cache,
            value_cache,
            slot_mapping,
            fmt.kv_cache_dtype,
            k_scale,
            v_scale,
            **layout_kw,
        )
    except NotImplementedError:
        # An extension built without kernels for this device (a CPU-only build given CUDA
        # tensors): torch raises before the op runs.
        if not fallback:
            raise
        return False
    return True


def _write_with_codecs(
    sample: KVSample,
    fmt: CacheFormat,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Write with the format's pure-torch reference codec (:mod:`vllm.kv_quant.codecs`)."""
    codec = fmt.encoding.codec
    layout = fmt.scale_layout_for(key_cache.shape[1], sample.head_size)
    codec.write(sample.key, key_cache, slot_mapping, k_scale, layout)
    codec.write(sample.value, value_cache, slot_mapping, v_scale, layout)


def write_cache(
    sample: KVSample,
    fmt: CacheFormat,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    writer: str = "auto",
    layout: str = "NHD",
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
) -> PagedCache:
    """Write ``sample.key`` / ``sample.value`` (bf16) into a fresh paged cache of ``fmt``.

    ``writer`` is ``auto``, ``op`` or ``reference`` (module docstring); ``layout`` is the
    physical order, ``NHD`` or ``HND``. The scales are fp32 ``[1]`` or ``[H]`` (unread for the
    per-token-head formats, whose writers compute one scale per row).
    """
    if sample.head_size != sample.head_size_v:
        raise ValueError(
            f"{sample.name}: a FlashInfer-shaped cache needs head_size == head_size_v, got "
            f"{sample.head_size} and {sample.head_size_v}"
        )
    used = resolve_writer(writer) if has_kernel(fmt) else "reference"
    device = sample.key.device
    num_blocks, slot_mapping, tables = assign_slots(
        sample.seq_lens, block_size, seed=seed, device=device
    )
    k_scale = k_scale.to(device=device, dtype=torch.float32)
    v_scale = v_scale.to(device=device, dtype=torch.float32)
    if fmt.is_packed:
        kv_cache, used = _write_packed(
            sample, fmt, num_blocks, block_size, slot_mapping, seed, used
        )
    else:
        kv_cache = allocate_cache(
            fmt, num_blocks, block_size, sample.num_kv_heads, sample.head_size, layout, device, seed
        )
        key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
        args = (sample, fmt, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        if used == "op" and not _write_with_op(*args, fallback=writer == "auto"):
            used = "reference"
        if used == "reference":
            _write_with_codecs(*args)
    return PagedCache(
        fmt=fmt,
        kv_cache=kv_cache,
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=sample.seq_lens,
        k_scale=k_scale,
        v_scale=v_scale,
        k_scale_layout=fmt.scale_layout_for(block_size, sample.head_size),
        v_scale_layout=fmt.scale_layout_for(block_size, sample.head_size_v),
        head_size=sample.head_size,
        head_size_v=sample.head_size_v,
        writer=used,
    )


def make_reader(reader: str = "auto") -> CacheReader:
    """The reader named ``reader``: ``codec``, ``backend`` (the reference attention backend;
    raises when it is not available) or ``auto`` (the backend when available)."""
    if reader not in READERS:
        raise ValueError(f"reader: expected one of {', '.join(READERS)}, got {reader!r}")
    if reader == "codec":
        return CodecReader()
    ok, why = backend_status()
    if ok:
        return BackendReader()
    if reader == "backend":
        raise RuntimeError(f"reader: the reference attention backend is not available: {why}")
    return CodecReader()
