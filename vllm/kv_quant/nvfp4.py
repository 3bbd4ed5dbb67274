"""Reference NVFP4 codec: E2M1 values, FP8-e4m3 block scales, fp32 global scale.

Byte format (docs/design.md §5). Each group of 16 consecutive elements of the last dim shares one
e4m3 block scale byte ``sf``; each element is a 4-bit E2M1 code (bit 3 = sign, bits 0..2 index
into :data:`E2M1_VALUES`). Two codes per byte, even element in the low nibble. ``global_scale``
is the fp32 *dequantization* scale: ``x ≈ E2M1[q] * float(sf) * global_scale``.

Quantization follows a fixed sequence of separately rounded fp32 operations so that every
implementation (this file, the C++ CPU kernel, the CUDA kernels) produces identical bytes; see
:func:`quantize_nvfp4`.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import NVFP4_GROUP_SIZE
from vllm.kv_quant.fp8 import (
    FP8_E4M3_MAX,
    FP8_NAN_BYTE,
    Fp8Format,
    fp8_bytes_to_fp32,
    fp32_to_fp8_bytes,
)

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""Magnitudes of E2M1 codes 0..7 (codes 8..15 are the same magnitudes, negative)."""

E2M1_MAX = 6.0
"""Largest E2M1 magnitude (saturation bound)."""

NVFP4_SCALE_MAX = FP8_E4M3_MAX * E2M1_MAX
"""``MAX`` of the recommended global scale ``amax(|x|) / MAX`` (448 × 6 = 2688): the group
holding ``amax`` then gets block scale 448, the top of e4m3, so every smaller group's block scale
keeps its three mantissa bits for 2.6 binades longer than with ``amax / 448`` (whose largest block
scale is 448 / 6 ≈ 75) before it turns subnormal or zero (docs/design.md §5.3)."""

_FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

SCALE_SEARCH_4OVER6 = "4over6"
"""``KVCacheFormat.scale_search`` value of ``nvfp4_4over6``: each group's block scale is
``amax / 6`` or ``amax / 4``, whichever reconstructs the group with the lower squared error."""

# |v| thresholds of the round-half-to-even E2M1 grid: the magnitude index is the number of
# thresholds passed. ``True`` means "strictly greater" (the tie rounds down to an even code),
# ``False`` means "greater or equal" (the tie rounds up to an even code).
_E2M1_THRESHOLDS: tuple[tuple[float, bool], ...] = (
    (0.25, True),  # tie 0.25 -> 0   (code 0 is even)
    (0.75, False),  # tie 0.75 -> 1   (code 2)
    (1.25, True),  # tie 1.25 -> 1   (code 2)
    (1.75, False),  # tie 1.75 -> 2   (code 4)
    (2.5, True),  # tie 2.5  -> 2   (code 4)
    (3.5, False),  # tie 3.5  -> 4   (code 6)
    (5.0, True),  # tie 5    -> 4   (code 6)
)


