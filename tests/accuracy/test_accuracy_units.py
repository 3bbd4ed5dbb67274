"""Small pieces of the accuracy machinery: format ids, scales, slots, metrics."""

from __future__ import annotations

import pytest
import torch

from vllm.accuracy.cache_io import assign_slots
from vllm.accuracy.formats import (
    DEFAULT_FORMATS,
    CacheFormat,
    amax_scale,
    parse_format,
    parse_formats,
)
from vllm.accuracy.metrics import MetricsAccumulator, make_reference
from vllm.accuracy.samples import KVSample


@pytest.mark.parametrize(
    ("text", "dtype", "per_head", "layout", "name"),
    [
        ("bf16", "bfloat16", False, None, "bf16"),
        ("bfloat16", "bfloat16", False, None, "bf16"),
        ("fp8", "fp8_e4m3", False, None, "fp8_e4m3"),
        ("fp8_e5m2/head", "fp8_e5m2", True, None, "fp8_e5m2/head"),
        ("nvfp4/tensor", "nvfp4", False, None, "nvfp4"),
        ("nvfp4/head@interleave4", "nvfp4", True, "interleave4", "nvfp4/head@interleave4"),
        (" nvfp4@linear ", "nvfp4", False, "linear", "nvfp4@linear"),
        ("int8_per_token_head", "int8_per_token_head", False, None, "int8_per_token_head"),
    ],
)
def test_parse_format(text: str, dtype: str, per_head: bool, layout: str | None, name: str) -> None:
    """A format without @layout keeps the op's default (resolved per geometry)."""
    fmt = parse_format(text)
    got_layout = None if fmt.scale_layout is None else fmt.scale_layout.value
    assert (fmt.kv_cache_dtype, fmt.per_head, got_layout) == (dtype, per_head, layout)
    assert fmt.name == name and parse_format(fmt.name) == fmt


def test_format_scale_layout_defaults_per_geometry() -> None:
    nvfp4 = parse_format("nvfp4")
    assert nvfp4.scale_layout_for(16, 128).value == "interleave4"
    assert nvfp4.scale_layout_for(16, 80).value == "linear"
    assert parse_format("nvfp4@linear").scale_layout_for(16, 128).value == "linear"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("int8", "unknown KV-cache dtype"),
        ("fp8/channel", "unknown KV-cache encoding"),
        ("bf16/head", "needs a format with a k_scale / v_scale"),
        ("fp8_e4m3@interleave4", "only NVFP4"),
        ("nvfp4@zigzag", "expected one of"),
        ("int8_per_token_head/head", "granularity: /head needs a format with a k_scale"),
        ("fp8_per_token_head/tensor", "granularity: /tensor needs a format with a k_scale"),
        ("fp8_per_token_head@linear", "only NVFP4"),
        ("fp8_ds_mla", "unknown KV-cache dtype"),
    ],
)
def test_parse_format_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_format(text)


def test_parse_formats_defaults_and_dedup() -> None:
    assert [f.name for f in parse_formats(None)] == list(DEFAULT_FORMATS)
    assert [f.name for f in parse_formats("all")] == list(DEFAULT_FORMATS)
    assert [f.name for f in parse_formats("fp8,fp8_e4m3,nvfp4,")] == ["fp8_e4m3", "nvfp4"]
    with pytest.raises(ValueError, match="no format"):
        parse_formats(",")


def test_bytes_per_token_matches_design_worked_example() -> None:
    # docs/design.md §4: N=16, H=8, D=128 pages of 65,536 / 32,768 / 18,432 bytes.
    for name, page in (("bf16", 65536), ("fp8_e5m2", 32768), ("nvfp4", 18432)):
        assert parse_format(name).bytes_per_token(8, 128, 128) * 16 == page
    assert CacheFormat("nvfp4").cache_last_dim(128) == 72


def test_amax_scale() -> None:
    x = torch.zeros(4, 3, 16)
    x[1, 0, 2] = -896.0
    x[2, 1, 0] = 44.8
    assert amax_scale(x, False, 448.0).tolist() == [2.0]
    per_head = amax_scale(x, True, 448.0)
    assert per_head.dtype == torch.float32
    assert per_head.tolist() == pytest.approx([2.0, 0.1, 1.0])  # all-zero head -> 1.0


