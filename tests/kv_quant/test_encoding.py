"""KVCacheEncoding: one value per layer encoding, one grammar, every compatibility rule in one
place, page bytes with the sink rows, and a fingerprint that changes exactly when the bytes do;
the planner and the plan CLI count what the encoding holds."""

from __future__ import annotations

import pytest
import torch
from kv_cache_test_utils import LLAMA_LIKE

from vllm.config.cache import CacheConfig
from vllm.kv_quant import KeyRope
from vllm.kv_quant.encoding import KeySpec, KVCacheEncoding, RopeIdentity, ScaleGranularity
from vllm.kv_quant.formats import cache_dtype_names, lookup
from vllm.kv_quant.scale_layout import ScaleLayout
from vllm.v1.core.kv_cache_sizing import kv_cache_memory_for_blocks
from vllm.v1.core.model_specs import get_kv_cache_specs


@pytest.mark.parametrize("name", cache_dtype_names())
def test_every_dtype_string_is_the_encoding_with_defaults(name: str) -> None:
    encoding = KVCacheEncoding.parse(name)
    assert encoding.format is lookup(name) and encoding.key.is_identity
    assert encoding == KVCacheEncoding(lookup(name))
    assert encoding.id == lookup(name).name  # a canonical id is a kv_cache_dtype string
    assert KVCacheEncoding.parse(encoding.id) == encoding


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("fp8", "fp8_e4m3"),
        ("bf16", "bfloat16"),
        ("fp8/head+offset+hadamard", "fp8_e4m3/head+hadamard+offset"),
        ("nvfp4_mse+sink+prerope+offset", "nvfp4_mse+offset+prerope+sink"),
        ("nvfp4/tensor@linear+sink1", "nvfp4@linear+sink"),
        ("fp8_e5m2+sink3", "fp8_e5m2+sink3"),
        (" int8_per_token_head ", "int8_per_token_head"),
    ],
)
def test_ids_parse_to_their_canonical_form(text: str, canonical: str) -> None:
    encoding = KVCacheEncoding.parse(text)
    assert encoding.id == canonical and KVCacheEncoding.parse(canonical) == encoding


def test_the_parts() -> None:
    enc = KVCacheEncoding.parse("nvfp4_mse/head@linear+hadamard+offset+prerope+sink2")
    assert enc.format.name == "nvfp4_mse" and enc.granularity is ScaleGranularity.HEAD
    assert enc.k_scale_layout is enc.v_scale_layout is ScaleLayout.LINEAR
    assert enc.key == KeySpec("hadamard", True, True, 2)
    assert KVCacheEncoding.parse("int8_per_token_head").granularity is ScaleGranularity.TOKEN_HEAD
    assert KVCacheEncoding.parse("auto").granularity is ScaleGranularity.NONE
    assert KVCacheEncoding.parse("nvfp4").sink_scale_multiplier == 6.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("fp4", "kv_cache_dtype: unknown KV-cache dtype 'fp4'"),
        ("fp8+rotate", "kv_cache_dtype: unknown KV-cache encoding 'fp8\\+rotate'"),
        ("fp8+sink+sink2", "unknown KV-cache encoding"),
        ("fp8+sink0", "unknown KV-cache encoding"),
        ("fp8/channel", "unknown KV-cache encoding"),
        ("bf16+offset", "key_offset: expected a quantized cache format"),
        ("int4_per_token_head+offset", "key_offset: expected a format whose writers apply key"),
        ("turboquant_k8v4+hadamard", "key_rotation: expected a format whose writers apply key"),
        ("bf16/head", "granularity: /head needs a format with a k_scale / v_scale"),
        ("int8_per_token_head+sink", "key_sink_tokens: expected an FP8 or NVFP4 cache"),
        ("fp8@interleave4", "k_scale_layout: only NVFP4 formats have block scales"),
        ("nvfp4@zigzag", "scale_layout: expected one of"),
    ],
)
def test_bad_ids_name_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheEncoding.parse(text)


def test_mla_records_only_where_allowed() -> None:
    assert KVCacheEncoding.parse("fp8_ds_mla").format.mla_only
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'fp8_ds_mla'"):
        KVCacheEncoding.parse("fp8_ds_mla", include_mla_only=False)


def test_geometry_rules() -> None:
    KVCacheEncoding.parse("nvfp4+sink").check_geometry(16, 8, 128)
    for text, args, message in (
        ("fp8+hadamard", (16, 8, 96), "head_size: expected a power of two"),
        ("fp8+sink17", (16, 8, 128), "key_sink_tokens: expected at most block_size=16"),
        ("nvfp4@interleave4", (6, 8, 128), "k_scale_layout: expected a layout that fits"),
        ("nvfp4", (16, 8, 40), "head_size: NVFP4 KV cache needs a positive multiple of 16"),
    ):
        with pytest.raises(ValueError, match=message):
            KVCacheEncoding.parse(text).check_geometry(*args)
    rope = KeyRope.from_base(256, 8)
    with pytest.raises(ValueError, match="key_rope: expected rotary_dim <= head_size=128"):
        KVCacheEncoding.parse("nvfp4+prerope").with_rope(rope).check_geometry(16, 8, 128)


