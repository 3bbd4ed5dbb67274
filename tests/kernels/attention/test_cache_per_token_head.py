"""reshape_and_cache_flash into per-token-head INT8 / FP8 caches (``int8_per_token_head``,
``fp8_per_token_head``) against the reference codec (vllm.kv_quant.per_token_head), byte for byte:
random inputs, edge values, odd shapes and strides, NHD and HND, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from kv_cache_test_utils import DEVICES, PER_TOKEN_HEAD_DTYPES

from vllm import _custom_ops as ops
from vllm.kv_quant import dequantize_per_token_head, unpack_rows

from .cache_utils import SOURCE_DTYPES, _id, check_against_reference, make_case

KINDS = PER_TOKEN_HEAD_DTYPES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_matches_reference(device: str, kind: str, dtype: torch.dtype, hnd: bool) -> None:
    check_against_reference(make_case(device, kind, dtype, hnd=hnd, row_padding=5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "head_size,head_size_v,block_size,num_heads",
    [(4, 4, 1, 1), (36, 36, 3, 5), (64, 128, 16, 2), (128, 128, 7, 3), (256, 72, 16, 1)],
)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_odd_shapes(
    device: str,
    kind: str,
    head_size: int,
    head_size_v: int,
    block_size: int,
    num_heads: int,
    hnd: bool,
) -> None:
    case = make_case(
        device,
        kind,
        torch.bfloat16,
        num_blocks=5,
        block_size=block_size,
        num_heads=num_heads,
        head_size=head_size,
        head_size_v=head_size_v,
        hnd=hnd,
        num_tokens=min(13, 5 * block_size),
        row_padding=3,
    )
    check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_padded_pages(device: str, kind: str) -> None:
    """Pages further apart than one (2, N, H, D + 4) page (a padded spec's as_strided view) and
    rows at offsets that are not multiples of 4 (the scale is written byte by byte)."""
    case = make_case(device, kind, torch.float16, num_blocks=4, block_size=5, num_heads=3)
    b, n, h, f = case.key_cache.shape
    raw = torch.randint(0, 256, (b * (2 * n * h * f + 7) + 3,), dtype=torch.uint8, device=device)
    raw_dtype = raw.view(case.key_cache.dtype)
    page = 2 * n * h * f + 7
    case.key_cache = torch.as_strided(raw_dtype, (b, n, h, f), (page, h * f, f, 1), 3)
    case.value_cache = torch.as_strided(raw_dtype, (b, n, h, f), (page, h * f, f, 1), 3 + n * h * f)
    case.buffers = [raw]
    check_against_reference(case)


def _edge_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 8 values that hit every rule of the codec: ties, saturation, zeros, NaN, Inf,
    tiny rows under the scale floor, subnormals, -0."""
    inf, nan = float("inf"), float("nan")
    rows = [
        [0.0] * 8,
        [-0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0],
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],  # int8 ties at scale 1
        [448.0, 0.5, 1.5, 2.5, -0.5, -3.25, 5.5, 6.5],  # e4m3 ties at scale 1
        [1.0, inf, -inf, 0.25, -2.0, 3.0, 0.0, 1e-3],
        [inf, -inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, nan, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        [nan, inf, -inf, 1.0, 0.0, 0.0, 0.0, 0.0],
        [1e-7, -3e-8, 5e-8, 0.0, 1e-9, -1e-7, 2e-8, 0.0],
        [1e-40, -2e-40, 3e-41, 0.0, 0.0, 0.0, 0.0, 0.0],
        [3e38, -3e38, 1.0, -1.0, 1e30, 0.0, 0.0, 0.0],
        [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0],
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    if dtype != torch.float32:
        x = x.clamp(-6e4, 6e4) if dtype == torch.float16 else x
        x = x.to(dtype)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_edge_values(device: str, kind: str, dtype: torch.dtype, hnd: bool) -> None:
    rows = _edge_rows(dtype)
    num_heads = 2
    tokens = rows.shape[0] // num_heads
    case = make_case(
        device, kind, dtype, num_blocks=2, block_size=8, num_heads=num_heads, head_size=8,
        num_tokens=tokens, padding=0, skip_every=0, hnd=hnd,
    )  # fmt: skip
    case.key = rows.reshape(tokens, num_heads, 8).to(device)
    case.value = (-rows.flip(0)).reshape(tokens, num_heads, 8).to(device)
    check_against_reference(case)
    # And the rules themselves, read back through the codec.
    slots = case.slot_mapping
    blocks, offsets = slots // 8, slots % 8
    written = case.key_cache[blocks, offsets]
    q, scale = unpack_rows(written)
    back = dequantize_per_token_head(written, kind)
    nan_rows = torch.isnan(case.key.float()).any(-1)
    assert torch.isnan(scale[nan_rows]).all() and (q[nan_rows] == 0).all()
    assert torch.isnan(back[nan_rows]).all()
    finite = ~nan_rows
    assert (scale[finite] >= 1e-6).all() and torch.isfinite(back[finite]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_scales_are_ignored(device: str, kind: str) -> None:
    """k_scale / v_scale are not read: any value, even 0 or NaN, gives the same bytes (upstream
    engines pass the placeholder 1.0); the scale rule on their shape still holds."""
    case = make_case(device, kind, torch.bfloat16)
    case.k_scale = torch.zeros((), device=device)
    case.v_scale = torch.full((4,), float("nan"), device=device)
    check_against_reference(case)


@pytest.mark.parametrize("kind", KINDS)
def test_argument_errors(kind: str) -> None:
    """Every argument is checked before the first byte moves, one line naming it."""
    cache_dtype = torch.int8 if kind.startswith("int8") else torch.uint8
    key = torch.randn(3, 2, 8)
    one = torch.ones(())
    slots = torch.tensor([0, 1, 2])

    def call(key: torch.Tensor, cache: torch.Tensor) -> None:
        before = cache.clone()
        try:
            ops.reshape_and_cache_flash(key, key, cache, cache.clone(), slots, kind, one, one)
        finally:
            assert torch.equal(cache, before)

    with pytest.raises(RuntimeError, match=r"key_cache: expected last dim D \+ 4 = 12 .* got 8"):
        call(key, torch.zeros(2, 4, 2, 8, dtype=cache_dtype))
    wrong = torch.uint8 if cache_dtype == torch.int8 else torch.int8
    wrong_name = str(wrong).removeprefix("torch.")
    with pytest.raises(RuntimeError, match=rf"key_cache: expected dtype .* got {wrong_name}"):
        call(key, torch.zeros(2, 4, 2, 12, dtype=wrong))
    with pytest.raises(RuntimeError, match=rf"key: {kind} needs a head size that is a multiple "):
        call(torch.randn(3, 2, 6), torch.zeros(2, 4, 2, 10, dtype=cache_dtype))
