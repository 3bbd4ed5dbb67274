"""``nvfp4_4over6``: the codec's bytes against a scalar oracle of upstream v0.33.0's CUDA writer
(``cvt_warp_fp16_to_fp4_4over6``), written here from the kernel's arithmetic with numpy fp32
scalars, independently of :mod:`vllm.kv_quant.nvfp4`.

Oracle conventions (see /tmp/notes/fourover6-design.md): ``rcp.approx.ftz.f32`` is taken as the
correctly rounded reciprocal with subnormal inputs and results flushed to zero; the error sum is
un-contracted fp32 (no FMA), pair by pair; a NaN element codes as E2M1 code 0.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm.kv_quant.codecs import codec_for
from vllm.kv_quant.formats import KVQuantMode, kernel_cache_kind, lookup
from vllm.kv_quant.modes import CacheKind
from vllm.kv_quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from vllm.kv_quant.nvfp4_cache import nvfp4_split_data_scale, nvfp4_write_cache
from vllm.kv_quant.scale_layout import ScaleLayout

F32 = np.float32
_TINY = 2.0**-126


def _rcp(v: np.float32) -> np.float32:
    if abs(float(v)) < _TINY:
        v = F32(math.copysign(0.0, float(v)))
    with np.errstate(divide="ignore", invalid="ignore"):
        r = F32(1.0) / v
    return F32(math.copysign(0.0, float(r))) if abs(float(r)) < _TINY else r


def _e4m3_values() -> list[float]:
    """Value of each e4m3 byte 0x00..0x7E (bias 7, 3 mantissa bits, subnormals below 2^-6)."""
    out = []
    for b in range(0x7F):
        e, m = b >> 3, b & 7
        out.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


_E4M3 = _e4m3_values()


def _e4m3_byte(v: np.float32) -> int:
    """Satfinite round-to-nearest-even e4m3 byte of a non-negative (or NaN) fp32."""
    f = float(v)
    if math.isnan(f):
        return 0x7F
    if f >= 448.0:
        return 0x7E
    best = min(range(0x7F), key=lambda b: (abs(_E4M3[b] - f), b & 1))
    return best


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_code(v: np.float32) -> int:
    """Code of ``cvt.rn.satfinite.e2m1x2.f32``: nearest, ties to even, saturate at 6."""
    f = float(v)
    if math.isnan(f):
        return 0
    a = abs(f)
    bounds = ((0.25, 0), (0.75, 1), (1.25, 2), (1.75, 3), (2.5, 4), (3.5, 5), (5.0, 6))
    mag = 7
    for edge, idx in bounds:
        # at a midpoint the even code wins: codes 0, 2, 4, 6 sit below edges 0.25, 1.25, 2.5, 5
        if a < edge or (a == edge and idx % 2 == 0):
            mag = idx
            break
    return mag | (8 if math.copysign(1.0, f) < 0 else 0)


def _group_error(x: list[np.float32], mult: np.float32) -> np.float32:
    err = F32(0.0)
    deq = _rcp(mult) if mult != 0 else F32(0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, 16, 2):
            pair = []
            for v in (x[i], x[i + 1]):
                if mult == 0:
                    d = v
                else:
                    code = _e2m1_code(v * mult)
                    q = F32(math.copysign(_E2M1[code & 7], -1.0 if code & 8 else 1.0))
                    d = q * deq - v
                pair.append(d * d)
            err = err + (pair[0] + pair[1])
    return err


def _oracle_group(x: list[np.float32], k_scale: float) -> tuple[int, list[int]]:
    """``(scale byte, 16 E2M1 codes)`` of one group as upstream's 4over6 writer makes them."""
    sf_scale = F32(1.0) / F32(k_scale)
    mags = [abs(float(v)) for v in x]
    vec_max = F32(math.nan if any(math.isnan(m) for m in mags) else max(mags))
    cands = []
    with np.errstate(over="ignore", invalid="ignore"):
        for denom in (6.0, 4.0):
            byte = _e4m3_byte(sf_scale * (vec_max * _rcp(F32(denom))))
            val = F32(math.nan) if byte == 0x7F else F32(_E4M3[byte])
            mult = _rcp(val * _rcp(sf_scale)) if val != 0 else F32(0.0)
            cands.append((byte, mult, _group_error(x, mult)))
    (b6, m6, e6), (b4, m4, e4) = cands
    byte, mult = (b4, m4) if e4 < e6 else (b6, m6)
    with np.errstate(over="ignore", invalid="ignore"):
        return byte, [_e2m1_code(v * mult) for v in x]


