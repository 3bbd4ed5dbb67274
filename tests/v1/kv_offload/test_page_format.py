"""KVPageFormat: every input that decides the bytes changes the fingerprint; headers are
checked field by field before any byte is trusted."""

from __future__ import annotations

import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vllm.kv_quant.calibrated import KVCacheCalibration, LayerCalibration
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.v1.attention.backends.utils import kv_cache_layout
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


def _encoded(encoding: str, num_blocks: int = 4) -> KVCacheConfig:
    enc = KVCacheEncoding.parse(encoding)
    attn = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
        kv_quant_mode=enc.format.quant_mode, encoding=enc,
    )  # fmt: skip
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=num_blocks * attn.page_size_bytes, shared_by=["a"])],
        kv_cache_groups=[KVCacheGroupSpec(["a"], attn)],
    )


def test_the_whole_encoding_the_page_order_and_the_calibration_are_in_it() -> None:
    """Pages of different encodings (also of one page size), of NHD and HND caches and of other
    calibrated values never share a fingerprint; the same inputs always do."""

    def of(encoding: str = "nvfp4", layout: str = "NHD", **kw) -> str:
        return fmt(kv_cache_config=_encoded(encoding), kv_cache_layout=layout, **kw).fingerprint

    base = of()
    assert of() == base
    with kv_cache_layout("HND"):  # the layout in effect is the default
        assert fmt(kv_cache_config=_encoded("nvfp4")).fingerprint == of(layout="HND")
    variants = [
        of("nvfp4_mse"),
        of("nvfp4+hadamard"),
        of("nvfp4+offset"),
        of("nvfp4+sink"),
        of("nvfp4@linear"),  # the default at 16 tokens x 64 is interleave4
        of("nvfp4/head"),
        of(layout="HND"),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    # explicit layouts are what the encoding resolves to: the same bytes, the same fingerprint
    assert of("nvfp4@interleave4") != base  # (the spec's encoding names it: a different spec)
    assert fmt(kv_cache_config=_encoded("nvfp4")).scale_layouts == (
        ("a", "interleave4", "interleave4"),
    )
    enc = KVCacheEncoding.parse("nvfp4+offset")
    calibrated = KVCacheCalibration(
        enc, {"a": LayerCalibration(torch.tensor(0.5), torch.tensor(0.25), torch.zeros(2, 64))}
    )
    other = KVCacheCalibration(
        enc, {"a": LayerCalibration(torch.tensor(0.5), torch.tensor(0.25), torch.ones(2, 64))}
    )
    assert len({of("nvfp4+offset"), of("nvfp4+offset", calibration=calibrated),
                of("nvfp4+offset", calibration=other)}) == 3  # fmt: skip


def test_the_fingerprint_is_the_same_in_another_process() -> None:
    """Every field goes in by value (an encoding by its byte-deciding facts, never an object's
    address), so two processes agree."""
    here = fmt(kv_cache_config=_encoded("nvfp4_mse+offset+sink")).fingerprint
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from test_page_format import fmt, _encoded; "
        "print(fmt(kv_cache_config=_encoded('nvfp4_mse+offset+sink')).fingerprint)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == here
