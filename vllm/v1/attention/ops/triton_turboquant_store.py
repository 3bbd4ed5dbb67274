"""TurboQuant's cache store as one Triton kernel (upstream v0.33.0's ``triton_turboquant_store``
at upstream's path): the bytes of the reference codec :mod:`vllm.kv_quant.turboquant.codec`,
on a GPU and under Triton's interpreter.

Lloyd-Max presets: the key norms and the rotation ``y = k / (|k| + 1e-8) @ PiT`` are one torch
matmul before the launch (the codec's :func:`~vllm.kv_quant.turboquant.codec.rotate_unit_keys`,
so both see the same ``y``); the kernel codes ``y``, packs the codes and the fp16 norm, and codes
and packs the value. FP8 presets: the kernel rounds the key to e4m3 itself. Every float
conversion is done on bit patterns (:mod:`.triton_kv_encode`) and the one division is ``div_rn``
with FMA contraction off, because the interpreter's and the GPU's own conversions and ``/``
differ from torch's.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.kv_quant.turboquant.codec import (
    check_turboquant_store,
    rotate_unit_keys,
)
from vllm.kv_quant.turboquant.config import TQ_PRESETS, TurboQuantConfig
from vllm.triton_utils import tl, triton
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_kv_encode import (
    as_bits,
    f32_bits_to_fp16_bits,
    f32_to_e4m3,
)

__all__ = ["triton_compile_cases", "triton_turboquant_store"]

_NUM_WARPS = 4


@triton.jit
def _store_codes(dst_ptr, codes, BITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Pack ``codes`` (int32, BITS wide) as a little-endian bit stream: 8 codes per BITS bytes."""
    groups = tl.reshape(codes, [BLOCK_D // 8, 8])
    shifts = tl.arange(0, 8) * BITS
    words = tl.sum(groups << shifts[None, :], axis=1)
    g = tl.arange(0, BLOCK_D // 8)
    for k in tl.static_range(BITS):
        tl.store(dst_ptr + g * BITS + k, ((words >> (8 * k)) & 0xFF).to(tl.uint8), mask=g < D // 8)


@triton.jit
def _store_fp16(dst_ptr, x):
    """fp32 scalar ``x`` as 2 little-endian fp16 bytes, rounded to nearest even."""
    h = f32_bits_to_fp16_bits(as_bits(x))
    tl.store(dst_ptr, (h & 0xFF).to(tl.uint8))
    tl.store(dst_ptr + 1, ((h >> 8) & 0xFF).to(tl.uint8))


@triton.jit
def _tq_store_kernel(
    key_ptr,  # fp32 [N*H, D]: the keys (FP8) or their rotated unit vectors y (Lloyd-Max)
    norm_ptr,  # fp32 [N*H]: key norms (Lloyd-Max only)
    value_ptr,  # fp32 [N*H, D]
    midpoint_ptr,  # fp32 [2**MSE_BITS - 1], ascending (Lloyd-Max only)
    cache_ptr,  # uint8 [num_blocks, block_size, H, slot bytes]
    slot_ptr,  # int [N]
    stride_block,
    stride_pos,
    stride_head,
    num_slots,
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_FP8: tl.constexpr,
    MSE_BITS: tl.constexpr,
    KPS: tl.constexpr,
    VQB: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.load(slot_ptr + pid // H).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        base = (
            cache_ptr
            + (slot // BLOCK_SIZE) * stride_block
            + (slot % BLOCK_SIZE) * stride_pos
            + (pid % H).to(tl.int64) * stride_head
        )
        d = tl.arange(0, BLOCK_D)
        in_row = d < D
        row = pid.to(tl.int64) * D
        k = tl.load(key_ptr + row + d, mask=in_row, other=0.0)
        if KEY_FP8:
            tl.store(base + d, f32_to_e4m3(k).to(tl.uint8), mask=in_row)
        else:
            # Code = number of midpoints <= y (a NaN compares false everywhere: code 0).
            code = tl.zeros([BLOCK_D], dtype=tl.int32)
            for i in tl.static_range(2**MSE_BITS - 1):
                code += (k >= tl.load(midpoint_ptr + i)).to(tl.int32)
            _store_codes(base, code, MSE_BITS, D, BLOCK_D)
            _store_fp16(base + D * MSE_BITS // 8, tl.load(norm_ptr + pid))
        v = tl.load(value_ptr + row + d, mask=in_row, other=0.0)
        lo = tl.min(tl.where(in_row, v, float("inf")), axis=0)
        hi = tl.max(tl.where(in_row, v, -float("inf")), axis=0)
        LEVELS: tl.constexpr = (1 << VQB) - 1
        scale = tl.math.div_rn(hi - lo, tl.zeros_like(hi) + LEVELS)
        scale = tl.where(scale > 1e-8, scale, 1e-8)
        shifted = tl.math.div_rn(v - lo, tl.zeros_like(v) + scale) + 0.5
        vcode = tl.minimum(tl.maximum(shifted.to(tl.int32), 0), LEVELS)
        _store_codes(base + KPS, vcode, VQB, D, BLOCK_D)
        _store_fp16(base + KPS + D * VQB // 8, scale)
        _store_fp16(base + KPS + D * VQB // 8 + 2, lo)


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    midpoints: torch.Tensor,
    cfg: TurboQuantConfig,
) -> tuple[tuple[int], list[Any], dict[str, Any]]:
    """Grid, runtime arguments and constexprs of one store launch."""
    n, h, d = key.shape
    if cfg.key_fp8:
        keys = key.float().reshape(n * h, d).contiguous()
        norms = mids = keys  # FP8 keys read no norms or midpoints: any fp32 pointer will do
    else:
        keys, norms = rotate_unit_keys(key, PiT)
        mids = midpoints.float().contiguous()
    args = [
        keys.contiguous(),
        norms.contiguous(),
        value.float().reshape(n * h, d).contiguous(),
        mids,
        kv_cache,
        slot_mapping,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.shape[0] * kv_cache.shape[1],
    ]
    constexprs = dict(
        H=h,
        BLOCK_SIZE=kv_cache.shape[1],
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        KEY_FP8=cfg.key_fp8,
        MSE_BITS=cfg.key_mse_bits,
        KPS=cfg.key_packed_size,
        VQB=cfg.value_quant_bits,
    )
    return (n * h,), args, constexprs


def triton_turboquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    midpoints: torch.Tensor,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
) -> None:
    """Store ``key`` / ``value`` ``[N, H, D]`` into ``kv_cache [num_blocks, block_size, H, slot
    bytes]`` (uint8) at ``slot_mapping [N]`` (negative: skipped), as
    :func:`~vllm.kv_quant.turboquant.codec.turboquant_write_cache`. ``PiT`` (fp32 ``[D, D]``)
    and ``midpoints`` (fp32 ``[2**mse_bits - 1]``, ascending) serve Lloyd-Max keys; the bit
    widths and ``key_packed_size`` (bytes) are those of a :class:`TurboQuantConfig`."""
    cfg, _, _ = check_turboquant_store(
        key,
        value,
        kv_cache,
        slot_mapping,
        PiT,
        midpoints,
        mse_bits,
        key_packed_size,
        value_quant_bits,
        key_fp8,
    )
    if key.shape[0] == 0:
        return
    grid, args, constexprs = _launch(key, value, kv_cache, slot_mapping, PiT, midpoints, cfg)
    _tq_store_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS, enable_fp_fusion=False)


def triton_compile_cases() -> list[TritonCompileCase]:
    """The store for each preset at head dims 128 and 96 (a row shorter than its block)."""
    cases = []
    for name in TQ_PRESETS:
        for d in (128, 96):
            cfg = TurboQuantConfig.from_cache_dtype(name, d)
            key = torch.zeros(1, 2, d)
            cache = torch.zeros(1, 16, 2, cfg.slot_size_aligned, dtype=torch.uint8)
            pit = torch.zeros(d, d)
            mids = torch.zeros(max(2**cfg.key_mse_bits - 1, 1))
            slots = torch.zeros(1, dtype=torch.int64)
            _, args, constexprs = _launch(key, key, cache, slots, pit, mids, cfg)
            cases.append(
                case_from_launch(
                    f"store/{name}/d{d}",
                    _tq_store_kernel,
                    args,
                    constexprs,
                    num_warps=_NUM_WARPS,
                    enable_fp_fusion=False,
                )
            )
    return cases
