"""nvfp4_mse: NVFP4 with the block-scale search (docs/design.md §5.3), codec properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.kv_quant import dequantize_nvfp4, quantize_nvfp4, unpack_e2m1
from vllm.kv_quant.formats import NVFP4, lookup

from .oracles import DEVICES, e2m1_oracle, fl32, fp8_decode_oracle, nvfp4_oracle

INF = float("inf")
NAN = float("nan")
E2M1_SIGNED = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float64,
)


def _group_oracle(x: torch.Tensor, inv: float, sf: int) -> tuple[int, list[int]]:
    """The design's steps 2-4 for one finite, non-zero group ``x [16]``, one fp32 rounding per
    operation (float64 arithmetic rounded by ``fl32``), the sum taken in order."""
    x64 = x.to(torch.float64)
    best: tuple[float, int, list[int]] | None = None
    for c in (sf, sf - 1, sf + 1):
        if c < 0 or c > 0x7E:
            continue
        c_f = float(fp8_decode_oracle(torch.tensor([c], dtype=torch.uint8), "e4m3")[0])
        mult = 0.0 if c_f == 0 else float(fl32(torch.tensor(inv / c_f, dtype=torch.float64)))
        codes = e2m1_oracle(fl32(x64 * mult)).tolist()
        err = torch.tensor(0.0, dtype=torch.float64)
        for i in range(16):
            approx = fl32(E2M1_SIGNED[codes[i]] * c_f)
            target = fl32(x64[i] * inv)
            d = fl32(approx - target)
            err = fl32(err + fl32(d * d))
        if best is None or float(err) < best[0]:
            best = (float(err), c, codes)
    assert best is not None
    return best[1], best[2]


def _group_errors(x: torch.Tensor, packed, scales, gs: torch.Tensor) -> torch.Tensor:
    deq = dequantize_nvfp4(packed, scales, gs).to(torch.float64)
    return ((deq - x.to(torch.float64)) ** 2).reshape(*x.shape[:-1], -1, 16).sum(-1)


def test_registry_entry_is_nvfp4_but_for_the_writer() -> None:
    fmt = lookup("nvfp4_mse")
    assert fmt.is_nvfp4 and fmt.scale_search and not NVFP4.scale_search
    for field in (
        "storage_dtype",
        "quant_mode",
        "block_scale_group",
        "scale_layouts",
        "cache_kind",
    ):
        assert getattr(fmt, field) == getattr(NVFP4, field), field
    assert [fmt.last_dim(d) for d in (16, 64, 128, 256)] == [
        NVFP4.last_dim(d) for d in (16, 64, 128, 256)
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_head", [False, True])
def test_never_worse_than_nvfp4_and_matches_the_oracle(device: str, per_head: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 64, generator=gen) * torch.rand(64, 4, 1, generator=gen) * 8
    amax = x.abs().amax(dim=(0, 2)) if per_head else x.abs().amax().reshape(1)
    gs = amax / 2688
    x, gs_d = x.to(device), gs.to(device)
    p0, s0 = quantize_nvfp4(x, gs_d)
    p1, s1 = quantize_nvfp4(x, gs_d, scale_search=True)
    e0, e1 = _group_errors(x, p0, s0, gs_d), _group_errors(x, p1, s1, gs_d)
    assert bool((e1 <= e0 * (1 + 1e-6)).all())
    assert float(e1.sum()) < 0.95 * float(e0.sum())  # the search pays off on Gaussian data
    assert bool((s1 != s0).any())
    # Where the plain byte already wins, the search writes nvfp4's bytes.
    same = (s1 == s0).cpu()
    codes0 = unpack_e2m1(p0).reshape(*x.shape[:-1], -1, 16).cpu()
    codes1 = unpack_e2m1(p1).reshape(*x.shape[:-1], -1, 16).cpu()
    assert torch.equal(codes0[same], codes1[same])
    # The byte definition, group by group, against a float64 oracle of the steps.
    xs, s0c, s1c, c1 = x.cpu(), s0.cpu(), s1.cpu(), codes1
    for t in range(0, 64, 7):
        for h in range(4):
            inv = float(fl32(1.0 / gs[h if per_head else 0].to(torch.float64)))
            for g in range(4):
                sf, codes = _group_oracle(xs[t, h, 16 * g : 16 * g + 16], inv, int(s0c[t, h, g]))
                assert int(s1c[t, h, g]) == sf
                assert c1[t, h, g].tolist() == codes


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e4, 1e4, width=32), min_size=16, max_size=16),
    st.floats(2.0**-20, 16.0, width=32),
)
def test_random_groups_match_the_oracle(values: list[float], scale: float) -> None:
    x = torch.tensor([values], dtype=torch.float32)
    gs = torch.tensor([scale], dtype=torch.float32)
    packed, sf = quantize_nvfp4(x, gs, scale_search=True)
    _, plain = nvfp4_oracle(x, gs)
    if float(x.abs().max()) == 0:
        assert int(sf[0, 0]) == int(plain[0, 0])
        return
    inv = float(fl32(1.0 / gs.to(torch.float64))[0])
    want_sf, want_codes = _group_oracle(x[0], inv, int(plain[0, 0]))
    assert int(sf[0, 0]) == want_sf
    assert unpack_e2m1(packed)[0].tolist() == want_codes
    p0, s0 = quantize_nvfp4(x, gs)
    assert float(_group_errors(x, packed, sf, gs).sum()) <= float(
        _group_errors(x, p0, s0, gs).sum()
    ) * (1 + 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_edge_groups_keep_the_plain_rule(device: str) -> None:
    """NaN, Inf and all-zero groups: nvfp4's bytes. A group at 448 saturation searches only
    downward (0x7F is NaN), a group whose plain byte is 0 only upward."""
    rows = [
        [0.0] * 16,
        [-0.0] * 16,
        [NAN] + [1.0] * 15,
        [INF] + [0.3] * 15,
        [-INF, INF] + [2.0] * 14,
    ]
    x = torch.tensor(rows, dtype=torch.float32).to(device)
    gs = torch.ones(1, device=device)
    p0, s0 = quantize_nvfp4(x, gs)
    p1, s1 = quantize_nvfp4(x, gs, scale_search=True)
    assert torch.equal(p0, p1) and torch.equal(s0, s1)
    # Saturation: values far above 448 * 6 give the plain byte 0x7E; candidates 0x7E, 0x7D.
    big = torch.tensor([[1e6] + [5e3] * 15], device=device)
    _, s_big = quantize_nvfp4(big, gs, scale_search=True)
    assert int(s_big[0, 0]) in (0x7E, 0x7D)
    # Tiny values: plain byte 0 (all codes zero); the search may pick the subnormal 0x01.
    tiny = torch.full((1, 16), 2.0**-12, device=device)
    _, s_tiny = quantize_nvfp4(tiny, gs)
    _, s_tiny1 = quantize_nvfp4(tiny, gs, scale_search=True)
    assert int(s_tiny[0, 0]) == 0 and int(s_tiny1[0, 0]) in (0x00, 0x01)


@pytest.mark.parametrize("device", DEVICES)
def test_subnormal_block_scales(device: str) -> None:
    """Groups whose block scales are e4m3 subnormals (bytes 1..7): the search moves among them
    and never raises the group error."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(32, 16, generator=gen) * 2.0**-6).to(device)  # (amax / 6) < 2^-6
    gs = torch.ones(1, device=device)
    p0, s0 = quantize_nvfp4(x, gs)
    p1, s1 = quantize_nvfp4(x, gs, scale_search=True)
    assert int(s0.max()) < 8 and int(s1.max()) < 9
    assert bool((_group_errors(x, p1, s1, gs) <= _group_errors(x, p0, s0, gs) * (1 + 1e-6)).all())


def test_vllm_kv_check_accepts_it() -> None:
    from vllm.accuracy.formats import MEASURED_FORMATS, parse_format, parse_formats

    assert "nvfp4_mse" in [f.name for f in MEASURED_FORMATS]
    fmts = parse_formats("nvfp4+hadamard+offset,nvfp4_mse+hadamard+offset")
    assert [f.kv_cache_dtype for f in fmts] == ["nvfp4", "nvfp4_mse"]
    assert fmts[1].is_nvfp4 and fmts[1].key_rotation == "hadamard" and fmts[1].key_offset
    assert parse_format("nvfp4_mse/head@linear").format.scale_search
