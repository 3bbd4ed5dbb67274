"""Load/store specs that address media by block ids."""

from __future__ import annotations

from abc import ABC
from collections.abc import Iterable

import numpy as np

from vllm.v1.kv_offload.abstract import LoadStoreSpec


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A list of block ids in one medium, in transfer order.

    ``block_ids`` is stored as a 1-D ``np.int64`` array. What one block is depends on the medium:
    a GPU block is one page of every registered KV-cache tensor (the block size of the group
    using the tensor, in tokens; groups may differ); a CPU block is one offloaded block
    (``block_size_factor`` GPU pages of every tensor; the factor is 1 when groups differ in
    block size, see :class:`~vllm.v1.kv_offload.spec.OffloadingSpec`).
    """

    def __init__(self, block_ids: Iterable[int] | np.ndarray):
        ids = np.asarray(block_ids if isinstance(block_ids, np.ndarray) else list(block_ids))
        if ids.size == 0:
            ids = ids.astype(np.int64)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"block_ids: expected a 1-D sequence of ints, got dtype {ids.dtype} and "
                f"shape {ids.shape}"
            )
        self.block_ids: np.ndarray = ids.astype(np.int64, copy=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_ids={self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU KV-cache block ids (pages of the worker's KV cache)."""

    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """Offloaded block ids in the CPU-side buffers."""

    @staticmethod
    def medium() -> str:
        return "CPU"


BlockHash = bytes | int
"""A block's content hash (upstream's ``BlockHash`` is ``bytes``; ints are accepted too)."""


def block_hash_hex(block_hash: BlockHash) -> str:
    """The hash as hex text, for keys (``ValueError`` for other types)."""
    if isinstance(block_hash, (bytes, bytearray)):
        if not block_hash:
            raise ValueError("block_hashes: expected non-empty bytes, got b''")
        return bytes(block_hash).hex()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return format(block_hash, "x")
    raise ValueError(f"block_hashes: expected bytes or int hashes, got {type(block_hash).__name__}")


class MooncakeLoadStoreSpec(LoadStoreSpec):
    """Offloaded blocks in a Mooncake distributed store, addressed by block hash.

    The key of a block is its hash plus the fingerprint of the page format
    (:class:`~vllm.v1.kv_offload.page_format.KVPageFormat`), so blocks of another model,
    format or geometry never match.
    """

    def __init__(self, block_hashes: Iterable[BlockHash]):
        self.block_hashes: tuple[BlockHash, ...] = tuple(block_hashes)
        self.hash_hex: tuple[str, ...] = tuple(block_hash_hex(h) for h in self.block_hashes)

    @staticmethod
    def medium() -> str:
        return "MOONCAKE"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_hashes={list(self.hash_hex)})"
