"""The Octave cache store as one Triton kernel: the bytes of the reference codec
:mod:`vllm.kv_quant.octave_codec` (and of the extension's ``_C::octave_cache_store``), on a GPU
and under Triton's interpreter.

One program writes one (token, head) slot, K then V, each in the codec's order of operations:
sign flips, the Walsh-Hadamard butterflies (each pair sum and difference one IEEE add, as a
reduction over an axis of two), the scale ``1/sqrt(block)``, then per group the two sums as the
codec's fixed halving trees (:func:`~vllm.kv_quant.octave_codec.tree_sum`; ``tl.sum`` would add in
its own order), ``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``sqrt`` are approximate on NVIDIA
GPUs), the Lloyd-Max buckets, and the fp16 scales converted on bit patterns. A head dim that is not
a power of two runs padded with zeros to the next one (the codec pads V's sums the same way).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from vllm.kv_quant.octave import OCTAVE_FORMATS, OctaveFormat
from vllm.kv_quant.octave_codec import LUT, LUT_MULT, LUT_ONE, signs, v_block
from vllm.triton_utils import tl, triton
from vllm.triton_utils.aot import TritonCompileCase, case_from_launch
from vllm.v1.attention.ops.triton_kv_encode import as_bits, f32_bits_to_fp16_bits

__all__ = ["triton_compile_cases", "triton_octave_store"]

_NUM_WARPS = 4
_RMS_FLOOR = tl.constexpr(1e-12)
_DOT_FLOOR = tl.constexpr(1e-30)
_WIDE_MULT = tl.constexpr(LUT_MULT[4])
_SCALE_ONE = tl.constexpr(LUT_ONE)


@triton.jit
def _fwht(x, NB: tl.constexpr, BLK: tl.constexpr, LOG2_BLK: tl.constexpr, NORM: tl.constexpr):
    """Orthonormal Walsh-Hadamard transform of each of the NB blocks of BLK values of x."""
    y = tl.reshape(x, [NB, BLK])
    for level in tl.static_range(LOG2_BLK):
        pairs = tl.reshape(y, [NB, BLK >> (level + 1), 2, 1 << level])  # stride 2^level
        h = tl.arange(0, 2)[None, None, :, None]
        total = tl.sum(pairs, axis=2)  # low + high
        diff = tl.sum(tl.where(h == 0, pairs, -pairs), axis=2)  # low + (-high)
        y = tl.reshape(tl.where(h == 0, total[:, :, None, :], diff[:, :, None, :]), [NB, BLK])
    return y * NORM


@triton.jit
def _tree_sum(v, G: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr):
    """[G] sums of the rows of v [G, W], halving as octave_codec.tree_sum."""
    for level in tl.static_range(LOG2_W):
        v = tl.sum(tl.reshape(v, [G, 2, W >> (level + 1)]), axis=1)  # first half + second
    return tl.reshape(v, [G])


@triton.jit
def _bucket(t, lut_ptr, FIRST: tl.constexpr, LEVELS: tl.constexpr):
    """Lloyd-Max code of t: the midpoints below it (ties low, NaN the top code, as
    torch.bucketize); the codebook's levels from lut_ptr + FIRST."""
    code = tl.zeros(t.shape, tl.int32)
    for c in tl.static_range(LEVELS - 1):
        mid = (tl.load(lut_ptr + FIRST + c) + tl.load(lut_ptr + FIRST + c + 1)) * 0.5
        code += (~(t <= mid)).to(tl.int32)
    return code


@triton.jit
def _code_groups(x, valid, lut_ptr, G: tl.constexpr, W: tl.constexpr, LOG2_W: tl.constexpr,
                 N: tl.constexpr, WIDE_GROUPS: tl.constexpr, FIRST: tl.constexpr,
                 LEVELS: tl.constexpr, MULT: tl.constexpr):  # fmt: skip
    """Codes [G * W] and fp16 scale bits [G] of the groups x [G, W] (valid: the N real values
    of each, the rest zeros). The first WIDE_GROUPS groups take 4-bit codes, the others the
    codebook at lut_ptr + FIRST (LEVELS levels, MULT units per standard deviation)."""
    wide = (tl.arange(0, G) < WIDE_GROUPS)[:, None]
    ss = _tree_sum(x * x, G, W, LOG2_W)
    rms = tl.sqrt_rn(tl.math.div_rn(ss, tl.zeros_like(ss) + N))
    rms = tl.where(rms < _RMS_FLOOR, _RMS_FLOOR, rms)  # NaN stays NaN
    mult = tl.where(wide, _WIDE_MULT, MULT)
    t = tl.math.div_rn(x, tl.zeros_like(x) + rms[:, None]) * mult
    narrow = _bucket(t, lut_ptr, FIRST, LEVELS)
    if WIDE_GROUPS > 0:
        code = tl.where(wide, _bucket(t, lut_ptr, 8, 16), narrow)
        level = tl.load(lut_ptr + tl.where(wide, 8, FIRST) + code)
    else:
        code = narrow
        level = tl.load(lut_ptr + FIRST + code)
    dot = _tree_sum(tl.where(valid, x * level, 0.0), G, W, LOG2_W)
    floored = tl.where(dot < _DOT_FLOOR, _DOT_FLOOR, dot)
    scale = tl.where(dot > 0.0, tl.math.div_rn(ss, floored), 0.0) * _SCALE_ONE
    return tl.reshape(code, [G * W]), f32_bits_to_fp16_bits(as_bits(tl.abs(scale)))


