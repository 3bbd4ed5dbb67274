"""Pure-torch codec of the Octave KV caches (layout: :mod:`vllm.kv_quant.octave`).

Writing a slot, all in fp32 (the order of operations is upstream's reference, which its ROCm
kernels follow up to summation order):

1. Rotate: multiply by a fixed ±1 pattern (``torch.Generator`` seeded ``0x5E17``, one draw per
   dim), then an orthonormal Walsh-Hadamard transform (butterflies of stride 1, 2, 4, ..., then
   ``* 1/sqrt(block)``) over 64-dim blocks (block K), or over all ``D`` dims (compact K; V when
   ``D`` is a power of two, else 64-dim blocks).
2. Per block (each 64-dim K block, all of compact K, all of V): ``ss = sum(x^2)``,
   ``rms = max(sqrt(ss / n), 1e-12)``, code = the Lloyd-Max bucket of ``x / rms * MULT`` (ties to
   the lower code, NaN to the top one), ``scale = ss / dot(x, LUT[code]) * 64`` (0 when the dot
   is not positive), stored as fp16. A code ``c`` reads back as ``LUT[c] * (scale / 64)``; the
   scale makes ``x . x_hat = |x|^2`` rather than a least-squares fit, which would shrink the
   vector. Both sums run in :func:`tree_sum`'s fixed order (upstream's reference leaves the order
   to torch, which differs between CPUs and devices, so its fp16 scales can differ from these by
   an ulp in a few slots in 10^4; the codes agree).
3. Pack: 4-bit codes as little-endian words of 8 dims (byte ``j`` holds dim ``j`` low and
   ``j + 4`` high); 3-bit codes as a 2-bit plane (word per 16 dims, dims ``4i..4i+3`` at bits
   ``2i`` of bytes 0..3) then a 1-bit plane (word per 32 dims, dims ``4i..4i+3`` at bit ``i``).

Attention runs in the rotated space; :func:`octave_decode` can undo the rotation.
"""

from __future__ import annotations

import functools
import math

import torch

from vllm.kv_quant.nvfp4_cache import check_slot_mapping
from vllm.kv_quant.octave import HADAMARD_BLOCK, NOPE_BITS, ROPE_BITS, OctaveFormat

__all__ = [
    "LUT",
    "LUT_MULT",
    "LUT_ONE",
    "SIGN_SEED",
    "check_octave_store",
    "fwht_blocks",
    "octave_cache_store",
    "octave_decode",
    "octave_encode",
    "rotate",
    "sign_bits",
    "signs",
    "tree_sum",
    "unrotate",
    "v_block",
]

SIGN_SEED = 0x5E17
"""Seed of the ±1 pattern applied before the Hadamard transform."""

LUT: dict[int, tuple[int, ...]] = {
    3: (-127, -79, -45, -14, 14, 45, 79, 127),
    4: (-126, -95, -74, -58, -43, -30, -18, -6, 6, 18, 30, 43, 58, 74, 95, 126),
}
"""Lloyd-Max codebooks of N(0, 1) as int8, by code width: ``LUT[b][c] / LUT_MULT[b]``
approximates centroid ``c``."""

LUT_MULT: dict[int, float] = {3: 59.0, 4: 46.0}
"""Codebook units per standard deviation, by code width."""

LUT_ONE = 64.0
"""Fixed point of the stored scales (keeps small blocks' fp16 scales out of subnormals)."""

_RMS_FLOOR = 1e-12
_DOT_FLOOR = 1e-30


@functools.cache
def _sign_draws(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64) * -2 + 1


