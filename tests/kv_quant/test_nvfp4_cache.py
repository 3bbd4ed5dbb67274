"""Whole-page NVFP4 cache writer/reader against byte offsets computed from docs/design.md §5."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.kv_quant import (
    ScaleLayout,
    dequantize_nvfp4,
    nvfp4_read_cache,
    nvfp4_read_cache_raw,
    nvfp4_write_cache,
    quantize_nvfp4,
)
from vllm.utils.torch_utils import nvfp4_kv_cache_full_dim

from .oracles import DEVICES


def make_cache(B: int, N: int, H: int, D: int, layout: str, gen: torch.Generator, device: str):
    """A (B, 2, N, H, F) cache poisoned with random bytes: (raw storage, logical view)."""
    F = nvfp4_kv_cache_full_dim(D)
    shape = (B, 2, N, H, F) if layout == "NHD" else (B, 2, H, N, F)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).to(device)
    cache = raw if layout == "NHD" else raw.permute(0, 1, 3, 2, 4)
    return raw, cache


def stored_pos(t: int, s: int, S: int, scale_layout: ScaleLayout) -> tuple[int, int]:
    if scale_layout is ScaleLayout.LINEAR:
        return t, s
    q = S // 4
    return (t // 4) * 4 + s // q, (s % q) * 4 + t % 4


def expected_storage(before, slots, packed, scales, N, H, D, side, layout, scale_layout):
    """Storage after writing, computed from byte offsets: page = [K_data|K_scale|V_data|V_scale],
    regions ordered [N][H][.] (NHD) or [H][N][.] (HND)."""
    F = nvfp4_kv_cache_full_dim(D)
    S = D // 16
    flat = before.clone().cpu().reshape(-1)
    page_bytes = 2 * N * H * F
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, t = divmod(slot, N)
        base = b * page_bytes + side * N * H * F
        for h in range(H):
            entry = (t * H + h) if layout == "NHD" else (h * N + t)
            off = base + entry * (D // 2)
            flat[off : off + D // 2] = packed[i, h].cpu()
            for s in range(S):
                r, c = stored_pos(t, s, S, scale_layout)
                row = (r * H + h) if layout == "NHD" else (h * N + r)
                flat[base + N * H * (D // 2) + row * S + c] = scales[i, h, s].cpu()
    return flat.reshape(before.shape)


def run_write_check(B, N, H, D, layout, side, scale_layout, per_head, dtype, T, seed, device):
    gen = torch.Generator().manual_seed(seed)
    raw, cache = make_cache(B, N, H, D, layout, gen, device)
    before = raw.clone()
    slots = torch.randperm(B * N, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.25] = -1
    x = (torch.randn(T + 3, H, D, generator=gen) * torch.exp2(torch.rand(H, 1) * 8)).to(dtype)
    gs = (torch.rand(H if per_head else 1, generator=gen) + 0.01) * 0.05
    nvfp4_write_cache(x.to(device), cache[:, side], slots.to(device), gs.to(device), scale_layout)

    keep = slots >= 0
    packed, scales = quantize_nvfp4(x[:T], gs)
    want = expected_storage(before, slots, packed, scales, N, H, D, side, layout, scale_layout)
    assert torch.equal(raw.cpu(), want)

    data, sc = nvfp4_read_cache_raw(cache[:, side], D, scale_layout)
    assert data.shape == (B, N, H, D // 2) and sc.shape == (B, N, H, D // 16)
    assert torch.equal(data.reshape(B * N, H, -1)[slots[keep]].cpu(), packed[keep])
    assert torch.equal(sc.reshape(B * N, H, -1)[slots[keep]].cpu(), scales[keep])
    back = nvfp4_read_cache(cache[:, side], gs.to(device), D, scale_layout)
    assert back.shape == (B, N, H, D) and back.dtype == torch.float32
    ref = dequantize_nvfp4(packed, scales, gs)
    assert torch.equal(back.reshape(B * N, H, D)[slots[keep]].cpu(), ref[keep])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("scale_layout", list(ScaleLayout))
@pytest.mark.parametrize("side", [0, 1])
def test_write_read_page(layout: str, scale_layout: ScaleLayout, side: int, device: str) -> None:
    run_write_check(3, 16, 4, 128, layout, side, scale_layout, True, torch.bfloat16, 20, 0, device)
    run_write_check(2, 8, 2, 64, layout, side, scale_layout, False, torch.float32, 9, 1, device)


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3),
    N=st.sampled_from([1, 2, 4, 8, 16, 32]),
    H=st.integers(1, 4),
    D=st.sampled_from([16, 32, 48, 64, 128, 256]),
    layout=st.sampled_from(["NHD", "HND"]),
    side=st.integers(0, 1),
    interleave=st.booleans(),
    per_head=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    frac=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_write_read_random(B, N, H, D, layout, side, interleave, per_head, dtype, frac, seed):
    S = D // 16
    ok = N % 4 == 0 and S % 4 == 0
    scale_layout = ScaleLayout.INTERLEAVE4 if interleave and ok else ScaleLayout.LINEAR
    T = int(frac * B * N)
    for device in DEVICES:
        run_write_check(B, N, H, D, layout, side, scale_layout, per_head, dtype, T, seed, device)


def test_page_stride_matches_design_example() -> None:
    # N=16, H=8, D=128: page 18,432 bytes; K scale region at byte 8,192; V side at 9,216.
    gen = torch.Generator().manual_seed(0)
    raw = torch.zeros(2, 2, 16, 8, 72, dtype=torch.uint8)
    x = torch.randn(1, 8, 128, generator=gen)
    gs = torch.tensor([0.01])
    nvfp4_write_cache(x, raw[:, 1], torch.tensor([16 + 3]), gs)
    packed, scales = quantize_nvfp4(x, gs)
    flat = raw.reshape(-1)
    page1_v = 18432 + 9216
    assert torch.equal(flat[page1_v + 3 * 8 * 64 : page1_v + 4 * 8 * 64], packed[0].reshape(-1))
    assert torch.equal(
        flat[page1_v + 8192 + 3 * 64 : page1_v + 8192 + 4 * 64], scales[0].reshape(-1)
    )
    assert int(flat[:page1_v].count_nonzero()) == 0


def test_rejects_bad_input_before_writing() -> None:
    gen = torch.Generator().manual_seed(0)
    raw, cache = make_cache(2, 8, 2, 64, "NHD", gen, "cpu")
    before = raw.clone()
    x = torch.randn(4, 2, 64)
    gs = torch.tensor([0.1])
    k = cache[:, 0]
    with pytest.raises(ValueError, match="slot_mapping"):
        nvfp4_write_cache(x, k, torch.tensor([0, 3, 16, 1]), gs)
    with pytest.raises(ValueError, match="slot_mapping"):
        nvfp4_write_cache(x, k, torch.tensor([0, 1, 2, 3, 4]), gs)
    with pytest.raises(ValueError, match="num_tokens"):
        nvfp4_write_cache(
            x,
            make_cache(2, 6, 2, 64, "NHD", gen, "cpu")[1][:, 0],
            torch.tensor([0]),
            gs,
            "interleave4",
        )
    with pytest.raises(ValueError, match="num_scales"):
        nvfp4_write_cache(
            torch.randn(1, 2, 32),
            make_cache(2, 8, 2, 32, "NHD", gen, "cpu")[1][:, 0],
            torch.tensor([0]),
            gs,
            "interleave4",
        )
    with pytest.raises(ValueError, match="global_scale"):
        nvfp4_write_cache(x, k, torch.tensor([0]), torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="cache_side"):
        nvfp4_write_cache(torch.randn(1, 2, 32), k, torch.tensor([0]), gs)
    with pytest.raises(ValueError, match="x"):
        nvfp4_write_cache(torch.randn(1, 3, 64), k, torch.tensor([0]), gs)
    with pytest.raises(ValueError, match="scale_layout"):
        nvfp4_write_cache(x, k, torch.tensor([0]), gs, "interleave8")
    assert torch.equal(raw, before)


def test_all_negative_slots_write_nothing() -> None:
    gen = torch.Generator().manual_seed(0)
    raw, cache = make_cache(2, 4, 2, 64, "HND", gen, "cpu")
    before = raw.clone()
    nvfp4_write_cache(torch.randn(3, 2, 64), cache[:, 1], torch.full((3,), -1), torch.ones(1))
    nvfp4_write_cache(
        torch.randn(3, 2, 64), cache[:, 1], torch.empty(0, dtype=torch.int64), torch.ones(1)
    )
    assert torch.equal(raw, before)
