"""``scaled_dequantize`` with upstream's semantics: per-tensor and per-group scales."""

from __future__ import annotations

import pytest
import torch

from vllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape,
    scaled_dequantize,
)


def _fp8(shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(shape, generator=gen) * 50).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("scale_shape", [(), (1,), (1, 1)])
def test_per_tensor(scale_shape: tuple[int, ...]) -> None:
    x_q = _fp8((6, 4, 8))
    scale = torch.full(scale_shape, 0.25)
    got = scaled_dequantize(x_q, scale, group_shape=None, out_dtype=torch.float16)
    assert got.dtype == torch.float16 and got.shape == x_q.shape
    assert torch.equal(got, (x_q.float() * 0.25).half())


def test_per_group_grid_and_vectors() -> None:
    x_q = _fp8((4, 8))
    grid = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # 2x4 tiles
    got = scaled_dequantize(x_q, grid, GroupShape(2, 4))
    expected = x_q.float() * grid.repeat_interleave(2, 0).repeat_interleave(4, 1)
    assert torch.equal(got, expected)
    per_row = torch.arange(1.0, 5.0)
    assert torch.equal(scaled_dequantize(x_q, per_row, (1, -1)), x_q.float() * per_row[:, None])
    per_col = torch.arange(1.0, 9.0)
    assert torch.equal(scaled_dequantize(x_q, per_col, (-1, 1)), x_q.float() * per_col)


def test_scale_grid_must_tile() -> None:
    with pytest.raises(ValueError, match="x_s: expected"):
        scaled_dequantize(_fp8((4, 8)), torch.ones(3, 2), GroupShape(2, 4))
    with pytest.raises(ValueError, match="1-D scale"):
        scaled_dequantize(_fp8((4, 8)), torch.ones(2), GroupShape(2, 4))