def e2m1_decode_table(device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 value of each E2M1 code 0..15 (code 8 is -0.0), shape ``[16]``."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of ``v``: round half to even on the E2M1 grid, saturate to
    ±6, sign bit from ``signbit(v)`` (so -0.0 and negatives rounding to 0 give code 8).
    NaN gives code 0. ``v`` is fp32 (fp16/bf16 are widened exactly)."""
    if v.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"v: expected dtype float32, float16 or bfloat16, got {v.dtype}")
    v = v.to(torch.float32)
    a = v.abs()
    mag = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, strict in _E2M1_THRESHOLDS:
        passed = a > threshold if strict else a >= threshold
        mag += passed.to(torch.uint8)
    sign = torch.signbit(v) & ~torch.isnan(v)
    return mag | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 ``codes`` (uint8, 0..15; higher bits are ignored)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected dtype torch.uint8, got {codes.dtype}")
    table = e2m1_decode_table(codes.device)
    return table[(codes & 0x0F).long()]


def fp32_to_e4m3_satfinite(t: torch.Tensor) -> torch.Tensor:
    """e4m3 bytes (uint8) of fp32 ``t``: round to nearest even, ``|t| >= 448`` or ±Inf →
    ±448 (0x7E / 0xFE), NaN → 0x7F."""
    return fp32_to_fp8_bytes(t, Fp8Format.E4M3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes ``[..., D]`` (uint8 0..15, D even) into bytes ``[..., D/2]``:
    byte j = ``(codes[2j+1] << 4) | codes[2j]``."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes: expected dtype torch.uint8, got {codes.dtype}")
    if codes.dim() < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes: expected an even last dim, got shape {list(codes.shape)}")
    if codes.numel() > 0 and bool((codes > 0x0F).any()):
        raise ValueError("codes: expected E2M1 codes in 0..15, got larger values")
    return _pack(codes)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """:func:`pack_e2m1` without the checks (no device sync)."""
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes ``[..., D/2]`` into E2M1 codes ``[..., D]`` (low nibble first)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected dtype torch.uint8, got {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("packed: expected at least one dim")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _check_global_scale(global_scale: torch.Tensor, lead_shape: torch.Size) -> None:
    if not isinstance(global_scale, torch.Tensor):
        raise ValueError(
            f"global_scale: expected a torch.float32 tensor, got {type(global_scale).__name__}"
        )
    if global_scale.dtype != torch.float32:
        raise ValueError(f"global_scale: expected dtype torch.float32, got {global_scale.dtype}")
    if global_scale.numel() == 1:
        return  # per-tensor scale: any shape holding one value
    # Broadcastable to lead_shape without growing it (torch.broadcast_shapes imports sympy).
    shape = global_scale.shape
    ok = len(shape) <= len(lead_shape) and all(
        g in (1, n) for g, n in zip(reversed(shape), reversed(lead_shape), strict=False)
    )
    if not ok:
        raise ValueError(
            f"global_scale: expected one value or a shape broadcastable to {list(lead_shape)} "
            f"(usually [1] or [H]), got {list(global_scale.shape)}"
        )


def _scale_for_groups(global_scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``global_scale`` on ``device``, shaped to broadcast against ``[..., G]`` group tensors
    without adding dims (a one-value scale becomes 0-dim)."""
    gs = global_scale.to(device)
    return gs.reshape(()) if gs.numel() == 1 else gs.unsqueeze(-1)


def quantize_nvfp4(
    x: torch.Tensor, global_scale: torch.Tensor, *, scale_search: bool | str = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., D]`` (fp32/fp16/bf16, ``D % 16 == 0``) to NVFP4.

    ``global_scale`` (fp32 dequantization scale) holds one value (any shape, e.g. ``[1]``) or
    broadcasts to ``x.shape[:-1]`` (e.g. ``[H]`` for ``x [..., H, D]``). It is moved to ``x``'s
    device.

    Per 16-element group, each step one separately rounded fp32 op:

    1. ``inv_gs = 1 / global_scale`` (IEEE division)
    2. ``amax = max |x_i|`` (NaN-propagating)
    3. ``sf = e4m3_satfinite((amax * inv_gs) / 6)``
    4. if ``sf`` is the NaN byte 0x7F: data bytes all 0x00 for the group
    5. else ``mult = 0 if float(sf) == 0 else inv_gs / float(sf)``,
       ``q_i = e2m1_encode(x_i * mult)``

    ``scale_search=True`` is the ``nvfp4_mse`` writer: each finite, non-zero group then takes
    the e4m3 byte among ``sf``, ``sf - 1``, ``sf + 1`` with the smallest squared group error
    (:func:`_search_block_scales`, docs/design.md §5.3); the bytes read back as any NVFP4.
    ``scale_search="4over6"`` is the ``nvfp4_4over6`` writer (:func:`_quantize_4over6`).

    Returns ``(packed uint8 [..., D/2], block_scales uint8 [..., D/16])`` (scales are e4m3 bytes,
    in group order).
    """
    if x.dtype not in _FLOAT_INPUT_DTYPES:
        raise ValueError(f"x: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0 or x.shape[-1] % NVFP4_GROUP_SIZE != 0:
        raise ValueError(
            f"x: NVFP4 needs a last dim (head size) that is a positive multiple of "
            f"{NVFP4_GROUP_SIZE}, got shape {list(x.shape)}"
        )
    if scale_search not in (False, True, SCALE_SEARCH_4OVER6):
        raise ValueError(
            f"scale_search: expected False, True or {SCALE_SEARCH_4OVER6!r}, got {scale_search!r}"
        )
    lead = x.shape[:-1]
    _check_global_scale(global_scale, lead)
    if scale_search == SCALE_SEARCH_4OVER6:
        return _quantize_4over6(x, global_scale)
    dim = x.shape[-1]
    groups = dim // NVFP4_GROUP_SIZE
    xf = x.to(torch.float32).reshape(*lead, groups, NVFP4_GROUP_SIZE)

    gs = _scale_for_groups(global_scale, x.device)  # broadcasts against [..., G]
    # Tensor / tensor divisions throughout: a Python-scalar divisor may be turned into a
    # multiplication by its reciprocal on CUDA, which is not IEEE division.
    inv_gs = torch.ones_like(gs) / gs  # 1
    amax = xf.abs().amax(dim=-1)  # 2, [..., G]
    t = (amax * inv_gs) / torch.full_like(amax, E2M1_MAX)  # 3
    sf = fp32_to_e4m3_satfinite(t)
    sf_f = fp8_bytes_to_fp32(sf, Fp8Format.E4M3)
    is_nan_group = sf == FP8_NAN_BYTE
    mult = torch.where(sf_f == 0, torch.zeros_like(sf_f), inv_gs / sf_f)  # 5
    codes = e2m1_encode(xf * mult.unsqueeze(-1))
    codes = torch.where(is_nan_group.unsqueeze(-1), torch.zeros_like(codes), codes)  # 4
    if scale_search:
        sf, codes = _search_block_scales(xf, inv_gs, amax, sf, codes)
    packed = _pack(codes.reshape(*lead, dim))
    return packed, sf


def _candidate_error(
    xf: torch.Tensor, inv_gs: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and squared group error of groups ``xf [..., G, 16]`` under scale bytes
    ``c [..., G]``: ``err = sum_i (E2M1[code_i] * c_f - x_i * inv)^2`` in fp32, one rounded op
    each, summed strictly in order i = 0..15."""
    c_f = fp8_bytes_to_fp32(c, Fp8Format.E4M3)
    mult = torch.where(c_f == 0, torch.zeros_like(c_f), inv_gs / c_f)
    codes = e2m1_encode(xf * mult.unsqueeze(-1))
    approx = e2m1_decode(codes) * c_f.unsqueeze(-1)
    target = xf * (inv_gs.unsqueeze(-1) if inv_gs.dim() > 0 else inv_gs)
    diff = approx - target
    sq = diff * diff
    err = torch.zeros_like(c_f)
    for i in range(NVFP4_GROUP_SIZE):  # sequential: no tree reduction
        err = err + sq[..., i]
    return codes, err


def _search_block_scales(
    xf: torch.Tensor,
    inv_gs: torch.Tensor,
    amax: torch.Tensor,
    sf: torch.Tensor,
    codes: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``nvfp4_mse`` block-scale search (docs/design.md §5.3): candidates ``sf``,
    ``sf - 1``, ``sf + 1`` (in that order, within ``[0x00, 0x7E]``); the smallest error wins, a tie
    keeps the earlier. Groups holding a NaN or an Inf, and all-zero groups, keep ``(sf, codes)``."""
    searched = torch.isfinite(amax) & (amax != 0)
    best_codes, best_err = _candidate_error(xf, inv_gs, sf)
    best = sf
    wide = sf.to(torch.int16)
    for step in (-1, 1):
        cand = wide + step
        valid = (cand >= 0) & (cand <= 0x7E)
        c = cand.clamp(0, 0x7E).to(torch.uint8)
        cand_codes, err = _candidate_error(xf, inv_gs, c)
        better = valid & (err < best_err)  # strictly: a tie keeps the earlier candidate
        best = torch.where(better, c, best)
        best_err = torch.where(better, err, best_err)
        best_codes = torch.where(better.unsqueeze(-1), cand_codes, best_codes)
    sf = torch.where(searched, best, sf)
    codes = torch.where(searched.unsqueeze(-1), best_codes, codes)
    return sf, codes


_FTZ_MIN = 2.0**-126  # smallest normal fp32: the flush-to-zero bound of upstream's reciprocal


def _rcp_ftz(v: torch.Tensor) -> torch.Tensor:
    """``1 / v`` rounded to fp32, with subnormal inputs and results flushed to signed zero (the
    ``rcp.approx.ftz.f32`` steps of upstream's 4over6 writer, taken as correctly rounded)."""
    v = torch.where(v.abs() < _FTZ_MIN, torch.copysign(torch.zeros_like(v), v), v)
    r = torch.ones_like(v) / v
    return torch.where(r.abs() < _FTZ_MIN, torch.copysign(torch.zeros_like(r), r), r)


def _reconstruction_error(xf: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """Squared error of groups ``xf [..., G, 16]`` coded with multiplier ``mult [..., G]``
    (0 codes every element as 0): ``sum (E2M1[q_i] * rcp(mult) - x_i)^2``, one rounded fp32 op
    each, summed pair by pair in element order (``err + (d_2k^2 + d_2k+1^2)``)."""
    m = mult.unsqueeze(-1)
    deq = torch.where(m != 0, _rcp_ftz(m), torch.zeros_like(m))
    diff = e2m1_decode(e2m1_encode(xf * m)) * deq - xf
    sq = diff * diff
    err = torch.zeros_like(mult)
    for i in range(0, NVFP4_GROUP_SIZE, 2):  # sequential, as upstream's unrolled loop
        err = err + (sq[..., i] + sq[..., i + 1])
    return err


def _quantize_4over6(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``nvfp4_4over6`` writer on checked input (see :func:`quantize_nvfp4`). Per group:
    ``s = 1 / global_scale`` (IEEE); for ``d`` in (6, 4): ``sf_d = e4m3_satfinite(s * (amax *
    rcp(d)))``, ``mult_d = rcp(float(sf_d) * rcp(s))`` (0 when ``sf_d`` is 0). ``sf_4`` wins only
    when its :func:`_reconstruction_error` is strictly lower (ties and NaN errors keep ``sf_6``);
    codes are ``e2m1_encode(x_i * mult)``. A NaN group gets scale byte 0x7F and codes 0."""
    lead, dim = x.shape[:-1], x.shape[-1]
    xf = x.to(torch.float32).reshape(*lead, dim // NVFP4_GROUP_SIZE, NVFP4_GROUP_SIZE)
    gs = _scale_for_groups(global_scale, x.device)
    sf_scale = torch.ones_like(gs) / gs
    inv_sf_scale = _rcp_ftz(sf_scale)
    amax = xf.abs().amax(dim=-1)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for denominator in (E2M1_MAX, 4.0):
        rcp_d = _rcp_ftz(torch.full_like(amax, denominator))
        sf = fp32_to_e4m3_satfinite(sf_scale * (amax * rcp_d))
        sf_f = fp8_bytes_to_fp32(sf, Fp8Format.E4M3)
        mult = torch.where(sf_f != 0, _rcp_ftz(sf_f * inv_sf_scale), torch.zeros_like(sf_f))
        err = _reconstruction_error(xf, mult)
        if best is None:
            best = (sf, mult, err)
        else:
            use4 = err < best[2]
            best = (torch.where(use4, sf, best[0]), torch.where(use4, mult, best[1]), err)
    assert best is not None
    sf, mult, _ = best
    codes = e2m1_encode(xf * mult.unsqueeze(-1))
    return _pack(codes.reshape(*lead, dim)), sf


def dequantize_nvfp4(
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    global_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantize NVFP4: ``packed [..., D/2]`` uint8, ``block_scales [..., D/16]`` (uint8 e4m3
    bytes or float8_e4m3fn), ``global_scale`` fp32 broadcastable to ``packed.shape[:-1]``.

    Returns ``(E2M1[q] * float(sf)) * global_scale`` computed in fp32 ``[..., D]``, then cast
    to ``out_dtype``. A NaN scale byte gives NaN for its whole group.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed: expected dtype torch.uint8, got {packed.dtype}")
    if block_scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(
            f"block_scales: expected dtype torch.uint8 or torch.float8_e4m3fn, "
            f"got {block_scales.dtype}"
        )
    if packed.dim() < 1 or packed.shape[-1] % (NVFP4_GROUP_SIZE // 2) != 0:
        raise ValueError(
            f"packed: expected a last dim that is a multiple of {NVFP4_GROUP_SIZE // 2}, "
            f"got shape {list(packed.shape)}"
        )
    lead = packed.shape[:-1]
    groups = packed.shape[-1] * 2 // NVFP4_GROUP_SIZE
    if tuple(block_scales.shape) != (*lead, groups):
        raise ValueError(
            f"block_scales: expected shape {[*lead, groups]} for packed of shape "
            f"{list(packed.shape)}, got {list(block_scales.shape)}"
        )
    _check_global_scale(global_scale, lead)
    device = packed.device
    vals = e2m1_decode(unpack_e2m1(packed)).reshape(*lead, groups, NVFP4_GROUP_SIZE)
    sf_f = fp8_bytes_to_fp32(block_scales.to(device), Fp8Format.E4M3).unsqueeze(-1)
    gs = _scale_for_groups(global_scale, device).unsqueeze(-1)
    out = (vals * sf_f) * gs
    return out.reshape(*lead, groups * NVFP4_GROUP_SIZE).to(out_dtype)
