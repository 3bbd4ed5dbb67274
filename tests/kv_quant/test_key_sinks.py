"""Key sinks: the first keys of each page kept again in FP8 (the rows' codec)."""

from __future__ import annotations

import pytest
import torch

from vllm.kv_quant import (
    E2M1_MAX,
    FP8_E4M3_MAX,
    FP8_E5M2_MAX,
    dequantize_fp8,
    key_sink_scale,
    quantize_fp8,
    read_key_sinks,
    write_key_sinks,
)
from vllm.kv_quant.encoding import KVCacheEncoding


def test_rows_among_the_first_s_of_their_page_are_written_in_fp8() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, block_size, rows, heads, dim = 5, 4, 2, 3, 8
    sinks = torch.full((blocks, rows, heads, dim), 0x55, dtype=torch.uint8)
    key = torch.randn(9, heads, dim, generator=gen).to(torch.bfloat16)
    scale = torch.tensor([0.01, 0.02, 0.03])
    # slots: page 0 offsets 0, 1, 2; page 3 offset 1; page 4 offset 0 skipped (-1); padding row
    slots = torch.tensor([0, 1, 2, 13, -1, 16, 19, 8])
    write_key_sinks(sinks, key, slots, block_size, scale)
    codes = quantize_fp8(key.float(), scale, "e4m3")
    assert torch.equal(sinks[0, 0], codes[0]) and torch.equal(sinks[0, 1], codes[1])
    assert torch.equal(sinks[3, 1], codes[3]) and torch.equal(sinks[4, 0], codes[5])
    assert torch.equal(sinks[2, 0], codes[7])
    untouched = torch.ones(blocks, rows, dtype=torch.bool)
    for b, r in ((0, 0), (0, 1), (3, 1), (4, 0), (2, 0)):
        untouched[b, r] = False
    assert bool((sinks[untouched] == 0x55).all())  # offset 2, slot -1, 19 (offset 3): no row
    got = read_key_sinks(sinks, torch.tensor([3, 0]), scale)
    assert got.shape == (2, rows, heads, dim) and got.dtype == torch.float32
    assert torch.equal(got[1, 0], dequantize_fp8(codes[0], scale, "e4m3"))
    assert torch.equal(got[0, 1], dequantize_fp8(codes[3], scale, "e4m3"))


def test_sink_scale_spans_the_formats_amax() -> None:
    """The rows' e4m3 scale is the K scale times ``scale_max / 448``: the FP8 rows span the
    amax the K scale was calibrated on (e4m3 1, NVFP4 6, e5m2 128)."""
    k_scale = torch.tensor([0.5])
    multipliers = {}
    for name in ("fp8_e4m3", "nvfp4", "nvfp4_mse", "fp8_e5m2"):
        multipliers[name] = KVCacheEncoding.parse(name + "+sink").sink_scale_multiplier
    assert multipliers == {"fp8_e4m3": 1.0, "nvfp4": E2M1_MAX, "nvfp4_mse": E2M1_MAX,
                           "fp8_e5m2": FP8_E5M2_MAX / FP8_E4M3_MAX}  # fmt: skip
    assert torch.equal(key_sink_scale(k_scale, 1.0), k_scale)
    assert torch.equal(key_sink_scale(k_scale, E2M1_MAX), k_scale * E2M1_MAX)


def test_bad_arguments_are_refused_before_writing() -> None:
    sinks = torch.zeros(2, 1, 2, 4, dtype=torch.uint8)
    scale = torch.ones(1)
    with pytest.raises(ValueError, match=r"key_sinks: expected a uint8 \[num_blocks, S, H, D\]"):
        write_key_sinks(
            sinks.float(), torch.zeros(1, 2, 4), torch.zeros(1, dtype=torch.int64), 4, scale
        )
    with pytest.raises(
        ValueError, match=r"key: expected \[T, 2, 4\] like the key sinks, got \[1, 3, 4\]"
    ):
        write_key_sinks(sinks, torch.zeros(1, 3, 4), torch.zeros(1, dtype=torch.int64), 4, scale)
    with pytest.raises(
        ValueError, match="slot_mapping: slot 8 is out of range for a cache of 8 slots"
    ):
        write_key_sinks(sinks, torch.ones(1, 2, 4), torch.tensor([8]), 4, scale)
    assert not bool(sinks.any())
