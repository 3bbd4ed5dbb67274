"""The planner: layers → groups → KVCacheConfig, for every shipped preset and dtype."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.config.cache import CacheConfig
from vllm.model_presets import available_presets, load_preset
from vllm.v1.attention.backends import kv_cache_layout
from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.attention.backends.registry import get_attn_backend
from vllm.v1.core.kv_cache_utils import (
    MAX_EXACT_PAGE_GROWTH,
    MAX_PAGE_GROWTH,
    PLANNER_LAYOUT,
    UPSTREAM_LAYOUT,
    InsufficientKVCacheMemoryError,
    KVCachePlan,
    blocks_per_request,
    get_kv_cache_config,
    get_kv_cache_groups,
    plan_kv_cache,
    planner_vllm_config,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.core.model_specs import kv_bytes_per_entry, spec_bytes_per_token
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    KVQuantMode,
    LatentPageSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from vllm.v1.worker.gpu.attn_utils import (
    _allocate_kv_cache,
    _reshape_kv_cache,
    spec_cache_dtype_str,
)

GiB = 2**30
PRESETS = available_presets()
DTYPES = ("bfloat16", "fp8", "nvfp4")


def _plan(name: str, dtype: str = "bfloat16", memory: int = 80 * GiB, **kw) -> KVCachePlan:
    block = kw.pop("block_size", None)
    skip = kw.pop("skip", [])
    cache = CacheConfig(block_size=block or 16, cache_dtype=dtype, kv_cache_dtype_skip_layers=skip)
    if block is None and "v4" in name:
        cache.block_size = 256
    return plan_kv_cache(name, cache, memory, **kw)


def _layer_pages(plan: KVCachePlan) -> dict[str, int]:
    return {name: spec.page_size_bytes for name, spec in plan.specs.items()}


SM100 = (10, 0)
"""Blackwell: the one capability where FlashInfer serves bf16, fp8 and nvfp4 caches alike."""


def worker_backend(spec: KVCacheSpec) -> type[AttentionBackend]:
    """The backend a worker picks for a layer (``get_attn_backend`` on sm_100, HND layout):
    ``MLACommonBackend`` for latent specs, else FlashInfer when it serves the layer's head
    size / cache dtype / block size, else the reference backend."""
    return get_attn_backend(
        spec.head_size,
        torch.bfloat16,
        spec_cache_dtype_str(spec),
        spec.storage_block_size,
        SM100,
        use_mla=isinstance(spec, LatentPageSpec),
        head_size_v=None if isinstance(spec, LatentPageSpec) else spec.head_size_v,
        kv_cache_layout="HND",
    )


def run_worker(config: KVCacheConfig, cache_dtype: str | None = None) -> None:
    """``_allocate_kv_cache`` on the meta device and ``_reshape_kv_cache`` with the backend
    each layer gets (:func:`worker_backend`); FlashInfer splits blocks into kernel blocks of
    16/32/64 and rejects padded pages it would have to split."""
    specs = dict(iter_layer_specs(config))
    backends = {
        name: worker_backend(spec)
        for name, spec in specs.items()
        if isinstance(spec, AttentionSpec)
    }
    with kv_cache_layout("HND"):
        raw = _allocate_kv_cache(config, "meta")
        caches = _reshape_kv_cache(config, raw, backends, cache_dtype)
    assert set(caches) == set(specs)
    for name, spec in specs.items():
        cache = caches[name]
        first = cache[0] if isinstance(cache, list | tuple) else cache
        # Pages are split into whole kernel blocks (Mamba views: one per page).
        split, rest = divmod(first.shape[0], config.num_blocks) if config.num_blocks else (1, 0)
        assert rest == 0 and spec.storage_block_size % split == 0


def assert_worker_consumable(plan: KVCachePlan) -> None:
    """Run the real worker on the plan: ``_allocate_kv_cache`` on the meta device, then
    ``_reshape_kv_cache`` with each layer's backend (FlashInfer splits blocks into kernel
    blocks of 16/32/64 and rejects padded pages it would have to split)."""
    config = plan.kv_cache_config
    pages = _layer_pages(plan)
    shared = [name for tensor in config.kv_cache_tensors for name in tensor.shared_by]
    grouped = [name for group in config.kv_cache_groups for name in group.layer_names]
    assert Counter(shared) == Counter(list(plan.base.specs)), "every layer in exactly one tensor"
    assert Counter(grouped) == Counter(list(plan.base.specs)), "every layer in exactly one group"
    for tensor in config.kv_cache_tensors:
        sizes = {pages[name] for name in tensor.shared_by}
        assert len(sizes) == 1, f"layers sharing a tensor differ in page size: {sizes}"
        assert tensor.size == config.num_blocks * sizes.pop()
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            assert set(spec.kv_cache_specs) == set(group.layer_names)
        else:
            assert all(plan.specs[name] == spec for name in group.layer_names)
    run_worker(config, plan.cache_dtype)
    total = sum(t.size for t in config.kv_cache_tensors)
    assert total == plan.memory_used <= plan.available_memory
    assert plan.available_memory - total < plan.bytes_per_block, "num_blocks is the most that fit"
    assert plan.bytes_per_block == sum(pages[t.shared_by[0]] for t in config.kv_cache_tensors)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_plans(name, dtype):
    plan = _plan(name, dtype)
    assert_worker_consumable(plan)
    assert plan.fits and plan.blocks_per_request <= plan.kv_cache_config.num_blocks
    # Raised block sizes stay multiples of the requested one (offload's hash block,
    # docs/design.md §8).
    for group in plan.kv_cache_config.kv_cache_groups:
        assert group.kv_cache_spec.block_size % plan.base.block_size == 0
    assert plan.max_concurrency >= 1
    derived = load_preset(name)["derived"]
    attn = {n: s for n, s in plan.specs.items() if not isinstance(s, MambaSpec)}
    # Bytes per token recomputed from the allocated specs (block sizes may have grown).
    rate = sum(
        (Fraction(kv_bytes_per_entry(s), getattr(s, "compress_ratio", 1)) for s in attn.values()),
        Fraction(0),
    )
    reference = derived.get("kv_bytes_per_token_bf16") or derived.get(
        "kv_bytes_per_token_if_all_layers_full_bf16"
    )
    if reference is None:  # DeepSeek-V4: window entries + growing entries
        reference = (
            derived["growing_kv_bytes_per_token_bf16"]
            + derived["swa_bytes_per_sequence_bf16"] // 128
        )
    if dtype == "bfloat16":
        assert rate == reference
    elif all(type(s) in (FullAttentionSpec, SlidingWindowSpec) for s in attn.values()):
        assert rate == reference * {"fp8": Fraction(1, 2), "nvfp4": Fraction(9, 32)}[dtype]
    if dtype == "bfloat16" and "mamba2_state_bytes_per_sequence_all_layers_bf16" in derived:
        assert (
            plan.state_bytes_per_sequence
            == derived["mamba2_state_bytes_per_sequence_all_layers_bf16"]
        )


def _has_sliding_window(name: str) -> bool:
    return "sliding_window" in _plan(name).base.kinds.values()


@pytest.mark.parametrize("skip", [[], ["sliding_window"]], ids=["no_skip", "skip_sliding"])
@pytest.mark.parametrize("dtype", ("auto", "bfloat16", "fp8", "nvfp4"))
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_runs_the_real_worker(name, dtype, skip):
    """preset × dtype × skip → the planner's config through ``_allocate_kv_cache`` and
    ``_reshape_kv_cache`` with the backend each layer gets on sm_100 (FlashInfer where it
    serves the layer, else the reference backend; MLA layers: MLACommonBackend)."""
    if skip and not _has_sliding_window(name):
        pytest.skip("no sliding-window layers to skip")
    plan = _plan(name, dtype, skip=skip)
    assert_worker_consumable(plan)
    for spec in plan.specs.values():
        # A padded plain-attention page would be split into kernel blocks: never produced.
        if isinstance(spec, AttentionSpec) and not isinstance(spec, LatentPageSpec):
            assert spec.page_size_padded is None, spec


@pytest.mark.parametrize("name", ["llama-3.1-8b-instruct", "qwen3-32b", "deepseek-v3"])
def test_uniform_model_bytes_per_token_from_tensors(name):
    plan = _plan(name)
    config = plan.kv_cache_config
    (group,) = config.kv_cache_groups
    tokens = config.num_blocks * group.kv_cache_spec.block_size
    per_token = sum(t.size for t in config.kv_cache_tensors) / tokens
    assert per_token == load_preset(name)["derived"]["kv_bytes_per_token_bf16"]
    assert len(config.kv_cache_tensors) == len(plan.specs)
    assert plan.token_capacity == tokens  # max_model_len is a multiple of 16 here


def test_llama_numbers():
    plan = _plan("llama-3.1-8b-instruct", memory=80 * GiB, max_model_len=131072)
    assert plan.kv_cache_config.num_blocks == 80 * GiB // (32 * 65536) == 40960
    assert plan.blocks_per_request == 8192 and plan.max_concurrency == 5.0
    nv = _plan("llama-3.1-8b-instruct", "nvfp4", memory=80 * GiB, max_model_len=131072)
    assert nv.kv_cache_config.num_blocks == 80 * GiB // (32 * 18432)


def test_gpt_oss_hybrid_layout():
    plan = _plan("gpt-oss-120b", memory=80 * GiB, max_model_len=131072)
    config = plan.kv_cache_config
    assert [len(g.layer_names) for g in config.kv_cache_groups] == [18, 18]
    assert isinstance(config.kv_cache_groups[0].kv_cache_spec, SlidingWindowSpec)
    assert type(config.kv_cache_groups[1].kv_cache_spec) is FullAttentionSpec
    assert len(config.kv_cache_tensors) == 18
    for i, tensor in enumerate(config.kv_cache_tensors):
        assert tensor.shared_by == [
            f"model.layers.{2 * i}.self_attn",
            f"model.layers.{2 * i + 1}.self_attn",
        ]
    assert config.num_blocks == 80 * GiB // (18 * 32768)
    # full: cdiv(131072, 16); sliding: cdiv(127 + 8192, 16) + 1
    assert plan.blocks_per_request == 8192 + math.ceil((127 + 8192) / 16) + 1
    assert plan.page_padding_fraction == 0 and plan.group_padding_fraction == 0


def test_gemma3_group_size_beats_upstream_padding():
    plan = _plan("gemma-3-27b-it")
    groups = plan.kv_cache_config.kv_cache_groups
    assert [len(g.layer_names) for g in groups] == [13, 13, 13, 13, 10]
    assert len(plan.kv_cache_config.kv_cache_tensors) == 13
    assert plan.group_padding_fraction == pytest.approx(3 / 65)
    # Upstream uses g=10: 7 groups, 8 empty slots of 70.
    assert PLANNER_LAYOUT.group_size([52, 10]) == 13
    assert UPSTREAM_LAYOUT.group_size([52, 10]) == 10


@pytest.mark.parametrize(
    ("name", "dtype", "block"),
    [
        ("nemotron-h-56b-base-8k", "bfloat16", 2080),
        ("nemotron-h-56b-base-8k", "fp8", 4160),
        ("qwen3-next-80b-a3b-instruct", "bfloat16", 544),
        ("qwen3-next-80b-a3b-instruct", "fp8", 1072),
    ],
)
def test_mamba_hybrids_raise_attention_block_and_pad_state(name, dtype, block):
    plan = _plan(name, dtype)
    attn = [s for s in plan.specs.values() if not isinstance(s, MambaSpec)]
    mamba = [s for s in plan.specs.values() if isinstance(s, MambaSpec)]
    assert {s.block_size for s in attn} == {block}  # upstream's choice
    (page,) = {s.page_size_bytes for s in plan.specs.values()}
    assert all(s.page_size_padded is None for s in attn)  # attention pages are never padded
    assert all(s.real_page_size_bytes <= page for s in mamba)
    assert (
        page - mamba[0].real_page_size_bytes
        < attn[0].real_page_size_bytes // attn[0].block_size * 16
    )
    assert all(s.block_size == block for s in mamba)


def test_deepseek_v4_pages():
    bf16 = _plan("deepseek-v4-flash")
    kinds = bf16.base.kinds
    blocks = {
        (kinds[n], getattr(s, "compress_ratio", 1)): s.block_size for n, s in bf16.specs.items()
    }
    assert blocks == {
        ("sliding_window_mla", 1): 256,
        ("compressed_mla", 4): 1024,
        ("mla_indexer", 4): 4096,
        ("compressed_mla", 128): 32768,
    }
    assert {s.page_size_bytes for s in bf16.specs.values()} == {262144}
    assert bf16.page_padding_fraction == 0
    fp8 = _plan("deepseek-v4-flash", "fp8")
    assert {s.page_size_bytes for s in fp8.specs.values()} == {149760}
    assert fp8.page_padding_fraction < 0.02
    for spec in fp8.specs.values():
        if isinstance(spec, MLAAttentionSpec) and spec.cache_dtype_str == "fp8_ds_mla":
            assert spec.alignment == 576
    assert fp8.kv_cache_config.num_blocks > bf16.kv_cache_config.num_blocks
    nvfp4 = _plan("deepseek-v4-flash", "nvfp4")
    assert nvfp4.kv_cache_config.num_blocks == fp8.kv_cache_config.num_blocks
    assert any("nvfp4 is not a DeepSeek-V4 cache format" in n for n in nvfp4.notes)


def test_uniform_type_group_for_mixed_pages():
    plan = _plan("llama-3.1-8b-instruct", "nvfp4", skip=["model.layers.0.self_attn"])
    (group,) = plan.kv_cache_config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    sizes = [t.size for t in plan.kv_cache_config.kv_cache_tensors]
    num_blocks = plan.kv_cache_config.num_blocks
    assert sizes[0] == num_blocks * 65536 and set(sizes[1:]) == {num_blocks * 18432}
    assert num_blocks == 80 * GiB // (65536 + 31 * 18432)
    assert_worker_consumable(plan)


def test_skip_layers_in_hybrid_model():
    plan = _plan("gpt-oss-120b", "fp8", skip=["sliding_window"])
    for spec in plan.specs.values():
        if isinstance(spec, SlidingWindowSpec):
            assert spec.dtype == torch.bfloat16 and spec.block_size == 16
        else:
            assert spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR and spec.block_size == 32
        assert spec.page_size_bytes == 32768 and spec.page_size_padded is None
    assert_worker_consumable(plan)
    # nvfp4 pages (9216 B per 16 tokens) do not divide 32768: an exact common page of
    # lcm(32768, 9216) = 294912 B instead of padding (a padded full page of 112 tokens would be
    # split into 7 FlashInfer kernel blocks of 16, which the worker rejects).
    nv = _plan("gpt-oss-120b", "nvfp4", skip=["sliding_window"])
    for spec in nv.specs.values():
        assert spec.page_size_bytes == 294912 and spec.page_size_padded is None
        assert spec.block_size == (144 if isinstance(spec, SlidingWindowSpec) else 512)
    assert nv.page_padding_fraction == 0
    assert_worker_consumable(nv)
    gemma = _plan("gemma-3-27b-it", "nvfp4", skip=["sliding_window"])
    assert {(type(s).__name__, s.block_size, s.page_size_bytes) for s in gemma.specs.values()} == {
        ("SlidingWindowSpec", 144, 1179648),
        ("FullAttentionSpec", 512, 1179648),
    }
    # Bytes per token are unchanged: only the allocation granularity grew.
    assert nv.kv_bytes_per_token == sum(spec_bytes_per_token(s) for s in nv.base.specs.values())


def _planner_unify(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    return unify_kv_cache_spec_page_size(specs, MAX_PAGE_GROWTH, MAX_EXACT_PAGE_GROWTH)


def test_unequal_attention_pages_are_never_padded():
    bf16 = SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    nvfp4 = FullAttentionSpec(
        block_size=16,
        num_kv_heads=8,
        head_size=64,
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.NVFP4,
    )
    unified = _planner_unify({"swa": bf16, "full": nvfp4})
    assert unified["swa"].block_size == 144 and unified["full"].block_size == 512
    assert {s.page_size_bytes for s in unified.values()} == {294912}
    assert all(s.page_size_padded is None for s in unified.values())
    # Pages without a common multiple within 64× the largest page: refused, not padded.
    odd = [
        FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8 * p, dtype=torch.bfloat16)
        for p in (67, 71)
    ]
    with pytest.raises(ValueError, match="no common multiple"):
        _planner_unify({"a": odd[0], "b": odd[1]})


def test_tensor_parallel():
    tp1 = _plan("llama-3.1-70b-instruct", memory=40 * GiB)
    tp4 = _plan("llama-3.1-70b-instruct", memory=40 * GiB, tensor_parallel_size=4)
    assert {s.num_kv_heads for s in tp4.specs.values()} == {2}
    assert tp4.kv_cache_config.num_blocks == 4 * tp1.kv_cache_config.num_blocks
    tp8 = _plan("llama-3.1-70b-instruct", memory=40 * GiB, tensor_parallel_size=8)
    tp16 = _plan("llama-3.1-70b-instruct", memory=40 * GiB, tensor_parallel_size=16)
    assert {s.num_kv_heads for s in tp16.specs.values()} == {1}  # replicated
    assert tp16.kv_cache_config.num_blocks == tp8.kv_cache_config.num_blocks
    v3 = _plan("deepseek-v3", max_model_len=4096)
    v3_tp8 = _plan("deepseek-v3", max_model_len=4096, tensor_parallel_size=8)
    assert v3_tp8.kv_cache_config.num_blocks == v3.kv_cache_config.num_blocks  # latent not split
    with pytest.raises(ValueError, match="tensor_parallel_size: 3"):
        _plan("llama-3.1-70b-instruct", tensor_parallel_size=3)


def test_not_even_one_request():
    with pytest.raises(InsufficientKVCacheMemoryError) as info:
        _plan("llama-3.1-70b-instruct", memory=10 * GiB, max_model_len=131072)
    err = info.value
    assert isinstance(err, ValueError)
    assert "needs 42949672960 bytes (40.00 GiB)" in str(err)
    assert err.needed_bytes == 131072 * 327680
    assert err.max_model_len_that_fits == 32768
    assert "the largest max_model_len that fits is 32768" in str(err)
    # A budget below one block.
    with pytest.raises(ValueError, match="not even a 1-token request fits"):
        _plan("llama-3.1-8b-instruct", memory=1000, max_model_len=16)
    # Sliding windows need far less than the whole context.
    plan = _plan("mistral-7b-v0.1", memory=2 * GiB, max_model_len=32768)
    assert plan.fits and plan.bytes_per_request < 32768 * 131072
    # require_fit=False reports instead of raising.
    from vllm.v1.core.kv_cache_utils import plan_kv_cache_for_specs

    base = _plan("llama-3.1-70b-instruct").base
    soft = plan_kv_cache_for_specs("x", base, 10 * GiB, 131072, require_fit=False)
    assert not soft.fits and soft.max_model_len_that_fits() == 32768


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_model_len"):
        _plan("llama-3.1-8b-instruct", max_model_len=0)
    with pytest.raises(ValueError, match="block_size: .*multiple of 128"):
        plan_kv_cache("deepseek-v4-flash", CacheConfig(), 80 * GiB)
    with pytest.raises(ValueError, match="available presets"):
        plan_kv_cache("no-such-model", None, 80 * GiB)
    with pytest.raises(ValueError, match="kv_cache_specs"):
        get_kv_cache_config({}, GiB, 16)


@settings(max_examples=40, deadline=None)
@given(
    index=st.integers(0, len(PRESETS) - 1),
    dtype=st.sampled_from(DTYPES),
    memory=st.integers(min_value=0, max_value=200 * GiB),
    max_model_len=st.integers(min_value=1, max_value=300_000),
)
def test_plan_invariants_property(index, dtype, memory, max_model_len):
    name = PRESETS[index]
    try:
        plan = _plan(name, dtype, memory=memory, max_model_len=max_model_len)
    except InsufficientKVCacheMemoryError as err:
        assert err.needed_bytes > memory
        assert f"needs {err.needed_bytes} bytes" in str(err)
        return
    assert_worker_consumable(plan)
    groups = plan.kv_cache_config.kv_cache_groups
    assert plan.blocks_per_request == blocks_per_request(groups, max_model_len, 8192)
    assert plan.bytes_per_request <= memory


_ATTN = st.builds(
    lambda cls, heads, head, block, mode, window: cls(
        block_size=block,
        num_kv_heads=heads,
        head_size=head,
        dtype=torch.uint8 if mode.is_quantized else torch.bfloat16,
        kv_quant_mode=mode,
        **({"sliding_window": window} if cls is SlidingWindowSpec else {}),
    ),
    st.sampled_from([FullAttentionSpec, SlidingWindowSpec]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([64, 128, 256]),
    st.sampled_from([16, 32, 64]),
    st.sampled_from([KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR, KVQuantMode.NVFP4]),
    st.integers(1, 4096),
)
_MAMBA = st.builds(
    # Conv state of an even number of bf16 elements: the fp32 SSM state starts 4-byte aligned.
    lambda a, b, c: MambaSpec(
        block_size=16, shapes=((3, 2 * a), (b, 64, c)), dtypes=(torch.bfloat16, torch.float32)
    ),
    st.integers(1, 4096),
    st.integers(1, 64),
    st.integers(1, 128),
)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.tuples(st.one_of(_ATTN, _MAMBA), st.integers(1, 12)), min_size=1, max_size=4)
)
def test_unify_and_group_property(kinds):
    specs = {}
    for k, (spec, count) in enumerate(kinds):
        for i in range(count):
            specs[f"kind{k}.layer{i}"] = spec
    if all(isinstance(s, MambaSpec) for s in specs.values()) and len(set(specs.values())) > 1:
        pass  # still valid: pages padded to the largest
    unified = _planner_unify(specs)
    if len({s.page_size_bytes for s in specs.values()}) > 1:
        assert len({s.page_size_bytes for s in unified.values()}) == 1
        if any(not isinstance(s, MambaSpec) for s in specs.values()):
            # at least one attention spec is unpadded
            assert any(
                not isinstance(s, MambaSpec) and s.page_size_padded is None
                for s in unified.values()
            )
    for name, spec in unified.items():
        old = specs[name]
        assert spec.block_size % old.block_size == 0 or isinstance(spec, MambaSpec)
        if not isinstance(spec, MambaSpec):
            assert kv_bytes_per_entry(spec) == kv_bytes_per_entry(old)  # same bytes per token
    groups = get_kv_cache_groups(planner_vllm_config(1024), dict(specs), policy=PLANNER_LAYOUT)
    grouped = [n for g in groups for n in g.layer_names]
    assert sorted(grouped) == sorted(specs)
    config = get_kv_cache_config(specs, 64 * GiB, 1024)
    assert sum(t.size for t in config.kv_cache_tensors) <= 64 * GiB
    for spec in unified.values():
        if not isinstance(spec, MambaSpec | LatentPageSpec):
            assert spec.page_size_padded is None  # split into kernel blocks: never padded
    run_worker(config)


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 64), min_size=2, max_size=5))
def test_group_size_choice_property(counts):
    g = PLANNER_LAYOUT.group_size(counts)

    def stats(size):
        n = sum(-(-c // size) for c in counts)
        return n, n * size - sum(counts)

    groups, padding = stats(g)
    assert padding <= 0.05 * groups * g
    for other in range(1, max(counts) + 1):
        n, pad = stats(other)
        if pad <= 0.05 * n * other:
            assert (groups, padding) <= (n, pad)
