"""Reference codec and registry entry of the ``int4_per_token_head`` KV cache (upstream v0.33's
``KVQuantMode.INT4_PER_TOKEN_HEAD``).

Each cached row (one token, one KV head, one side) of head size ``D`` is ``D / 2`` bytes of packed
4-bit codes followed by one fp32 word, little-endian, in the row's last 4 bytes (upstream's inline
layout: the cache's last dim is ``D / 2 + 4``). Writing one row ``x[0..D-1]``:

1. rotate: ``r = RHT(float32(x))``, rounded back to ``x.dtype`` (upstream rounds there too) and
   widened to fp32 again. ``RHT`` is the unnormalized Walsh-Hadamard transform of ``x * s``,
   applied block-diagonally over blocks of ``b`` values, ``b`` the largest power of two dividing
   ``D``; ``s`` is a fixed ±1 vector of length ``b`` derived from ``b`` alone (a CPU
   ``torch.Generator`` seeded ``0x9E3779B9`` drawing ``bernoulli(0.5)``), so no page byte holds
   it and every layer of one head size shares it;
2. ``scale = max((max r - min r) / 15, 1e-6)`` in fp32;
3. ``zp = clamp(rnd(-min r / scale), 0, 15)``, ``rnd`` rounding half away from zero as upstream
   does (``trunc(t + 0.5)`` for ``t >= 0``, ``trunc(t - 0.5)`` otherwise, each sum one fp32
   rounding);
4. ``q_i = clamp(rnd(r_i * (1 / scale) + zp), 0, 15)`` (three fp32 roundings: the inverse, the
   product, the sum);
5. byte ``j`` holds ``q_{2j}`` in its low nibble and ``q_{2j+1}`` in its high nibble; the fp32 word
   is ``scale``'s bits with the low 4 mantissa bits replaced by ``zp``.

Reading: ``zp`` = the word's low 4 bits, ``scale'`` = the word with them cleared, ``y_i = (q_i -
zp) * scale'`` (rotated domain), ``x ≈ RHT⁻¹(y) = H(y) * s / b``. Rows are assumed finite, and so
their rotations in the source dtype (upstream defines no NaN/Inf behaviour for this format).
"""

from __future__ import annotations

import functools

import torch

from vllm.kv_quant.formats import (
    PER_TOKEN_HEAD_SCALE_BYTES,
    CacheKind,
    KVCacheFormat,
    KVQuantMode,
    register_format,
)
from vllm.kv_quant.fp8 import _FLOAT_INPUT_DTYPES
from vllm.kv_quant.nvfp4_cache import check_slot_mapping

__all__ = [
    "INT4_PER_TOKEN_HEAD",
    "INT4_QMAX",
    "INT4_SCALE_FLOOR",
    "RHT_SEED",
    "dequantize_int4_rows",
    "int4_per_token_head_read_cache",
    "int4_per_token_head_write_cache",
    "int4_scale_words",
    "int4_row_dim",
    "quantize_int4_rows",
    "rht_block_size",
    "rht_signs",
    "single_rht",
]

INT4_QMAX = 15.0
"""Largest 4-bit code: ``scale = (max - min) / 15``."""

INT4_SCALE_FLOOR = 1e-6
"""Smallest scale the writer computes (before the zero point replaces its low 4 bits)."""

RHT_SEED = 0x9E3779B9
"""Seed of the CPU generator that draws the rotation's sign vector (upstream's)."""

_ZP_MASK = 0xF


def int4_row_dim(head_size: int) -> int:
    """Bytes per row: ``head_size / 2`` packed bytes, then the fp32 scale word. ``head_size`` must
    be a positive multiple of 8 so that word stays 4-byte aligned in every row (upstream carves
    fp32 views of the scales out of the page)."""
    if head_size <= 0 or head_size % (2 * PER_TOKEN_HEAD_SCALE_BYTES) != 0:
        raise ValueError(
            f"head_size: an int4_per_token_head KV cache needs a positive multiple of "
            f"{2 * PER_TOKEN_HEAD_SCALE_BYTES}, got {head_size}"
        )
    return head_size // 2 + PER_TOKEN_HEAD_SCALE_BYTES


