"""Pure-torch reference codec of TurboQuant's packed K+V slot: the bytes the Triton store
(:mod:`vllm.v1.attention.ops.triton_turboquant_store`) writes, and their decoding.

One slot holds one (token, KV head), ``cfg.slot_size`` bytes, little-endian throughout:

* key, FP8 presets: ``D`` e4m3 bytes of the key (round to nearest even, ``|k| > 448`` → ±448,
  NaN → 0x7F: the GPU's saturating conversion);
* key, Lloyd-Max presets: the key is widened to fp32, its L2 norm ``n`` taken, ``k / (n + 1e-8)``
  rotated by ``PiT`` (``y = x @ PiT``, a torch matmul shared with the Triton store), and each
  ``y_d`` coded as the number of ``midpoints`` ``<= y_d`` (NaN → 0); the codes are packed as a
  little-endian bit stream (code ``d`` in bits ``[b*d, b*d + b)``), then ``fp16(n)``;
* value: ``lo = min(v)``, ``s = max((max(v) - lo) / (2**b - 1), 1e-8)`` in fp32, code
  ``clamp(trunc((v - lo) / s + 0.5), 0, 2**b - 1)``, packed the same way, then ``fp16(s)``,
  ``fp16(lo)``.

Values must be finite (the codes of NaN / Inf values are unspecified, as upstream's).
"""

from __future__ import annotations

import torch

from vllm.kv_quant.fp8 import Fp8Format, fp8_bytes_to_fp32, fp32_to_fp8_bytes
from vllm.kv_quant.turboquant.config import TurboQuantConfig, kernel_config

__all__ = [
    "KEY_NORM_EPS",
    "VALUE_SCALE_FLOOR",
    "check_turboquant_cache",
    "check_turboquant_inputs",
    "check_turboquant_store",
    "rotate_unit_keys",
    "turboquant_encode_slots",
    "turboquant_decode_slots",
    "turboquant_read_cache",
    "turboquant_write_cache",
]

KEY_NORM_EPS = 1e-8
"""Added to a key's norm before dividing by it (an all-zero key stays zero)."""

VALUE_SCALE_FLOOR = 1e-8
"""Smallest value scale (a constant value vector codes as all zeros)."""

_GROUP = 8  # codes per packed group: b bytes hold 8 codes of b bits
_SOURCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_turboquant_inputs(
    key: torch.Tensor, value: torch.Tensor, cfg: TurboQuantConfig
) -> tuple[int, int, int]:
    """``(N, H, D)`` of matching ``[N, H, D]`` float ``key`` / ``value`` with ``D`` the
    config's head dim, a multiple of 8 (codes pack in groups of 8); else ``ValueError``."""
    for name, t in (("key", key), ("value", value)):
        if t.dtype not in _SOURCE_DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
        if t.dim() != 3:
            raise ValueError(f"{name}: expected shape [N, H, D], got {list(t.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value: expected key's shape {list(key.shape)}, got {list(value.shape)}")
    n, h, d = key.shape
    if d != cfg.head_dim or d % _GROUP != 0:
        raise ValueError(f"key: expected head dim {cfg.head_dim} (a multiple of {_GROUP}), got {d}")
    return n, h, d


def _check_table(
    cfg: TurboQuantConfig, table: torch.Tensor | None, name: str, size: int
) -> torch.Tensor:
    if table is None or table.dtype != torch.float32 or table.shape != (size,):
        got = None if table is None else f"{table.dtype} {list(table.shape)}"
        raise ValueError(
            f"{name}: expected float32 [{size}] for {cfg.key_mse_bits}-bit keys, got {got}"
        )
    return table


def _check_rotation(rotation: torch.Tensor | None, d: int, name: str) -> torch.Tensor:
    if rotation is None or rotation.dtype != torch.float32 or rotation.shape != (d, d):
        got = None if rotation is None else f"{rotation.dtype} {list(rotation.shape)}"
        raise ValueError(f"{name}: expected float32 [{d}, {d}], got {got}")
    return rotation


def rotate_unit_keys(key: torch.Tensor, PiT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y [N*H, D], norms [N*H])`` fp32: each key's L2 norm and its unit vector rotated by
    ``PiT``. The one place the Lloyd-Max presets compute these, so that the codec and the Triton
    store (which codes ``y`` in a kernel) see the same bits on a device."""
    flat = key.float().reshape(-1, key.shape[-1])
    norms = flat.norm(dim=1, keepdim=True)
    return (flat / (norms + KEY_NORM_EPS)) @ PiT, norms.squeeze(1)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` int codes (< 2**bits) → ``[..., D * bits / 8]`` bytes, little-endian bits."""
    groups = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, _GROUP)
    shifts = torch.arange(_GROUP, device=codes.device) * bits
    words = (groups << shifts).sum(dim=-1, keepdim=True)
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*codes.shape[:-1], -1)


