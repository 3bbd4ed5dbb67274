"""FP8 reference codec: exact RNE against a float64 oracle, saturation, NaN, scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.kv_quant import (
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    FP8_NAN_BYTE,
    Fp8Format,
    dequantize_fp8,
    fp8_format_from_cache_dtype,
    fp8_read_cache,
    fp8_write_cache,
    quantize_fp8,
)

from .oracles import DEVICES, fl32, fp8_decode_oracle, fp8_grid, fp8_oracle

FORMATS = [Fp8Format.E4M3, Fp8Format.E5M2]
ONE = torch.tensor([1.0])


def _neg_nan() -> torch.Tensor:
    return torch.tensor([0xFFC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)


def _conversion_probe(fmt: Fp8Format) -> torch.Tensor:
    """fp32 values probing every rounding decision: all grid values, all midpoints, the
    fp32 neighbours of both, values past MAX, and values below the smallest subnormal."""
    grid = fp8_grid(fmt.value).to(torch.float32)
    mids = ((grid[1:].double() + grid[:-1].double()) / 2).to(torch.float32)
    assert torch.equal(mids.double(), (grid[1:].double() + grid[:-1].double()) / 2)  # exact
    pts = torch.cat([grid, mids])
    inf = torch.tensor(float("inf"))
    extra = torch.tensor(
        [fmt.max * 1.03, fmt.max * 1.0625, fmt.max * 1.07, fmt.max * 2, 1e30, 3.4e38, float("inf")]
    )
    tiny = float(grid[1]) / 2
    extra = torch.cat([extra, torch.tensor([tiny / 2, tiny, tiny * 1.5, 1e-30, 1e-45])])
    pts = torch.cat([pts, extra])
    pts = torch.cat([pts, torch.nextafter(pts, inf), torch.nextafter(pts, -inf)])
    return torch.cat([pts, -pts])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_is_what_torch_decodes(fmt: Fp8Format, device: str) -> None:
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    got = dequantize_fp8(codes.to(device), ONE.to(device), fmt).cpu().double()
    want = fp8_decode_oracle(codes, fmt.value)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(got[ok], want[ok])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_conversion_is_exact_rne(fmt: Fp8Format, device: str) -> None:
    x = _conversion_probe(fmt)
    got = quantize_fp8(x.to(device), ONE, fmt).cpu()
    want = fp8_oracle(x, fmt.value)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), int(got[i]), int(want[i])) for i in bad[:10]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_conversion_random_bit_patterns(fmt: Fp8Format, device: str) -> None:
    gen = torch.Generator().manual_seed(1234)
    bits = torch.randint(-(2**31), 2**31, (200_000,), dtype=torch.int64, generator=gen)
    x = bits.to(torch.int32).view(torch.float32)
    got = quantize_fp8(x.to(device), ONE, fmt).cpu()
    assert torch.equal(got, fp8_oracle(x, fmt.value))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_nan_inf(fmt: Fp8Format, device: str) -> None:
    max_byte = 0x7E if fmt is Fp8Format.E4M3 else 0x7B
    x = torch.cat(
        [
            torch.tensor([fmt.max, fmt.max * 1.5, 1e38, float("inf")]),
            torch.tensor([-fmt.max, -fmt.max * 1.5, -1e38, float("-inf")]),
            torch.tensor([float("nan")]),
            _neg_nan(),
        ]
    )
    got = quantize_fp8(x.to(device), ONE, fmt).cpu().tolist()
    assert got == [max_byte] * 4 + [max_byte | 0x80] * 4 + [FP8_NAN_BYTE] * 2
    # NaN from the division itself (0/0, inf/inf) is canonical too.
    z = quantize_fp8(
        torch.tensor([[0.0], [float("-inf")]], device=device),
        torch.tensor([0.0, float("inf")]),
        fmt,
    )
    assert z.cpu().flatten().tolist() == [FP8_NAN_BYTE, FP8_NAN_BYTE]
    assert float(dequantize_fp8(torch.tensor([max_byte], dtype=torch.uint8), ONE, fmt)) == fmt.max


@pytest.mark.parametrize("fmt", FORMATS)
def test_subnormals_and_signed_zero(fmt: Fp8Format) -> None:
    grid = fp8_grid(fmt.value)
    min_sub = float(grid[1])
    x = torch.tensor([0.0, -0.0, min_sub, min_sub / 2, -min_sub / 2, min_sub * 0.75, min_sub * 1.5])
    got = quantize_fp8(x, ONE, fmt).tolist()
    # min_sub/2 is a tie between 0 (even) and min_sub (odd): rounds to zero keeping its sign;
    # 1.5 * min_sub is a tie between codes 1 and 2: rounds to 2.
    assert got == [0x00, 0x80, 0x01, 0x00, 0x80, 0x01, 0x02]


def test_division_not_reciprocal_multiply() -> None:
    """x / scale must be an IEEE division: find inputs where x * (1/scale) lands on another
    fp8 code and check that the codec follows the division."""
    gen = torch.Generator().manual_seed(7)
    grid = fp8_grid("e4m3")
    mids = (grid[40:100] + grid[41:101]) / 2
    s = fl32(1 + torch.rand(20_000, dtype=torch.float64, generator=gen))
    x = fl32(mids[:, None] * s[None, :])
    s = s.expand_as(x)
    by_div = fl32(x / s)
    by_rcp = fl32(x * fl32(1.0 / s))
    differ = fp8_oracle(by_div, "e4m3") != fp8_oracle(by_rcp, "e4m3")
    assert int(differ.sum()) > 10
    xs, ss = x[differ].float(), s[differ].float()
    for device in DEVICES:
        got = torch.stack(
            [quantize_fp8(xs[i : i + 1].to(device), ss[i : i + 1], "e4m3") for i in range(10)]
        )
        assert torch.equal(got.cpu().flatten(), fp8_oracle(by_div[differ][:10], "e4m3"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_per_tensor_and_per_head_scale(fmt: Fp8Format, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    T, H, D = 7, 4, 32
    x = (torch.randn(T, H, D, generator=gen) * 50).to(dtype)
    scales = {
        "tensor": torch.tensor([0.173]),
        "head": torch.tensor([0.05, 0.3, 1.7, 11.0]),
    }
    for kind, scale in scales.items():
        got = quantize_fp8(x.to(device), scale.to(device), fmt).cpu()
        s64 = scale.double()[:, None] if kind == "head" else scale.double()
        want = fp8_oracle(fl32(x.double() / s64), fmt.value)
        assert torch.equal(got, want), kind
        dq = dequantize_fp8(got.to(device), scale.to(device), fmt).cpu()
        assert torch.equal(dq.double(), fl32(fp8_decode_oracle(got, fmt.value) * s64))
        # Round trip where x / scale is in range: within half an fp8 ulp of x / scale (relative
        # 2^-(m+1), or half the smallest subnormal), times scale; saturated values give ±MAX.
        rel = 2.0 ** -(4 if fmt is Fp8Format.E4M3 else 3)
        sub = float(fp8_grid(fmt.value)[1]) / 2
        x64 = x.double()
        err = (dq.double() - x64).abs()
        bound = (x64.abs() * rel + sub * s64) * (1 + 1e-6)
        in_range = (x64 / s64).abs() <= fmt.max
        assert bool((err <= bound)[in_range].all())
        assert bool((dq.double().abs() == fl32(fmt.max * s64).expand_as(x64))[~in_range].all())
        saturates = kind == "head" and fmt is Fp8Format.E4M3
        assert bool(in_range.any()) and (not saturates or bool((~in_range).any()))
    per_head = quantize_fp8(x, scales["head"], fmt)
    for h in range(H):
        one = quantize_fp8(x[:, h : h + 1], scales["head"][h : h + 1], fmt)
        assert torch.equal(per_head[:, h : h + 1], one)


def test_dequantize_out_dtype() -> None:
    q = torch.tensor([[0x38, 0xB8]], dtype=torch.uint8)  # e4m3 1.0, -1.0
    out = dequantize_fp8(q, torch.tensor([0.5]), "e4m3", out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [[0.5, -0.5]]


def test_format_enum_and_cache_dtype_mapping() -> None:
    assert Fp8Format.E4M3.torch_dtype == torch.float8_e4m3fn
    assert Fp8Format.E5M2.torch_dtype == torch.float8_e5m2
    assert Fp8Format.E4M3.max == FP8_E4M3_MAX == 448.0
    assert Fp8Format.E5M2.max == FP8_E5M2_MAX == 57344.0
    assert Fp8Format("e4m3") is Fp8Format.E4M3 and Fp8Format.E5M2 == "e5m2"
    assert fp8_format_from_cache_dtype("fp8") is Fp8Format.E4M3
    assert fp8_format_from_cache_dtype("fp8_e4m3") is Fp8Format.E4M3
    assert fp8_format_from_cache_dtype("fp8_e5m2") is Fp8Format.E5M2
    for bad in ("auto", "nvfp4", "fp8_e4m3fn", "bfloat16"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            fp8_format_from_cache_dtype(bad)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
def test_one_value_scale_in_any_shape_is_per_tensor(shape: tuple[int, ...]) -> None:
    x = torch.randn(3, 4, 16)
    scale = torch.full(shape, 0.01)
    q = quantize_fp8(x, scale)
    assert torch.equal(q, quantize_fp8(x, torch.tensor([0.01])))
    assert torch.equal(dequantize_fp8(q, scale), dequantize_fp8(q, torch.tensor([0.01])))


def test_scale_validation() -> None:
    x = torch.zeros(3, 4, 16)
    for bad in (
        torch.tensor([1.0], dtype=torch.float64),
        torch.tensor([1.0, 2.0]),
        torch.ones(1, 4),
        torch.ones(4, 1),
    ):
        with pytest.raises(ValueError, match="scale"):
            quantize_fp8(x, bad)
        with pytest.raises(ValueError, match="scale"):
            dequantize_fp8(x.to(torch.uint8), bad)
    with pytest.raises(ValueError, match="x"):
        quantize_fp8(x.double(), ONE)
    with pytest.raises(ValueError, match="fmt"):
        quantize_fp8(x, ONE, "e3m4")


# ---- whole-page FP8 writer ----------------------------------------------------------------


def _fp8_cache(B: int, N: int, H: int, D: int, layout: str, gen: torch.Generator):
    shape = (B, 2, N, H, D) if layout == "NHD" else (B, 2, H, N, D)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    cache = raw if layout == "NHD" else raw.permute(0, 1, 3, 2, 4)
    return raw, cache


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    N=st.sampled_from([1, 4, 16]),
    H=st.integers(1, 3),
    D=st.sampled_from([8, 16, 64]),
    layout=st.sampled_from(["NHD", "HND"]),
    side=st.integers(0, 1),
    fmt=st.sampled_from(FORMATS),
    per_head=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_fp8_write_cache(B, N, H, D, layout, side, fmt, per_head, dtype, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw, cache = _fp8_cache(B, N, H, D, layout, gen)
    before = raw.clone()
    T = int(torch.randint(0, B * N + 1, (1,), generator=gen))
    slots = torch.randperm(B * N, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.25] = -1
    x = (torch.randn(T + 2, H, D, generator=gen) * 30).to(dtype)
    scale = torch.rand(H if per_head else 1, generator=gen) + 0.05
    fp8_write_cache(x, cache[:, side], slots, scale, fmt)
    expected = before.clone()
    q = quantize_fp8(x, scale, fmt)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, t = divmod(s, N)
        if layout == "NHD":
            expected[b, side, t] = q[i]
        else:
            expected[b, side, :, t] = q[i]
    assert torch.equal(raw, expected)
    back = fp8_read_cache(cache[:, side], scale, fmt).reshape(B * N, H, D)
    ok = slots >= 0
    assert torch.equal(back[slots[ok]], dequantize_fp8(q[:T][ok], scale, fmt))


def test_fp8_write_cache_rejects_out_of_range_slot() -> None:
    raw = torch.zeros(2, 4, 2, 16, dtype=torch.uint8)
    x = torch.ones(3, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        fp8_write_cache(x, raw, torch.tensor([0, 8, 1]), ONE)
    assert int(raw.count_nonzero()) == 0
    with pytest.raises(ValueError, match="slot_mapping"):
        fp8_write_cache(x, raw, torch.tensor([0, 1, 2, 3]), ONE)
    with pytest.raises(ValueError, match="slot_mapping"):
        fp8_write_cache(x, raw, torch.tensor([0, 1], dtype=torch.int32), ONE)
