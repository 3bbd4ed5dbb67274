"""Upstream's other Triton writers, byte for byte against the reference codecs:
``triton_reshape_and_cache_flash_per_token_head_quant`` (per-token-head INT8 / FP8 with separate
fp32 scale caches, upstream's layout) and ``triton_reshape_and_cache_flash_diffkv`` (K and V of
different head sizes in one row). Random bytes everywhere else must survive; skipped tokens;
strided caches; NaN rows; bad input."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import quantize_per_token_head
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
    triton_reshape_and_cache_flash_diffkv,
    triton_reshape_and_cache_flash_per_token_head_quant,
)

from .cache_utils import SOURCE_DTYPES, _id, assert_bytes_equal, make_slots, reference_write
from .test_triton_reshape_and_cache_flash import TRITON_DEVICES

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (the dev extra, Linux)")

PTH_CACHE_DTYPES = {
    "int8": (torch.int8, "int8_per_token_head"),
    "fp8": (torch.float8_e4m3fn, "fp8_per_token_head"),
    "uint8": (torch.uint8, "fp8_per_token_head"),
}


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str):
    """Random bytes viewed as ``dtype``, ``shape`` (a slice of a wider buffer: odd strides)."""
    *lead, last = shape
    width = last + 3
    nbytes = torch.Size([*lead, width]).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)
    return raw.view(dtype).view(*lead, width)[..., :last]


def _source(t_pad: int, heads: int, dim: int, dtype: torch.dtype, gen: torch.Generator, device):
    return (torch.randn(t_pad, heads, dim, generator=gen) * 3).to(dtype).to(device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("cache", list(PTH_CACHE_DTYPES))
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
def test_per_token_head_quant_matches_codec(device: str, cache: str, dtype: torch.dtype) -> None:
    cache_dtype, kind = PTH_CACHE_DTYPES[cache]
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, d, dv, tokens = 3, 4, 2, 32, 48, 7
    key = _source(tokens + 2, heads, d, dtype, gen, device)
    value = _source(tokens + 2, heads, dv, dtype, gen, device)
    key[1, 0, 3] = float("nan")  # a NaN row: zero bytes, NaN scale
    value[2, 1, :] = 0.0  # an all-zero row: the scale floor
    key_cache = _random((num_blocks, block_size, heads, d), cache_dtype, gen, device)
    value_cache = _random((num_blocks, block_size, heads, dv), cache_dtype, gen, device)
    k_scales = _random((num_blocks, block_size, heads), torch.float32, gen, device)
    v_scales = _random((num_blocks, block_size, heads), torch.float32, gen, device)
    slots = make_slots(tokens, num_blocks * block_size, 3, gen, device)
    outputs = (key_cache, value_cache, k_scales, v_scales)
    expected = [t.clone() for t in outputs]
    keep = slots >= 0
    page, row = slots[keep] // block_size, slots[keep] % block_size
    for x, data, scales in ((key, expected[0], expected[2]), (value, expected[1], expected[3])):
        q, scale = quantize_per_token_head(x[: slots.shape[0]][keep], kind)
        data.view(torch.uint8)[page, row] = q.view(torch.uint8)
        scales[page, row] = scale
    # Not vacuous: the expected bytes differ from the random ones.
    u8 = torch.uint8
    assert all(
        not torch.equal(e.view(u8), t.view(u8)) for e, t in zip(expected, outputs, strict=True)
    )
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, key_cache, value_cache, k_scales, v_scales, slots
    )
    assert_bytes_equal(
        [t.view(torch.uint8) for t in outputs], [t.view(torch.uint8) for t in expected]
    )


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_per_token_head_quant_negative_slots(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    key = _source(4, 2, 16, torch.bfloat16, gen, device)
    caches = [_random((2, 4, 2, 16), torch.int8, gen, device) for _ in range(2)]
    scales = [_random((2, 4, 2), torch.float32, gen, device) for _ in range(2)]
    before = [t.clone() for t in (*caches, *scales)]
    slots = torch.full((4,), -1, dtype=torch.int64, device=device)
    triton_reshape_and_cache_flash_per_token_head_quant(key, key, *caches, *scales, slots)
    assert_bytes_equal(
        [t.view(torch.uint8) for t in (*caches, *scales)], [t.view(torch.uint8) for t in before]
    )


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(key_cache=a["key_cache"].half()),
         r"key_cache: expected dtype int8 or float8_e4m3fn \(uint8: e4m3 bytes\), got float16"),
        (lambda a: a.update(value_cache=a["value_cache"].view(torch.uint8)),
         r"value_cache: expected dtype int8 \(key_cache's\), got uint8"),
        (lambda a: a.update(k_scale_cache=a["k_scale_cache"][:, :2]),
         r"k_scale_cache: expected a float32 tensor \[2, 4, 2\], got float32 of shape \[2, 2, 2\]"),
        (lambda a: a.update(value_cache=a["value_cache"][..., :8]),
         r"value_cache: expected shape \[2, 4, 2, 16\] with a contiguous last dim"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()),
         r"slot_mapping: expected dtype int64, got int32"),
        (lambda a: a.update(value=a["value"].float()),
         r"value: expected dtype bfloat16 \(key's dtype\), got float32"),
    ],
)  # fmt: skip
def test_per_token_head_quant_bad_input(device: str, mutate, message: str) -> None:
    gen = torch.Generator().manual_seed(2)
    key = _source(3, 2, 16, torch.bfloat16, gen, device)
    args = dict(
        key=key,
        value=key.clone(),
        key_cache=_random((2, 4, 2, 16), torch.int8, gen, device),
        value_cache=_random((2, 4, 2, 16), torch.int8, gen, device),
        k_scale_cache=_random((2, 4, 2), torch.float32, gen, device),
        v_scale_cache=_random((2, 4, 2), torch.float32, gen, device),
        slot_mapping=torch.arange(3, device=device),
    )
    mutate(args)
    before = [t.clone() for t in args.values()]
    with pytest.raises(RuntimeError, match=message):
        triton_reshape_and_cache_flash_per_token_head_quant(**args)
    for t, b in zip(args.values(), before, strict=True):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "kind,cache_dtype",
    [("auto", torch.bfloat16), ("auto", torch.float32), ("float16", torch.float16),
     ("fp8", torch.uint8), ("fp8_e5m2", torch.uint8)],
    ids=_id,
)  # fmt: skip
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("per_head", [False, True], ids=["scale1", "scaleH"])
def test_diffkv_matches_reference(
    device: str, kind: str, cache_dtype: torch.dtype, dtype: torch.dtype, per_head: bool
) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, d_k, d_v, tokens = 3, 4, 2, 24, 40, 6
    key = _source(tokens + 1, heads, d_k, dtype, gen, device)
    value = _source(tokens + 1, heads, d_v, dtype, gen, device)
    kv_cache = _random((num_blocks, block_size, heads, d_k + d_v), cache_dtype, gen, device)
    n = heads if per_head else 1
    k_scale = (0.01 + 0.05 * torch.rand(n, generator=gen)).to(device).reshape(n if per_head else ())
    v_scale = (0.01 + 0.05 * torch.rand(n, generator=gen)).to(device)
    slots = make_slots(tokens, num_blocks * block_size, 4, gen, device)
    expected = kv_cache.clone()
    reference_write(expected[..., :d_k], key, slots, kind, k_scale, "linear")
    reference_write(expected[..., d_k:], value, slots, kind, v_scale, "linear")
    triton_reshape_and_cache_flash_diffkv(key, value, kv_cache, slots, kind, k_scale, v_scale)
    assert_bytes_equal([kv_cache.view(torch.uint8)], [expected.view(torch.uint8)])


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(
    "kind,cache_dtype,message",
    [("nvfp4", torch.uint8,
      r"kv_cache_dtype: expected an unquantized or FP8 format for rows holding K and V, "
      r"got 'nvfp4'"),
     ("fp8", torch.bfloat16, r"kv_cache: expected dtype uint8 for kv_cache_dtype 'fp8'"),
     ("fp9", torch.uint8, r"kv_cache_dtype: unknown KV-cache dtype 'fp9'")],
)  # fmt: skip
def test_diffkv_bad_input(device: str, kind: str, cache_dtype: torch.dtype, message: str) -> None:
    gen = torch.Generator().manual_seed(4)
    key = _source(2, 1, 16, torch.bfloat16, gen, device)
    kv_cache = _random((1, 4, 1, 32), cache_dtype, gen, device)
    before = kv_cache.clone()
    one = torch.ones((), device=device)
    with pytest.raises((RuntimeError, ValueError), match=message):
        triton_reshape_and_cache_flash_diffkv(
            key, key, kv_cache, torch.arange(2, device=device), kind, one, one
        )
    assert torch.equal(kv_cache, before)
