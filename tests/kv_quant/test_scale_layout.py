"""NVFP4 block-scale layouts: interleave4 is a permutation with the documented placement."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.kv_quant import ScaleLayout, from_layout, interleave4_index, layout_index, to_layout

from .oracles import DEVICES


def test_parse() -> None:
    assert ScaleLayout.parse("linear") is ScaleLayout.LINEAR
    assert ScaleLayout.parse("interleave4") is ScaleLayout.INTERLEAVE4
    assert ScaleLayout.parse(ScaleLayout.INTERLEAVE4) is ScaleLayout.INTERLEAVE4
    assert ScaleLayout.LINEAR == "linear"
    with pytest.raises(ValueError, match="'linear', 'interleave4'"):
        ScaleLayout.parse("swizzled")


def test_hand_checked_4x4() -> None:
    # S // 4 == 1: (t, s) -> (s, t), a transpose of each 4x4 block.
    x = torch.arange(16).reshape(4, 4)
    assert to_layout(x, "interleave4").tolist() == x.T.tolist()
    x8 = torch.arange(32).reshape(8, 4)
    assert to_layout(x8, "interleave4").tolist() == [*x8[:4].T.tolist(), *x8[4:].T.tolist()]


def test_hand_checked_8x8() -> None:
    # Value v = 8t + s. S // 4 == 2: (t, s) -> row (t//4)*4 + s//2, col (s%2)*4 + t%4.
    x = torch.arange(64).reshape(8, 8)
    want = [
        [0, 8, 16, 24, 1, 9, 17, 25],
        [2, 10, 18, 26, 3, 11, 19, 27],
        [4, 12, 20, 28, 5, 13, 21, 29],
        [6, 14, 22, 30, 7, 15, 23, 31],
        [32, 40, 48, 56, 33, 41, 49, 57],
        [34, 42, 50, 58, 35, 43, 51, 59],
        [36, 44, 52, 60, 37, 45, 53, 61],
        [38, 46, 54, 62, 39, 47, 55, 63],
    ]
    assert to_layout(x, ScaleLayout.INTERLEAVE4).tolist() == want
    assert torch.equal(from_layout(torch.tensor(want), "interleave4"), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, s", [(4, 4), (8, 8), (16, 4), (16, 16), (64, 8), (4, 12), (32, 20)])
def test_interleave4_is_a_permutation(n: int, s: int, device: str) -> None:
    rows, cols = interleave4_index(n, s, device)
    assert rows.dtype == cols.dtype == torch.int64 and rows.shape == cols.shape == (n, s)
    assert int(rows.min()) >= 0 and int(rows.max()) < n
    assert int(cols.min()) >= 0 and int(cols.max()) < s
    flat = (rows * s + cols).flatten().sort().values.cpu()
    assert torch.equal(flat, torch.arange(n * s))
    # Formula spot check.
    t, j = n - 1, s - 1
    assert (int(rows[t, j]), int(cols[t, j])) == (
        (t // 4) * 4 + j // (s // 4),
        (j % (s // 4)) * 4 + t % 4,
    )


@settings(max_examples=30, deadline=None)
@given(
    n4=st.integers(1, 16),
    s4=st.integers(1, 8),
    lead=st.sampled_from([(), (3,), (2, 5)]),
    dtype=st.sampled_from([torch.uint8, torch.float8_e4m3fn, torch.float32]),
    layout=st.sampled_from(list(ScaleLayout)),
)
def test_round_trip(n4, s4, lead, dtype, layout) -> None:
    n, s = 4 * n4, 4 * s4
    x = torch.randint(0, 120, (*lead, n, s), dtype=torch.uint8).to(torch.float32).to(dtype)
    stored = to_layout(x, layout)
    assert stored.shape == x.shape and stored.dtype == dtype
    assert torch.equal(from_layout(stored, layout).float(), x.float())
    assert torch.equal(to_layout(from_layout(x, layout), layout).float(), x.float())
    rows, cols = layout_index(layout, n, s)
    assert torch.equal(stored[..., rows, cols].float(), x.float())


def test_linear_is_identity() -> None:
    x = torch.arange(24).reshape(2, 3, 4)
    assert torch.equal(to_layout(x, "linear"), x) and torch.equal(from_layout(x, "linear"), x)
    rows, cols = layout_index("linear", 3, 4)
    assert torch.equal(rows * 4 + cols, torch.arange(12).reshape(3, 4))


def test_divisibility_errors() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        interleave4_index(6, 4)
    with pytest.raises(ValueError, match="num_scales"):
        interleave4_index(8, 2)
    with pytest.raises(ValueError, match="num_scales"):
        to_layout(torch.zeros(8, 6), "interleave4")
    with pytest.raises(ValueError, match="scales"):
        to_layout(torch.zeros(8), "interleave4")


def test_fits_is_the_rule_default_for_asks() -> None:
    from vllm.kv_quant.scale_layout import ScaleLayout

    for block_size, head_size in ((16, 64), (16, 128), (4, 64), (6, 64), (16, 80), (16, 32)):
        assert ScaleLayout.LINEAR.fits(block_size, head_size)
        fits = block_size % 4 == 0 and head_size % 64 == 0
        assert ScaleLayout.INTERLEAVE4.fits(block_size, head_size) is fits
        want = ScaleLayout.INTERLEAVE4 if fits else ScaleLayout.LINEAR
        assert ScaleLayout.default_for(block_size, head_size) is want