def test_assign_slots_pages_are_disjoint_and_shuffled() -> None:
    num_blocks, slots, tables = assign_slots((20, 5), block_size=8, seed=0)
    assert num_blocks == 3 + 1 + 2
    assert slots.dtype == torch.int64 and slots.numel() == 25
    assert len(set(slots.tolist())) == 25
    pages = torch.cat(tables).tolist()
    assert len(set(pages)) == 4 and all(0 <= p < num_blocks for p in pages)
    assert torch.equal(slots[:20] // 8, tables[0][torch.arange(20) // 8])


def test_metrics_known_values() -> None:
    key = torch.ones(4, 1, 16, dtype=torch.bfloat16)
    value = torch.arange(64, dtype=torch.float32).view(4, 1, 16).to(torch.bfloat16)
    query = torch.zeros(2, 1, 16)
    sample = KVSample("t", query, key, value, seq_lens=(4,), query_lens=(2,))
    out_ref = value.float().mean(0, keepdim=True).expand(2, 1, 16)
    ref = make_reference(sample, out_ref)
    acc = MetricsAccumulator()
    acc.add(sample, 2 * key.float(), value.float(), -out_ref, ref)
    m = acc.result()
    assert m.k_rel_rms == pytest.approx(1.0) and m.k_max_abs == 1.0
    assert m.v_rel_rms == 0.0
    assert m.out_cos_mean == pytest.approx(-1.0) and m.out_rel_err == pytest.approx(2.0)
    assert m.kl_mean == 0.0  # zero queries: uniform attention either way


def test_format_ids_with_key_options() -> None:
    from vllm.accuracy.formats import parse_format

    fmt = parse_format("nvfp4/head+offset+hadamard")
    assert (fmt.key_rotation, fmt.key_offset, fmt.per_head) == ("hadamard", True, True)
    assert fmt.name == "nvfp4/head+hadamard+offset" and fmt.has_key_options
    assert parse_format(fmt.name) == fmt
    assert not parse_format("fp8").has_key_options
    pre = parse_format("nvfp4_mse+sink+prerope+hadamard+offset")
    assert (pre.key_prerope, pre.key_sink_tokens) == (True, 1) and pre.has_key_options
    assert pre.name == "nvfp4_mse+hadamard+offset+prerope+sink"
    assert parse_format(pre.name) == pre
    # SmolLM2's geometry: 3 heads of 64, 16-token pages; one FP8 sink key row per page
    plain = parse_format("nvfp4").bytes_per_token(3, 64, 64)
    assert pre.bytes_per_token(3, 64, 64) == plain + 3 * 64 // 16
    # the page holds its sink rows: 3456 bytes of K and V, then 3 * 64 of sink rows
    assert parse_format("nvfp4").page_bytes(3, 64, 64) == 3456
    assert pre.page_bytes(3, 64, 64) == 3456 + 192
    for bad, message in (
        ("bf16+hadamard", "key_rotation: expected a quantized cache format"),
        ("fp8+rotate", "unknown KV-cache encoding"),
        ("fp8+offset+offset", "unknown KV-cache encoding"),
        ("bf16+prerope", "key_rope: expected a quantized cache format"),
        ("int8_per_token_head+sink", "key_sink_tokens: expected an FP8 or NVFP4 cache"),
        ("fp8+sink+sink", "unknown KV-cache encoding"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_format(bad)


def test_the_kv_check_refuses_key_options() -> None:
    from vllm.accuracy.formats import parse_format
    from vllm.accuracy.runner import run_check
    from vllm.accuracy.synthetic import synthetic_sample

    with pytest.raises(ValueError, match="formats: expected formats without"):
        run_check(
            [synthetic_sample(seed=0, seq_lens=(16,), num_kv_heads=1, head_size=16)],
            [parse_format("fp8+hadamard")],
            source="synthetic",
            description="test",
        )
