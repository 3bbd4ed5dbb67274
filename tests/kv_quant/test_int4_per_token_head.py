"""``int4_per_token_head``: registry entry, page math, and the reference codec bit for bit against
an independent scalar oracle of upstream v0.33's write path (``single_rht`` on CPU, then its
``_reshape_cache_int4_kernel`` math, transcribed as per-element fp32 NumPy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.kv_quant.formats import CacheKind, KVQuantMode, kernel_cache_kind, lookup
from vllm.kv_quant.int4_per_token_head import (
    INT4_PER_TOKEN_HEAD,
    dequantize_int4_rows,
    int4_per_token_head_read_cache,
    int4_per_token_head_write_cache,
    int4_row_dim,
    quantize_int4_rows,
    rht_block_size,
    single_rht,
)
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, kv_cache_uses_per_token_head_scales
from vllm.v1.kv_cache_interface import FullAttentionSpec

F = np.float32


def _oracle_signs(block: int) -> np.ndarray:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9)
    bern = torch.bernoulli(torch.full((block,), 0.5), generator=gen)
    return (2.0 * bern - 1.0).numpy().astype(F)


def _oracle_rht(row: np.ndarray) -> np.ndarray:
    """Forward RHT of one fp32 row: per block, sign flip then in-place butterflies."""
    d = row.shape[0]
    b = d & -d
    signs = _oracle_signs(b)
    out = row.astype(F).copy()
    for start in range(0, d, b):
        x = out[start : start + b] * signs
        h = 1
        while h < b:
            for i in range(0, b, 2 * h):
                for j in range(i, i + h):
                    a, c = x[j], x[j + h]
                    x[j], x[j + h] = F(a + c), F(a - c)
            h *= 2
        out[start : start + b] = x
    return out


def _rnd(t: np.float32) -> np.float32:
    # upstream: (t + 0.5).to(int32) for t >= 0, (t - 0.5).to(int32) otherwise (fp32 sums)
    s = F(t + F(0.5)) if t >= 0 else F(t - F(0.5))
    return F(np.trunc(s))


def _oracle_row(x: torch.Tensor) -> tuple[bytes, int]:
    """Packed bytes and scale-word bits of one row ``x [D]`` (its own dtype)."""
    rotated = torch.from_numpy(_oracle_rht(x.float().numpy())).to(x.dtype).float().numpy()
    lo, hi = F(rotated.min()), F(rotated.max())
    scale = max(F(F(hi - lo) / F(15.0)), F(1e-6))
    zp = min(max(_rnd(F(-lo) / scale), F(0)), F(15))
    inv = F(F(1.0) / scale)
    codes = [int(min(max(_rnd(F(F(v * inv) + zp)), F(0)), F(15))) for v in rotated]
    packed = bytes(codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(len(codes) // 2))
    bits = int(np.array([scale], dtype=F).view(np.int32)[0])
    return packed, (bits & ~0xF) | int(zp)


def _edge_rows(d: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(d)
    big = 6.0e4 if dtype == torch.float16 else 1.0e6
    rows = [
        torch.zeros(d),
        torch.full((d,), 1e-9),
        torch.full((d,), 3.0),
        torch.nn.functional.one_hot(torch.tensor(d // 3), d).float() * 7.5,
        torch.randn(d, generator=gen) * 1e-5,
        torch.randn(d, generator=gen) * big / d,
        torch.randn(d, generator=gen) + 40.0,
        torch.arange(d, dtype=torch.float32) - d / 2,
    ]
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("head_size", [8, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_codec_matches_upstream_oracle(head_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_size)
    x = torch.cat([(torch.randn(12, head_size, generator=gen) * 2).to(dtype),
                   _edge_rows(head_size, dtype)])  # fmt: skip
    packed, word = quantize_int4_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (x.shape[0], head_size // 2)
    bits = word.view(torch.int32)
    for i in range(x.shape[0]):
        want_bytes, want_bits = _oracle_row(x[i])
        assert bytes(packed[i].tolist()) == want_bytes, f"row {i}"
        assert int(bits[i]) == want_bits, f"row {i}"


def test_rotation_is_its_own_inverse_up_to_block() -> None:
    x = torch.randn(3, 96)
    assert rht_block_size(96) == 32 and rht_block_size(128) == 128
    back = single_rht(single_rht(x), inverse=True) / 32
    torch.testing.assert_close(back, x, atol=1e-5, rtol=0)
    row = x[0].numpy()
    assert np.array_equal(single_rht(x[0]).numpy(), _oracle_rht(row))


def test_round_trip_and_decode_is_the_scale_word() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=gen)
    packed, word = quantize_int4_rows(x)
    y = dequantize_int4_rows(packed, word)
    # 4-bit asymmetric, one scale per row: error within one code step after rotating back
    step = (word.view(torch.int32) & -16).view(torch.float32)
    assert ((y - x).abs().amax(-1) <= step * 1.0).all()
    rotated = dequantize_int4_rows(packed, word, rotated=True)
    q = torch.stack([packed & 15, packed >> 4], -1).flatten(-2).float()
    zp = (word.view(torch.int32) & 15).float()
    assert torch.equal(rotated, (q - zp[..., None]) * step[..., None])


def test_registry_entry_and_page_math() -> None:
    fmt = lookup("int4_per_token_head")
    assert fmt is INT4_PER_TOKEN_HEAD and fmt.quant_mode is KVQuantMode.INT4_PER_TOKEN_HEAD
    assert fmt.storage_dtype == torch.uint8 and fmt.is_per_token_head
    assert [int4_row_dim(d) for d in (8, 64, 96, 128, 256)] == [8, 36, 52, 68, 132]
    assert STR_DTYPE_TO_TORCH_DTYPE["int4_per_token_head"] == torch.uint8
    assert kv_cache_uses_per_token_head_scales("int4_per_token_head")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.uint8,
                             kv_quant_mode=KVQuantMode.INT4_PER_TOKEN_HEAD)  # fmt: skip
    # upstream: (D/2 + D/2) bytes + two fp32 scales per token and head
    assert spec.page_size_bytes == 16 * 8 * (64 + 64 + 8)


@pytest.mark.parametrize("head_size", [0, 4, 12, 66])
def test_row_dim_rejects_unaligned_head_sizes(head_size: int) -> None:
    with pytest.raises(ValueError, match="head_size: an int4_per_token_head KV cache needs"):
        int4_row_dim(head_size)


def test_compiled_kernels_take_it_as_its_own_kind() -> None:
    assert kernel_cache_kind("int4_per_token_head") is CacheKind.INT4_PER_TOKEN_HEAD


def test_write_read_cache_and_errors() -> None:
    x = torch.randn(5, 2, 64, dtype=torch.bfloat16)
    side = torch.zeros(3, 4, 2, 36, dtype=torch.uint8)
    slots = torch.tensor([3, -1, 0, 11, 6])
    int4_per_token_head_write_cache(x, side, slots)
    packed, word = quantize_int4_rows(x)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(side[s // 4, s % 4, :, :32], packed[i])
        assert torch.equal(side[s // 4, s % 4, :, 32:].contiguous().view(torch.float32)[:, 0],
                           word[i])  # fmt: skip
    out = int4_per_token_head_read_cache(side)
    assert out.shape == (3, 4, 2, 64)
    assert torch.equal(out[0, 3], dequantize_int4_rows(packed[0], word[0]))
    before = side.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        int4_per_token_head_write_cache(x, side, torch.tensor([0, 1, 2, 3, 12]))
    with pytest.raises(ValueError, match="x: expected shape"):
        int4_per_token_head_write_cache(x[..., :32], side, slots)
    with pytest.raises(ValueError, match="x: expected dtype"):
        int4_per_token_head_write_cache(x.to(torch.int8), side, slots)
    with pytest.raises(ValueError, match="cache_side: expected a uint8"):
        int4_per_token_head_write_cache(x, side.to(torch.int8), slots)
    assert torch.equal(side, before)