def _oracle(x: torch.Tensor, k_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    flat = x.float().reshape(-1, 16).numpy()
    scales, packed = [], []
    for row in flat:
        byte, codes = _oracle_group([F32(v) for v in row], k_scale)
        scales.append(byte)
        packed.extend(codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2))
    lead = x.shape[:-1]
    return (
        torch.tensor(packed, dtype=torch.uint8).reshape(*lead, x.shape[-1] // 2),
        torch.tensor(scales, dtype=torch.uint8).reshape(*lead, x.shape[-1] // 16),
    )


def _check(x: torch.Tensor, k_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    packed, sf = quantize_nvfp4(
        x, torch.tensor([k_scale], dtype=torch.float32), scale_search="4over6"
    )
    want_packed, want_sf = _oracle(x, k_scale)
    assert torch.equal(sf, want_sf)
    assert torch.equal(packed, want_packed)
    return packed, sf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("k_scale", [1.0, 0.37, 3.0e-3, 17.0])
def test_random_groups_match_upstream_arithmetic(dtype: torch.dtype, k_scale: float) -> None:
    gen = torch.Generator().manual_seed(int(k_scale * 1000) + dtype.itemsize)
    x = torch.randn(3, 2, 64, generator=gen) * torch.logspace(-3, 2, 64)
    _check(x.to(dtype), k_scale)


def test_edge_groups() -> None:
    rows = [
        [0.0] * 16,  # zero group: scale 0, codes 0
        [-0.0] * 16,  # signed zeros keep their sign bit
        [3.0] * 16,  # /6 and /4 both exact: the tie keeps amax/6
        [6.0] + [4.5] * 15,  # upstream's case: amax/4 wins
        [1.0e30] * 8 + [-1.0] * 8,  # block scale saturates at 448
        [1.0e-9] * 16,  # block scale underflows to 0
        [math.nan] + [1.0] * 15,
        [math.inf] + [1.0] * 15,
        [-math.inf] + [0.0] * 15,
        [float(i) - 7.5 for i in range(16)],
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    _, sf = _check(x)
    assert sf[0].item() == 0 and sf[6].item() == 0x7F and sf[4].item() == 0x7E
    assert sf[2].item() == 0x30  # 0.5 = 3 / 6, not 0.75 = 3 / 4
    assert sf[3].item() == 0x3C  # 1.5 = 6 / 4


def test_lower_error_than_nvfp4_on_upstream_case() -> None:
    x = torch.tensor([6.0] + [4.5] * 15, dtype=torch.bfloat16).repeat(4)
    one = torch.ones(1, dtype=torch.float32)

    def mse(search: bool | str) -> float:
        packed, sf = quantize_nvfp4(x, one, scale_search=search)
        return float((dequantize_nvfp4(packed, sf, one) - x.float()).square().mean())

    assert mse("4over6") < mse(False)


def test_never_worse_than_amax_over_6() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=gen) * torch.rand(256, 1, generator=gen) * 50
    one = torch.ones(1, dtype=torch.float32)
    errs = []
    for search in (False, "4over6"):
        packed, sf = quantize_nvfp4(x, one, scale_search=search)
        errs.append((dequantize_nvfp4(packed, sf, one) - x).square().sum(-1))
    assert bool((errs[1] <= errs[0] * (1 + 1e-6)).all())
    assert bool((errs[1] < errs[0]).any())


def test_per_head_global_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 32, generator=gen, dtype=torch.float32)
    gs = torch.tensor([0.5, 0.02], dtype=torch.float32)
    packed, sf = quantize_nvfp4(x, gs, scale_search="4over6")
    for h in range(2):
        want_packed, want_sf = _oracle(x[:, h], float(gs[h]))
        assert torch.equal(sf[:, h], want_sf) and torch.equal(packed[:, h], want_packed)


def test_cache_writer_stores_the_codec_bytes() -> None:
    fmt = lookup("nvfp4_4over6")
    assert fmt.quant_mode == KVQuantMode.NVFP4 and fmt.last_dim(128) == 72
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 1, 32, generator=gen, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 1, fmt.last_dim(32), dtype=torch.uint8)
    scale = torch.tensor([0.25], dtype=torch.float32)
    nvfp4_write_cache(
        x, cache, torch.tensor([0, 5, 2]), scale, "linear", scale_search=fmt.scale_search
    )
    packed, sf = quantize_nvfp4(x, scale, scale_search="4over6")
    data, scales = nvfp4_split_data_scale(cache)
    for i, slot in enumerate((0, 5, 2)):
        assert torch.equal(data[slot // 4, slot % 4, 0], packed[i, 0])
        assert torch.equal(scales[slot // 4, slot % 4, 0].view(torch.uint8), sf[i, 0])


def test_bad_policy_is_refused_and_the_kernels_take_the_format() -> None:
    one = torch.ones(1, dtype=torch.float32)
    with pytest.raises(ValueError, match="scale_search: expected False, True or '4over6'"):
        quantize_nvfp4(torch.zeros(16), one, scale_search="4over5")
    assert kernel_cache_kind("nvfp4_4over6") is CacheKind.NVFP4  # the compiled writers take it


def test_format_codec_writes_4over6_and_reads_as_nvfp4() -> None:
    """The registry's codec (the REFERENCE backend's writer and reader) for the format."""
    fmt = lookup("nvfp4_4over6")
    codec = codec_for(fmt)
    x = torch.tensor([6.0] + [4.5] * 15, dtype=torch.bfloat16).repeat(2, 1, 4)  # [T=2, H=1, 64]
    side = torch.zeros(1, 4, 1, fmt.last_dim(64), dtype=torch.uint8)
    scale = torch.ones(1, dtype=torch.float32)
    codec.write(x, side, torch.tensor([1, 2]), scale, ScaleLayout.LINEAR)
    out = codec.read(side, scale, 64, ScaleLayout.LINEAR, torch.float32)
    packed, sf = quantize_nvfp4(x, scale, scale_search="4over6")
    assert bool((sf == 0x3C).all())  # amax / 4 = 1.5 for every group
    assert torch.equal(out[0, 1:3], dequantize_nvfp4(packed, sf, scale))
    assert torch.equal(out[0, 1:3], x.float())  # this group is exact under amax / 4
