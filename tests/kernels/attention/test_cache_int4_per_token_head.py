"""reshape_and_cache_flash into ``int4_per_token_head`` caches against the reference codec
(vllm.kv_quant.int4_per_token_head), byte for byte: random inputs, edge rows, odd shapes and
strides, NHD and HND, every Hadamard block size, and the argument checks."""

from __future__ import annotations

import pytest
import torch
from kv_cache_test_utils import DEVICES

from vllm import _custom_ops as ops
from vllm.kv_quant.int4_per_token_head import int4_per_token_head_write_cache

from .cache_utils import SOURCE_DTYPES, _id, check_against_reference, make_case

KIND = "int4_per_token_head"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_matches_reference(device: str, dtype: torch.dtype, hnd: bool) -> None:
    check_against_reference(make_case(device, KIND, dtype, hnd=hnd, row_padding=5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "head_size,head_size_v,block_size,num_heads",
    # Hadamard blocks 8 (D = 24, 40), 32 (96), 64, 128, 256 and 512; K and V of different blocks.
    [(8, 8, 1, 1), (24, 40, 3, 5), (96, 96, 7, 3), (64, 128, 16, 2), (256, 72, 16, 1),
     (512, 512, 2, 2)],
)  # fmt: skip
@pytest.mark.parametrize("hnd", [False, True], ids=["NHD", "HND"])
def test_odd_shapes(
    device: str, head_size: int, head_size_v: int, block_size: int, num_heads: int, hnd: bool
) -> None:
    for dtype in SOURCE_DTYPES:
        case = make_case(
            device, KIND, dtype, num_blocks=5, block_size=block_size, num_heads=num_heads,
            head_size=head_size, head_size_v=head_size_v, hnd=hnd,
            num_tokens=min(9, 5 * block_size), padding=2, row_padding=3,
        )  # fmt: skip
        check_against_reference(case)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES, ids=_id)
def test_edge_rows(device: str, dtype: torch.dtype) -> None:
    """All-zero and constant rows (the 1e-6 scale floor, zero points at both ends), rows of one
    spike, large and tiny magnitudes, halves that round to the ties of the zero point. (A row
    whose rotation overflows the source dtype has no defined bytes, upstream's nor ours.)"""
    case = make_case(device, KIND, dtype, num_tokens=12, padding=0, skip_every=0, num_heads=2)
    rows = case.key.shape[0]
    edge = torch.zeros(rows, 2, 64)
    edge[1] = 3.0
    edge[2] = -7.5
    edge[3, :, 5] = 1e4
    edge[4] = torch.linspace(-1, 1, 64)
    edge[5] = 1e-30
    edge[6] = torch.linspace(-300, 900, 64)  # rotated: sums up to 64 x 900, finite in fp16
    edge[7, :, ::2] = 0.5
    edge[8] = torch.arange(64) % 16 - 7.5
    edge[9] = -1e-3
    case.key.copy_(edge.to(dtype))
    case.value.copy_(edge.flip(0).to(dtype))
    check_against_reference(case)


def _caches(head_size: int, head_size_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    d_v = head_size if head_size_v is None else head_size_v
    return (
        torch.zeros(2, 4, 2, head_size // 2 + 4, dtype=torch.uint8),
        torch.zeros(2, 4, 2, d_v // 2 + 4, dtype=torch.uint8),
    )


def test_the_pages_upstreams_triton_writer_reads_back() -> None:
    """The compiled bytes decode with the codec (its own test pins the bytes against upstream's
    reference): a round trip within the format's error."""
    x = torch.randn(6, 2, 64)
    k_cache, v_cache = _caches(64)
    slots = torch.arange(6)
    one = torch.ones(())
    ops.reshape_and_cache_flash(x, x, k_cache, v_cache, slots, KIND, one, one)
    expected = torch.zeros_like(k_cache)
    int4_per_token_head_write_cache(x, expected, slots)
    assert torch.equal(k_cache, expected) and torch.equal(v_cache, expected)


@pytest.mark.parametrize(
    "head_size,key_sinks,message",
    [
        (12, False, "key: int4_per_token_head needs a head size that is a multiple of 8, got 12"),
        (1024, False, "key: int4_per_token_head needs a head size of at most 512, got 1024"),
        (64, True, "key_sinks: expected none for kv_cache_dtype 'int4_per_token_head'"),
    ],
)
def test_bad_arguments_name_what_is_wrong(head_size: int, key_sinks: bool, message: str) -> None:
    x = torch.randn(3, 2, head_size)
    k_cache, v_cache = _caches(head_size + head_size % 8)
    before = (k_cache.clone(), v_cache.clone())
    sinks = torch.zeros(2, 1, 2, head_size, dtype=torch.uint8) if key_sinks else None
    one = torch.ones(())
    with pytest.raises(RuntimeError, match=message):
        ops.reshape_and_cache_flash(
            x, x, k_cache, v_cache, torch.arange(3), KIND, one, one,
            key_sinks=sinks, key_sink_scale=one if key_sinks else None,
        )  # fmt: skip
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_wrong_row_width_names_the_formula() -> None:
    x = torch.randn(3, 2, 64)
    bad = torch.zeros(2, 4, 2, 64 + 4, dtype=torch.uint8)
    one = torch.ones(())
    with pytest.raises(RuntimeError, match=r"key_cache: expected last dim D/2 \+ 4 = 36"):
        ops.reshape_and_cache_flash(x, x, bad, bad.clone(), torch.arange(3), KIND, one, one)
