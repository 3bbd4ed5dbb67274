"""``ultraquant_full_dequant_kv``: reads a request's cached K/V back from an ``ultraquant_4bit``
paged cache (upstream's ``vllm.v1.attention.ops.ultraquant.triton_dequant`` entry point).

On a GPU with Triton one program decodes one (position, request, head) slot's K and V
(:func:`triton_ultraquant_full_dequant_kv`); elsewhere the slots are gathered and decoded with the
torch reference (:func:`.reference.ultraquant_dequant`). Both give each value as its E2M1 level
times its group's power of two (exact in fp32), rounded once to the output dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_kv_encode import e2m1_to_f32, from_bits
from vllm.v1.attention.ops.ultraquant.format import (
    check_paged_cache,
    k_scales_offset,
    v_codes_offset,
    v_scales_offset,
)
from vllm.v1.attention.ops.ultraquant.reference import UltraQuantEncoded, ultraquant_dequant

__all__ = [
    "triton_compile_cases",
    "triton_ultraquant_full_dequant_kv",
    "ultraquant_full_dequant_kv",
]

_NUM_WARPS = 4


@triton.jit
def _decode_side(slot, CODES: tl.constexpr, SCALES: tl.constexpr, d, mask):
    """fp32 values of one side of a slot: code ``d`` in the low (even ``d``) or high nibble of
    byte ``d // 2``, times ``2^(byte - 127)`` of its group's UE8M0 byte (its bits shifted into
    an fp32 exponent: byte 0 is 0.0)."""
    byte = tl.load(slot + CODES + d // 2, mask=mask, other=0).to(tl.uint32)
    code = (byte >> ((d % 2) * 4).to(tl.uint32)) & 0xF
    scale_byte = tl.load(slot + SCALES + d // 32, mask=mask, other=0).to(tl.uint32)
    return e2m1_to_f32(code) * from_bits(scale_byte << 23)


@triton.jit
def _uq_full_dequant_kernel(
    cache_ptr,  # uint8 [num_blocks, block_size, Hk, slot bytes], slots contiguous
    table_ptr,  # int [B, max_blocks]
    k_ptr,  # [B, Hk, S, D], D contiguous
    v_ptr,
    stride_block,
    stride_pos,
    stride_head,
    stride_table,
    k_stride_b,
    k_stride_h,
    k_stride_s,
    v_stride_b,
    v_stride_h,
    v_stride_s,
    HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_SCALES: tl.constexpr,
    V_CODES: tl.constexpr,
    V_SCALES: tl.constexpr,
):
    pos = tl.program_id(0)
    request = tl.program_id(1) // HK
    head = tl.program_id(1) % HK
    block = tl.load(table_ptr + request * stride_table + pos // BLOCK_SIZE).to(tl.int64)
    slot = cache_ptr + block * stride_block + (pos % BLOCK_SIZE) * stride_pos + head * stride_head
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    k = _decode_side(slot, 0, K_SCALES, d, mask)
    v = _decode_side(slot, V_CODES, V_SCALES, d, mask)
    k_row = k_ptr + request * k_stride_b + head * k_stride_h + pos * k_stride_s
    v_row = v_ptr + request * v_stride_b + head * v_stride_h + pos * v_stride_s
    tl.store(k_row + d, k.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_row + d, v.to(v_ptr.dtype.element_ty), mask=mask)


def _launch(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    alloc_len: int,
) -> tuple[tuple[int, int], list[Any], dict[str, Any]]:
    """Grid, runtime arguments and constexprs of one launch."""
    b, hk, _, d = k_out.shape
    table = block_table.to(kv_cache.device)
    args = [
        kv_cache,
        table,
        k_out,
        v_out,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        table.stride(0),
        *k_out.stride()[:3],
        *v_out.stride()[:3],
    ]
    constexprs = dict(
        HK=hk,
        BLOCK_SIZE=kv_cache.shape[1],
        D=d,
        BLOCK_D=1 << (d - 1).bit_length(),
        K_SCALES=k_scales_offset(d),
        V_CODES=v_codes_offset(d),
        V_SCALES=v_scales_offset(d),
    )
    return (alloc_len, b * hk), args, constexprs


def triton_ultraquant_full_dequant_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    alloc_len: int,
) -> None:
    """:func:`ultraquant_full_dequant_kv` as one Triton kernel (on a GPU, or CPU tensors under
    the interpreter): the caller checks the arguments; the cache's slots and the outputs' last
    dim must be contiguous."""
    if alloc_len == 0 or k_out.shape[0] * k_out.shape[1] == 0:
        return
    grid, args, constexprs = _launch(kv_cache, block_table, k_out, v_out, alloc_len)
    _uq_full_dequant_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS)


def triton_compile_cases() -> list[TritonCompileCase]:
    """The dequant at head sizes 128 and 256 into bf16 outputs, int32 block tables."""
    cases = []
    for d in (128, 256):
        cache = torch.zeros(2, 16, 2, d + 2 * (d // 32), dtype=torch.uint8)
        out = torch.zeros(1, 2, 16, d, dtype=torch.bfloat16)
        table = torch.zeros(1, 1, dtype=torch.int32)
        _, args, constexprs = _launch(cache, table, out, out, 16)
        cases.append(
            case_from_launch(
                f"ultraquant_full_dequant/d{d}",
                _uq_full_dequant_kernel,
                args,
                constexprs,
                num_warps=_NUM_WARPS,
            )
        )
    return cases


def ultraquant_full_dequant_kv(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    alloc_len: int,
) -> None:
    """Decode positions ``[0, alloc_len)`` (tokens) of each of the ``B`` requests in
    ``block_table`` ``[B, max_blocks]`` into ``k_out``/``v_out`` ``[B, Hk, >= alloc_len, D]``
    (fp16/bf16/fp32, one rounding from the exact fp32 value). K comes back in the rotated
    basis it is stored in."""
    if k_out.dim() != 4 or v_out.shape != k_out.shape or v_out.dtype != k_out.dtype:
        raise ValueError(
            f"k_out: expected [B, Hk, S, D] with v_out alike, got {tuple(k_out.shape)} and "
            f"{tuple(v_out.shape)}"
        )
    b, hk, s, d = k_out.shape
    check_paged_cache(kv_cache, hk, d)
    block_size = kv_cache.shape[1]
    need_blocks = -(-alloc_len // block_size)
    if not 0 <= alloc_len <= s or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(
            f"block_table: expected [{b}, >= {need_blocks}] and alloc_len in [0, {s}], got "
            f"{tuple(block_table.shape)} and {alloc_len}"
        )
    if block_table.shape[1] < need_blocks:
        raise ValueError(
            f"block_table: expected >= {need_blocks} blocks per request, got {block_table.shape[1]}"
        )
    used = block_table[:, :need_blocks]
    if used.numel() and bool(((used < 0) | (used >= kv_cache.shape[0])).any()):
        raise ValueError(
            f"block_table: expected block ids in [0, {kv_cache.shape[0]}) in the first "
            f"{need_blocks} columns, got {used.min().item()} .. {used.max().item()}"
        )
    if (
        kv_cache.is_cuda
        and HAS_TRITON
        and kv_cache.stride(3) == 1
        and k_out.stride(-1) == 1
        and v_out.stride(-1) == 1
    ):
        triton_ultraquant_full_dequant_kv(kv_cache, block_table, k_out, v_out, alloc_len)
        return
    pos = torch.arange(alloc_len, device=kv_cache.device)
    blocks = block_table.to(kv_cache.device, torch.int64)[:, pos // block_size]
    slots = kv_cache[blocks, pos % block_size]  # [B, alloc_len, Hk, slot bytes]
    k_sc, v_co, v_sc = k_scales_offset(d), v_codes_offset(d), v_scales_offset(d)
    groups = v_co - k_sc
    for out, codes, scales in (
        (k_out, slots[..., :k_sc], slots[..., k_sc:v_co]),
        (v_out, slots[..., v_co:v_sc], slots[..., v_sc : v_sc + groups]),
    ):
        values = ultraquant_dequant(UltraQuantEncoded(codes, scales), d)
        out[:, :, :alloc_len] = values.transpose(1, 2).to(out.dtype)
