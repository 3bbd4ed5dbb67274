"""Prefix-cache block hashing (upstream's hashing names, importable from
:mod:`vllm.v1.core.kv_cache_utils`).

A block's hash chains its parent's: ``hash_fn((parent_hash, token_ids, extra_keys))``, the first
block's parent being :data:`NONE_HASH` (see :func:`resolve_none_hash_seed` for its seed). Equal
prefixes therefore give equal hashes, and a block hash identifies the whole prefix up to it. The
extra keys separate equal token ids whose KV differs: the LoRA adapter name, the multimodal item
identifiers (with their offset inside the block), the cache salt (first block only) and a SHA-256
digest of the block's prompt embeddings.

Hashes are raw ``bytes`` (``BlockHash``); a block hash plus a 4-byte big-endian KV-cache group id
is the key of one cached page (``BlockHashWithGroupId``). Block sizes are in tokens.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NewType, TypeAlias, overload

import torch

from vllm.utils.hashing import xxhash, xxhash_cbor

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "BlockHash",
    "BlockHashList",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "ExternalBlockHash",
    "generate_block_hash_extra_keys",
    "get_block_hash",
    "get_group_id",
    "get_none_hash_seed",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "make_block_hash_with_group_id",
    "maybe_convert_block_hash",
    "need_extra_keys",
    "resolve_block_hashes",
    "resolve_none_hash_seed",
    "tensor_data",
    "to_event_extra_keys",
]

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
# What KV events carry: the hash bytes, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) their low
# 64 bits as an int, for consumers that predate byte hashes.
ExternalBlockHash: TypeAlias = "bytes | int"

logger = logging.getLogger(__name__)

_GROUP_ID_BYTES = 4
_INT_HASH_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
# Not collision resistant: their seed must stay secret (random) unless the operator sets one.
_NON_CRYPTO_HASH_FUNCTIONS = frozenset({xxhash, xxhash_cbor})

# Seed of every chain; set by init_none_hash (which the engine calls once at start-up).
NONE_HASH: BlockHash
# The seed used without PYTHONHASHSEED by the SHA-256 functions, so that independent
# processes (other nodes, the P2P tier) compute the same hashes for the same prefix.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_none_hash_seed: str | None = None


# The suffixes of the group ids models have, made once: a key is built on every prefix lookup.
_GROUP_SUFFIXES = tuple(i.to_bytes(_GROUP_ID_BYTES, "big") for i in range(64))


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """``block_hash`` followed by ``group_id`` as 4 big-endian bytes (no tuple per key)."""
    if 0 <= group_id < len(_GROUP_SUFFIXES):
        return BlockHashWithGroupId(block_hash + _GROUP_SUFFIXES[group_id])
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(_GROUP_ID_BYTES, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The block-hash part of ``key``."""
    return BlockHash(key[:-_GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group-id part of ``key``."""
    return int.from_bytes(key[-_GROUP_ID_BYTES:], "big")


def maybe_convert_block_hash(hash_bytes: BlockHash) -> ExternalBlockHash:
    """``hash_bytes`` as events publish it: bytes, or its low 64 bits when the env asks."""
    if os.environ.get(_INT_HASH_ENV, "0").strip().lower() not in ("1", "true"):
        return hash_bytes
    return int.from_bytes(hash_bytes, "big") & 0xFFFF_FFFF_FFFF_FFFF


def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes]) -> str:
    """The seed :data:`NONE_HASH` is derived from: ``PYTHONHASHSEED`` when set; else
    :data:`DEFAULT_NONE_HASH_SEED` for the SHA-256 functions, or 32 fresh random bytes (hex)
    for the xxHash ones, whose collisions an attacker could precompute from a known seed."""
    seed = os.getenv("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def get_none_hash_seed() -> str:
    """The seed the last :func:`init_none_hash` used (:data:`DEFAULT_NONE_HASH_SEED` before
    one ran), for peers that must agree on :data:`NONE_HASH`."""
    return DEFAULT_NONE_HASH_SEED if _none_hash_seed is None else _none_hash_seed


def init_none_hash(hash_fn: Callable[[Any], bytes]) -> None:
    """Set :data:`NONE_HASH` to ``hash_fn(resolve_none_hash_seed(hash_fn))``."""
    global NONE_HASH, _none_hash_seed
    _none_hash_seed = resolve_none_hash_seed(hash_fn)
    if hash_fn in _NON_CRYPTO_HASH_FUNCTIONS and os.getenv("PYTHONHASHSEED") is None:
        # The random seed makes these hashes differ between processes; say so once here.
        logger.warning(
            "PYTHONHASHSEED is not set: NONE_HASH for %s uses a random per-process seed, so "
            "block hashes differ between processes; set it (or use sha256) to share caches.",
            getattr(hash_fn, "__name__", hash_fn),
        )
    NONE_HASH = BlockHash(hash_fn(_none_hash_seed))


def tensor_data(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` (C order, any dtype), for hashing."""
    flat = tensor.detach().cpu().contiguous().flatten()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def need_extra_keys(request: Request) -> bool:
    """Whether ``request``'s blocks hash more than token ids (MM, LoRA or cache salt)."""
    return (
        bool(request.mm_features)
        or request.lora_request is not None
        or (request.cache_salt is not None)
    )


def _mm_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[list[Any], int]:
    """``("mm", identifier, offset of the item relative to the block start)`` of every multimodal
    item overlapping tokens [start, end), and the index of the item the next block starts at.
    Items are sorted by offset; ``start_mm_idx`` < 0 counts from the last item."""
    features = request.mm_features
    keys: list[Any] = []
    if not features:
        return keys, start_mm_idx
    last = features[-1].mm_position
    if last.offset + last.length <= start_token_idx:
        # Past every item (late prefill, decode): nothing to scan.
        return keys, start_mm_idx
    idx = start_mm_idx
    if idx < 0:
        if -idx > len(features):
            raise AssertionError(f"start_mm_idx: expected >= {-len(features)}, got {start_mm_idx}")
        idx += len(features)
    while idx < len(features):
        feature = features[idx]
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if end_token_idx <= offset:
            break  # the block ends before this item
        if start_token_idx >= offset + length:
            idx += 1  # the block starts after this item
            continue
        keys.append(("mm", feature.identifier, offset - start_token_idx))
        if end_token_idx < offset + length:
            break  # the item continues into the next block
        idx += 1
    return keys, idx


def _prompt_embeds_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int
) -> list[tuple[str, bytes]]:
    """SHA-256 of the block's prompt embeddings, computed once per block range per request."""
    if request.prompt_embeds is None:
        return []
    span = (start_token_idx, end_token_idx)
    digest = request._prompt_embeds_per_block_hashes.get(span)
    if digest is None:
        digest = hashlib.sha256(
            tensor_data(request.prompt_embeds[start_token_idx:end_token_idx])
        ).digest()
        request._prompt_embeds_per_block_hashes[span] = digest
    return [("prompt_embeds", digest)]


def generate_block_hash_extra_keys(
    request: Request, start_token_idx: int, end_token_idx: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of the block holding tokens [start, end) (None when there are none), in
    the order ``("lora", name, path)``, the ``("mm", identifier, offset)`` keys,
    ``("cache_salt", salt)`` (first block only), ``("prompt_embeds", sha256 digest)``; and the
    multimodal index the next block's scan starts at. The tags keep keys of different kinds
    from colliding (a LoRA named like a salt); the path makes a re-pointed LoRA name miss."""
    mm_keys, next_mm_idx = _mm_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys: list[Any] = []
    if request.lora_request is not None:
        keys.append(("lora", request.lora_request.lora_name, request.lora_request.lora_path))
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    keys.extend(_prompt_embeds_extra_keys(request, start_token_idx, end_token_idx))
    return (tuple(keys) if keys else None), next_mm_idx


def to_event_extra_keys(
    extra_keys: Iterable[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """The per-block extra keys as KV events publish them (consumers parse v0.22's untagged
    shapes): ``("mm", id, offset)`` → ``(id, offset)``, any other ``(tag, value, ...)`` →
    ``value`` (a LoRA's name, a cache salt, a prompt-embeds digest). None for no blocks."""
    if not extra_keys:
        return None
    return [
        None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
        for keys in extra_keys
    ]


def hash_block_tokens(
    hash_function: Callable[[Any], bytes],
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block chained to ``parent_block_hash`` (None/empty: first block)."""
    parent = parent_block_hash or NONE_HASH
    return BlockHash(hash_function((parent, tuple(curr_block_token_ids), extra_keys)))


def get_request_block_hasher(
    block_size: int,
    caching_hash_fn: Callable[[Any], bytes],
    num_hash_lookahead_tokens: int = 0,
) -> Callable[[Request], list[BlockHash]]:
    """A function giving the hashes of a request's full blocks not hashed yet (the request keeps
    them in ``request.block_hashes``); ``block_size`` in tokens.

    ``num_hash_lookahead_tokens`` (L, tokens) > 0: a block's hash also covers the L tokens
    after it (the drafter's K/V at the block's last position depends on them), so it exists
    only once those tokens do. The hashed tokens stay the block's; its extra keys become
    ``(E, *next L tokens)``, where ``E`` are the extra keys of the block and those tokens.
    A bool counts as 0 or 1 token (callers pass "has a drafter" as upstream's do)."""
    if not isinstance(num_hash_lookahead_tokens, int):
        raise TypeError(
            "num_hash_lookahead_tokens: expected an int, "
            f"got {type(num_hash_lookahead_tokens).__name__}"
        )
    if num_hash_lookahead_tokens < 0:
        raise ValueError(
            f"num_hash_lookahead_tokens: expected an int >= 0, got {num_hash_lookahead_tokens}"
        )
    lookahead = int(num_hash_lookahead_tokens)

    def request_block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes) * block_size
        num_tokens = request.num_tokens - lookahead
        if start + block_size > num_tokens:
            return []
        mm_idx = _first_mm_idx_reaching(request, start)
        parent = request.block_hashes[-1] if request.block_hashes else None
        token_ids = request.all_token_ids
        new_hashes: list[BlockHash] = []
        while start + block_size <= num_tokens:
            end = start + block_size
            if lookahead:
                extra, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, start, end, end + lookahead, mm_idx
                )
                extra_keys: tuple[Any, ...] | None = (extra, *token_ids[end : end + lookahead])
            else:
                extra_keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_block_tokens(caching_hash_fn, parent, token_ids[start:end], extra_keys)
            new_hashes.append(parent)
            start = end
        return new_hashes

    return request_block_hasher


def _first_mm_idx_reaching(request: Request, token_idx: int) -> int:
    """Index of the first multimodal item ending after ``token_idx`` (items are sorted and
    disjoint, so their ends are sorted too); a later call may resume inside any item."""
    features = request.mm_features
    if token_idx == 0 or not features:
        return 0
    return bisect.bisect_right(
        features, token_idx, key=lambda f: f.mm_position.offset + f.mm_position.length
    )


def generate_lookahead_block_hash_extra_keys(
    request: Request,
    start_token_idx: int,
    end_token_idx: int,
    hash_end_token_idx: int,
    start_mm_idx: int,
) -> tuple[tuple[Any, ...] | None, int]:
    """The extra keys of a block [start, end) whose hash covers tokens up to
    ``hash_end_token_idx`` (its lookahead), and the multimodal index the next block's scan
    starts at: the first item still open at ``end_token_idx``, since the lookahead scan may
    have moved past items the next block overlaps."""
    extra_keys, mm_idx = generate_block_hash_extra_keys(
        request, start_token_idx, hash_end_token_idx, start_mm_idx
    )
    return extra_keys, _rewind_mm_idx(request, mm_idx, end_token_idx)


def _rewind_mm_idx(request: Request, mm_idx: int, end_token_idx: int) -> int:
    """The first multimodal item (from ``mm_idx`` back) that still reaches past
    ``end_token_idx``; a lookahead scan may have moved past items the next block overlaps."""
    features = request.mm_features
    if mm_idx < 0:
        mm_idx += len(features)
    while mm_idx > 0:
        position = features[mm_idx - 1].mm_position
        if position.offset + position.length <= end_token_idx:
            break
        mm_idx -= 1
    return mm_idx


class BlockHashListWithBlockSize:
    """Read-only view of block hashes computed every ``hash_block_size`` tokens as hashes of
    ``target_block_size``-token blocks (a multiple): hash ``i`` is the last fine hash inside
    block ``i``, which already chains the whole prefix up to the block's end (upstream v0.33;
    v0.22 concatenated the fine hashes)."""

    def __init__(
        self, block_hashes: list[BlockHash], hash_block_size: int, target_block_size: int
    ) -> None:
        if target_block_size % hash_block_size != 0:
            raise AssertionError(
                f"target_block_size: expected a multiple of {hash_block_size}, "
                f"got {target_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, int):
            if idx < 0:
                idx += len(self)
            return self._get_value_at(idx)
        if isinstance(idx, slice):
            return [self._get_value_at(i) for i in range(*idx.indices(len(self)))]
        raise TypeError(f"idx: expected int or slice, got {type(idx).__name__}")

    def __iter__(self) -> Iterator[BlockHash]:
        return (self._get_value_at(i) for i in range(len(self)))

    def _get_value_at(self, idx: int) -> BlockHash:
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]


BlockHashList: TypeAlias = "list[BlockHash] | BlockHashListWithBlockSize"


def resolve_block_hashes(
    block_hashes: BlockHashList,
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> BlockHashList:
    """``block_hashes`` (one per ``hash_block_size`` tokens, or already a view) as a manager
    of ``block_size``-token blocks reads them (sizes in tokens).

    The raw hashes stay when the sizes match, and also for a manager that can look up at hash
    granularity (``supports_fine_grained_hash_lookup``) while partial hits are on: hits
    aligned to ``alignment_tokens`` < ``block_size`` (a divisor of it). Otherwise a view of one
    hash per block; a view already built for another block size is an error."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        if block_hashes.scale_factor * hash_block_size != block_size:
            raise AssertionError(
                f"block_hashes: expected a view of {block_size}-token blocks, got one of "
                f"{block_hashes.scale_factor * hash_block_size}-token blocks"
            )
        return block_hashes
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)