INT4_PER_TOKEN_HEAD = register_format(
    KVCacheFormat(
        name="int4_per_token_head",
        accepted_names=("int4_per_token_head",),
        storage_dtype=torch.uint8,
        quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD,
        label="int4_pth",
        row_dim=int4_row_dim,
        cache_kind=CacheKind.INT4_PER_TOKEN_HEAD,
    )
)


def rht_block_size(head_size: int) -> int:
    """``b``: the largest power of two dividing ``head_size`` (the Hadamard block, values)."""
    if head_size <= 0:
        raise ValueError(f"head_size: expected a positive int, got {head_size}")
    return head_size & -head_size


@functools.cache
def _signs_cpu(block: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((block,), 0.5), generator=gen) - 1.0


def rht_signs(block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The rotation's ±1 fp32 sign vector for Hadamard block ``block`` (a power of two)."""
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block: expected a power of two, got {block}")
    return _signs_cpu(block).to(device)


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of the last dim (a power of two), as butterflies
    (``H H = b I``): the sums upstream's CPU path computes, in the same order."""
    d = x.shape[-1]
    h = 1
    while h < d:
        pairs = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        lo, hi = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([lo + hi, lo - hi], dim=-2).reshape(x.shape)
        h *= 2
    return x


def single_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Upstream's ``single_rht``: ``H(x * s)`` forward, ``H(x) * s`` inverse, block-diagonal over
    blocks of ``b`` (:func:`rht_block_size`) values of the last dim. Forward then inverse
    multiplies by ``b``. ``x`` is used in its own dtype (callers pass fp32)."""
    d = x.shape[-1]
    block = rht_block_size(d)
    blocks = x.reshape(*x.shape[:-1], d // block, block)
    signs = rht_signs(block, x.device).to(x.dtype)
    out = _hadamard(blocks) * signs if inverse else _hadamard(blocks * signs)
    return out.reshape(x.shape)


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    """``trunc(t ± 0.5)`` with the sum rounded to fp32 first, as upstream's float-to-int cast."""
    half = torch.full_like(t, 0.5)
    return torch.trunc(torch.where(t >= 0, t + half, t - half))


def _check_rows(x: torch.Tensor) -> None:
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] <= 0 or x.shape[-1] % 2:
        raise ValueError(f"x: expected a tensor [..., D] with D even and > 0, got {list(x.shape)}")


