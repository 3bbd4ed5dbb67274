"""Decode attention over TurboQuant KV-cache slots (upstream v0.33.0's
``triton_turboquant_decode_attention`` at upstream's path and signature), written for this
library: attention over the values :func:`~vllm.kv_quant.turboquant.codec.turboquant_decode_slots`
decodes, up to fp32 summation order.

One Triton kernel decodes the slots of every page the batch references into fp32 keys and
values (compact pages, bit patterns only: FP8 keys through the exact e4m3 decoder, fp16 norms
and scales from their bytes, codes from the packed bit stream, no FMA contraction), then this
library's paged attention kernel reads them as fp32 pages with an fp32 query: Lloyd-Max keys
stay in the rotated frame (``norm * c``) and meet the query rotated once, ``q @ PiT`` (``PiT``
is ``Pi``'s inverse, so the scores are those of the rotated-back keys); FP8 keys meet the query
as it is. Values are stored unrotated, so the output needs no inverse rotation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.kv_quant.turboquant.config import TQ_PRESETS, TurboQuantConfig
from vllm.triton_utils import tl, triton
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_attention_plan import MAX_SPLITS, plan_paged_attention
from vllm.v1.attention.ops.triton_kv_decode import fp8_units
from vllm.v1.attention.ops.triton_turboquant_store import kernel_config

__all__ = ["triton_compile_cases", "triton_turboquant_decode_attention"]

_NUM_WARPS = 4
_NORM_EPS = 1e-16  # the codec's: a decoded all-zero code vector stays zero under norm correction
_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _codes(row_ptr, d, ok, BITS: tl.constexpr):
    """Codes ``d`` of a little-endian bit stream at ``row_ptr`` (code ``d`` in bits
    ``[BITS*d, BITS*d + BITS)``), int32; a code crossing a byte boundary reads both bytes."""
    bit = d * BITS
    first = bit >> 3
    shift = bit & 7
    lo = tl.load(row_ptr + first, mask=ok, other=0).to(tl.int32)
    hi = tl.load(row_ptr + first + 1, mask=ok & (shift + BITS > 8), other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> shift) & ((1 << BITS) - 1)


@triton.jit
def _fp16_at(ptr, ok):
    """The fp32 value of the little-endian fp16 at ``ptr`` (2 bytes), exact."""
    b0 = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    b1 = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (b0 | (b1 << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _tq_decode_pages_kernel(
    cache_ptr,  # uint8 [num_blocks, block_size, H, slot bytes]
    page_ptr,  # int64 [P]: the pages to decode
    centroid_ptr,  # fp32 [2**MSE_BITS] (Lloyd-Max keys only)
    key_out_ptr,  # fp32 [P, block_size, H, D], contiguous
    value_out_ptr,  # fp32 [P, block_size, H, D], contiguous
    stride_block,
    stride_pos,
    stride_head,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    KPS: tl.constexpr,
    VQB: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    NORM_EPS: tl.constexpr,
):
    """Page ``page_ptr[pid0]``, head ``pid1``: every slot's key and value, as the codec's
    ``turboquant_decode_slots`` (keys in the rotated frame)."""
    p = tl.program_id(0)
    head = tl.program_id(1)
    page = tl.load(page_ptr + p).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    n_ok = n < BLOCK_SIZE
    ok = n_ok[:, None] & (d < D)[None, :]
    rows = cache_ptr + page * stride_block + n[:, None] * stride_pos + head * stride_head
    if KEY_FP8:
        byte = tl.load(rows + d[None, :], mask=ok, other=0)
        key = fp8_units(byte, False).to(tl.float32) * 256.0  # e4m3 units are 2^-8: exact
    else:
        code = _codes(rows, d[None, :], ok, MSE_BITS)
        c = tl.load(centroid_ptr + code, mask=ok, other=0.0)
        if NORM_CORRECTION:
            length = tl.sqrt_rn(tl.sum(c * c, axis=1) + NORM_EPS)
            c = tl.math.div_rn(c, length[:, None] + tl.zeros_like(c))
        key = _fp16_at(rows + D * MSE_BITS // 8, n_ok[:, None]) * c
    vcode = _codes(rows + KPS, d[None, :], ok, VQB).to(tl.float32)
    stats = rows + KPS + D * VQB // 8
    value = vcode * _fp16_at(stats, n_ok[:, None]) + _fp16_at(stats + 2, n_ok[:, None])
    dst = ((p.to(tl.int64) * BLOCK_SIZE + n[:, None]) * num_heads + head) * D + d[None, :]
    tl.store(key_out_ptr + dst, key, mask=ok)
    tl.store(value_out_ptr + dst, value, mask=ok)


def _decode_launch(
    kv_cache: torch.Tensor,
    pages: torch.Tensor,
    centroids: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    cfg: TurboQuantConfig,
) -> tuple[tuple[int, int], list[Any], dict[str, Any]]:
    """Grid, runtime arguments and constexprs of one page-decode launch."""
    block_size, heads = kv_cache.shape[1], kv_cache.shape[2]
    args: list[Any] = [
        kv_cache, pages, centroids, keys, values, *kv_cache.stride()[:3], heads,
    ]  # fmt: skip
    constexprs: dict[str, Any] = dict(
        BLOCK_SIZE=block_size,
        BLOCK_N=triton.next_power_of_2(block_size),
        D=cfg.head_dim,
        BLOCK_D=triton.next_power_of_2(cfg.head_dim),
        KEY_FP8=cfg.key_fp8,
        MSE_BITS=cfg.key_mse_bits,
        KPS=cfg.key_packed_size,
        VQB=cfg.value_quant_bits,
        NORM_CORRECTION=cfg.norm_correction,
        NORM_EPS=_NORM_EPS,
    )
    return (pages.shape[0], heads), args, constexprs


def _check_float_table(x: torch.Tensor | None, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != shape:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
        raise ValueError(f"{name}: expected float32 {list(shape)}, got {got}")
    return x


def _check_batch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cfg: TurboQuantConfig,
) -> torch.Tensor:
    """The checks of the batch's tensors; returns the sorted pages its sequences read."""
    if query.dim() != 3 or query.dtype not in _QUERY_DTYPES:
        raise ValueError(
            f"query: expected a float16 / bfloat16 / float32 [B, Hq, D] tensor, got "
            f"{query.dtype} of shape {list(query.shape)}"
        )
    batch, num_heads, _ = query.shape
    if (
        kv_cache.dtype != torch.uint8
        or kv_cache.dim() != 4
        or kv_cache.shape[3] < cfg.slot_size
        or kv_cache.stride(3) != 1
    ):
        raise ValueError(
            f"kv_cache: expected uint8 [num_blocks, block_size, Hk, >= {cfg.slot_size}] with "
            f"contiguous slots, got {kv_cache.dtype} of shape {list(kv_cache.shape)}"
        )
    if num_heads % kv_cache.shape[2] != 0:
        raise ValueError(
            f"query: expected a multiple of the cache's {kv_cache.shape[2]} KV heads, got "
            f"{num_heads} heads"
        )
    check_integer_tensor("block_table", block_table)
    check_integer_tensor("seq_lens", seq_lens)
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(
            f"block_table: expected [{batch}, max_blocks], got {list(block_table.shape)}"
        )
    block_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    lens = seq_lens.to(torch.int64)
    if seq_lens.shape != (batch,) or bool(((lens < 0) | (lens > capacity)).any()):
        raise ValueError(
            f"seq_lens: expected [{batch}] lengths in 0..{capacity} (the block table's tokens), "
            f"got {seq_lens.tolist() if seq_lens.numel() <= 16 else list(seq_lens.shape)}"
        )
    table = block_table[:batch].to(torch.int64)
    column = torch.arange(table.shape[1], device=table.device)
    read = column[None, :] * block_size < lens.to(table.device)[:, None]
    pages = table[read]
    if pages.numel() and bool(((pages < 0) | (pages >= kv_cache.shape[0])).any()):
        raise ValueError(
            f"block_table: expected the pages the sequences read in 0..{kv_cache.shape[0] - 1}, "
            f"got {pages.min().item()}..{pages.max().item()}"
        )
    return torch.unique(pages)


