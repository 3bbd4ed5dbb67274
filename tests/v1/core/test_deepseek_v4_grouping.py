"""DeepSeek-V4's layer-tuple grouping and sizing (upstream v0.22's
``group_and_unify_kv_cache_specs`` path), on the specs upstream's DeepSeek-V4 layers register,
with DeepSeek-V4-Flash's layer counts. Expected values are worked out here from the page
formulas, not by the code under test. Page sizes are in bytes, block sizes and lengths in
tokens.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import vllm
from vllm.config.model import ModelConfig
from vllm.config.scheduler import SchedulerConfig
from vllm.config.speculative import SpeculativeConfig
from vllm.config.vllm import VllmConfig
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.kv_cache_interface import (
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

_SHARED = Path("/work/shared/model_configs/deepseek-v4-flash.json")
_VENDORED = Path(vllm.__file__).parent / "model_presets" / "deepseek-v4-flash.json"
FLASH = json.loads((_SHARED if _SHARED.exists() else _VENDORED).read_text())["config"]

BLOCK = 256  # the full-MLA block size DeepSeek-V4 runs with
ALIGN = 576  # FlashMLA's page alignment
RECORD = 584  # bytes of one fp8_ds_mla DeepSeek-V4 slot
MAX_LEN = 8192
BATCHED = 2048


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _mla(ratio: int, fp8: bool) -> MLAAttentionSpec:
    """DeepseekV4MLAAttention.get_kv_cache_spec (bf16: unquantized 2-byte latents)."""
    return MLAAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=FLASH["head_dim"],
        dtype=torch.uint8 if fp8 else torch.bfloat16,
        compress_ratio=ratio,
        cache_dtype_str="fp8_ds_mla" if fp8 else None,
        alignment=ALIGN,
        model_version="deepseek_v4",
    )


def _indexer() -> MLAAttentionSpec:
    """DeepseekV4IndexerCache: 128 fp8 values + one fp32 scale per 128 per key."""
    head = FLASH["index_head_dim"]
    return MLAAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=1,
        head_size=head + head // 128 * 4,
        dtype=torch.uint8,
        compress_ratio=4,
        alignment=ALIGN,
    )


def _swa(fp8: bool) -> SlidingWindowMLASpec:
    """DeepseekV4SWACache: 64-token blocks, the config's window."""
    return SlidingWindowMLASpec(
        block_size=64,
        num_kv_heads=1,
        head_size=FLASH["head_dim"],
        dtype=torch.uint8,
        sliding_window=FLASH["sliding_window"],
        cache_dtype_str="fp8_ds_mla" if fp8 else "auto",
        alignment=ALIGN,
        model_version="deepseek_v4",
    )


def _state(ratio: int, head_dim: int) -> SlidingWindowMLASpec:
    """CompressorStateCache: fp32 kv + score states of ``coff * head_dim`` each."""
    coff = 2 if ratio == 4 else 1
    return SlidingWindowMLASpec(
        block_size=4 if ratio == 4 else 8,
        num_kv_heads=1,
        head_size=2 * coff * head_dim,
        dtype=torch.float32,
        sliding_window=coff * ratio,
        alignment=ALIGN,
    )


def _ratios(mtp: bool) -> list[int]:
    count = FLASH["num_hidden_layers"] + (FLASH["num_nextn_predict_layers"] if mtp else 0)
    return FLASH["compress_ratios"][:count]


def dsv4_specs(fp8: bool = True, mtp: bool = False) -> dict[str, KVCacheSpec]:
    """The spec of every cache layer, per decoder layer: indexer keys and indexer compressor
    state (ratio 4), the SWA cache, the compressed KV and its compressor state (ratio > 1)."""
    specs: dict[str, KVCacheSpec] = {}
    for i, ratio in enumerate(_ratios(mtp)):
        attn = f"model.layers.{i}.self_attn"
        if ratio == 4:
            specs[f"{attn}.indexer.k_cache"] = _indexer()
            specs[f"{attn}.indexer.compressor.state_cache"] = _state(4, FLASH["index_head_dim"])
        specs[f"{attn}.swa_cache"] = _swa(fp8)
        if ratio > 1:
            specs[f"{attn}.mla_attn"] = _mla(ratio, fp8)
            specs[f"{attn}.compressor.state_cache"] = _state(ratio, FLASH["head_dim"])
    return specs