@triton.jit
def _store_codes(dst, code, DP: tl.constexpr, BITS: tl.constexpr, START: tl.constexpr,
                 END: tl.constexpr):  # fmt: skip
    """Packs the codes of dims [START, END) of code [DP] (START a multiple of 64) as one stream
    at dst (octave_codec._pack)."""
    if BITS == 4:
        nibbles = tl.reshape(code, [DP // 8, 2, 4])  # (word, nibble, byte)
        shift = (tl.arange(0, 2) * 4)[None, :, None]
        byte = tl.reshape(tl.sum(nibbles << shift, axis=1), [DP // 2])
        b = tl.arange(0, DP // 2)
        tl.store(dst + b - START // 2, byte.to(tl.uint8), mask=(b >= START // 2) & (b < END // 2))
    else:
        low = tl.reshape(code & 3, [DP // 16, 4, 4])  # (word, dims 4q.., byte)
        shift2 = (tl.arange(0, 4) * 2)[None, :, None]
        byte2 = tl.reshape(tl.sum(low << shift2, axis=1), [DP // 4])
        b2 = tl.arange(0, DP // 4)
        ok2 = (b2 >= START // 4) & (b2 < END // 4)
        tl.store(dst + b2 - START // 4, byte2.to(tl.uint8), mask=ok2)
        high = tl.reshape(code >> 2, [DP // 32, 8, 4])
        shift1 = tl.arange(0, 8)[None, :, None]
        byte1 = tl.reshape(tl.sum(high << shift1, axis=1), [DP // 8])
        b1 = tl.arange(0, DP // 8)
        ok1 = (b1 >= START // 8) & (b1 < END // 8)
        tl.store(dst + (END - START) // 4 + b1 - START // 8, byte1.to(tl.uint8), mask=ok1)


@triton.jit
def _store_fp16(dst, bits, COUNT: tl.constexpr, STORED: tl.constexpr):
    """The first STORED of COUNT fp16 bit patterns (uint32 [COUNT]), little-endian from dst."""
    i = tl.arange(0, COUNT)
    ok = i < STORED
    tl.store(dst + 2 * i, (bits & 0xFF).to(tl.uint8), mask=ok)
    tl.store(dst + 2 * i + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=ok)


@triton.jit
def _octave_store_kernel(
    key_ptr,  # fp32 [N * H, D]
    value_ptr,  # fp32 [N * H, D]
    cache_ptr,  # uint8 (num_blocks, H, block_size, slot bytes), slots contiguous
    slot_ptr,  # int64 [N]
    sign_ptr,  # fp32 [D]: the ±1 pattern
    lut_ptr,  # fp32 [24]: the 3-bit codebook, then the 4-bit one
    stride_block,
    stride_head,
    stride_pos,
    num_slots,
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,  # D rounded up to a power of two
    LOG2_DP: tl.constexpr,
    ROPE: tl.constexpr,  # block K's 4-bit dims
    COMPACT: tl.constexpr,
    K_NORM: tl.constexpr,
    V_BLK: tl.constexpr,
    LOG2_V_BLK: tl.constexpr,
    V_NORM: tl.constexpr,
    V_BITS: tl.constexpr,
    V_FIRST: tl.constexpr,
    V_LEVELS: tl.constexpr,
    V_MULT: tl.constexpr,
    NARROW_MULT: tl.constexpr,
    OFF_KN: tl.constexpr,
    OFF_V: tl.constexpr,
    OFF_SC: tl.constexpr,
    NKS: tl.constexpr,  # K scales
    SLOT: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = tl.load(slot_ptr + pid // H).to(tl.int64)
    if (slot >= 0) & (slot < num_slots):
        base = (
            cache_ptr
            + (slot // BLOCK_SIZE) * stride_block
            + (pid % H).to(tl.int64) * stride_head
            + (slot % BLOCK_SIZE) * stride_pos
        )
        d = tl.arange(0, DP)
        valid = d < D
        sgn = tl.load(sign_ptr + d, mask=valid, other=1.0)
        row = pid.to(tl.int64) * D + d
        k = tl.load(key_ptr + row, mask=valid, other=0.0) * sgn
        v = tl.load(value_ptr + row, mask=valid, other=0.0) * sgn
        if COMPACT:
            groups = _fwht(k, 1, DP, LOG2_DP, K_NORM)
            codes, scales = _code_groups(groups, valid[None, :], lut_ptr, 1, DP, LOG2_DP, D, 0,
                                         0, 8, NARROW_MULT)  # fmt: skip
            _store_codes(base, codes, DP, 3, 0, D)
            _store_fp16(base + OFF_SC, scales, 1, 1)
        else:
            groups = _fwht(k, DP // 64, 64, 6, K_NORM)
            codes, scales = _code_groups(groups, tl.reshape(valid, [DP // 64, 64]), lut_ptr,
                                         DP // 64, 64, 6, 64, ROPE // 64, 0, 8,
                                         NARROW_MULT)  # fmt: skip
            if ROPE > 0:
                _store_codes(base, codes, DP, 4, 0, ROPE)
            if ROPE < D:
                _store_codes(base + OFF_KN, codes, DP, 3, ROPE, D)
            _store_fp16(base + OFF_SC, scales, DP // 64, NKS)
        rotated = tl.reshape(_fwht(v, DP // V_BLK, V_BLK, LOG2_V_BLK, V_NORM), [1, DP])
        codes, scales = _code_groups(rotated, valid[None, :], lut_ptr, 1, DP, LOG2_DP, D, 0,
                                     V_FIRST, V_LEVELS, V_MULT)  # fmt: skip
        _store_codes(base + OFF_V, codes, DP, V_BITS, 0, D)
        _store_fp16(base + OFF_SC + 2 * NKS, scales, 1, 1)
        pad = tl.arange(0, 8)
        used = OFF_SC + 2 * (NKS + 1)
        tl.store(base + used + pad, tl.zeros([8], tl.uint8), mask=pad < SLOT - used)


@functools.cache
def _tables(head_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ±1 pattern and the codebooks (3-bit, then 4-bit) on ``device``, built once (a launch
    would otherwise copy them to the GPU every step)."""
    codebooks = torch.tensor(LUT[3] + LUT[4], dtype=torch.float32, device=device)
    return signs(head_size, device), codebooks


def _launch(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: OctaveFormat,
) -> tuple[tuple[int], list[Any], dict[str, Any]]:
    """Grid, runtime arguments and constexprs of one store launch."""
    n, h, d = key.shape
    dp = 1 << (d - 1).bit_length()
    vb = v_block(d)
    args = [
        key.float().reshape(n * h, d).contiguous(),
        value.float().reshape(n * h, d).contiguous(),
        cache,
        slot_mapping.to(torch.int64).contiguous(),
        *_tables(d, cache.device),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.shape[0] * cache.shape[2],
    ]
    constexprs = dict(
        H=h,
        BLOCK_SIZE=cache.shape[2],
        D=d,
        DP=dp,
        LOG2_DP=dp.bit_length() - 1,
        ROPE=fmt.k_wide_dim,
        COMPACT=fmt.compact,
        K_NORM=1.0 / math.sqrt(fmt.k_rotation_block),
        V_BLK=vb,
        LOG2_V_BLK=vb.bit_length() - 1,
        V_NORM=1.0 / math.sqrt(vb),
        V_BITS=fmt.v_bits,
        V_FIRST=0 if fmt.v_bits == 3 else 8,
        V_LEVELS=1 << fmt.v_bits,
        V_MULT=LUT_MULT[fmt.v_bits],
        NARROW_MULT=LUT_MULT[3],
        OFF_KN=fmt.off_k_nope,
        OFF_V=fmt.off_v,
        OFF_SC=fmt.off_scales,
        NKS=fmt.num_k_scales,
        SLOT=fmt.slot_bytes,
    )
    return (n * h,), args, constexprs


def triton_octave_store(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: OctaveFormat,
) -> None:
    """Write the slots of ``key`` / ``value [N, H, D]`` into ``cache (num_blocks, H,
    block_size, slot bytes)`` (uint8, slots contiguous) at ``slot_mapping [N]`` (negative, or
    past the cache: skipped), as :func:`~vllm.kv_quant.octave_codec.octave_cache_store`. The
    caller checks the arguments (:func:`~vllm.kv_quant.octave_codec.check_octave_store`)."""
    if key.shape[0] == 0:
        return
    grid, args, constexprs = _launch(key, value, cache, slot_mapping, fmt)
    _octave_store_kernel[grid](*args, **constexprs, num_warps=_NUM_WARPS, enable_fp_fusion=False)


def triton_compile_cases() -> list[TritonCompileCase]:
    """The store for each format at upstream's head (256, 64 rotary dims), and block K at a
    head of 192 (padded to 256) with 128 rotary dims."""
    cases = []
    names = [entry.name for entry in OCTAVE_FORMATS]
    for name, d, rope in [(name, 256, 64) for name in names] + [(names[1], 192, 128)]:
        compact = OctaveFormat.from_cache_dtype(name, d, 0).compact
        fmt = OctaveFormat.from_cache_dtype(name, d, 0 if compact else rope)
        key = torch.zeros(1, 2, d)
        cache = torch.zeros(1, 2, 16, fmt.slot_bytes, dtype=torch.uint8)
        _, args, constexprs = _launch(key, key, cache, torch.zeros(1, dtype=torch.int64), fmt)
        cases.append(
            case_from_launch(
                f"octave_store/{name}_d{d}_r{fmt.rope_dim}",
                _octave_store_kernel,
                args,
                constexprs,
                num_warps=_NUM_WARPS,
                enable_fp_fusion=False,
            )
        )
    return cases
