"""NVFP4 reference codec: E2M1 rounding, block scales, non-finite policy, packing, error bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.kv_quant import (
    E2M1_VALUES,
    NVFP4_SCALE_MAX,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_decode_table,
    e2m1_encode,
    fp32_to_e4m3_satfinite,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)

from .oracles import (
    DEVICES,
    e2m1_oracle,
    fl32,
    fp8_decode_oracle,
    fp8_grid,
    fp8_oracle,
    nvfp4_oracle,
)

INF = float("inf")
NAN = float("nan")
ONE = torch.tensor([1.0])


def test_tables() -> None:
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    table = e2m1_decode_table()
    assert table.dtype == torch.float32 and table.shape == (16,)
    assert table.tolist() == [*E2M1_VALUES, *(-v for v in E2M1_VALUES)]
    assert torch.signbit(table[8]) and not torch.signbit(table[0])
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_decode(codes), table)
    assert torch.equal(e2m1_encode(table), codes)


# Each tie and the code it must round to (half to even on the E2M1 grid).
TIES = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_thresholds_and_ties(device: str) -> None:
    ties = torch.tensor(list(TIES), dtype=torch.float32)
    below = torch.nextafter(ties, torch.zeros_like(ties))
    above = torch.nextafter(ties, torch.full_like(ties, INF))
    got = {
        name: e2m1_encode(v.to(device)).cpu().tolist()
        for name, v in {"tie": ties, "below": below, "above": above}.items()
    }
    assert got["tie"] == list(TIES.values())
    # Just below a tie rounds to the lower neighbour, just above to the upper one.
    assert got["below"] == [0, 1, 2, 3, 4, 5, 6]
    assert got["above"] == [1, 2, 3, 4, 5, 6, 7]
    neg = e2m1_encode(-ties.to(device)).cpu().tolist()
    assert neg == [c | 8 for c in TIES.values()]


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_sweep_matches_oracle(device: str) -> None:
    v = torch.linspace(-8, 8, 64001, dtype=torch.float32)
    grid = torch.tensor([*E2M1_VALUES, *TIES], dtype=torch.float32)
    near = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    v = torch.cat([v, near, -near, torch.tensor([INF, -INF, NAN, 1e30, -1e-30, 1e-45])])
    assert torch.equal(e2m1_encode(v.to(device)).cpu(), e2m1_oracle(v))


def test_e2m1_saturation_signs_nan() -> None:
    v = torch.tensor([6.0, 6.5, 100.0, INF, -6.5, -INF, 0.0, -0.0, -0.1, -0.25, 0.1, NAN, -NAN])
    assert e2m1_encode(v).tolist() == [7, 7, 7, 7, 15, 15, 0, 8, 8, 8, 0, 0, 0]
    assert e2m1_encode(torch.tensor([-2.0], dtype=torch.bfloat16)).tolist() == [12]


def test_fp32_to_e4m3_satfinite() -> None:
    t = torch.tensor([0.0, -0.0, 1.0, 448.0, 464.0, 1e9, INF, -448.0, -1e9, -INF, NAN, 2**-9])
    got = fp32_to_e4m3_satfinite(t).tolist()
    assert got == [0x00, 0x80, 0x38, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0xFE, 0x7F, 0x01]


def test_pack_unpack_nibble_order() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert torch.equal(unpack_e2m1(packed), codes)
    assert unpack_e2m1(torch.tensor([[0x21, 0xF0]], dtype=torch.uint8)).tolist() == [[1, 2, 0, 15]]
    gen = torch.Generator().manual_seed(0)
    c = torch.randint(0, 16, (3, 5, 32), dtype=torch.uint8, generator=gen)
    assert torch.equal(unpack_e2m1(pack_e2m1(c)), c)
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_e2m1(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_hand_built_group(device: str) -> None:
    # amax 6 with global scale 1: block scale 1.0 (0x38), mult 1, every value is its own code.
    x = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], device=device)
    packed, scales = quantize_nvfp4(x, ONE)
    assert packed.cpu().tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert scales.cpu().tolist() == [0x38]
    assert torch.equal(dequantize_nvfp4(packed, scales, ONE).cpu(), x.cpu())
    # Global scale 2, values doubled: block scale 1.0 again, same codes.
    packed2, scales2 = quantize_nvfp4(2 * x, torch.tensor([2.0], device=device))
    assert torch.equal(packed2, packed) and torch.equal(scales2, scales)
    # Block scale 2 (0x40): amax 12.
    packed3, scales3 = quantize_nvfp4(2 * x, ONE)
    assert scales3.cpu().tolist() == [0x40] and torch.equal(packed3, packed)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_groups_and_negative_zero(device: str) -> None:
    x = torch.zeros(3, 32, device=device)
    x[1] = -0.0
    x[2, 5] = -0.0
    packed, scales = quantize_nvfp4(x, torch.tensor([0.01], device=device))
    assert scales.cpu().tolist() == [[0, 0]] * 3
    assert packed[0].cpu().tolist() == [0] * 16
    assert packed[1].cpu().tolist() == [0x88] * 16
    assert packed[2].cpu().tolist() == [0, 0, 0x80] + [0] * 13
    assert not bool(dequantize_nvfp4(packed, scales, torch.tensor([0.01])).any())
    # -0.0 inside a non-zero group also keeps its sign.
    y = torch.zeros(16, device=device)
    y[0], y[1] = 3.0, -0.0
    assert quantize_nvfp4(y, ONE)[0].cpu().tolist()[0] == 0x87


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_groups(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, generator=gen)
    x[0, 3] = NAN
    x[1, 20] = -NAN
    x[2, 7] = INF
    x[3, 17] = -INF
    gs = torch.tensor([0.02])
    packed, scales = quantize_nvfp4(x.to(device), gs.to(device))
    packed, scales = packed.cpu(), scales.cpu()
    ref_packed, ref_scales = quantize_nvfp4(torch.nan_to_num(x, nan=0.0, posinf=0, neginf=0), gs)
    # NaN group: scale byte 0x7F and zero data; the other group of the row is untouched.
    assert scales[0, 0] == 0x7F and packed[0, :8].tolist() == [0] * 8
    assert scales[1, 1] == 0x7F and packed[1, 8:].tolist() == [0] * 8
    assert torch.equal(packed[0, 8:], ref_packed[0, 8:]) and scales[0, 1] == ref_scales[0, 1]
    assert torch.equal(packed[1, :8], ref_packed[1, :8]) and scales[1, 0] == ref_scales[1, 0]
    # Inf group: scale 448 (0x7E), the Inf element saturates to ±6, the rest use mult inv/448.
    assert scales[2, 0] == 0x7E and scales[3, 1] == 0x7E
    codes = unpack_e2m1(packed)
    assert codes[2, 7] == 7 and codes[3, 17] == 15
    mult = (torch.ones(1) / gs) / torch.tensor([448.0])
    assert torch.equal(codes[2, :16], e2m1_encode(x[2, :16] * mult))
    assert torch.equal(codes[3, 16:], e2m1_encode(x[3, 16:] * mult))
    dq = dequantize_nvfp4(packed, scales, gs)
    assert bool(torch.isnan(dq[0, :16]).all()) and not bool(torch.isnan(dq[0, 16:]).any())
    assert float(dq[2, 7]) == float(torch.tensor(6.0 * 448.0) * gs)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(16,), (3, 32), (2, 3, 64), (5, 4, 128), (1, 2, 256)]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    per_head=st.booleans(),
    log2_gs=st.floats(-140, 40),
    spread=st.floats(0, 30),
    seed=st.integers(0, 2**16),
    specials=st.booleans(),
)
def test_quantize_matches_float64_oracle(shape, dtype, per_head, log2_gs, spread, seed, specials):
    """Bit-exact against an independent float64 emulation of the fp32 op sequence, for global
    scales from subnormal to huge (covers zero, subnormal and saturated block scales)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.rand(shape, generator=gen) * spread)
    if specials:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (4,), generator=gen)
        flat[idx] = torch.tensor([NAN, INF, -INF, -0.0])
    x = x.to(dtype)
    heads = shape[-2] if per_head and len(shape) > 1 else 1
    gs = torch.exp2(log2_gs + torch.rand(heads, generator=gen) * 4).float()
    want_packed, want_scales = nvfp4_oracle(x, gs)
    for device in DEVICES:
        packed, scales = quantize_nvfp4(x.to(device), gs.to(device))
        assert torch.equal(scales.cpu(), want_scales)
        assert torch.equal(packed.cpu(), want_packed)
        dq = dequantize_nvfp4(packed, scales, gs.to(device)).cpu().double()
        codes = unpack_e2m1(want_packed).reshape(*shape[:-1], -1, 16)
        sf = fp8_decode_oracle(want_scales, "e4m3").unsqueeze(-1)
        ref = (e2m1_decode(codes).double() * sf).float().double()
        g64 = gs.double().unsqueeze(-1).unsqueeze(-1) if heads > 1 else gs.double()
        ref = (ref * g64).float().double().reshape(dq.shape)
        assert torch.equal(torch.isnan(dq), torch.isnan(ref))
        assert torch.equal(dq.nan_to_num(), ref.nan_to_num())