def _names(kind: str, mtp: bool = False) -> list[str]:
    """Layer names of one kind, in layer order."""
    ratios = _ratios(mtp)
    attn = "model.layers.{}.self_attn"
    pick = {
        "c4": (4, ".mla_attn"),
        "c128": (128, ".mla_attn"),
        "indexer": (4, ".indexer.k_cache"),
        "c4_state": (4, ".compressor.state_cache"),
        "indexer_state": (4, ".indexer.compressor.state_cache"),
        "c128_state": (128, ".compressor.state_cache"),
    }
    if kind == "swa":
        return [attn.format(i) + ".swa_cache" for i in range(len(ratios))]
    ratio, suffix = pick[kind]
    return [attn.format(i) + suffix for i, r in enumerate(ratios) if r == ratio]


def _pages(fp8: bool) -> dict[str, int]:
    """Each kind's own page (bytes), from the layer formulas."""
    latent = RECORD if fp8 else FLASH["head_dim"] * 2
    index_key = FLASH["index_head_dim"] + FLASH["index_head_dim"] // 128 * 4
    return {
        "c4": _round_up(BLOCK // 4 * latent, ALIGN),
        "c128": _round_up(BLOCK // 128 * latent, ALIGN),
        "indexer": _round_up(BLOCK // 4 * index_key, ALIGN),
        "swa": _round_up(64 * RECORD, ALIGN),  # the record, by model_version, in both variants
        "c4_state": _round_up(4 * 2 * 2 * FLASH["head_dim"] * 4, ALIGN),
        "indexer_state": _round_up(4 * 2 * 2 * FLASH["index_head_dim"] * 4, ALIGN),
        "c128_state": _round_up(8 * 2 * FLASH["head_dim"] * 4, ALIGN),
    }


def _config(method: str | None = None, max_len: int = MAX_LEN) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(max_model_len=max_len),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=BATCHED, max_model_len=max_len),
        speculative_config=SpeculativeConfig(method=method) if method else None,
    )


def _by_hand_tuples(counts: list[int]) -> int:
    """The tuple count with least padding, at least counts[0], larger on ties."""
    candidates = range(counts[0], max(counts) + 1)
    return min(candidates, key=lambda d: (sum(d * -(-c // d) - c for c in counts), -d))


def test_layer_counts_match_flash() -> None:
    assert len(_names("c4")) == len(_names("indexer")) == 21
    assert len(_names("c128")) == 20
    assert len(_names("swa")) == FLASH["num_hidden_layers"]


def test_approximate_gcd_hand_cases() -> None:
    gcd = kcu._approximate_gcd
    assert gcd([12, 18]) == 6  # no padding for 1, 2, 3 or 6: the largest
    assert gcd([10, 21]) == 1  # coprime: only d = 1 pads nothing
    assert gcd([7]) == 7
    assert gcd([4, 6], lower_bound=3) == 6  # d = 3, 4 and 6 all pad 2: the largest wins
    assert gcd([10, 21], lower_bound=5) == 11  # 10 → 11, 21 → 22
    assert gcd([21, 43, 21, 20], lower_bound=21) == 22  # pads 1 + 1 + 1 + 2
    assert gcd([3, 4], lower_bound=10) == 10  # above every value: the bound itself
    assert gcd([5, 6], lower_bound=0) == 1  # a bound under 1 counts as 1
    for bad in ([], [0, 3], [4, -2]):
        with pytest.raises(ValueError, match="values: expected"):
            gcd(bad)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_ds_mla", "bf16"])
def test_groups(fp8: bool) -> None:
    specs = dsv4_specs(fp8)
    before = dict(specs)
    groups = kcu.get_kv_cache_groups(_config(), specs)
    pages = _pages(fp8)
    full_pages = sorted({pages["c4"], pages["c128"], pages["indexer"]})

    def padded(kind: str) -> int:
        return min(p for p in full_pages if p >= pages[kind])

    swa = _names("swa")
    # full MLA; SWA split in two (43 layers, 22 tuples); ratio-4 states; ratio-128 states
    tuples = _by_hand_tuples([21, len(swa), 21, 20])
    assert tuples == 22
    assert len(groups) == 5
    full = set(_names("c4") + _names("c128") + _names("indexer"))
    assert set(groups[0].layer_names) == full and len(groups[0].layer_names) == len(full)
    assert groups[1].layer_names == swa[0::2] and groups[2].layer_names == swa[1::2]
    states = [
        n for pair in zip(_names("indexer_state"), _names("c4_state"), strict=True) for n in pair
    ]
    assert groups[3].layer_names == states
    assert groups[4].layer_names == _names("c128_state")
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in groups)
    assert not any(g.is_eagle_group for g in groups)
    # Windowed pages padded up to the nearest full-MLA page; full-MLA pages untouched.
    kinds = {n: k for k in pages for n in _names(k)}
    for group in groups:
        for name, spec in group.kv_cache_spec.kv_cache_specs.items():
            kind = kinds[name]
            if name in full:
                assert spec is before[name]
                continue
            assert spec.page_size_bytes == padded(kind)
            assert spec.page_size_padded == (padded(kind) if pages[kind] != padded(kind) else None)
            assert spec == dataclasses.replace(before[name], page_size_padded=spec.page_size_padded)
    if fp8:
        assert padded("c4_state") == padded("swa") == pages["c4"] == 37_440
        assert padded("indexer_state") == pages["indexer"] == 8_640
    # The caller's specs are not padded in place (upstream pads them; the groups are the same).
    assert specs == before and all(specs[n] is before[n] for n in specs)
    # The padded specs, in the caller's order (what upstream's dict holds afterwards), group
    # the same way again.
    allocated = dict(kcu.iter_layer_specs(_cfg(groups)))
    again = kcu.get_kv_cache_groups(_config(), {n: allocated[n] for n in specs})
    assert [g.layer_names for g in again] == [g.layer_names for g in groups]


def _cfg(groups: list) -> kcu.KVCacheConfig:
    return kcu.KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_ds_mla", "bf16"])
def test_tensors_blocks_and_memory(fp8: bool) -> None:
    config = _config()
    groups = kcu.get_kv_cache_groups(config, dsv4_specs(fp8))
    pages = _pages(fp8)
    full_pages = sorted({pages["c4"], pages["c128"], pages["indexer"]})
    tuples = 22
    per_block = sum(full_pages) * tuples
    assert kcu._pool_bytes_per_block(groups) == per_block
    budget = 10 * 2**30 + 12_345
    out = kcu.get_kv_cache_config_from_groups(config, groups, budget)
    assert out.num_blocks == budget // per_block
    assert len(out.kv_cache_tensors) == tuples * 3
    swa = _names("swa")
    lists = {
        pages["c4"]: [
            _names("c4"),
            swa[0::2],
            swa[1::2],
            _names("c4_state"),
            _names("c128_state"),
        ],
        pages["indexer"]: [_names("indexer"), _names("indexer_state")],
        pages["c128"]: [_names("c128")],
    }
    if not fp8:  # bf16: states and SWA latents fit the ratio-4 page too
        assert min(p for p in full_pages if p >= pages["swa"]) == pages["c4"]
    for t in range(tuples):
        for j, page in enumerate(full_pages):
            tensor = out.kv_cache_tensors[t * 3 + j]
            assert tensor.size == page * out.num_blocks
            expected = [names[t] for names in lists[page] if t < len(names)]
            assert sorted(tensor.shared_by) == sorted(expected)
    shared = [n for t in out.kv_cache_tensors for n in t.shared_by]
    assert sorted(shared) == sorted(dsv4_specs(fp8))  # every layer once
    # One request: every group's pages, each block id costing the whole tuple block.
    full_pages_needed = -(-MAX_LEN // BLOCK)

    def window_pages(window: int, block: int) -> int:
        return -(-min(window - 1 + BATCHED, MAX_LEN) // block) + 1

    needed = full_pages_needed + 2 * window_pages(FLASH["sliding_window"], 64)
    needed += window_pages(8, 4) + window_pages(128, 8)
    assert kcu._max_memory_usage_bytes_from_groups(config, groups) == per_block * needed
    # Upstream v0.33's concurrency formula, by hand: every group's block ids, one pool.
    request = sum(
        -(-g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes)
        for g in groups
    )
    concurrency = kcu.get_max_concurrency_for_kv_cache_config(config, out)
    assert concurrency == out.num_blocks / request


def test_override_and_too_little_memory() -> None:
    config = _config()
    groups = kcu.get_kv_cache_groups(config, dsv4_specs())
    config.cache_config.num_gpu_blocks_override = 7
    out = kcu.get_kv_cache_config_from_groups(config, groups, 0)
    assert out.num_blocks == 7
    assert out.kv_cache_tensors[0].size == 7 * _pages(True)["c128"]
    config.cache_config.num_gpu_blocks_override = None
    assert kcu.get_kv_cache_config_from_groups(config, groups, 10).num_blocks == 0
    with pytest.raises(ValueError, match="kv_cache_groups: expected several"):
        kcu._get_kv_cache_config_deepseek_v4(config, groups[:1], 10)
    # A windowed page that was not padded to a full-MLA size.
    specs = dsv4_specs()
    raw = {n: specs[n] for n in _names("c128_state")}
    unpadded = UniformTypeKVCacheSpecs.from_specs(raw)
    assert unpadded is not None
    bad = [groups[0], kcu.KVCacheGroupSpec(list(raw), unpadded)]
    with pytest.raises(ValueError, match="expected a page of one of the full-MLA sizes"):
        kcu._get_kv_cache_config_deepseek_v4(config, bad, 10)


@pytest.mark.parametrize(("method", "flagged"), [(None, False), ("mtp", True), ("ngram", False)])
def test_eagle_group(method: str | None, flagged: bool) -> None:
    specs = dsv4_specs(mtp=True)
    groups = kcu.get_kv_cache_groups(_config(method), specs)
    last = next(reversed(specs))
    assert last == _names("swa", mtp=True)[-1]
    eagle = [g for g in groups if g.is_eagle_group]
    if flagged:
        assert len(eagle) == 1 and last in eagle[0].layer_names
    else:
        assert not eagle


def test_annotate_directly() -> None:
    specs = dsv4_specs(mtp=True)
    grouped = kcu.group_and_unify_kv_cache_specs(specs)
    assert grouped is not None
    groups = kcu._get_kv_cache_groups_uniform_groups(grouped)
    # Only where some layer is a DeepSeek-V4 one (model_version).
    unversioned = {n: s for n, s in specs.items() if getattr(s, "model_version", None) is None}
    kcu._annotate_eagle_groups_deepseek_v4(_config("eagle"), unversioned, groups)
    assert not any(g.is_eagle_group for g in groups)
    kcu._annotate_eagle_groups_deepseek_v4(_config("eagle"), specs, groups)
    assert [g.is_eagle_group for g in groups] == [
        next(reversed(specs)) in g.layer_names for g in groups
    ]
    assert sum(g.is_eagle_group for g in groups) == 1


def test_group_and_unify() -> None:
    specs = dsv4_specs()
    grouped = kcu.group_and_unify_kv_cache_specs(specs)
    assert grouped is not None and len(grouped) == 4
    assert [len(g.kv_cache_specs) for g in grouped] == [62, 43, 42, 20]
    assert [g.block_size for g in grouped] == [BLOCK, 64, 4, 8]
    # Without a sliding-window MLA layer: not DeepSeek-V4.
    full_only = {n: s for n, s in specs.items() if isinstance(s, MLAAttentionSpec)}
    assert kcu.group_and_unify_kv_cache_specs(full_only) is None
    # Where upstream asserts or drops layers, None (the hybrid path then applies).
    other = SlidingWindowSpec(
        block_size=64, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    assert kcu.group_and_unify_kv_cache_specs({**specs, "x": other}) is None
    windowed = {n: s for n, s in specs.items() if isinstance(s, SlidingWindowMLASpec)}
    assert kcu.group_and_unify_kv_cache_specs(windowed) is None
    with pytest.raises(ValueError, match="grouped_specs: expected"):
        kcu._get_kv_cache_groups_uniform_groups(list(reversed(grouped)))


def test_get_kv_cache_configs_end_to_end() -> None:
    config = _config()
    specs = dsv4_specs()
    memory = 4 * 2**30
    (out,) = kcu.get_kv_cache_configs(config, [specs], [memory])
    pages = _pages(True)
    per_block = (pages["c4"] + pages["c128"] + pages["indexer"]) * 22
    assert out.num_blocks == memory // per_block
    assert len(out.kv_cache_groups) == 5 and len(out.kv_cache_tensors) == 66
    scheduler = kcu.generate_scheduler_kv_cache_config([out])
    assert [type(g.kv_cache_spec) for g in scheduler.kv_cache_groups] == [MLAAttentionSpec] + [
        SlidingWindowMLASpec
    ] * 4
    assert [g.kv_cache_spec.block_size for g in scheduler.kv_cache_groups] == [BLOCK, 64, 64, 4, 8]
    # Two pipeline stages: the global groups, each stage keeping its layers.
    names = list(specs)
    half = names.index("model.layers.22.self_attn.swa_cache")
    stages = [dict(list(specs.items())[:half]), dict(list(specs.items())[half:])]
    first, second = kcu.get_kv_cache_configs(_config(), stages, [memory, 2 * memory])
    assert first.num_blocks == second.num_blocks
    for stage, cfg in zip(stages, (first, second), strict=True):
        assert len(cfg.kv_cache_groups) == 5
        assert sorted(n for g in cfg.kv_cache_groups for n in g.layer_names) == sorted(stage)
        assert sorted(n for t in cfg.kv_cache_tensors for n in t.shared_by) == sorted(stage)
    # Too little memory for one request of MAX_LEN tokens.
    with pytest.raises(ValueError, match="max seq len"):
        kcu.get_kv_cache_configs(_config(), [specs], [per_block])
    # Fitting max_model_len to the memory.
    fitted = _config(max_len=1 << 20)
    fitted.model_config.original_max_model_len = -1
    kcu.get_kv_cache_configs(fitted, [specs], [200 * per_block])
    assert 0 < fitted.model_config.max_model_len < 1 << 20
    # Overriding num_blocks (one request needs 890 block ids: the ratio-4 states' 4-token
    # blocks take 515 of them).
    override = _config()
    override.cache_config.num_gpu_blocks_override = 900
    (out,) = kcu.get_kv_cache_configs(override, [specs], [memory])
    assert out.num_blocks == 900
    assert out.kv_cache_tensors[0].size == 900 * min(pages["c4"], pages["c128"], pages["indexer"])
    override.cache_config.num_gpu_blocks_override = 889
    with pytest.raises(ValueError, match="max seq len"):
        kcu.get_kv_cache_configs(override, [specs], [memory])


def test_planner_specs_keep_the_hybrid_layout() -> None:
    # The planner's DeepSeek-V4 specs (SWA latents in 256-token pages) do not fit layer tuples:
    # they take the page-unified hybrid path as before.
    plan = kcu.plan_kv_cache("deepseek-v4-flash", None, 80 * 2**30, 8192)
    assert {s.page_size_bytes for s in plan.specs.values()} == {262144}
    assert not any(
        isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        for g in plan.kv_cache_config.kv_cache_groups
    )
