"""Model configs → per-layer KV-cache specs, checked against the presets' derived numbers."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.model_presets import available_presets, load_preset
from vllm.v1.core.kv_cache_utils import planner_vllm_config
from vllm.v1.core.model_specs import (
    LAYER_KINDS,
    build_kv_cache_specs,
    deepseek_v4_compressor_state_bytes,
    get_kv_cache_specs,
    kv_bytes_for_tokens,
    kv_bytes_per_entry,
    load_model_config,
    parse_model_layout,
    spec_bytes_per_token,
    unwrap_config,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

PRESETS = available_presets()
SHIPPED = {
    "deepseek-v3",
    "deepseek-v4-flash",
    "deepseek-v4-pro",
    "gemma-3-27b-it",
    "gpt-oss-120b",
    "gpt-oss-20b",
    "llama-3.1-70b-instruct",
    "llama-3.1-8b-instruct",
    "mistral-7b-v0.1",
    "nemotron-h-56b-base-8k",
    "qwen3-30b-a3b",
    "qwen3-32b",
    "qwen3-next-80b-a3b-instruct",
}


def _specs(name: str, dtype: str = "auto", **kw):
    return build_kv_cache_specs(parse_model_layout(load_preset(name)), dtype, **kw)


def _attention(specs):
    return {n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}


def _formula(text: str):
    """The evaluable part of a derived ``kv_bytes_for_L_tokens_bf16`` formula."""
    expr = text.split(" with ")[0]
    assert re.fullmatch(r"[0-9L*+()/ ,minflor]+", expr), expr
    return lambda length: eval(
        expr, {"__builtins__": {}}, {"L": length, "min": min, "floor": math.floor}
    )


def test_every_shipped_preset_is_packaged():
    assert set(PRESETS) == SHIPPED
    for name in PRESETS:
        preset = load_preset(name)
        assert {"name", "source", "config", "derived"} <= preset.keys()


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "fp8", "fp8_e5m2", "nvfp4"])
def test_every_preset_maps(name, dtype):
    result = _specs(name, dtype)
    assert result.specs, name
    assert list(result.specs) == list(result.kinds)
    for layer_name, spec in result.specs.items():
        assert layer_name.startswith("model.layers.")
        assert spec.page_size_bytes > 0
        assert result.kinds[layer_name] in LAYER_KINDS


@pytest.mark.parametrize("name", PRESETS)
def test_bytes_per_token_match_derived(name):
    preset = load_preset(name)
    derived = preset["derived"]
    specs = _specs(name).specs
    attn = _attention(specs)
    for spec in attn.values():
        assert spec.dtype == torch.bfloat16
    if "kv_bytes_per_token_bf16" in derived:
        assert (
            sum(spec_bytes_per_token(s) for s in attn.values())
            == derived["kv_bytes_per_token_bf16"]
        )
    if "kv_bytes_per_token_per_layer_bf16" in derived:
        assert {spec_bytes_per_token(s) for s in attn.values()} == {
            derived["kv_bytes_per_token_per_layer_bf16"]
        }
    if "kv_bytes_per_token_if_all_layers_full_bf16" in derived:
        total = sum(spec_bytes_per_token(s) for s in attn.values())
        assert total == derived["kv_bytes_per_token_if_all_layers_full_bf16"]
    full = [s for s in attn.values() if type(s) is FullAttentionSpec]
    sliding = [s for s in attn.values() if isinstance(s, SlidingWindowSpec)]
    if "kv_bytes_per_token_full_layers_bf16" in derived:
        assert (
            sum(spec_bytes_per_token(s) for s in full)
            == derived["kv_bytes_per_token_full_layers_bf16"]
        )
    if "full_layers" in derived:
        assert len(full) == derived["full_layers"]
    if "sliding_layers" in derived:
        assert len(sliding) == derived["sliding_layers"]
    cap = derived.get("sliding_layers_cap_bytes_per_sequence_bf16") or derived.get(
        "swa_bytes_per_sequence_bf16"
    )
    if cap is not None:
        assert sum(s.sliding_window * kv_bytes_per_entry(s) for s in sliding) == cap
    if "kv_bytes_for_L_tokens_bf16" in derived:
        formula = _formula(derived["kv_bytes_for_L_tokens_bf16"])
        for length in (1, 3, 4, 127, 128, 129, 1023, 1024, 4095, 4096, 5000, 131072):
            assert kv_bytes_for_tokens(attn, length) == formula(length), length


@settings(max_examples=60, deadline=None)
@given(length=st.integers(min_value=0, max_value=2_000_000), index=st.integers(0, len(PRESETS) - 1))
def test_bytes_for_any_length_match_derived_formula(length, index):
    name = PRESETS[index]
    derived = load_preset(name)["derived"]
    attn = _attention(_specs(name).specs)
    if "kv_bytes_for_L_tokens_bf16" in derived:
        assert kv_bytes_for_tokens(attn, length) == _formula(derived["kv_bytes_for_L_tokens_bf16"])(
            length
        )
    elif "kv_bytes_per_token_bf16" in derived:
        assert kv_bytes_for_tokens(attn, length) == length * derived["kv_bytes_per_token_bf16"]


def test_head_dim_rule_and_llama_numbers():
    specs = _specs("llama-3.1-8b-instruct").specs
    assert len(specs) == 32
    spec = specs["model.layers.0.self_attn"]
    assert (spec.num_kv_heads, spec.head_size, spec.block_size) == (8, 128, 16)
    assert spec.page_size_bytes == 65536  # docs/design.md §4 worked example
    assert (
        _specs("llama-3.1-8b-instruct", "fp8").specs["model.layers.0.self_attn"].page_size_bytes
        == 32768
    )
    nv = _specs("llama-3.1-8b-instruct", "nvfp4").specs["model.layers.0.self_attn"]
    assert nv.page_size_bytes == 18432 and nv.kv_quant_mode == KVQuantMode.NVFP4
    assert load_preset("llama-3.1-70b-instruct")["derived"]["head_dim"] == 128
    assert _specs("llama-3.1-70b-instruct").specs["model.layers.79.self_attn"].head_size == 128


def test_gpt_oss_layer_types():
    specs = _specs("gpt-oss-120b").specs
    assert len(specs) == 36
    for i in range(36):
        spec = specs[f"model.layers.{i}.self_attn"]
        assert (spec.num_kv_heads, spec.head_size) == (8, 64)
        if i % 2 == 0:
            assert isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 128
        else:
            assert type(spec) is FullAttentionSpec
        assert spec_bytes_per_token(spec) == 2048
    # NVFP4 on the sliding layers (the seed bug): F(64)=36 per side.
    nv = _specs("gpt-oss-120b", "nvfp4").specs["model.layers.0.self_attn"]
    assert isinstance(nv, SlidingWindowSpec) and nv.page_size_bytes == 16 * 8 * 72


def test_gemma3_pattern():
    result = _specs("gemma-3-27b-it")
    full = [n for n, k in result.kinds.items() if k == "full_attention"]
    assert full == [f"model.layers.{i}.self_attn" for i in range(5, 62, 6)]
    assert all(
        s.sliding_window == 1024 for s in result.specs.values() if isinstance(s, SlidingWindowSpec)
    )
    assert any("sliding_window_pattern" in note for note in result.notes)


def test_mistral_all_sliding():
    specs = _specs("mistral-7b-v0.1").specs
    assert all(
        isinstance(s, SlidingWindowSpec) and s.sliding_window == 4096 for s in specs.values()
    )
    derived = load_preset("mistral-7b-v0.1")["derived"]
    assert (
        sum(s.sliding_window * kv_bytes_per_entry(s) for s in specs.values())
        == derived["kv_bytes_per_sequence_cap_bf16"]
    )


def test_deepseek_v3_mla():
    derived = load_preset("deepseek-v3")["derived"]
    for dtype, elem in (("auto", 2), ("fp8", 1)):
        specs = _specs("deepseek-v3", dtype).specs
        assert len(specs) == 61
        for spec in specs.values():
            assert isinstance(spec, MLAAttentionSpec)
            assert (spec.num_kv_heads, spec.head_size) == (
                1,
                derived["mla_cache_elems_per_token_per_layer"],
            )
        assert sum(spec_bytes_per_token(s) for s in specs.values()) == 61 * 576 * elem
    assert sum(spec_bytes_per_token(s) for s in _specs("deepseek-v3").specs.values()) == 70272


def test_mla_nvfp4_falls_back_with_a_note():
    v3 = _specs("deepseek-v3", "nvfp4")
    assert {s.dtype for s in v3.specs.values()} == {torch.bfloat16}
    assert set(v3.cache_dtypes.values()) == {"auto"}
    assert any("nvfp4 is not an MLA cache format" in note for note in v3.notes)
    v4 = _specs("deepseek-v4-flash", "nvfp4")
    fp8 = _specs("deepseek-v4-flash", "fp8")
    assert v4.specs == fp8.specs
    assert any("nvfp4 is not a DeepSeek-V4 cache format" in note for note in v4.notes)


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_deepseek_v4(name):
    preset = load_preset(name)
    derived = preset["derived"]
    result = _specs(name)
    assert result.block_size == 256
    counts = Counter(result.kinds.values())
    ratios = Counter(
        s.compress_ratio for n, s in result.specs.items() if result.kinds[n] == "compressed_mla"
    )
    num_layers = preset["config"]["num_hidden_layers"]
    assert counts["sliding_window_mla"] == num_layers
    assert ratios[4] == derived["layers_csa_ratio4"] == counts["mla_indexer"]
    assert ratios[128] == derived["layers_hca_ratio128"]
    assert num_layers - ratios[4] - ratios[128] == derived["layers_swa_only_ratio0"]
    specs = result.specs
    main = {n: s for n, s in specs.items() if result.kinds[n] in ("compressed_mla", "mla_indexer")}
    assert (
        sum(spec_bytes_per_token(s) for s in main.values())
        == derived["growing_kv_bytes_per_token_bf16"]
    )
    swa = [s for s in specs.values() if isinstance(s, SlidingWindowMLASpec)]
    assert {kv_bytes_per_entry(s) for s in swa} == {derived["kv_entry_bytes_bf16"]}
    assert (
        sum(s.sliding_window * kv_bytes_per_entry(s) for s in swa)
        == derived["swa_bytes_per_sequence_bf16"]
    )
    indexer = [s for n, s in specs.items() if result.kinds[n] == "mla_indexer"]
    assert {kv_bytes_per_entry(s) for s in indexer} == {derived["indexer_entry_bytes_bf16"]}
    assert (
        deepseek_v4_compressor_state_bytes(preset)
        == derived["compressor_state_bytes_per_sequence_aiconfigurator_model"]
    )
    # fp8: the rtp-llm engine entries and the docs/design.md §4 worked example (block 256).
    fp8 = _specs(name, "fp8")
    engine = derived["engine_entry_bytes_rtp_llm"]
    for layer_name, spec in fp8.specs.items():
        kind = fp8.kinds[layer_name]
        if kind == "mla_indexer":
            assert kv_bytes_per_entry(spec) == engine["fp8_indexer_entry"]
            continue
        assert kv_bytes_per_entry(spec) == engine["fp8_kv_entry"]
        if kind == "compressed_mla":
            assert spec.cache_dtype_str == "fp8_ds_mla" and spec.alignment == 576
            expected = {4: (64, 37376, 37440), 128: (2, 1168, 1728)}[spec.compress_ratio]
            assert (
                spec.storage_block_size,
                spec.real_page_size_bytes,
                spec.page_size_bytes,
            ) == expected


def test_nemotron_h_mamba_shapes():
    derived = load_preset("nemotron-h-56b-base-8k")["derived"]
    result = _specs("nemotron-h-56b-base-8k", "fp8")
    mamba = [s for s in result.specs.values() if isinstance(s, MambaSpec)]
    attn = _attention(result.specs)
    assert len(mamba) == derived["mamba_layers"] and len(attn) == derived["attention_layers"]
    shapes = derived["mamba2_state_shapes_per_layer_vllm"]
    for spec in mamba:
        assert spec.shapes == (tuple(shapes["conv_state"]), tuple(shapes["ssm_state"]))
        assert spec.dtypes == (torch.bfloat16, torch.bfloat16)  # state ignores the fp8 request
        sizes = derived["mamba2_state_bytes_per_layer_bf16"]
        assert spec.state_sizes_bytes == (sizes["conv"], sizes["ssm"])
    assert (
        sum(s.page_size_bytes for s in mamba)
        == derived["mamba2_state_bytes_per_sequence_all_layers_bf16"]
    )
    assert all(n.endswith(".mixer") for n, s in result.specs.items() if isinstance(s, MambaSpec))
    assert any("recurrent state in the model dtype" in note for note in result.notes)


def test_qwen3_next_gdn_shapes():
    derived = load_preset("qwen3-next-80b-a3b-instruct")["derived"]
    specs = _specs("qwen3-next-80b-a3b-instruct").specs
    gdn = {n: s for n, s in specs.items() if isinstance(s, MambaSpec)}
    attn = _attention(specs)
    assert len(gdn) == derived["linear_attention_layers"]
    assert len(attn) == derived["full_attention_layers"]
    assert list(attn) == [f"model.layers.{i}.self_attn" for i in range(3, 48, 4)]
    shapes = derived["gdn_state_shapes_per_linear_layer_vllm"]
    sizes = derived["gdn_state_bytes_per_linear_layer"]
    for spec in gdn.values():
        assert spec.shapes == (tuple(shapes["conv_state"]), tuple(shapes["recurrent_state"]))
        assert spec.state_sizes_bytes == (sizes["conv_bf16"], sizes["recurrent_bf16"])
    assert (
        sum(s.page_size_bytes for s in gdn.values())
        == derived["gdn_state_bytes_per_sequence_all_36_layers"]["all_bf16"]
    )


def test_tensor_parallel_heads():
    llama = load_preset("llama-3.1-8b-instruct")
    assert (
        get_kv_cache_specs(llama, tensor_parallel_size=2)["model.layers.0.self_attn"].num_kv_heads
        == 4
    )
    # Fewer KV heads than ranks: replicated, one head per rank.
    assert (
        get_kv_cache_specs(llama, tensor_parallel_size=16)["model.layers.0.self_attn"].num_kv_heads
        == 1
    )
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 .*num_key_value_heads"):
        get_kv_cache_specs(llama, tensor_parallel_size=3)
    # MLA latent is never split.
    v3 = get_kv_cache_specs(load_preset("deepseek-v3"), tensor_parallel_size=8)
    assert {(s.num_kv_heads, s.head_size) for s in v3.values()} == {(1, 576)}
    # Mamba heads are split; groups replicate when fewer than ranks.
    nemo = get_kv_cache_specs(load_preset("nemotron-h-56b-base-8k"), tensor_parallel_size=2)
    mamba = next(s for s in nemo.values() if isinstance(s, MambaSpec))
    assert mamba.shapes == ((3, 128 * 64 + 2 * 4 * 256), (128, 64, 256))
    nemo16 = get_kv_cache_specs(load_preset("nemotron-h-56b-base-8k"), tensor_parallel_size=16)
    mamba16 = next(s for s in nemo16.values() if isinstance(s, MambaSpec))
    assert mamba16.shapes == ((3, 16 * 64 + 2 * 1 * 256), (16, 64, 256))
    nxt = get_kv_cache_specs(load_preset("qwen3-next-80b-a3b-instruct"), tensor_parallel_size=2)
    gdn = next(s for s in nxt.values() if isinstance(s, MambaSpec))
    assert gdn.shapes == ((3, 4096), (16, 128, 128))
    assert nxt["model.layers.3.self_attn"].num_kv_heads == 1
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        parse_model_layout(llama, tensor_parallel_size=0)


def test_skip_layers():
    result = _specs("gpt-oss-120b", "fp8", skip_layers=["sliding_window"])
    for name, spec in result.specs.items():
        if isinstance(spec, SlidingWindowSpec):
            assert spec.dtype == torch.bfloat16 and result.cache_dtypes[name] == "auto"
        else:
            assert spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
    by_name = _specs("llama-3.1-8b-instruct", "nvfp4", skip_layers=["model.layers.0.self_attn"])
    assert by_name.specs["model.layers.0.self_attn"].dtype == torch.bfloat16
    assert by_name.specs["model.layers.1.self_attn"].kv_quant_mode == KVQuantMode.NVFP4
    v4 = _specs("deepseek-v4-flash", "fp8", skip_layers=["mla"])
    assert v4.specs == _specs("deepseek-v4-flash").specs
    # A layer name covers its sub-caches.
    v4_one = _specs("deepseek-v4-flash", "fp8", skip_layers=["model.layers.2.self_attn"])
    assert all(
        v4_one.specs[n].dtype == torch.bfloat16
        for n in (
            "model.layers.2.self_attn",
            "model.layers.2.self_attn.swa",
            "model.layers.2.self_attn.indexer",
        )
    )
    assert v4_one.specs["model.layers.3.self_attn"].dtype == torch.uint8
    # Kinds a model lacks are accepted (one CacheConfig for many models); typos are not.
    _specs("llama-3.1-8b-instruct", "fp8", skip_layers=["mamba"])
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers: 'slidng_window'"):
        _specs("gpt-oss-120b", "fp8", skip_layers=["slidng_window"])


def test_wrapper_bare_and_file_inputs(tmp_path):
    preset = load_preset("qwen3-32b")
    assert get_kv_cache_specs(preset) == get_kv_cache_specs(preset["config"])
    assert unwrap_config(preset) == preset["config"]
    raw = tmp_path / "config.json"
    raw.write_text(json.dumps(preset["config"]))
    wrapped = tmp_path / "my-model.json"
    wrapped.write_text(json.dumps(preset))
    for path in (raw, wrapped, str(raw)):
        _, cfg = load_model_config(path)
        assert cfg == preset["config"]
    assert load_model_config("qwen3-32b") == ("qwen3-32b", preset["config"])
    with pytest.raises(ValueError, match="available presets: .*gpt-oss-120b"):
        load_model_config("no-such-model")


def test_block_size_rules():
    assert _specs("deepseek-v4-flash", block_size=128).block_size == 128
    with pytest.raises(ValueError, match="block_size: .*multiple of 128"):
        _specs("deepseek-v4-flash", block_size=64)
    with pytest.raises(ValueError, match="block_size"):
        _specs("llama-3.1-8b-instruct", block_size=0)
    with pytest.raises(ValueError, match="cache_dtype: unknown KV-cache dtype 'int8'"):
        _specs("llama-3.1-8b-instruct", "int8")


def _llama(**overrides):
    cfg = dict(load_preset("llama-3.1-8b-instruct")["config"])
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_llama(model_type="foo"), r"config: cannot map model_type 'foo'; expected one of .*llama"),
        (_llama(model_type=None), r"config: missing key 'model_type'"),
        (_llama(num_key_value_heads=None), r"config: missing key 'num_key_value_heads'"),
        (_llama(num_hidden_layers=0), r"config: key 'num_hidden_layers' must be a positive int"),
        (_llama(hidden_size=4095), r"'hidden_size' 4095 is not a multiple"),
        (_llama(torch_dtype="int4"), r"config: key 'torch_dtype'"),
        (
            {**load_preset("gpt-oss-20b")["config"], "layer_types": ["full_attention"]},
            r"config: key 'layer_types' must list one type per layer \(24\)",
        ),
        (
            {**load_preset("gpt-oss-20b")["config"], "sliding_window": None},
            r"config: missing key 'sliding_window'",
        ),
        (
            {
                k: v
                for k, v in load_preset("gemma-3-27b-it")["config"].items()
                if k != "text_config"
            },
            r"config: missing key 'text_config'",
        ),
        (
            {
                **load_preset("gemma-3-27b-it")["config"],
                "text_config": {
                    k: v
                    for k, v in load_preset("gemma-3-27b-it")["config"]["text_config"].items()
                    if k != "num_key_value_heads"
                },
            },
            r"config: missing key 'text_config.num_key_value_heads'",
        ),
        (
            {**load_preset("nemotron-h-56b-base-8k")["config"], "hybrid_override_pattern": "M*"},
            r"config: key 'hybrid_override_pattern' must have one character per layer",
        ),
        (
            {
                **load_preset("nemotron-h-56b-base-8k")["config"],
                "hybrid_override_pattern": "X" * 118,
            },
            r"config: key 'hybrid_override_pattern\[0\]' is 'X'",
        ),
        (
            {
                k: v
                for k, v in load_preset("nemotron-h-56b-base-8k")["config"].items()
                if k != "ssm_state_size"
            },
            r"config: missing key 'ssm_state_size'",
        ),
        (
            {
                k: v
                for k, v in load_preset("qwen3-next-80b-a3b-instruct")["config"].items()
                if k != "full_attention_interval"
            },
            r"config: missing key 'full_attention_interval'",
        ),
        (
            {k: v for k, v in load_preset("deepseek-v3")["config"].items() if k != "kv_lora_rank"},
            r"config: missing key 'kv_lora_rank'",
        ),
        (
            {**load_preset("deepseek-v4-flash")["config"], "compress_ratios": [0, 8] + [4] * 42},
            r"config: key 'compress_ratios\[1\]' is 8",
        ),
        (
            {**load_preset("deepseek-v4-flash")["config"], "compress_ratios": [0]},
            r"config: key 'compress_ratios' must list at least num_hidden_layers \(43\)",
        ),
    ],
)
def test_bad_configs_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        get_kv_cache_specs(config)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 8),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    head=st.sampled_from([64, 80, 96, 128, 256]),
    block=st.sampled_from([1, 16, 32, 64]),
    window=st.one_of(st.none(), st.integers(1, 8192)),
)
def test_dense_page_sizes_property(layers, kv_heads, head, block, window):
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * 4,
        "num_key_value_heads": kv_heads,
        "head_dim": head,
        "hidden_size": 1024,
        "sliding_window": window,
        "torch_dtype": "float16",
    }
    pages = {}
    for dtype in ("auto", "fp8", "nvfp4"):
        specs = get_kv_cache_specs(cfg, dtype, block)
        assert len(specs) == layers
        (page,) = {s.page_size_bytes for s in specs.values()}
        pages[dtype] = page
        cls = SlidingWindowSpec if window else FullAttentionSpec
        assert all(type(s) is cls for s in specs.values())
    assert pages["auto"] == block * kv_heads * 2 * head * 2
    assert pages["fp8"] == pages["auto"] // 2
    assert pages["nvfp4"] == block * kv_heads * 2 * (head // 2 + head // 16)
    assert Fraction(pages["auto"], pages["nvfp4"]) == Fraction(32, 9)


def test_sliding_window_mla_spec():
    common = dict(block_size=256, num_kv_heads=1, head_size=512, sliding_window=128)
    bf16 = SlidingWindowMLASpec(dtype=torch.bfloat16, **common)
    assert bf16.real_page_size_bytes == bf16.page_size_bytes == 256 * 1024
    fp8 = SlidingWindowMLASpec(
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
        **common,
    )
    assert fp8.page_size_bytes == 256 * 584
    aligned = SlidingWindowMLASpec(
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8_ds_mla",
        model_version="deepseek_v4",
        alignment=576,
        **common,
    )
    assert aligned.page_size_bytes == 149760 and aligned.real_page_size_bytes == 149504
    # Sliding-window memory bound, not full attention.
    usage = bf16.max_memory_usage_bytes(planner_vllm_config(1_000_000, 8192))
    assert usage == (math.ceil(8319 / 256) + 1) * 262144
    with pytest.raises(ValueError, match="NVFP4 is not a format for MLA"):
        SlidingWindowMLASpec(dtype=torch.uint8, kv_quant_mode=KVQuantMode.NVFP4, **common)
    with pytest.raises(ValueError, match="fp8_ds_mla record .*DeepSeek-V4.*512, got 576"):
        SlidingWindowMLASpec(
            dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla",
            model_version="deepseek_v4",
            **{**common, "head_size": 576},
        )
    # Upstream: model_version="deepseek_v4" alone selects the record for sliding-window MLA.
    by_version = SlidingWindowMLASpec(dtype=torch.uint8, model_version="deepseek_v4", **common)
    assert by_version.page_size_bytes == 256 * 584
    with pytest.raises(ValueError, match="page_size_padded"):
        SlidingWindowMLASpec(dtype=torch.bfloat16, page_size_padded=1, **common)