def _half_step(u: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around magnitude ``u`` (u >= 0)."""
    return torch.where(u < 2, 0.25, torch.where(u < 4, 0.5, 1.0)).to(torch.float64)


def check_error_bound(x: torch.Tensor, gs: torch.Tensor) -> float:
    """Assert the NVFP4 round-trip bound; return max(err / bound) (tightness).

    For a finite group with amax a, global scale g > 0 and t = a / (6 g), the block scale is
    s = RNE_e4m3(t) with |s - t| <= max(2^-4 t, 2^-10) (3 mantissa bits; subnormal spacing 2^-9),
    provided t <= 448 (no block-scale saturation). With the effective scale e = s g, element x_i
    maps to v_i = x_i / e; E2M1 rounding errs by at most half a grid step at |v_i| (0.25 below 2,
    0.5 below 4, 1 up to 6) and elements beyond 6e saturate. Hence

        |x_i - dq_i| <= e * halfstep(|x_i| / e) + max(0, |x_i| - 6 e)            (s > 0)
        |x_i - dq_i| = |x_i| <= 6 g 2^-10                                        (s = 0)
        max(0, |x_i| - 6 e) <= 6 g max(2^-4 t, 2^-10)                             (scale rounding)

    plus a relative 2^-20 slack for the fp32 roundings of 1/g, 1/(s g), x*mult and the product.
    """
    lead, dim = x.shape[:-1], x.shape[-1]
    packed, scales = quantize_nvfp4(x, gs)
    dq = dequantize_nvfp4(packed, scales, gs).double().reshape(*lead, dim // 16, 16)
    x64 = x.double().reshape(*lead, dim // 16, 16)
    g = gs.double().reshape(-1, 1, 1) if gs.numel() > 1 else gs.double()
    g = g.expand(*lead, dim // 16, 1) if gs.numel() > 1 else g
    s = fp8_decode_oracle(scales, "e4m3").unsqueeze(-1)
    amax = x64.abs().amax(-1, keepdim=True)
    t = amax / (6 * g)
    assert bool((t <= 448 * (1 + 2**-20)).all()), "the bound assumes no block-scale saturation"
    assert bool(
        ((s - t).abs() <= torch.maximum(t * 2**-4, torch.full_like(t, 2**-10)) * (1 + 2**-20)).all()
    )
    e = s * g
    a = x64.abs()
    slack = 2**-20 * (a + 6 * e)
    err = (x64 - dq).abs()
    u = torch.where(e > 0, a / e * (1 + 2**-20), torch.zeros_like(a))
    sat = (a - 6 * e).clamp(min=0)
    assert bool(
        (
            sat
            <= 6 * g * torch.maximum(t * 2**-4, torch.full_like(t, 2**-10)) * (1 + 2**-18) + slack
        ).all()
    )
    bound = torch.where(e > 0, e * _half_step(u) + sat, 6 * g * 2**-10 * (1 + 2**-20)) + slack
    assert bool((err <= bound).all()), float((err - bound).max())
    return float((err / bound).max())


@pytest.mark.parametrize("per_head", [False, True])
def test_round_trip_error_bound(per_head: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    T, H, D = 64, 4, 128
    x = torch.randn(T, H, D, generator=gen) * torch.tensor([0.01, 1.0, 30.0, 1000.0])[:, None]
    if per_head:
        gs = x.abs().amax(dim=(0, 2)) / (6 * 448)
    else:
        gs = (x.abs().amax() / (6 * 448)).reshape(1)
    tightness = check_error_bound(x, gs)
    assert tightness > 0.5  # the bound is not vacuous
    # Large global scales push block scales into the e4m3 subnormal range and to zero.
    check_error_bound(x, gs * 2**12)
    check_error_bound(x, gs * 2**20)


@settings(max_examples=40, deadline=None)
@given(
    lead=st.sampled_from([(1,), (7,), (3, 2), (2, 5)]),
    groups=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    per_head=st.booleans(),
    log2_headroom=st.floats(0, 16),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_bound_random(lead, groups, dtype, per_head, log2_headroom, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, groups * 16)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randn(shape, generator=gen) * 3)
    x = x.to(dtype)
    xf = x.float()
    if per_head and len(lead) > 1:
        gs = xf.abs().amax(dim=tuple(i for i in range(xf.dim()) if i != xf.dim() - 2))
    else:
        gs = xf.abs().amax().reshape(1)
    gs = (gs / (6 * 448) * 2**log2_headroom).clamp(min=1e-30)
    check_error_bound(x, gs)


def test_per_head_scale_equals_per_head_calls() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 3, 64, generator=gen)
    gs = torch.tensor([0.001, 0.01, 0.1])
    packed, scales = quantize_nvfp4(x, gs)
    for h in range(3):
        p, s = quantize_nvfp4(x[:, h], gs[h : h + 1])
        assert torch.equal(packed[:, h], p) and torch.equal(scales[:, h], s)
    dq = dequantize_nvfp4(packed, scales, gs, out_dtype=torch.bfloat16)
    assert dq.dtype == torch.bfloat16 and dq.shape == x.shape


def test_validation() -> None:
    with pytest.raises(ValueError, match="x"):
        quantize_nvfp4(torch.zeros(2, 24), ONE)
    with pytest.raises(ValueError, match="x"):
        quantize_nvfp4(torch.zeros(2, 16, dtype=torch.float64), ONE)
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(torch.zeros(2, 3, 16), torch.ones(2))
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(torch.zeros(2, 16), torch.ones(1, dtype=torch.float64))
    p = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block_scales"):
        dequantize_nvfp4(p, torch.zeros(2, 2, dtype=torch.uint8), ONE)
    with pytest.raises(ValueError, match="packed"):
        dequantize_nvfp4(torch.zeros(2, 6, dtype=torch.uint8), p[:, :1], ONE)


def _groups_from(first: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Rows of 16: ``first[i]`` followed by ``rest[i]`` and zeros."""
    out = torch.zeros(first.numel(), 16, dtype=torch.float32)
    out[:, 0] = first
    out[:, 1] = rest
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_block_scale_operation_order(device: str) -> None:
    """Step 3 is ``(amax * inv_gs) / 6`` with two roundings. Find amax values for which
    re-associated forms pick another e4m3 byte, and check the codec follows the spec."""
    gen = torch.Generator().manual_seed(21)
    grid = fp8_grid("e4m3")
    mids = ((grid[1:] + grid[:-1]) / 2)[8:]  # e4m3 rounding boundaries (normal range)
    gs = fl32(torch.exp2(torch.rand(64, generator=gen, dtype=torch.float64) * 16 - 8))
    inv = fl32(1.0 / gs)
    base = fl32(mids[:, None] * 6 * gs[None, :])  # amax near a boundary, [M, G]
    ulps = torch.arange(-4, 5, dtype=torch.float64)
    amax = fl32(base[..., None] * (1 + ulps * 2**-23))  # neighbours of base
    inv_b = inv[None, :, None].expand_as(amax)
    spec = fp8_oracle(fl32(fl32(amax * inv_b) / 6.0), "e4m3")
    variants = {
        "times_sixth": fl32(fl32(amax * inv_b) * fl32(torch.tensor(1.0 / 6.0))),
        "inv_over_6_first": fl32(amax * fl32(inv_b / 6.0)),
        "divide_by_gs": fl32(fl32(amax / gs[None, :, None]) / 6.0),
    }
    for name, t_alt in variants.items():
        differ = spec != fp8_oracle(t_alt, "e4m3")
        assert int(differ.sum()) >= 5, name
        a = amax[differ][:50].float()
        g = gs[None, :, None].expand_as(amax)[differ][:50].float()
        x = _groups_from(a, -a * 0.3)
        for i in range(a.numel()):  # one global scale per group
            _, sc = quantize_nvfp4(x[i].to(device), g[i : i + 1].to(device))
            assert int(sc.cpu()) == int(spec[differ][i]), name


@pytest.mark.parametrize("device", DEVICES)
def test_element_operation_order(device: str) -> None:
    """Step 5 is ``x_i * (inv_gs / sf)``. Find elements next to E2M1 thresholds for which
    ``(x_i * inv_gs) / sf`` or ``x_i / (sf * gs)`` picks another code."""
    gen = torch.Generator().manual_seed(22)
    n = 256
    gs = fl32(torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * 16 - 8))
    amax = fl32(gs * 6 * torch.exp2(torch.rand(n, generator=gen, dtype=torch.float64) * 6 - 2))
    inv = fl32(1.0 / gs)
    sf = fp8_decode_oracle(fp8_oracle(fl32(fl32(amax * inv) / 6.0), "e4m3"), "e4m3")
    mult = fl32(inv / sf)
    ties = torch.tensor(list(TIES), dtype=torch.float64)
    ulps = torch.arange(-3, 4, dtype=torch.float64)
    x = fl32(fl32(ties[None, :, None] / mult[:, None, None]) * (1 + ulps * 2**-23))  # [n, 7, 7]
    x = x.reshape(n, -1)
    bc = {k: v[:, None].expand_as(x) for k, v in dict(gs=gs, inv=inv, sf=sf, mult=mult).items()}
    spec = e2m1_oracle(fl32(x * bc["mult"]))
    variants = {
        "two_step": fl32(fl32(x * bc["inv"]) / bc["sf"]),
        "combined_scale": fl32(x / fl32(bc["sf"] * bc["gs"])),
    }
    for name, v_alt in variants.items():
        differ = (spec != e2m1_oracle(v_alt)) & (x < amax[:, None].expand_as(x))
        assert int(differ.sum()) >= 5, name
        rows = differ.nonzero()[:40]
        for r, c in rows.tolist():
            grp = _groups_from(amax[r : r + 1].float(), x[r, c : c + 1].float())
            packed, _ = quantize_nvfp4(grp[0].to(device), gs[r : r + 1].float().to(device))
            assert int(packed.cpu()[0]) >> 4 == int(spec[r, c]), name


