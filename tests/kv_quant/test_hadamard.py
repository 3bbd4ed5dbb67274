"""The Hadamard rotation: the documented fp32 sequence, orthonormal, scores kept, edge values."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.kv_quant import hadamard_rotate


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("dim", [2, 16, 64, 128, 256])
def test_it_is_the_scaled_sylvester_matrix(dim: int) -> None:
    x = torch.randn(7, 3, dim, generator=torch.Generator().manual_seed(dim))
    want = (x.double() @ sylvester(dim).T) / math.sqrt(dim)
    torch.testing.assert_close(hadamard_rotate(x).double(), want, atol=1e-5, rtol=1e-5)


def test_the_butterfly_order_defines_every_bit() -> None:
    # One stage by hand on 4 values whose sums round in fp32: (a+b, a-b) then (., .) pairs.
    x = torch.tensor([1.0, 2.0**-24, 3.0, -(2.0**-23)], dtype=torch.float32)
    a = [x[0] + x[1], x[0] - x[1], x[2] + x[3], x[2] - x[3]]
    b = [a[0] + a[2], a[1] + a[3], a[0] - a[2], a[1] - a[3]]
    want = torch.stack(b) * torch.tensor(0.5, dtype=torch.float32)
    assert torch.equal(hadamard_rotate(x), want)


def test_scores_and_norms_are_kept() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 100, 64, generator=gen)
    k[:, 3] *= 50  # an outlier channel: spread by the rotation
    rq, rk = hadamard_rotate(q), hadamard_rotate(k)
    torch.testing.assert_close((rq * rk).sum(-1), (q * k).sum(-1), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1), rtol=1e-6, atol=0)
    assert rk.abs().amax() < 0.25 * k.abs().amax()
    torch.testing.assert_close(hadamard_rotate(rk), k, atol=1e-4, rtol=0)


def test_input_dtypes_and_edge_values() -> None:
    x = torch.tensor([[0.0, -0.0, float("inf"), 1.0]])
    y = hadamard_rotate(x)
    assert y.dtype == torch.float32 and torch.isinf(y).all()
    assert torch.isnan(hadamard_rotate(torch.tensor([float("nan"), 0.0]))).all()
    for dtype in (torch.bfloat16, torch.float16):
        v = torch.randn(4, 32).to(dtype)
        assert torch.equal(hadamard_rotate(v), hadamard_rotate(v.float()))


@pytest.mark.parametrize("shape", [(3, 80), (3, 1), (3, 0), ()])
def test_head_size_must_be_a_power_of_two(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="head_size: expected a power of two"):
        hadamard_rotate(torch.zeros(shape))


def test_integer_input_is_refused() -> None:
    with pytest.raises(ValueError, match="x: expected dtype float32, float16 or bfloat16"):
        hadamard_rotate(torch.zeros(4, 8, dtype=torch.int32))