def signs(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed ±1 pattern (fp32 ``[n]``) applied before the Hadamard transform."""
    return _sign_draws(n).to(device=device, dtype=torch.float32)


def sign_bits(n: int) -> torch.Tensor:
    """The pattern as the kernels take it: int32 words, bit ``i`` set where sign ``i`` is -1
    (``n`` a multiple of 32)."""
    if n <= 0 or n % 32:
        raise ValueError(f"n: expected a positive multiple of 32, got {n}")
    negative = (_sign_draws(n) < 0).to(torch.int64).view(-1, 32)
    words = (negative << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def fwht_blocks(x: torch.Tensor, block: int = HADAMARD_BLOCK) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform (fp32) of each ``block`` consecutive values of the
    last dim (a power of two dividing it)."""
    if block <= 0 or block & (block - 1) or x.shape[-1] % block:
        raise ValueError(
            f"block: expected a power of two dividing the last dim {x.shape[-1]}, got {block}"
        )
    y = x.float().reshape(-1, block)
    stride = 1
    while stride < block:
        pairs = y.view(-1, block // (2 * stride), 2, stride)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((low + high, low - high), dim=2).view(-1, block)
        stride *= 2
    return (y * (1.0 / math.sqrt(block))).view(x.shape)


def rotate(x: torch.Tensor, sgn: torch.Tensor, block: int = HADAMARD_BLOCK) -> torch.Tensor:
    """Sign flips, then the blockwise transform (fp32)."""
    return fwht_blocks(x.float() * sgn, block)


def unrotate(y: torch.Tensor, sgn: torch.Tensor, block: int = HADAMARD_BLOCK) -> torch.Tensor:
    """The inverse of :func:`rotate` (the transform is its own inverse)."""
    return fwht_blocks(y.float(), block) * sgn


def v_block(head_size: int) -> int:
    """V's Hadamard block: all dims when ``head_size`` is a power of two, else 64."""
    return head_size if head_size & (head_size - 1) == 0 else HADAMARD_BLOCK


def _lut(bits: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(LUT[bits], dtype=torch.float32, device=device)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum (``[..., 1]``) of the last dim in a fixed pairwise order: zero-padded to a power of
    two, then halved (``x[:n/2] + x[n/2:]``) until one value is left. Every writer adds in this
    order, so the sums, and the bytes, are the same on every device."""
    n = x.shape[-1]
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


def _quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8) of each row of the last dim and its scale (fp32, ``[..., 1]``)."""
    lut = _lut(bits, x.device)
    ss = tree_sum(x * x)
    rms = (ss / x.shape[-1]).sqrt().clamp_min(_RMS_FLOOR)
    codes = torch.bucketize(x / rms * LUT_MULT[bits], (lut[1:] + lut[:-1]) / 2)
    dot = tree_sum(x * lut[codes])
    scale = torch.where(dot > 0, ss / dot.clamp_min(_DOT_FLOOR), 0.0) * LUT_ONE
    # abs: a NaN scale (an Inf in the input) is stored as the positive quiet NaN on every device.
    return codes.to(torch.uint8), scale.abs()


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., n]`` → bytes ``[..., n * bits / 8]`` (layout in the module docstring)."""
    c = codes.to(torch.int64)
    lead = c.shape[:-1]
    if bits == 4:
        words = c.view(*lead, -1, 2, 4)  # (word, nibble, byte)
        return (words[..., 0, :] | (words[..., 1, :] << 4)).reshape(*lead, -1).to(torch.uint8)
    shift2 = (2 * torch.arange(4, device=c.device)).view(4, 1)
    plane2 = ((c & 3).view(*lead, -1, 4, 4) << shift2).sum(-2)
    shift1 = torch.arange(8, device=c.device).view(8, 1)
    plane1 = ((c >> 2).view(*lead, -1, 8, 4) << shift1).sum(-2)
    return torch.cat((plane2.reshape(*lead, -1), plane1.reshape(*lead, -1)), -1).to(torch.uint8)


def _unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Bytes → ``n`` codes (int64), the inverse of :func:`_pack`."""
    p = packed.to(torch.int64)
    lead = p.shape[:-1]
    if bits == 4:
        words = p.view(*lead, -1, 1, 4)
        return torch.cat((words & 15, words >> 4), dim=-2).reshape(*lead, n)
    shift2 = (2 * torch.arange(4, device=p.device)).view(4, 1)
    plane2 = (p[..., : n // 4].view(*lead, -1, 1, 4) >> shift2) & 3
    shift1 = torch.arange(8, device=p.device).view(8, 1)
    plane1 = (p[..., n // 4 :].view(*lead, -1, 1, 4) >> shift1) & 1
    return plane2.reshape(*lead, n) + 4 * plane1.reshape(*lead, n)


def _check_kv(key: torch.Tensor, value: torch.Tensor, fmt: OctaveFormat) -> None:
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a floating-point tensor, got {got}")
        if t.dim() != 3 or t.shape[-1] != fmt.head_size:
            raise ValueError(f"{name}: expected shape [T, H, {fmt.head_size}], got {list(t.shape)}")
    if value.shape != key.shape or value.device != key.device:
        raise ValueError(
            f"value: expected shape {list(key.shape)} on {key.device} (key's), "
            f"got {list(value.shape)} on {value.device}"
        )


def octave_encode(key: torch.Tensor, value: torch.Tensor, fmt: OctaveFormat) -> torch.Tensor:
    """Slots ``[T, H, slot_bytes]`` (uint8) of ``key`` and ``value`` ``[T, H, D]``."""
    _check_kv(key, value, fmt)
    t, h, d = key.shape
    sgn = signs(d, key.device)
    out = torch.zeros(t, h, fmt.slot_bytes, dtype=torch.uint8, device=key.device)
    if fmt.compact:
        k_codes, k_scale = _quantize(rotate(key, sgn, d), NOPE_BITS)
        out[..., : fmt.off_v] = _pack(k_codes, NOPE_BITS)
        k_scales = k_scale
    else:
        blocks = rotate(key, sgn).view(t, h, fmt.num_k_blocks, HADAMARD_BLOCK)
        nr = fmt.num_rope_blocks
        rope_codes, rope_scale = _quantize(blocks[:, :, :nr], ROPE_BITS)
        nope_codes, nope_scale = _quantize(blocks[:, :, nr:], NOPE_BITS)
        out[..., : fmt.off_k_nope] = _pack(rope_codes.view(t, h, fmt.rope_dim), ROPE_BITS)
        out[..., fmt.off_k_nope : fmt.off_v] = _pack(nope_codes.view(t, h, fmt.nope_dim), NOPE_BITS)
        k_scales = torch.cat((rope_scale[..., 0], nope_scale[..., 0]), -1)
    v_codes, v_scale = _quantize(rotate(value, sgn, v_block(d)), fmt.v_bits)
    out[..., fmt.off_v : fmt.off_scales] = _pack(v_codes, fmt.v_bits)
    scale_bytes = torch.cat((k_scales, v_scale), -1).to(torch.float16).view(torch.uint8)
    out[..., fmt.off_scales : fmt.off_scales + 2 * fmt.num_scales] = scale_bytes
    return out


def octave_decode(
    slots: torch.Tensor, fmt: OctaveFormat, rotated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(K, V)`` ``[T, H, D]`` of slots ``[T, H, slot_bytes]``; ``rotated=True`` leaves
    them in the rotated space the attention kernels work in."""
    if not isinstance(slots, torch.Tensor) or slots.dtype != torch.uint8 or slots.dim() != 3:
        got = f"{slots.dtype} {list(slots.shape)}" if isinstance(slots, torch.Tensor) else slots
        raise ValueError(f"slots: expected a uint8 [T, H, slot_bytes] tensor, got {got}")
    if slots.shape[-1] != fmt.slot_bytes:
        raise ValueError(f"slots: expected {fmt.slot_bytes} bytes per slot, got {slots.shape[-1]}")
    t, h, _ = slots.shape
    d, dev = fmt.head_size, slots.device
    scale_bytes = slots[..., fmt.off_scales : fmt.off_scales + 2 * fmt.num_scales]
    scales = scale_bytes.contiguous().view(torch.float16).float() / LUT_ONE
    if fmt.compact:
        codes = _unpack(slots[..., : fmt.off_v], d, NOPE_BITS)
        k = _lut(NOPE_BITS, dev)[codes] * scales[..., :1]
    else:
        rope = _lut(ROPE_BITS, dev)[_unpack(slots[..., : fmt.off_k_nope], fmt.rope_dim, ROPE_BITS)]
        nope_codes = _unpack(slots[..., fmt.off_k_nope : fmt.off_v], fmt.nope_dim, NOPE_BITS)
        nope = _lut(NOPE_BITS, dev)[nope_codes]
        k = torch.cat((rope, nope), -1).view(t, h, fmt.num_k_blocks, HADAMARD_BLOCK)
        k = (k * scales[..., : fmt.num_k_blocks, None]).view(t, h, d)
    v_codes = _unpack(slots[..., fmt.off_v : fmt.off_scales], d, fmt.v_bits)
    v = _lut(fmt.v_bits, dev)[v_codes] * scales[..., -1:]
    if not rotated:
        sgn = signs(d, dev)
        k = unrotate(k, sgn, fmt.k_rotation_block)
        v = unrotate(v, sgn, v_block(d))
    return k, v


def octave_cache_store(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: OctaveFormat,
) -> None:
    """Write token ``t``'s slots into ``cache (B, H, N, slot_bytes)`` (uint8, any strides) at
    flat slot ``slot_mapping[t]`` (block ``s // N``, offset ``s % N``); negative slots
    (padding) leave the cache unchanged."""
    check_octave_store(key, value, cache, slot_mapping, fmt)
    keep = slot_mapping >= 0
    n = slot_mapping.shape[0]
    slots = octave_encode(key[:n][keep], value[:n][keep], fmt)
    flat = slot_mapping[keep]
    block_size = cache.shape[2]
    cache[flat // block_size, :, flat % block_size] = slots


def check_octave_store(
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: OctaveFormat,
) -> None:
    """``ValueError`` (``<arg>: expected X, got Y``) unless :func:`octave_cache_store` can take
    these arguments: ``key`` / ``value [T, H, D]``, ``cache (B, H, N, slot_bytes)`` uint8 on
    their device, ``slot_mapping`` int64 ``[<= T]`` within the cache or negative."""
    _check_kv(key, value, fmt)
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[-1] != fmt.slot_bytes:
        raise ValueError(
            f"cache: expected a uint8 (B, H, N, {fmt.slot_bytes}) tensor, got {cache.dtype} "
            f"of shape {list(cache.shape)}"
        )
    if cache.shape[1] != key.shape[1] or cache.device != key.device:
        raise ValueError(
            f"key: expected {cache.shape[1]} KV heads on {cache.device} (the cache's), "
            f"got {key.shape[1]} on {key.device}"
        )
    num_blocks, _, block_size, _ = cache.shape
    check_slot_mapping(slot_mapping, key.shape[0], num_blocks * block_size, cache.device)
