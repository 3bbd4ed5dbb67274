"""Side-by-side cache dtypes of one model: footprints, plan facts and labels from the core
objects (the numbers ``vllm-kv plan`` prints)."""

from __future__ import annotations

import pytest

from vllm.model_presets import load_preset
from vllm.v1.core.cache_dtype_comparison import compare_cache_dtypes
from vllm.v1.core.kv_bytes import kv_footprint, total_state_bytes
from vllm.v1.core.model_config import unwrap_config
from vllm.v1.core.model_families import parse_model_layout
from vllm.v1.core.spec_display import spec_format_label

GiB = 2**30


def _layout(preset: str, **changes):
    config = unwrap_config(load_preset(preset))
    config.update(changes)
    return parse_model_layout(config)


def test_gpt_oss_footprints() -> None:
    # 36 layers, H=8, D=64: 2 * 8 * 64 * 2 = 2048 bf16 bytes per token and layer, half of the
    # layers slide over 128 tokens; fp8 halves that; nvfp4 stores F(64) = 36 bytes per head.
    compared = compare_cache_dtypes(
        "gpt-oss-120b", _layout("gpt-oss-120b"), ["bfloat16", "fp8", "nvfp4"]
    )
    per_layer = {"bfloat16": 2048, "fp8": 1024, "nvfp4": 2 * 8 * 36}
    for column in compared:
        fp = column.footprint
        assert column.plan is None
        assert fp.per_token == 36 * per_layer[column.dtype]
        assert fp.growing_per_token == 18 * per_layer[column.dtype]
        assert fp.window_cap_per_sequence == 18 * 128 * per_layer[column.dtype]
        assert fp.state_per_sequence == 0


def test_state_and_compressed_layers() -> None:
    (nemotron,) = compare_cache_dtypes("n", _layout("nemotron-h-56b-base-8k"), ["bfloat16"])
    specs = nemotron.specs.specs
    assert nemotron.footprint.state_per_sequence == total_state_bytes(specs) > 0
    (dsv4,) = compare_cache_dtypes("d", _layout("deepseek-v4-flash"), ["fp8"])
    fp = kv_footprint(dsv4.specs.specs)
    # Compressed layers add a fraction of an entry per token: not a whole number of bytes.
    assert fp.growing_per_token.denominator > 1
    labels = {spec_format_label(s) for s in dsv4.specs.specs.values()}
    assert labels == {"fp8_ds_mla", "fp8"}


def test_planned_columns_expose_the_plan_facts() -> None:
    compared = compare_cache_dtypes(
        "gpt-oss-120b", _layout("gpt-oss-120b"), ["bfloat16", "nvfp4"], available_memory=80 * GiB
    )
    for column in compared:
        plan = column.plan
        assert plan is not None and plan.fits and plan.max_model_len == 131072
        assert plan.block_sizes == [16]
        assert plan.page_sizes == [plan.specs["model.layers.0.self_attn"].page_size_bytes]
        groups = plan.kv_cache_config.kv_cache_groups
        per_group = [plan.group_blocks_per_request(g) for g in groups]
        assert sum(per_group) == plan.blocks_per_request == 8713  # 521 sliding + 8192 full
    assert [c.plan.page_sizes for c in compared] == [[32768], [9216]]


def test_budget_without_a_context_length_is_an_error() -> None:
    layout = _layout("qwen3-32b", max_position_embeddings=None)
    assert compare_cache_dtypes("q", layout, ["fp8"])[0].plan is None
    with pytest.raises(ValueError, match="max_model_len: the config has no max_position_embed"):
        compare_cache_dtypes("q", layout, ["fp8"], available_memory=GiB)
    (column,) = compare_cache_dtypes("q", layout, ["fp8"], available_memory=GiB, max_model_len=64)
    assert column.plan is not None and column.plan.max_model_len == 64
