"""v0.33 hashing names (seeds, lookahead, tagged keys, hash views, free-queue prepend, group
selection) and Mamba prefill checkpoints: behaviour and error paths upstream's tests leave out."""

from __future__ import annotations

import pytest
import torch

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    BlockHashListWithBlockSize,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from vllm.v1.request import Request


@pytest.fixture(autouse=True)
def _seed() -> None:
    init_none_hash(sha256)


def _request(tokens: list[int], block_size: int, lookahead: int | bool = 0, **kw) -> Request:
    return Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256, lookahead),
        **kw,
    )


def test_bool_lookahead_counts_as_zero_or_one_token() -> None:
    tokens = list(range(13))
    assert _request(tokens, 4, True).block_hashes == _request(tokens, 4, 1).block_hashes
    assert _request(tokens, 4, False).block_hashes == _request(tokens, 4, 0).block_hashes
    assert len(_request(tokens, 4, True).block_hashes) == 3  # 12 tokens + 1 lookahead


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, "expected an int >= 0, got -1"),
        (1.0, TypeError, "expected an int, got float"),
        ("2", TypeError, "expected an int, got str"),
    ],
)
def test_bad_lookahead_is_rejected_before_hashing(value, error, match) -> None:
    with pytest.raises(error, match=f"num_hash_lookahead_tokens: {match}"):
        get_request_block_hasher(4, sha256, value)


def test_incremental_hashing_resumes_inside_any_mm_item() -> None:
    # Three items; the request grows token by token, so later calls start inside the first and
    # second items (not only the last): every hash must equal the one-shot result.
    features = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=name, mm_position=PlaceholderRange(off, n)
        )
        for name, off, n in (("a", 1, 6), ("b", 9, 5), ("c", 15, 2))
    ]
    tokens = list(range(20))
    whole = _request(tokens, 4, mm_features=features)
    grown = _request(tokens[:3], 4, mm_features=features)
    for token in tokens[3:]:
        grown.append_output_token_ids(token)
    assert grown.block_hashes == whole.block_hashes and len(whole.block_hashes) == 5


def test_none_hash_seed_follows_last_init(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    init_none_hash(sha256)
    assert kv_cache_utils.get_none_hash_seed() == "42"
    assert sha256("42") == kv_cache_utils.NONE_HASH
    monkeypatch.delenv("PYTHONHASHSEED")
    init_none_hash(sha256)
    assert kv_cache_utils.get_none_hash_seed() == kv_cache_utils.DEFAULT_NONE_HASH_SEED


def test_event_extra_keys_drop_tags() -> None:
    tagged = [(("lora", "l", "/p"), ("mm", "img", 3), ("cache_salt", "s")), None]
    assert to_event_extra_keys(tagged) == [("l", ("img", 3), "s"), None]
    assert to_event_extra_keys([]) is None


def test_resolve_block_hashes_views_and_mismatch() -> None:
    raw = [BlockHash(bytes([i])) for i in range(8)]
    view = resolve_block_hashes(raw, 2, 4)
    assert isinstance(view, BlockHashListWithBlockSize) and list(view) == raw[1::2]
    # A partial-hit alignment that does not divide the block size falls back to the view.
    assert isinstance(
        resolve_block_hashes(raw, 2, 6, supports_fine_grained_hash_lookup=True, alignment_tokens=4),
        BlockHashListWithBlockSize,
    )
    with pytest.raises(AssertionError, match="expected a view of 4-token blocks, got one of 8"):
        resolve_block_hashes(BlockHashListWithBlockSize(raw, 2, 8), 2, 4)


def test_prepend_n_puts_blocks_first_in_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue([])
    queue.prepend_n(blocks[2:])
    queue.prepend_n(blocks[:2])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [0, 1, 2, 3]
    assert queue.num_free_blocks == 4
    assert [queue.popleft().block_id for _ in range(4)] == [0, 1, 2, 3]


def test_get_block_ids_group_selection() -> None:
    blocks = KVCacheBlocks(([KVCacheBlock(1)], [], [KVCacheBlock(3)]))
    assert blocks.get_block_ids(group_ids=[2, 0]) == ([3], [1])
    assert blocks.get_block_ids(allow_none=True, group_ids=[1]) is None
    with pytest.raises(ValueError, match=r"group_ids: expected ids in \[0, 3\), got \[0, 3\]"):
        blocks.get_block_ids(group_ids=[0, 3])


def _mamba(**kw) -> MambaSpec:
    return MambaSpec(
        block_size=kw.pop("block_size", 128),
        shapes=((1, 1),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        **kw,
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"num_prefill_checkpoint_blocks": -1}, "num_prefill_checkpoint_blocks: expected an int"),
        ({"num_prefill_checkpoint_blocks": True}, "num_prefill_checkpoint_blocks: expected an"),
        ({"prefill_checkpoint_alignment": 0}, "prefill_checkpoint_alignment: expected a positive"),
        ({"prefill_checkpoint_alignment": 1.5}, "prefill_checkpoint_alignment: expected a posit"),
    ],
)
def test_mamba_spec_rejects_bad_checkpoint_fields(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _mamba(**kw)


def test_align_mode_memory_counts_checkpoint_pages() -> None:
    config = VllmConfig(
        model_config=ModelConfig(max_model_len=1024),
        cache_config=CacheConfig(mamba_cache_mode="align"),
    )
    spec = _mamba(num_speculative_blocks=2, num_prefill_checkpoint_blocks=1)
    assert spec.max_memory_usage_bytes(config) == (2 + 2 + 1) * spec.page_size_bytes


def test_checkpoint_position_and_validity() -> None:
    # One token stays after the checkpoint (two with a 2-token hash lookahead).
    assert get_mamba_prefill_checkpoint_position(257, 128, False) == 256
    assert get_mamba_prefill_checkpoint_position(257, 128, False, 2) == 128
    # EAGLE: one hash block lower; never below 0.
    assert get_mamba_prefill_checkpoint_position(300, 128, True) == 128
    assert get_mamba_prefill_checkpoint_position(100, 128, True) == 0
    assert is_mamba_prefill_checkpoint_valid(0, 300, 256, 128, 128, 64)
    assert not is_mamba_prefill_checkpoint_valid(0, 300, 256, 128, 128, None)
    assert not is_mamba_prefill_checkpoint_valid(0, 300, 256, 128, 128, 96)  # off alignment
    assert not is_mamba_prefill_checkpoint_valid(64, 300, 256, 128, 128, 64)  # mid-hash start
    with pytest.raises(ValueError, match="checkpoint_alignment: expected a positive int"):
        is_mamba_prefill_checkpoint_valid(0, 300, 256, 128, 128, 0)


def _manager(spec: MambaSpec, hash_block_size: int = 64) -> tuple[MambaManager, BlockPool]:
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=hash_block_size)
    manager = MambaManager(
        spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0, scheduler_block_size=128
    )
    return manager, pool


