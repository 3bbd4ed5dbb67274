"""The per-token-head reference codec (docs/formats.md §4): upstream's scale rule and rounding,
our rules where upstream is silent (Inf, NaN), the inline row layout and the page size."""

from __future__ import annotations

import struct

import pytest
import torch
from kv_cache_test_utils import PER_TOKEN_HEAD_DTYPES

from vllm.kv_quant import (
    INT8_PER_TOKEN_HEAD_MAX,
    PER_TOKEN_HEAD_SCALE_FLOOR,
    dequantize_per_token_head,
    pack_rows,
    quantize_per_token_head,
    unpack_rows,
)
from vllm.kv_quant.formats import lookup
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    get_kv_quant_mode,
    is_quantized_kv_cache,
    kv_cache_uses_per_token_head_scales,
)

KINDS = PER_TOKEN_HEAD_DTYPES
QMAX = {"int8_per_token_head": 127.0, "fp8_per_token_head": 448.0}


def _upstream_reference(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of upstream's tests/quantization/test_per_token_kv_cache.py, restated:
    scale = max(amax / QMAX, 1e-6); q = clamp(x * (1 / scale)) rounded (int8: half to even)."""
    absmax = x.float().abs().amax(dim=-1)
    scales = (absmax / QMAX[kind]).clamp(min=1e-6)
    scaled = x.float() * (1.0 / scales[..., None])
    if kind.startswith("int8"):
        return scaled.round().clamp(-128, 127).to(torch.int8), scales
    q = scaled.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, scales


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_upstream_numerics_on_finite_data(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 8, 128, generator=gen) * torch.rand(64, 8, 1, generator=gen) * 5).to(dtype)
    x[0, 0] = 0  # a zero row: the floor
    q, scale = quantize_per_token_head(x, kind)
    ref_q, ref_scale = _upstream_reference(x, kind)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q, ref_q)


@pytest.mark.parametrize("kind", KINDS)
def test_rules(kind: str) -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor(
        [
            [2.0, 1.0, -0.5, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [1.0, inf, -inf, 0.5],
            [1.0, nan, inf, 0.5],
            [1e-9, -1e-9, 0.0, 0.0],
        ]
    )
    q, scale = quantize_per_token_head(x, kind)
    qmax = QMAX[kind]
    assert scale[0] == torch.tensor(2.0) / torch.tensor(qmax)
    assert scale[1] == torch.tensor(PER_TOKEN_HEAD_SCALE_FLOOR, dtype=torch.float32)
    assert (q[1] == 0).all()
    # Inf: the scale comes from the finite values, the Inf saturates to +-QMAX.
    assert scale[2] == torch.tensor(1.0) / torch.tensor(qmax)
    back = dequantize_per_token_head(pack_rows(q, scale), kind)
    assert back[2, 1] == qmax * scale[2] and back[2, 2] == -qmax * scale[2]
    # NaN: NaN scale, zero values, the whole row reads NaN.
    assert scale[3].view(torch.int32) == 0x7FC00000 and (q[3] == 0).all()
    assert torch.isnan(back[3]).all()
    # Tiny rows share the floor scale (1e-9 / 1e-6 is 0 in int8, e4m3's smallest subnormal).
    assert scale[4] == torch.tensor(1e-6, dtype=torch.float32)
    assert back[4].tolist()[2:] == [0.0, 0.0] and back[4, 0] == -back[4, 1]


def test_int8_ties_round_to_even() -> None:
    # amax 127 -> scale exactly 1, so x * (1 / scale) = x.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]])
    q, scale = quantize_per_token_head(x, "int8_per_token_head")
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 126]]


def test_row_layout_is_values_then_little_endian_fp32() -> None:
    x = torch.tensor([[[3.0, -1.0, 0.5, 0.0]]])
    q, scale = quantize_per_token_head(x, "int8_per_token_head")
    rows = pack_rows(q, scale)
    assert rows.dtype == torch.int8 and rows.shape == (1, 1, 8)
    raw = rows.view(torch.uint8).flatten().tolist()
    assert raw[:4] == [127, 256 - 42, 21, 0]
    assert struct.unpack("<f", bytes(raw[4:]))[0] == scale.item()
    q2, scale2 = unpack_rows(rows)
    assert torch.equal(q2, q) and torch.equal(scale2, scale)


@pytest.mark.parametrize("kind", KINDS)
def test_registry_interface_and_page_size(kind: str) -> None:
    fmt = lookup(kind)
    mode = {
        "int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
        "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD,
    }[kind]
    assert int(KVQuantMode.INT8_PER_TOKEN_HEAD) == 2 and int(KVQuantMode.FP8_PER_TOKEN_HEAD) == 3
    assert get_kv_quant_mode(kind) == mode and mode.is_per_token_head
    assert is_quantized_kv_cache(kind) and kv_cache_uses_per_token_head_scales(kind)
    assert not kv_cache_uses_per_token_head_scales("fp8") and not is_quantized_kv_cache("auto")
    assert fmt.storage_dtype == (torch.int8 if kind.startswith("int8") else torch.uint8)
    assert fmt.last_dim(128) == 132 and fmt.cache_kind is not None
    with pytest.raises(ValueError, match="head_size: a per-token-head KV cache needs a positive"):
        fmt.last_dim(66)
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=fmt.storage_dtype, kv_quant_mode=mode
    )
    # Upstream: 2 * N * H * D values plus 2 * N * H fp32 scales.
    assert spec.page_size_bytes == 2 * 16 * 8 * 128 + 2 * 16 * 8 * 4 == 33_792
    assert spec.kv_cache_format is fmt


def test_int8_max_constant() -> None:
    assert INT8_PER_TOKEN_HEAD_MAX == 127.0


def test_fp8_min_max_is_the_platform_fp8_range() -> None:
    """Upstream's per-token-head tests take the FP8 bounds from ``get_fp8_min_max``."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max

    assert get_fp8_min_max() == (-448.0, 448.0) == (-QMAX["fp8_per_token_head"], 448.0)