def _unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`_pack_codes`: ``[..., D * bits / 8]`` bytes → ``[..., D]`` int64."""
    groups = packed.to(torch.int64).reshape(*packed.shape[:-1], d // _GROUP, bits)
    byte_shifts = torch.arange(bits, device=packed.device) * 8
    words = (groups << byte_shifts).sum(dim=-1, keepdim=True)
    shifts = torch.arange(_GROUP, device=packed.device) * bits
    return ((words >> shifts) & ((1 << bits) - 1)).reshape(*packed.shape[:-1], d)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[...]`` fp32 → ``[..., 2]`` little-endian fp16 bytes (round to nearest even)."""
    return x.to(torch.float16).reshape(*x.shape, 1).view(torch.uint8)


def _fp16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _encode_values(value: torch.Tensor, bits: int) -> torch.Tensor:
    v = value.float()
    levels = (1 << bits) - 1
    lo = v.amin(dim=-1, keepdim=True)
    scale = (v.amax(dim=-1, keepdim=True) - lo) / float(levels)
    scale = torch.where(scale > VALUE_SCALE_FLOOR, scale, torch.full_like(scale, VALUE_SCALE_FLOOR))
    codes = ((v - lo) / scale + 0.5).to(torch.int32).clamp(0, levels)
    return torch.cat(
        (_pack_codes(codes, bits), _fp16_bytes(scale.squeeze(-1)), _fp16_bytes(lo.squeeze(-1))),
        dim=-1,
    )


def turboquant_encode_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    cfg: TurboQuantConfig,
    PiT: torch.Tensor | None = None,
    midpoints: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``[N, H, cfg.slot_size]`` uint8 slots of ``key`` / ``value`` ``[N, H, D]`` (module
    docstring). Lloyd-Max presets need ``PiT`` (fp32 ``[D, D]``) and ``midpoints`` (fp32, the
    ``2**key_mse_bits - 1`` ascending decision boundaries); FP8 presets ignore both."""
    n, h, d = check_turboquant_inputs(key, value, cfg)
    if cfg.key_fp8:
        key_bytes = fp32_to_fp8_bytes(key.float(), Fp8Format.E4M3)
    else:
        rotation = _check_rotation(PiT, d, "PiT")
        mids = _check_table(cfg, midpoints, "midpoints", 2**cfg.key_mse_bits - 1)
        y, norms = rotate_unit_keys(key, rotation)
        codes = torch.searchsorted(mids.to(y.device), y.contiguous(), right=True)
        codes = torch.where(torch.isnan(y), torch.zeros_like(codes), codes)
        key_bytes = torch.cat((_pack_codes(codes, cfg.key_mse_bits), _fp16_bytes(norms)), dim=-1)
        key_bytes = key_bytes.reshape(n, h, cfg.key_packed_size)
    return torch.cat((key_bytes, _encode_values(value, cfg.value_quant_bits)), dim=-1)


def turboquant_decode_slots(
    slots: torch.Tensor,
    cfg: TurboQuantConfig,
    centroids: torch.Tensor | None = None,
    Pi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)`` fp32 ``[..., D]`` of uint8 slots ``[..., >= cfg.slot_size]``.

    Lloyd-Max keys decode to ``norm * c`` with ``c`` the codes' ``centroids`` (fp32
    ``[2**key_mse_bits]``), ``c`` rescaled to unit length first under norm correction, in the
    rotated frame; ``Pi`` (fp32 ``[D, D]``, the inverse of the store's ``PiT``) rotates them back.
    Values decode to ``code * scale + lo``."""
    if slots.dtype != torch.uint8 or slots.dim() < 1 or slots.shape[-1] < cfg.slot_size:
        raise ValueError(
            f"slots: expected uint8 [..., >= {cfg.slot_size}], got {slots.dtype} "
            f"{list(slots.shape)}"
        )
    d, kps = cfg.head_dim, cfg.key_packed_size
    if cfg.key_fp8:
        key = fp8_bytes_to_fp32(slots[..., :d].contiguous(), Fp8Format.E4M3)
    else:
        table = _check_table(cfg, centroids, "centroids", 2**cfg.key_mse_bits).to(slots.device)
        code_bytes = kps - 2
        c = table[_unpack_codes(slots[..., :code_bytes], cfg.key_mse_bits, d)]
        if cfg.norm_correction:
            c = c / torch.sqrt((c * c).sum(dim=-1, keepdim=True) + 1e-16)
        key = _fp16_from_bytes(slots[..., code_bytes:kps]).unsqueeze(-1) * c
        if Pi is not None:
            key = key @ _check_rotation(Pi, d, "Pi")
    bits = cfg.value_quant_bits
    data_end = kps + d * bits // 8
    codes = _unpack_codes(slots[..., kps:data_end], bits, d).float()
    scale = _fp16_from_bytes(slots[..., data_end : data_end + 2]).unsqueeze(-1)
    lo = _fp16_from_bytes(slots[..., data_end + 2 : data_end + 4]).unsqueeze(-1)
    return key, codes * scale + lo


