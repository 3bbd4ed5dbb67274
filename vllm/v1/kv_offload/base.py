"""The medium-independent types of KV-cache offloading (upstream v0.22's ``kv_offload.base``).

- Keys: an :data:`OffloadKey` names one offloaded block, a block hash plus its KV-cache group.
- Load/store specs: where a transfer reads or writes (:class:`LoadStoreSpec`; GPU pages are a
  :class:`GPULoadStoreSpec` of per-group block ids).
- :class:`OffloadingManager`: the scheduler-side bookkeeping of offloaded blocks.
- :class:`CanonicalKVCaches`: the worker's KV cache as byte pages, what handlers copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np
import torch

OffloadKey = NewType("OffloadKey", bytes)
"""One offloaded block: its block hash followed by its KV-cache group index (4 bytes,
big-endian). Plain bytes, so keys hash and compare cheaply."""

_GROUP_IDX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """The key of block ``block_hash`` of KV-cache group ``group_idx``."""
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash part of ``key``."""
    return key[:-_GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index part of ``key``."""
    return int.from_bytes(key[-_GROUP_IDX_BYTES:], "big")


@dataclass
class ReqContext:
    """What a manager may know of the request a call is made for."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None


class LoadStoreSpec(ABC):
    """Where a transfer reads from or writes to: a medium plus addresses in it."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """Name of the medium this spec addresses (e.g. ``"GPU"``, ``"CPU"``)."""


@dataclass
class PrepareStoreOutput:
    """What :meth:`OffloadingManager.prepare_store` decided: the keys to write (those not
    offloaded already), where to write them, and the keys evicted to make room."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Keys that became loadable (``removed=False``) or were dropped from ``medium``."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """Scheduler-side record of which blocks are offloaded, and where.

    A block is loadable after :meth:`complete_store`; blocks passed to :meth:`prepare_load`
    or :meth:`prepare_store` are protected from eviction until the matching ``complete_*``.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True when ``key`` is offloaded and loadable, False when not, None to ask again
        later (the scheduler then delays the request)."""

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin the (offloaded) ``keys`` for reading; the spec locates their data."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used (also those the GPU prefix cache serves)."""
        return

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin keys of an earlier :meth:`prepare_load`."""
        return

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve room for ``keys`` (evicting others if needed); None when they cannot be
        stored."""

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Make stored ``keys`` loadable; with ``success=False`` drop those not yet stored."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call."""
        return ()

    def reset_cache(self) -> None:
        """Forget every tracked block."""
        return

    def shutdown(self) -> None:
        """Release resources."""
        return


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """Block ids of one medium, in transfer order, as a 1-D ``np.int64`` array."""

    def __init__(self, block_ids: list[int]):
        ids = np.asarray(block_ids)
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
    """GPU block ids, grouped by KV-cache group.

    ``block_ids`` lists group 0's ids, then group 1's, ...: ``group_sizes[g]`` ids each. A
    group's ids are logically consecutive blocks of a request, the first being the request's
    block ``block_indices[g]`` (in GPU blocks); with offloaded blocks larger than GPU blocks
    that index says where in the first offloaded block the group starts.
    """

    def __init__(
        self,
        block_ids: list[int],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ):
        super().__init__(block_ids)
        if sum(group_sizes) != len(self.block_ids) or len(block_indices) != len(group_sizes):
            raise ValueError(
                f"group_sizes/block_indices: expected one entry per group with group sizes "
                f"summing to {len(self.block_ids)} block ids, got group_sizes="
                f"{list(group_sizes)}, block_indices={list(block_indices)}"
            )
        self.group_sizes: Sequence[int] = group_sizes
        self.block_indices: Sequence[int] = block_indices

    @staticmethod
    def medium() -> str:
        return "GPU"


@dataclass
class CanonicalKVCacheTensor:
    """One KV-cache buffer as ``(num_blocks, ...)`` pages of ``page_size_bytes`` (padding
    included) each."""

    tensor: torch.Tensor
    page_size_bytes: int


@dataclass
class CanonicalKVCacheRef:
    """A group's use of ``tensors[tensor_idx]``; ``page_size_bytes`` is the layers' own
    (unpadded) page size."""

    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalKVCaches:
    """A worker's KV cache as distinct page tensors, and per KV-cache group the tensors its
    layers live in."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]