def test_page_aligned_checkpoint_is_published_and_freed_with_the_request() -> None:
    spec = _mamba(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=64)
    manager, pool = _manager(spec)
    request = _request(list(range(300)), 64)
    free_before = pool.get_num_free_blocks()
    estimate = manager.get_num_blocks_to_allocate("r", 300, [], 0, 0, 300)
    assert manager._checkpoints["r"] == (256, 1)
    manager.allocate_new_blocks("r", 300, 300)
    assert free_before - pool.get_num_free_blocks() == estimate == 2
    manager.cache_blocks(request, 300)
    block = manager.req_to_blocks["r"][1]
    key = make_block_hash_with_group_id(request.block_hashes[3], 0)  # hash of 256 tokens
    assert block.block_hash == key and pool.get_cached_block(request.block_hashes[3], [0])
    manager.free("r")
    assert "r" not in manager._checkpoints


def test_checkpoint_at_first_page_keeps_its_own_key() -> None:
    # 200 tokens: the checkpoint is the first page's end (128), the key cache_blocks gave it.
    spec = _mamba(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=64)
    manager, pool = _manager(spec)
    request = _request(list(range(200)), 64)
    assert manager.get_num_blocks_to_allocate("r", 200, [], 0, 0, 200) == 2
    assert manager._checkpoints["r"] == (128, 0)
    manager.allocate_new_blocks("r", 200, 200)
    manager.cache_blocks(request, 200)
    page = manager.req_to_blocks["r"][0]
    assert page.block_hash == make_block_hash_with_group_id(request.block_hashes[1], 0)
    assert pool.get_cached_block(request.block_hashes[1], [0]) == [page]


def test_admission_estimate_leaves_the_plan_alone() -> None:
    spec = _mamba(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=64)
    manager, _ = _manager(spec)
    manager.get_num_blocks_to_allocate("r", 100, [], 0, 0, 100)
    assert "r" not in manager._checkpoints
    manager.get_num_blocks_to_allocate("r", 300, [], 0, 0, 300, apply_admission_cap=True)
    assert "r" not in manager._checkpoints


@pytest.mark.parametrize("use_eagle", [False, True])
def test_coordinator_moves_mamba_checkpoints_for_eagle(use_eagle: bool) -> None:
    config = KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["m"], _mamba(num_prefill_checkpoint_blocks=1))],
    )
    manager = KVCacheManager(config, max_model_len=1024, hash_block_size=128, use_eagle=use_eagle)
    (mamba,) = manager.coordinator.single_type_managers
    assert isinstance(mamba, MambaManager)
    assert mamba.drop_eagle_checkpoint_block is use_eagle
