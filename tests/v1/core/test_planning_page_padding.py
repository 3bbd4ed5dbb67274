"""Upstream v0.33's page-size unification and full-allocation fallback beyond its own tests:
the error paths, the planner policy left as it was, promotion details, the sparse-MLA row
view's checks, and the spec fields added for packed latent caches."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm.v1.attention.backends.mla.sparse_utils import (
    align_blocks_to_rows,
    flat_kv_row_view,
    request_row_bounds,
)
from vllm.v1.core.kv_cache_grouping import get_kv_cache_groups, unify_hybrid_kv_cache_specs
from vllm.v1.core.page_size_unification import (
    MAX_EXACT_PAGE_GROWTH,
    MAX_PAGE_GROWTH,
    PageSizeUnificationError,
    unify_kv_cache_spec_page_size,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpecKind,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    UnsupportedKVCacheSpecError,
    get_kv_cache_spec_kind,
)


def full(**kw) -> FullAttentionSpec:
    return FullAttentionSpec(
        **{"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32} | kw
    )


def swa(**kw) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        **{"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
        | {"sliding_window": 128}
        | kw
    )


def mla(**kw) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        **{"block_size": 16, "num_kv_heads": 1, "head_size": 576, "dtype": torch.float32} | kw
    )


def config() -> SimpleNamespace:
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        cache_config=None,
        speculative_config=None,
    )


def test_non_dividing_mla_page_is_refused() -> None:
    # 16 x 576 x 4 = 36864 B does not divide 65536 B, and latent pages are not padded.
    specs = {"m": mla(), "a": full(num_kv_heads=8)}
    with pytest.raises(PageSizeUnificationError, match="'m' has a 36864-byte page") as info:
        unify_kv_cache_spec_page_size(specs)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, ValueError)


def test_dividing_mla_page_grows_its_block() -> None:
    unified = unify_kv_cache_spec_page_size({"m": mla(), "a": full(num_kv_heads=18)})
    assert unified["m"].block_size == 64 and unified["m"].page_size_padded is None


def test_pre_padded_page_that_cannot_reach_the_target_is_refused() -> None:
    # A page already padded does not grow with its block size (65536 B divides 131072 B).
    padded = swa(page_size_padded=65536)
    with pytest.raises(PageSizeUnificationError, match="cannot reach"):
        unify_kv_cache_spec_page_size({"s": padded, "a": full(num_kv_heads=16)})


@pytest.mark.parametrize("bounds", [(0, 1), (1, 0), (True, 1), (1.5, 1)])
def test_bad_bounds(bounds) -> None:
    with pytest.raises(ValueError, match="expected an int >= 1"):
        unify_kv_cache_spec_page_size({"a": full(), "b": swa(block_size=32)}, *bounds)


def test_planner_policy_still_never_pads_attention() -> None:
    specs = {"a": full(num_kv_heads=3), "b": full(num_kv_heads=2)}
    upstream = unify_kv_cache_spec_page_size(specs)
    assert upstream["b"].page_size_padded == upstream["a"].page_size_bytes
    planner = unify_kv_cache_spec_page_size(specs, MAX_PAGE_GROWTH, MAX_EXACT_PAGE_GROWTH)
    assert all(s.page_size_padded is None for s in planner.values())
    assert len({s.page_size_bytes for s in planner.values()}) == 1


def test_mamba_keeps_its_block_size_under_upstreams_rule() -> None:
    mamba = MambaSpec(block_size=16, shapes=((4096,),), dtypes=(torch.float32,))
    unified = unify_kv_cache_spec_page_size({"m": mamba, "a": full(num_kv_heads=4)})
    assert unified["m"].block_size == 16 and unified["m"].page_size_padded == 32768


def test_mamba_extra_dtypes_are_ignored_but_missing_ones_refused() -> None:
    spec = MambaSpec(block_size=16, shapes=((8,),), dtypes=(torch.float32, torch.float16))
    assert spec.dtypes == (torch.float32,) and spec.page_size_bytes == 32
    with pytest.raises(ValueError, match="one dtype per state shape"):
        MambaSpec(block_size=16, shapes=((8,), (8,)), dtypes=(torch.float32,))


def test_fallback_is_not_taken_without_sliding_window() -> None:
    # MLA pages that cannot be unified next to chunked layers (not promoted): the error stands.
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=64, dtype=torch.float32, attention_chunk_size=64
    )
    specs = {"m": mla(), "c": chunked, "s": swa()}
    with pytest.raises(PageSizeUnificationError):
        get_kv_cache_groups(config(), specs)


def test_fallback_promotes_only_allocation(caplog) -> None:
    draft = swa(sliding_window=64, dcp_sharded=True)
    specs = {"m": mla(block_size=64), "i": mla(block_size=64, head_size=132, dtype=torch.uint8)}
    specs["d"] = draft
    (group,) = get_kv_cache_groups(config(), specs)
    promoted = group.kv_cache_spec.kv_cache_specs["d"]
    assert type(promoted) is FullAttentionSpec and promoted.sliding_window == 64
    assert promoted.block_size == 64 and specs["d"] is draft
    assert "attention compute is unchanged" in caplog.text


def test_disabled_hybrid_manager_keeps_other_fields_and_grows_padding() -> None:
    specs = {"f": full(block_size=64), "s": swa(page_size_padded=32768, is_draft=True)}
    unify_hybrid_kv_cache_specs(specs)
    promoted = specs["s"]
    assert type(promoted) is FullAttentionSpec and promoted.is_draft
    # Real page 16384 B at block 16 → 65536 B at block 64, above the old padding.
    assert promoted.block_size == 64 and promoted.page_size_padded == 65536


def test_unsupported_spec_type_error_is_both_kinds() -> None:
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    enc = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.half)
    with pytest.raises(UnsupportedKVCacheSpecError, match="Unsupported KV cache spec type"):
        UniformTypeKVCacheSpecs.is_uniform_type({"e": enc})
    assert issubclass(UnsupportedKVCacheSpecError, AssertionError)
    assert issubclass(UnsupportedKVCacheSpecError, NotImplementedError)


def test_mixed_full_attention_group_kind() -> None:
    group = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"f": full(), "m": mla()})
    assert get_kv_cache_spec_kind(group) == KVCacheSpecKind.FULL_ATTENTION
    mixed = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"f": full(), "s": swa()})
    assert get_kv_cache_spec_kind(mixed) == KVCacheSpecKind.UNKNOWN


def test_latent_state_content_bytes() -> None:
    spec = mla(head_size=128, dtype=torch.uint8, block_size=64, state_content_bytes=132)
    assert spec.state_content_size_bytes == 132 and spec.page_size_bytes == 64 * 132
    with pytest.raises(ValueError, match="state_content_bytes"):
        mla(state_content_bytes=0)
    aligned = align_blocks_to_rows(spec, 64)
    assert aligned.block_stride_alignment == 64 * 132
    with pytest.raises(ValueError, match="rows: expected a positive int"):
        align_blocks_to_rows(spec, 0)


def test_flat_kv_row_view() -> None:
    backing = torch.arange(3 * 6 * 2, dtype=torch.float32).view(3, 6, 2)
    cache = backing[:, :4]  # 4 tokens a block, blocks 6 rows apart
    rows, stride = flat_kv_row_view(cache, 4)
    assert stride == 6 and rows.shape == (2 * 6 + 4, 2)
    assert torch.equal(rows[2 * stride + 3], cache[2, 3])
    with pytest.raises(ValueError, match="whole 4-element rows"):
        flat_kv_row_view(torch.zeros(3 * 10)[:26].as_strided((2, 2, 4), (10, 4, 1)), 2)
    with pytest.raises(ValueError, match="expected \\[num_blocks"):
        flat_kv_row_view(torch.zeros(4, 4), 4)
    with pytest.raises(ValueError, match="block_size"):
        flat_kv_row_view(cache, 0)


def test_request_row_bounds() -> None:
    assert request_row_bounds(np.array([0, 0, 1, 2, 2])).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="adjacent"):
        request_row_bounds(np.array([0, 1, 0]))
    with pytest.raises(ValueError, match="non-empty"):
        request_row_bounds(np.array([], dtype=np.int64))


def test_packed_attention_page_fields() -> None:
    packed = full(block_size=2, head_size=2, num_head_slots=3, state_content_bytes=20)
    assert packed.num_heads == 3 and packed.page_size_bytes == 3 * 2 * 20
    assert packed.state_content_size_bytes == 20
    assert full(block_size=2, head_size=2).num_heads == 2
    for name in ("num_head_slots", "state_content_bytes"):
        with pytest.raises(ValueError, match=name):
            full(**{name: 0})