def check_turboquant_cache(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    n: int,
    h: int,
    cfg: TurboQuantConfig,
    *,
    check_range: bool = True,
) -> None:
    """``ValueError`` unless ``kv_cache`` is uint8 ``[num_blocks, block_size, h, >= slot_size]``
    with contiguous slots and ``slot_mapping`` int32/int64 ``[n]``, and (``check_range``, which
    syncs with the device) every slot is below ``num_blocks * block_size``."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[2] != h:
        raise ValueError(
            f"kv_cache: expected uint8 [num_blocks, block_size, {h}, slot bytes], got "
            f"{kv_cache.dtype} {list(kv_cache.shape)}"
        )
    if kv_cache.shape[3] < cfg.slot_size or kv_cache.stride(3) != 1:
        raise ValueError(
            f"kv_cache: expected contiguous slots of >= {cfg.slot_size} bytes, got shape "
            f"{list(kv_cache.shape)} strides {list(kv_cache.stride())}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (n,):
        raise ValueError(
            f"slot_mapping: expected int32/int64 [{n}], got {slot_mapping.dtype} "
            f"{list(slot_mapping.shape)}"
        )
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    if check_range and n and int(slot_mapping.max()) >= num_slots:
        raise ValueError(
            f"slot_mapping: expected slots < {num_slots} (negative to skip a token), got "
            f"{int(slot_mapping.max())}"
        )


def check_turboquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    PiT: torch.Tensor,
    midpoints: torch.Tensor,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool,
) -> tuple[TurboQuantConfig, int, int]:
    """``(cfg, N, H)`` of a store with upstream's ``triton_turboquant_store`` arguments, checked
    (``ValueError`` on the first bad one): the config they describe, the inputs, the cache, the
    devices and, for Lloyd-Max keys, ``PiT`` and ``midpoints``. Slot ranges are checked on a CPU
    cache only: a GPU kernel skips slots past the cache rather than sync."""
    d = key.shape[-1] if key.dim() else 0
    cfg = kernel_config(d, mse_bits, key_packed_size, value_quant_bits, key_fp8)
    n, h, _ = check_turboquant_inputs(key, value, cfg)
    on_cpu = kv_cache.device.type == "cpu"
    check_turboquant_cache(kv_cache, slot_mapping, n, h, cfg, check_range=on_cpu)
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != kv_cache.device:
            raise ValueError(
                f"{name}: expected device {kv_cache.device} (kv_cache's), got {t.device}"
            )
    if not cfg.key_fp8:
        _check_rotation(PiT, d, "PiT")
        _check_table(cfg, midpoints, "midpoints", 2**mse_bits - 1)
    return cfg, n, h


def _slot_index(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, blocks, offsets)`` of the non-negative slots of a checked ``slot_mapping``."""
    block_size = kv_cache.shape[1]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    tokens = torch.nonzero(slots >= 0).squeeze(1)
    live = slots[tokens]
    return tokens, live // block_size, live % block_size


def turboquant_write_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cfg: TurboQuantConfig,
    PiT: torch.Tensor | None = None,
    midpoints: torch.Tensor | None = None,
) -> None:
    """Write token ``i``'s slots into ``kv_cache [num_blocks, block_size, H, >= slot_size]``
    at slot ``slot_mapping[i]`` (negative: skipped); bytes past ``slot_size`` (the padding)
    are left as they are. Everything is checked before anything is written."""
    n, h, _ = check_turboquant_inputs(key, value, cfg)
    check_turboquant_cache(kv_cache, slot_mapping, n, h, cfg)
    tokens, blocks, offsets = _slot_index(kv_cache, slot_mapping)
    packed = turboquant_encode_slots(key, value, cfg, PiT, midpoints).to(kv_cache.device)
    kv_cache[blocks, offsets, :, : cfg.slot_size] = packed[tokens]


def turboquant_read_cache(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cfg: TurboQuantConfig,
    centroids: torch.Tensor | None = None,
    Pi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(key, value)`` fp32 ``[N, H, D]`` decoded from the slots ``slot_mapping`` names (all
    non-negative) with :func:`turboquant_decode_slots`."""
    n = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    heads = kv_cache.shape[2] if kv_cache.dim() == 4 else -1
    check_turboquant_cache(kv_cache, slot_mapping, n, heads, cfg)
    tokens, blocks, offsets = _slot_index(kv_cache, slot_mapping)
    if tokens.numel() != n:
        raise ValueError("slot_mapping: expected every slot to be non-negative, got a negative one")
    return turboquant_decode_slots(kv_cache[blocks, offsets], cfg, centroids, Pi)