def quantize_int4_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` (fp32/fp16/bf16) row by row (steps 1-5 above).

    Returns ``(packed [..., D / 2] uint8, word [...] float32)``: the codes and the scale word
    (scale with the zero point in its low 4 bits)."""
    _check_rows(x)
    r = single_rht(x.to(torch.float32)).to(x.dtype).to(torch.float32)
    lo, hi = r.amin(dim=-1), r.amax(dim=-1)
    scale = torch.maximum(
        (hi - lo) / torch.full_like(lo, INT4_QMAX), torch.full_like(lo, INT4_SCALE_FLOOR)
    )
    zero, top = torch.zeros_like(lo), torch.full_like(lo, INT4_QMAX)
    zp = torch.clamp(_round_half_away(-lo / scale), zero, top)
    inv = torch.ones_like(scale) / scale
    q = _round_half_away(r * inv.unsqueeze(-1) + zp.unsqueeze(-1))
    q = torch.clamp(q, 0.0, INT4_QMAX).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    bits = (scale.view(torch.int32) & ~_ZP_MASK) | zp.to(torch.int32)
    return packed, bits.view(torch.float32)


def dequantize_int4_rows(
    packed: torch.Tensor, word: torch.Tensor, *, rotated: bool = False
) -> torch.Tensor:
    """fp32 values ``[..., D]`` of codes ``packed [..., D / 2]`` and scale words ``[...]``:
    ``(q - zp) * scale'`` in the rotated domain (``rotated=True``), else rotated back
    (``RHT⁻¹``, divided by ``b``)."""
    if packed.dtype != torch.uint8 or word.dtype != torch.float32:
        raise ValueError(
            f"packed, word: expected uint8 and float32, got {packed.dtype} and {word.dtype}"
        )
    bits = word.contiguous().view(torch.int32)
    zp = (bits & _ZP_MASK).to(torch.float32).unsqueeze(-1)
    scale = (bits & ~_ZP_MASK).view(torch.float32).unsqueeze(-1)
    q = torch.stack([packed & _ZP_MASK, packed >> 4], dim=-1).flatten(-2).to(torch.float32)
    y = (q - zp) * scale
    if rotated:
        return y
    block = torch.full_like(y, float(rht_block_size(y.shape[-1])))
    return single_rht(y, inverse=True) / block


def _split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if rows.dtype != torch.uint8 or rows.dim() == 0 or rows.shape[-1] <= 4:
        raise ValueError(
            f"rows: expected uint8 rows [..., D / 2 + 4], got {rows.dtype} of shape "
            f"{list(rows.shape)}"
        )
    half = rows.shape[-1] - PER_TOKEN_HEAD_SCALE_BYTES
    word = rows[..., half:].contiguous().view(torch.float32).squeeze(-1)
    return rows[..., :half], word


def int4_scale_words(side: torch.Tensor, head_size: int) -> torch.Tensor:
    """The fp32 scale words ``[B, N, H]`` of a cache side ``(B, N, H, D / 2 + 4)`` uint8, a view:
    each row's last 4 bytes (4-byte aligned, :func:`int4_row_dim`)."""
    return side[..., head_size // 2 :].view(torch.float32).squeeze(-1)


def int4_per_token_head_write_cache(
    x: torch.Tensor, cache_side: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Quantize the first ``T`` tokens of ``x [T_pad, H, D]`` into ``cache_side (B, N, H,
    D / 2 + 4)`` uint8 in place: token ``i`` to page ``slot_mapping[i] // N``, row
    ``slot_mapping[i] % N``; negative slots skipped; bad arguments raise before any write."""
    _check_rows(x)
    if cache_side.dim() != 4 or cache_side.dtype != torch.uint8:
        raise ValueError(
            f"cache_side: expected a uint8 (B, N, H, D / 2 + 4) tensor, got {cache_side.dtype} "
            f"of shape {list(cache_side.shape)}"
        )
    num_blocks, block_size, num_heads, row = cache_side.shape
    if x.dim() != 3 or x.shape[1] != num_heads or int4_row_dim(x.shape[2]) != row:
        raise ValueError(
            f"x: expected shape [T_pad, {num_heads}, {2 * (row - 4)}] to match cache_side, got "
            f"{list(x.shape)}"
        )
    if x.device != cache_side.device:
        raise ValueError(f"x: expected device {cache_side.device} (the cache's), got {x.device}")
    check_slot_mapping(slot_mapping, x.shape[0], num_blocks * block_size, cache_side.device)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    packed, word = quantize_int4_rows(x[: slot_mapping.shape[0]][keep])
    rows = torch.cat([packed, word.unsqueeze(-1).view(torch.uint8)], dim=-1)
    cache_side[slots // block_size, slots % block_size] = rows


def int4_per_token_head_read_cache(
    cache_side: torch.Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode a whole cache side ``(B, N, H, D / 2 + 4)`` to ``(B, N, H, D)`` values (rotated
    back) in ``out_dtype``."""
    if cache_side.dim() != 4:
        raise ValueError(
            f"cache_side: expected a (B, N, H, D / 2 + 4) tensor, got shape "
            f"{list(cache_side.shape)}"
        )
    packed, word = _split_rows(cache_side)
    return dequantize_int4_rows(packed, word).to(out_dtype)
