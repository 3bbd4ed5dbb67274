"""Block hashing: chaining, determinism (also across processes), extra keys, key packing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name, sha256, sha256_cbor, xxhash
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    BlockHashListWithBlockSize,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    need_extra_keys,
)
from vllm.v1.request import Request


@pytest.fixture(autouse=True)
def _seed() -> None:
    init_none_hash(sha256)


def _request(tokens: list[int], block_size: int = 4, hash_fn=sha256, **kw) -> Request:
    return Request(
        request_id=kw.pop("request_id", "r"),
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=8),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
        **kw,
    )


def _mm(offset: int, length: int, ident: str) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset, length)
    )


@pytest.mark.parametrize("hash_fn", [sha256, sha256_cbor])
def test_hashes_chain_and_only_full_blocks_are_hashed(hash_fn) -> None:
    request = _request(list(range(10)), hash_fn=hash_fn)
    assert len(request.block_hashes) == 2  # 10 tokens, 4 per block
    first = hash_fn((kv_cache_utils.NONE_HASH, (0, 1, 2, 3), None))
    assert request.block_hashes[0] == first
    assert request.block_hashes[1] == hash_fn((first, (4, 5, 6, 7), None))
    assert hash_block_tokens(hash_fn, None, [0, 1, 2, 3]) == first
    request.append_output_token_ids([10, 11])
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(
        hash_fn, request.block_hashes[1], [8, 9, 10, 11]
    )


def test_equal_prefixes_share_hashes_and_a_different_token_changes_the_rest() -> None:
    a = _request(list(range(12)))
    b = _request(list(range(12)))
    c = _request([0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11])
    assert a.block_hashes == b.block_hashes
    assert c.block_hashes[0] == a.block_hashes[0]
    assert c.block_hashes[1] != a.block_hashes[1] and c.block_hashes[2] != a.block_hashes[2]


def test_cbor_hashes_are_reproducible_across_processes() -> None:
    code = (
        "from vllm.utils.hashing import sha256_cbor\n"
        "from vllm.v1.core.kv_cache_utils import init_none_hash, hash_block_tokens\n"
        "init_none_hash(sha256_cbor)\n"
        "print(hash_block_tokens(sha256_cbor, None, [1, 2, 3], ('x',)).hex())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="1234")
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(outs) == 1
    assert outs.pop() == sha256_cbor((sha256_cbor("1234"), (1, 2, 3), ("x",))).hex()


def test_none_hash_follows_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    init_none_hash(sha256)
    assert sha256("7") == kv_cache_utils.NONE_HASH
    monkeypatch.delenv("PYTHONHASHSEED")
    # v0.33: SHA-256 without a seed uses the shared default, xxHash a random one.
    init_none_hash(sha256)
    assert sha256(kv_cache_utils.DEFAULT_NONE_HASH_SEED) == kv_cache_utils.NONE_HASH
    seeds = {kv_cache_utils.resolve_none_hash_seed(xxhash) for _ in range(3)}
    assert len(seeds) == 3 and kv_cache_utils.DEFAULT_NONE_HASH_SEED not in seeds
    assert kv_cache_utils.get_none_hash_seed() == kv_cache_utils.DEFAULT_NONE_HASH_SEED


def test_extra_keys_order_lora_mm_salt_embeds() -> None:
    embeds = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)
    request = _request(
        list(range(8)),
        lora_request=LoRARequest("adapter", 3, "/p"),
        mm_features=[_mm(1, 2, "img")],
        cache_salt="salt",
        prompt_embeds=embeds,
    )
    assert need_extra_keys(request)
    keys, next_mm = generate_block_hash_extra_keys(request, 0, 4, 0)
    digest = hashlib.sha256(embeds[:4].numpy().tobytes()).digest()
    assert keys == (
        ("lora", "adapter", "/p"),
        ("mm", "img", 1),
        ("cache_salt", "salt"),
        (
            "prompt_embeds",
            digest,
        ),
    )
    assert next_mm == 1
    # The salt keys only the first block; the second has no MM item.
    keys2, _ = generate_block_hash_extra_keys(request, 4, 8, next_mm)
    digest2 = hashlib.sha256(embeds[4:].numpy().tobytes()).digest()
    assert keys2 == (("lora", "adapter", "/p"), ("prompt_embeds", digest2))
    plain = _request(list(range(8)))
    assert not need_extra_keys(plain)
    assert generate_block_hash_extra_keys(plain, 0, 4, 0) == (None, 0)


def test_mm_item_spanning_blocks_keys_each_with_its_relative_offset() -> None:
    request = _request(list(range(12)), mm_features=[_mm(2, 7, "a"), _mm(9, 2, "b")])
    k0, i0 = generate_block_hash_extra_keys(request, 0, 4, 0)
    k1, i1 = generate_block_hash_extra_keys(request, 4, 8, i0)
    k2, i2 = generate_block_hash_extra_keys(request, 8, 12, i1)
    assert (k0, i0) == ((("mm", "a", 2),), 0)
    assert (k1, i1) == ((("mm", "a", -2),), 0)
    assert (k2, i2) == ((("mm", "a", -6), ("mm", "b", 1)), 2)
    # Same tokens, different image: different hashes from the first block on.
    other = _request(list(range(12)), mm_features=[_mm(2, 7, "z"), _mm(9, 2, "b")])
    assert all(x != y for x, y in zip(request.block_hashes, other.block_hashes, strict=True))


def test_salt_and_lora_separate_otherwise_equal_prompts() -> None:
    base = _request(list(range(8)))
    salted = _request(list(range(8)), cache_salt="s")
    lora = _request(list(range(8)), lora_request=LoRARequest("l", 1, "/p"))
    assert len({base.block_hashes[0], salted.block_hashes[0], lora.block_hashes[0]}) == 3


def test_group_id_packing_round_trips() -> None:
    h = sha256("x")
    key = make_block_hash_with_group_id(h, 70000)
    assert len(key) == len(h) + 4
    assert get_block_hash(key) == h and get_group_id(key) == 70000


def test_int_hashes_for_events(monkeypatch: pytest.MonkeyPatch) -> None:
    h = bytes(range(32))
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert maybe_convert_block_hash(h) == h
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    assert maybe_convert_block_hash(h) == int.from_bytes(h[-8:], "big")


def test_block_hash_list_with_block_size_takes_last_chained_hash() -> None:
    # v0.33: a coarse block's hash is its last fine hash (which chains the whole prefix).
    fine = [bytes([i]) * 2 for i in range(7)]
    coarse = BlockHashListWithBlockSize(fine, 16, 48)
    assert len(coarse) == 2
    assert coarse[0] == fine[2]
    assert coarse[-1] == coarse[1] == fine[5]
    assert coarse[0:2] == list(coarse)
    with pytest.raises(TypeError, match="idx: expected int or slice"):
        coarse["0"]  # type: ignore[index]
    with pytest.raises(AssertionError, match="multiple of 16"):
        BlockHashListWithBlockSize(fine, 16, 40)


def test_hash_fn_by_name() -> None:
    assert get_hash_fn_by_name("sha256_cbor") is sha256_cbor
    with pytest.raises(ValueError, match="hash_fn_name: expected one of"):
        get_hash_fn_by_name("md5")