def test_recommended_global_scale_keeps_small_groups() -> None:
    """``amax / NVFP4_SCALE_MAX`` puts the largest block scale at 448 (the top of e4m3), 6x the
    ``amax / 448`` one: groups 10^5 below the tensor's amax still get a block scale, where
    ``amax / 448`` rounds theirs to zero and loses them whole, and no group does worse."""
    gen = torch.Generator().manual_seed(0)
    group_amax = torch.logspace(0, -5.5, 64).reshape(64, 1)
    x = (torch.rand(64, 16, generator=gen) * 2 - 1) * group_amax
    x[:, 0] = group_amax[:, 0]  # each group reaches its amax
    amax = x.abs().amax()

    def group_errors(max_: float) -> tuple[torch.Tensor, torch.Tensor]:
        gs = (amax / max_).reshape(1)
        packed, scales = quantize_nvfp4(x.reshape(1, -1), gs)
        x_hat = dequantize_nvfp4(packed, scales, gs).reshape(64, 16)
        return (x_hat - x).norm(dim=1) / x.norm(dim=1), scales.reshape(-1)

    err_rec, scales_rec = group_errors(NVFP4_SCALE_MAX)
    err_448, scales_448 = group_errors(448.0)
    assert NVFP4_SCALE_MAX == 448.0 * 6.0
    assert scales_rec[0] == 0x7E and scales_448[0] < 0x7E  # 448 vs 448/6 for the amax group
    assert bool((scales_rec > 0).all()) and float(err_rec.max()) < 0.3
    lost = scales_448 == 0
    assert int(lost.sum()) >= 3 and bool((err_448[lost] == 1).all())
    assert bool((err_rec <= err_448 + 0.05).all())
    assert float(err_rec.mean()) < float(err_448.mean())
