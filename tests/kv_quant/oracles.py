"""Independent float64 oracles for the KV-cache byte formats (no use of torch's fp8 casts).

fp32 arithmetic is emulated as "compute in float64, round to float32": for ``*`` and ``/`` of
two fp32 operands this gives the correctly rounded fp32 result (the product is exact in float64;
for the quotient double rounding is innocuous since 53 >= 2 * 24 + 2).
"""

from __future__ import annotations

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def fl32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 ``t`` to the nearest fp32 (ties to even) and return it as float64."""
    return t.to(torch.float32).to(torch.float64)


def fp8_code_values(fmt: str) -> torch.Tensor:
    """float64 value of every non-negative FP8 code 0..127 from the format's definition
    (NaN for NaN codes, inf for e5m2's inf code)."""
    c = torch.arange(128, dtype=torch.int64)
    if fmt == "e4m3":
        exp, man, man_bits, bias = (c >> 3) & 0xF, c & 0x7, 3, 7
    else:
        exp, man, man_bits, bias = (c >> 2) & 0x1F, c & 0x3, 2, 15
    man_f = man.to(torch.float64) / 2**man_bits
    sub = man_f * 2.0 ** (1 - bias)
    norm = (1 + man_f) * torch.pow(2.0, (exp - bias).to(torch.float64))
    vals = torch.where(exp == 0, sub, norm)
    if fmt == "e4m3":
        vals[0x7F] = float("nan")
    else:
        vals[0x7C] = float("inf")
        vals[0x7D:] = float("nan")
    return vals


def fp8_grid(fmt: str) -> torch.Tensor:
    """Finite non-negative FP8 values, ascending; index i is code i."""
    vals = fp8_code_values(fmt)
    return vals[torch.isfinite(vals)]


def fp8_decode_oracle(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 value of FP8 byte ``codes`` (uint8)."""
    c = codes.long()
    mag = fp8_code_values(fmt)[c & 0x7F]
    return torch.where((c & 0x80) != 0, -mag, mag)


def _rne_on_grid(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value to ``|v|`` (ties to the even index), saturating."""
    a = v.to(torch.float64).abs().clamp(max=float(grid[-1]))
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    hi_idx = torch.searchsorted(grid, a).clamp(max=grid.numel() - 1)
    lo_idx = (hi_idx - 1).clamp(min=0)
    d_lo = a - grid[lo_idx]
    d_hi = grid[hi_idx] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi_idx % 2 == 0))
    return torch.where(take_hi, hi_idx, lo_idx)


def fp8_oracle(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 bytes (uint8) of ``v``: RNE, saturate to ±MAX, NaN -> 0x7F."""
    v = v.cpu().to(torch.float64)
    idx = _rne_on_grid(v, fp8_grid(fmt))
    code = idx | (torch.signbit(v).long() << 7)
    code = torch.where(torch.isnan(v), torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8)


def e2m1_oracle(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8): RNE on the grid, saturate to ±6, sign from signbit, NaN -> 0."""
    v = v.cpu().to(torch.float64)
    idx = _rne_on_grid(v, E2M1_GRID)
    code = idx | (torch.signbit(v).long() << 3)
    code = torch.where(torch.isnan(v), torch.zeros_like(code), code)
    return code.to(torch.uint8)


def nvfp4_oracle(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, block scale bytes) of ``x [..., D]`` following docs/design.md §5 step by step."""
    x64 = x.cpu().to(torch.float64)
    lead, dim = x64.shape[:-1], x64.shape[-1]
    g = x64.reshape(*lead, dim // 16, 16)
    gs = global_scale.cpu().to(torch.float64)
    gs = gs.reshape(()) if gs.numel() == 1 else gs.unsqueeze(-1)
    inv = fl32(1.0 / gs)
    amax = g.abs().amax(dim=-1)
    t = fl32(fl32(amax * inv) / 6.0)
    sf = fp8_oracle(t, "e4m3")
    sf_val = fp8_decode_oracle(sf, "e4m3")
    mult = torch.where(sf_val == 0, torch.zeros_like(sf_val), fl32(inv / sf_val))
    codes = e2m1_oracle(fl32(g * mult.unsqueeze(-1))).long()
    codes = torch.where((sf == 0x7F).unsqueeze(-1), torch.zeros_like(codes), codes)
    codes = codes.reshape(*lead, dim)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.to(torch.uint8), sf