def triton_turboquant_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
    norm_correction: bool = False,
    PiT: torch.Tensor | None = None,
    mid_o_buf: torch.Tensor | None = None,
    output_buf: torch.Tensor | None = None,
    lse_buf: torch.Tensor | None = None,
    buf_holder: Any = None,
    max_num_kv_splits: int = 32,
) -> torch.Tensor:
    """Decode attention: query ``b`` (``query [B, Hq, D]``, fp16 / bf16 / fp32, one token per
    sequence, at its last position) over the ``seq_lens[b]`` tokens of ``kv_cache
    [num_blocks, block_size, Hk, >= slot bytes]`` (uint8, TurboQuant slots) that
    ``block_table [B, max_blocks]`` maps, GQA (query head ``h`` reads KV head ``h // (Hq /
    Hk)``), softmax scale ``scale``. Returns ``[B, Hq, D]`` in the query's dtype: a view of
    ``output_buf`` when it has ``B`` rows or more and the query's dtype, else a new tensor
    (kept on ``buf_holder._tq_output_buf`` when ``buf_holder`` is given).

    The bit widths, ``key_packed_size`` (bytes), ``key_fp8`` and ``norm_correction`` are a
    :class:`TurboQuantConfig`'s (``effective_value_quant_bits``). Lloyd-Max keys need
    ``centroids`` (fp32 ``[2**mse_bits]``) and ``Pi`` / ``PiT`` (fp32 ``[D, D]``, ``PiT``
    defaulting to ``Pi.T``); FP8 keys read neither. ``max_num_kv_splits``: key segments per
    sequence (at most 32; the result is the same function of the cache for any count).
    ``mid_o_buf`` / ``lse_buf`` are upstream's stage buffers, accepted from its callers and not
    read: the partials live in the attention kernel's own scratch. A sequence of length 0
    gives zeros. Bad arguments raise ``ValueError``.
    """
    if query.dim() != 3:
        raise ValueError(f"query: expected a [B, Hq, D] tensor, got shape {list(query.shape)}")
    head_dim = query.shape[2]
    cfg = kernel_config(
        head_dim, mse_bits, key_packed_size, value_quant_bits, key_fp8, norm_correction
    )
    if head_dim % 8 != 0:
        raise ValueError(f"query: expected head dim D (a multiple of 8), got {head_dim}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float (the softmax scale), got {scale!r}")
    splits = max_num_kv_splits
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"max_num_kv_splits: expected a positive int, got {max_num_kv_splits!r}")
    pages = _check_batch(query, kv_cache, block_table, seq_lens, cfg)
    device = query.device
    if cfg.key_fp8:
        rotated_q = query.float()
        table = torch.zeros(1, dtype=torch.float32, device=device)  # not read
    else:
        given = PiT if PiT is not None else Pi.T if isinstance(Pi, torch.Tensor) else Pi
        rotation = _check_float_table(given, "PiT", (head_dim, head_dim))
        table = _check_float_table(centroids, "centroids", (cfg.n_centroids,)).to(device)
        rotated_q = query.float() @ rotation.to(device)
    batch, num_heads, _ = query.shape
    if pages.numel() == 0:  # nothing read: one page keeps the table's entries in range
        pages = torch.zeros(1, dtype=torch.int64, device=device)
    shape = (pages.shape[0], kv_cache.shape[1], kv_cache.shape[2], head_dim)
    keys = torch.empty(shape, dtype=torch.float32, device=device)
    values = torch.empty(shape, dtype=torch.float32, device=device)
    grid, args, constexprs = _decode_launch(kv_cache, pages.to(device), table, keys, values, cfg)
    _tq_decode_pages_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS, enable_fp_fusion=False)
    local_table = torch.searchsorted(pages, block_table[:batch].to(torch.int64).clamp(min=0))
    local_table = local_table.clamp_(max=pages.shape[0] - 1).to(torch.int32)
    result = torch.zeros(batch, num_heads, head_dim, dtype=torch.float32, device=device)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    plan_paged_attention(
        result, rotated_q.contiguous(), keys, values, local_table, seq_lens,
        torch.arange(batch + 1, dtype=torch.int32, device=device), "float32", ones, ones,
        float(scale), 1, block_table.shape[1] * kv_cache.shape[1],
        num_splits=min(max_num_kv_splits, MAX_SPLITS),
    )()  # fmt: skip
    usable = (
        output_buf is not None and output_buf.shape[0] >= batch and output_buf.dtype == query.dtype
    )
    if usable:
        output = output_buf[:batch, :num_heads, :head_dim]
    else:
        output = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=device)
        if buf_holder is not None:
            buf_holder._tq_output_buf = output
    output.copy_(result)
    return output


def triton_compile_cases() -> list[TritonCompileCase]:
    """The page decode for each preset at head dims 128 and 96 (a row shorter than its
    block), pages of 16 tokens."""
    cases = []
    for name in TQ_PRESETS:
        for d in (128, 96):
            cfg = TurboQuantConfig.from_cache_dtype(name, d)
            cache = torch.zeros(1, 16, 2, cfg.slot_size_aligned, dtype=torch.uint8)
            out = torch.zeros(1, 16, 2, d)
            table = torch.zeros(max(cfg.n_centroids, 1))
            pages = torch.zeros(1, dtype=torch.int64)
            _, args, constexprs = _decode_launch(cache, pages, table, out, out, cfg)
            cases.append(
                case_from_launch(
                    f"decode/{name}/d{d}",
                    _tq_decode_pages_kernel,
                    args,
                    constexprs,
                    num_warps=_NUM_WARPS,
                    enable_fp_fusion=False,
                )
            )
    return cases
