"""KVPageFormat: every input that decides the bytes changes the fingerprint; headers are
checked field by field before any byte is trusted."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
)
from vllm.v1.kv_offload.page_format import HEADER_MAGIC, KVPageFormat


def config(head_size: int = 64, mode: KVQuantMode = KVQuantMode.NONE, num_blocks: int = 4):
    dtype = torch.bfloat16 if mode == KVQuantMode.NONE else torch.uint8
    attn = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=head_size, dtype=dtype, kv_quant_mode=mode
    )
    mamba = MambaSpec(block_size=16, shapes=((3, 32),), dtypes=(torch.float32,))
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * attn.page_size_bytes, shared_by=["attn"]),
            KVCacheTensor(size=num_blocks * mamba.page_size_bytes, shared_by=["mamba"]),
        ],
        kv_cache_groups=[KVCacheGroupSpec(["attn"], attn), KVCacheGroupSpec(["mamba"], mamba)],
    )


def fmt(**changes) -> KVPageFormat:
    args = {"model": "m", "kv_cache_dtype": "auto", "tp_rank": 0, "block_size_factor": 1}
    cfg = changes.pop("kv_cache_config", config())
    args.update(changes)
    return KVPageFormat.from_kv_cache_config(cfg, **args)


def test_geometry() -> None:
    f = fmt()
    assert f.page_sizes_bytes == (16 * 2 * 128 * 2, 3 * 32 * 4)
    assert f.block_bytes == sum(f.page_sizes_bytes)
    assert fmt(block_size_factor=3).block_bytes == 3 * f.block_bytes
    assert fmt(block_size_factor=3, num_workers=2).block_bytes == 6 * f.block_bytes
    assert fmt(kv_cache_config=config(num_blocks=9)).fingerprint == f.fingerprint


@pytest.mark.parametrize(
    "changes",
    [
        {"model": "other"},
        {"kv_cache_dtype": "fp8_e5m2"},
        {"tp_rank": 1},
        {"block_size_factor": 2},
        {"num_workers": 2},
        {"kv_cache_config": config(head_size=128)},
        {"kv_cache_config": config(mode=KVQuantMode.FP8_PER_TENSOR)},
        {"kv_cache_config": config(mode=KVQuantMode.NVFP4)},
        {"scale_layouts": {"attn": ("interleave4", "interleave4")}},
        {"kv_scales": {"attn": (0.5, 0.25)}},
    ],
)
def test_every_input_changes_the_fingerprint(changes) -> None:
    base, other = fmt(), fmt(**changes)
    assert other.fingerprint != base.fingerprint
    assert base.describe_difference(other) is not None
    with pytest.raises(ValueError, match="header"):
        base.check_header(other.header())


def test_fp8_scale_values_and_layouts_are_distinguished() -> None:
    a = fmt(kv_scales={"attn": (0.5, 0.25)})
    assert a.fingerprint != fmt(kv_scales={"attn": (0.5, 0.5)}).fingerprint
    b = fmt(scale_layouts={"attn": ("linear", "linear")})
    assert b.fingerprint != fmt(scale_layouts={"attn": ("interleave4", "linear")}).fingerprint


def test_header_round_trip_and_errors() -> None:
    f = fmt()
    header = f.header()
    assert len(header) == f.header_bytes and f.header_bytes % 64 == 0
    assert header.startswith(HEADER_MAGIC)
    f.check_header(header)
    with pytest.raises(ValueError, match="expected magic"):
        f.check_header(b"X" * len(header))
    with pytest.raises(ValueError, match=f"expected {f.header_bytes} header bytes, got 3"):
        f.check_header(b"abc")
    wrong_size = bytearray(header)
    struct.pack_into("<Q", wrong_size, 40, f.block_bytes + 1)
    with pytest.raises(ValueError, match=f"expected a block of {f.block_bytes} bytes"):
        f.check_header(bytes(wrong_size))
    wrong_pages = bytearray(header)
    struct.pack_into("<Q", wrong_pages, 56, 7)
    with pytest.raises(ValueError, match="expected page sizes"):
        f.check_header(bytes(wrong_pages))
    with pytest.raises(ValueError, match="expected format fingerprint"):
        f.check_header(fmt(model="x").header())


def test_json_round_trip() -> None:
    f = fmt(
        scale_layouts={"attn": ("interleave4", "linear")},
        kv_scales={"attn": (0.5, 1.0)},
        num_workers=4,
    )
    assert KVPageFormat.from_json(f.to_json()) == f
    assert KVPageFormat.from_json(f.to_json()).fingerprint == f.fingerprint
    with pytest.raises(ValueError, match="malformed"):
        KVPageFormat.from_json('{"model": "m"}')


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": ""}, "model: expected a non-empty model name"),
        ({"tp_rank": -1}, "tp_rank: expected an int ≥ 0, got -1"),
        ({"block_size_factor": 0}, "block_size_factor"),
        ({"num_workers": 0}, "num_workers"),
        ({"kv_scales": {"nope": (1.0, 1.0)}}, "kv_scales: expected"),
        ({"scale_layouts": {"attn": ("linear",)}}, "scale_layouts: expected"),
    ],
)
def test_bad_inputs(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        fmt(**changes)


def test_describe_difference_names_the_field() -> None:
    assert fmt().describe_difference(fmt()) is None
    assert fmt().describe_difference(fmt(tp_rank=3)) == "tp_rank: 0 vs 3"
    other = fmt(kv_cache_config=config(head_size=128))
    assert fmt().describe_difference(other).startswith("page_sizes_bytes")
    assert replace(fmt(), model="z").describe_difference(fmt()) == "model: 'z' vs 'm'"
