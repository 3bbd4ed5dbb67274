"""KeyRope: RoPE of keys for caches that store them before it (forward, inverse, table, errors)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.kv_quant import KeyRope


def _complex_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, neox: bool):
    """Oracle in fp64: channel pairs as complex numbers times exp(i p f)."""
    half = freqs.shape[0]
    x = x.double()
    if neox:
        pairs = torch.complex(x[..., :half], x[..., half : 2 * half])
    else:
        pairs = torch.complex(x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2])
    angle = positions.double()[:, None, None] * freqs.double()[None, None, :]
    turned = pairs * torch.polar(torch.ones_like(angle), angle)
    out = x.clone()
    if neox:
        out[..., :half], out[..., half : 2 * half] = turned.real, turned.imag
    else:
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = turned.real, turned.imag
    return out


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 10])
def test_rotation_is_the_pairs_turned_by_position_times_frequency(
    neox: bool, rotary_dim: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    rope = KeyRope.from_base(rotary_dim, 300, base=500.0, is_neox_style=neox)
    x = torch.randn(7, 3, 16, generator=gen)
    positions = torch.tensor([0, 1, 2, 17, 100, 255, 299])
    freqs = 500.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    got = rope.rotate(x, positions)
    torch.testing.assert_close(
        got.double(), _complex_rope(x, positions, freqs, neox), atol=2e-5, rtol=0
    )
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])  # channels past rotary_dim
    assert torch.equal(got[0], x[0])  # position 0: cos 1, sin 0


def test_unrotate_inverts_rotate_and_keeps_norms() -> None:
    gen = torch.Generator().manual_seed(1)
    rope = KeyRope.from_base(64, 4096, base=100000.0)
    x = torch.randn(50, 2, 64, generator=gen)
    positions = torch.randint(0, 4096, (50,), generator=gen)
    back = rope.unrotate(rope.rotate(x, positions), positions)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.rotate(x, positions).norm(dim=-1), x.norm(dim=-1))


def test_from_base_matches_the_standard_table() -> None:
    rope = KeyRope.from_base(8, 5, base=10000.0)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    angles = torch.arange(5).float()[:, None] * inv
    assert rope.rotary_dim == 8 and rope.max_positions == 5
    assert torch.equal(rope.cos_sin, torch.cat([angles.cos(), angles.sin()], 1))
    assert math.isclose(float(rope.cos_sin[3, 4]), math.sin(3.0), rel_tol=1e-6)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (torch.zeros(4), r"cos_sin: expected a tensor \[max_positions, rotary_dim\], got \[4\]"),
        (torch.zeros(4, 3), r"even rotary_dim >= 2, got \[4, 3\]"),
        (torch.zeros(0, 4), r"at least one position"),
        (torch.full((2, 4), float("nan")), "cos_sin: expected finite float values"),
    ],
)
def test_bad_tables_are_refused(table: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyRope(table)


def test_bad_inputs_are_refused() -> None:
    rope = KeyRope.from_base(8, 10)
    with pytest.raises(ValueError, match=r"key: expected \[T, H, D\] with D >= rotary_dim=8"):
        rope.rotate(torch.zeros(2, 1, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"positions: expected \[2\] \(one per token\), got \[3\]"):
        rope.rotate(torch.zeros(2, 1, 8), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 10\).*got 0\.\.10"):
        rope.unrotate(torch.zeros(2, 1, 8), torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="rotary_dim: expected an even int >= 2, got 5"):
        KeyRope.from_base(5, 10)
    with pytest.raises(ValueError, match="max_positions: expected a positive int, got 0"):
        KeyRope.from_base(4, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_positions_are_checked_on_the_gpu_without_a_host_round_trip() -> None:
    """On a GPU the position check stays on the device: rotate / unrotate capture into a CUDA
    graph (reading the positions on the host is refused while capturing) and the replay equals
    the eager result. (A bad position then fails as a device-side assertion, which leaves the
    CUDA context unusable, so it is not provoked here.)"""
    rope = KeyRope.from_base(16, 64).to(torch.device("cuda"))
    x = torch.randn(5, 2, 16, device="cuda")
    positions = torch.tensor([0, 3, 17, 40, 63], device="cuda")
    eager = rope.unrotate(rope.rotate(x, positions), positions)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        rope.unrotate(rope.rotate(x, positions), positions)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rope.unrotate(rope.rotate(x, positions), positions)
    graph.replay()
    torch.testing.assert_close(captured, eager, rtol=0, atol=0)