def test_the_offset_rule_lives_in_the_encoding() -> None:
    KVCacheEncoding.parse("fp8+offset").check_attention(None, False)
    KVCacheEncoding.parse("fp8+offset+prerope").check_attention(30.0, True)  # added back
    with pytest.raises(ValueError, match="key_offset: expected an attention without sinks"):
        KVCacheEncoding.parse("fp8+offset").check_attention(30.0, False)


def test_page_bytes_count_the_sink_rows() -> None:
    plain = KVCacheEncoding.parse("nvfp4")
    sinks = KVCacheEncoding.parse("nvfp4_mse+offset+prerope+sink")
    assert plain.page_bytes(16, 8, 128) == 18_432
    assert sinks.page_bytes(16, 8, 128) == 18_432 + 1 * 8 * 128  # +5.6%
    assert KVCacheEncoding.parse("fp8+sink").page_bytes(16, 8, 128) == 32_768 + 1024  # +3.1%
    assert KVCacheEncoding.parse("auto").page_bytes(16, 8, 128, itemsize=2) == 65_536


def test_the_fingerprint_changes_exactly_when_the_bytes_do() -> None:
    base = KVCacheEncoding.parse("nvfp4")
    same = [KVCacheEncoding.parse("nvfp4/tensor"), KVCacheEncoding(lookup("nvfp4"))]
    assert all(e.fingerprint == base.fingerprint for e in same)
    rope = KeyRope.from_base(64, 32)
    other_rope = KeyRope.from_base(64, 32, base=500.0)
    different = [
        "nvfp4_mse", "nvfp4/head", "nvfp4@linear", "nvfp4@interleave4", "nvfp4+hadamard",
        "nvfp4+offset", "nvfp4+prerope", "nvfp4+sink", "nvfp4+sink2", "fp8",
    ]  # fmt: skip
    prints = {KVCacheEncoding.parse(t).fingerprint for t in different}
    prints |= {KVCacheEncoding.parse("nvfp4+prerope").with_rope(r).fingerprint
               for r in (rope, other_rope)}  # fmt: skip
    assert base.fingerprint not in prints and len(prints) == len(different) + 2
    assert RopeIdentity.of(rope) == RopeIdentity.of(KeyRope(rope.cos_sin.clone()))


def test_the_planner_and_the_config_take_an_encoding_id() -> None:
    assert CacheConfig(cache_dtype="nvfp4_mse+offset+prerope+sink").cache_dtype  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_dtype: unknown KV-cache encoding"):
        CacheConfig(cache_dtype="nvfp4+bogus")  # type: ignore[arg-type]
    specs = get_kv_cache_specs(LLAMA_LIKE, "nvfp4_mse+offset+prerope+sink", 16)
    plain = get_kv_cache_specs(LLAMA_LIKE, "nvfp4", 16)
    for spec, base in zip(specs.values(), plain.values(), strict=True):
        assert spec.encoding.id == "nvfp4_mse+offset+prerope+sink"  # type: ignore[attr-defined]
        assert spec.page_size_bytes == base.page_size_bytes + 8 * 128 == 19_456
        assert base.encoding == KVCacheEncoding.parse("nvfp4")  # type: ignore[attr-defined]
    assert kv_cache_memory_for_blocks(_vllm_config(), dict(specs), 10) == 2 * 10 * 19_456


def _vllm_config():  # type: ignore[no-untyped-def]
    from vllm.config import CacheConfig as Cache
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model="m", max_model_len=64),
        cache_config=Cache(block_size=16, cache_dtype="nvfp4_mse+offset+prerope+sink"),  # type: ignore[arg-type]
    )


def test_a_spec_checks_its_encoding() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

    with pytest.raises(ValueError, match="encoding: expected an encoding of a NVFP4 format"):
        FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.NVFP4, encoding=KVCacheEncoding.parse("fp8+sink"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="key_sink_tokens: expected at most block_size=2"):
        FullAttentionSpec(
            block_size=2, num_kv_heads=2, head_size=64, dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR, encoding=KVCacheEncoding.parse("fp8+sink3"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="encoding: a latent \\(MLA\\) cache is its format's"):
        MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=576, dtype=torch.uint8,
            kv_quant_mode=KVQuantMode.FP8_PER_TENSOR, encoding=KVCacheEncoding.parse("fp8+sink"),
        )  # fmt: skip
