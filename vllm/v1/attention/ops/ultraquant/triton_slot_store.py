"""The ``ultraquant_4bit`` store as one Triton kernel: the bytes of the reference codec
:mod:`vllm.kv_quant.ultraquant_codec`, on a GPU and under Triton's interpreter.

The keys arrive rotated by the codec's own torch matmul
(:func:`~vllm.kv_quant.ultraquant_codec.rotate_keys`, so that every writer codes the same rows);
one program codes one side (K or V) of one (token, head) slot: each group of 32 values gets its
UE8M0 exponent from the bits of ``s_raw = c * max|x|`` (the codec's exact snap), each value the
E2M1 code of ``x / 2^e`` (an IEEE division, ties to the lower level), two codes a byte.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.kv_quant.ultraquant import DEFAULT_CONSTANT_C, ultraquant_slot_size
from vllm.triton_utils import tl, triton
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_kv_encode import as_bits, from_bits

__all__ = ["triton_compile_cases", "triton_ultraquant_store"]

_NUM_WARPS = 4


@triton.jit
def _e2m1_code(t):
    """The E2M1 code of fp32 ``t``: the number of midpoints below ``t`` indexes the 15 sorted
    levels (a tie takes the lower one), -6 .. -0.5 are codes 15 .. 9, 0 .. 6 codes 0 .. 7."""
    idx = (
        (t > -5.0).to(tl.int32) + (t > -3.5).to(tl.int32) + (t > -2.5).to(tl.int32)
        + (t > -1.75).to(tl.int32) + (t > -1.25).to(tl.int32) + (t > -0.75).to(tl.int32)
        + (t > -0.25).to(tl.int32) + (t > 0.25).to(tl.int32) + (t > 0.75).to(tl.int32)
        + (t > 1.25).to(tl.int32) + (t > 1.75).to(tl.int32) + (t > 2.5).to(tl.int32)
        + (t > 3.5).to(tl.int32) + (t > 5.0).to(tl.int32)
    )  # fmt: skip
    return tl.where(idx < 7, 15 - idx, idx - 7)


@triton.jit
def _uq_store_kernel(
    key_ptr,  # fp32 [N*H, D]: the rotated keys
    value_ptr,  # fp32 [N*H, D]
    cache_ptr,  # uint8 [num_blocks, block_size, H, slot bytes]
    slot_ptr,  # int64 [N]
    stride_block,
    stride_pos,
    stride_head,
    num_slots,
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    C: tl.constexpr,
):
    pid = tl.program_id(0)
    side = tl.program_id(1)  # 0: K, 1: V
    slot = tl.load(slot_ptr + pid // H).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        G: tl.constexpr = D // 32
        base = (
            cache_ptr
            + (slot // BLOCK_SIZE) * stride_block
            + (slot % BLOCK_SIZE) * stride_pos
            + (pid % H).to(tl.int64) * stride_head
            + side * (D // 2 + G)
        )
        d = tl.arange(0, D)
        row = pid.to(tl.int64) * D + d
        x = tl.load(key_ptr + row) if side == 0 else tl.load(value_ptr + row)
        groups = tl.reshape(x, [G, 32])
        bits = as_bits(groups) & 0x7FFFFFFF
        bad = tl.max((bits >= 0x7F800000).to(tl.int32), axis=1)  # a NaN or Inf in the group
        s_raw = tl.max(tl.abs(groups), axis=1) * C
        s_bits = as_bits(s_raw)
        biased = ((s_bits >> 23) & 0xFF).to(tl.int32)
        up = ((s_bits & 0x7FFFFF) >= 0x3504F4).to(tl.int32)  # mantissa above sqrt(2)
        e = tl.minimum(tl.where(biased == 0, -126, biased - 127 + up), 127)
        zero = (bad > 0) | (s_raw <= 0.0) | (biased == 0xFF)
        scale = from_bits(((e + 127) << 23).to(tl.uint32))
        t = tl.math.div_rn(groups, tl.zeros_like(groups) + scale[:, None])
        codes = tl.where(zero[:, None], 0, _e2m1_code(t))
        pairs = tl.reshape(codes, [D // 2, 2])
        shifts = tl.arange(0, 2) * 4
        packed = tl.sum(pairs << shifts[None, :], axis=1)
        tl.store(base + tl.arange(0, D // 2), packed.to(tl.uint8))
        g = tl.arange(0, G)
        tl.store(base + D // 2 + g, tl.where(zero, 0, e + 127).to(tl.uint8))


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    constant_c: float,
) -> tuple[tuple[int, int], list[Any], dict[str, Any]]:
    """Grid, runtime arguments and constexprs of one store launch."""
    n, h, d = key.shape
    args = [
        key.float().reshape(n * h, d).contiguous(),
        value.float().reshape(n * h, d).contiguous(),
        kv_cache,
        slot_mapping.to(torch.int64).contiguous(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[0] * kv_cache.shape[1],
    ]
    constexprs = dict(H=h, BLOCK_SIZE=kv_cache.shape[1], D=d, C=float(constant_c))
    return (n * h, 2), args, constexprs


def triton_ultraquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    constant_c: float = DEFAULT_CONSTANT_C,
) -> None:
    """Write the slots of ``key`` (the rotated keys, ``[N, H, D]``, ``D`` a power of two >= 32)
    and ``value`` (``[N, H, D]``) into ``kv_cache`` (uint8 ``[num_blocks, block_size, H, >= slot
    bytes]``, slots contiguous) at ``slot_mapping [N]`` (negative, or past the cache: skipped).
    The caller checks the arguments (upstream's ``ultraquant_store`` does)."""
    if key.shape[0] == 0:
        return
    grid, args, constexprs = _launch(key, value, kv_cache, slot_mapping, constant_c)
    _uq_store_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS, enable_fp_fusion=False)


def triton_compile_cases() -> list[TritonCompileCase]:
    """The store at head dims 128 and 64 (bytes per slot: 136 and 68)."""
    cases = []
    for d in (128, 64):
        key = torch.zeros(1, 2, d)
        cache = torch.zeros(1, 16, 2, ultraquant_slot_size(d), dtype=torch.uint8)
        slots = torch.zeros(1, dtype=torch.int64)
        _, args, constexprs = _launch(key, key, cache, slots, DEFAULT_CONSTANT_C)
        cases.append(
            case_from_launch(
                f"ultraquant_store/d{d}",
                _uq_store_kernel,
                args,
                constexprs,
                num_warps=_NUM_WARPS,
                enable_fp_fusion=False,
            )
        )
    return cases
