"""The medium-independent types of KV-cache offloading (upstream v0.22's ``kv_offload.base``).

- Keys: an :data:`OffloadKey` names one offloaded block, a block hash plus its KV-cache group.
- Load/store specs: where a transfer reads or writes (:class:`LoadStoreSpec`; GPU pages are a
  :class:`GPULoadStoreSpec` of per-group block ids).
- :class:`OffloadingManager`: the scheduler-side bookkeeping of offloaded blocks.
- :class:`CanonicalKVCaches`: the worker's KV cache as byte pages, what handlers copy.
- :class:`OffloadingHandler`: moves blocks between two media asynchronously (jobs).
- :class:`OffloadingSpec`: one offloading medium: its manager and its handlers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NewType

import numpy as np
import torch

from vllm.utils import check_positive_int
from vllm.v1.core.block_hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


OffloadKey = NewType("OffloadKey", bytes)
"""One offloaded block: its block hash followed by its KV-cache group index (4 bytes,
big-endian), the same bytes as the device prefix cache's ``BlockHashWithGroupId`` so a block has
one key on every medium. Plain bytes, so keys hash and compare cheaply."""


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """The key of block ``block_hash`` of KV-cache group ``group_idx``."""
    return OffloadKey(make_block_hash_with_group_id(BlockHash(bytes(block_hash)), group_idx))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash part of ``key``."""
    return get_block_hash(BlockHashWithGroupId(key))


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index part of ``key``."""
    return get_group_id(BlockHashWithGroupId(key))


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


TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""(source, destination) of one transfer job."""

TransferType = tuple[str, str]
"""(source medium, destination medium), e.g. ``("GPU", "CPU")``."""


@dataclass
class TransferResult:
    """Outcome of one finished job.

    ``transfer_size`` is in bytes (every page moved, all tensors); ``transfer_time`` in
    seconds, when the handler measures it.
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: TransferType | None = None


class OffloadingHandler(ABC):
    """Moves blocks between two media asynchronously."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit job ``job_id`` without waiting for the copy; True when submitted."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs that finished since the last call (each reported once)."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until those of ``job_ids`` this handler runs have finished; their results
        are still reported by the next :meth:`get_finished`."""

    def shutdown(self) -> None:
        """Release resources (threads, streams)."""
        return


class OffloadingSpec(ABC):
    """How a worker's KV cache is offloaded: the scheduler-side manager and the worker-side
    handlers of one offloading medium.

    Reads ``vllm_config.kv_transfer_config.kv_connector_extra_config`` (any object with that
    mapping, e.g. :class:`~vllm.config.kv_transfer.KVTransferConfig`), the context-parallel
    sizes of ``vllm_config.parallel_config`` and ``vllm_config.cache_config``.

    - ``gpu_block_size``: per KV-cache group, its block size × dcp × pcp (tokens).
    - ``hash_block_size``: the tokens per request block hash, from
      :func:`~vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes`; every GPU block size
      must be a multiple (else ``ValueError``: ``gpu_block_size=<b> not divisible by
      hash_block_size=<h>``; hybrid models need ``--enable-prefix-caching``).
    - ``block_size_factor``: GPU blocks per offloaded block. ``extra_config["block_size"]``
      (tokens; needs one GPU block size, of which it is a multiple) or, ours,
      ``extra_config["block_size_factor"]``; default 1.
    - ``offloaded_block_size`` (ours): tokens per offloaded block, the largest GPU block size
      times the factor.

    One GPU block id indexes one page of every KV-cache tensor, whatever the group's block
    size, so with mixed GPU block sizes an offloaded block mirrors one GPU block id.
    """

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError("vllm_config.kv_transfer_config: offloading needs one, got None")
        self.extra_config: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        cp = parallel.decode_context_parallel_size * parallel.prefill_context_parallel_size
        self.gpu_block_size: tuple[int, ...] = tuple(
            group.kv_cache_spec.block_size * cp for group in kv_cache_config.kv_cache_groups
        )
        _, self.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        for size in self.gpu_block_size:
            if size % self.hash_block_size:
                raise ValueError(
                    f"gpu_block_size={size} not divisible by "
                    f"hash_block_size={self.hash_block_size}. Hybrid models (e.g. "
                    "Mamba+Attention) need --enable-prefix-caching to align block sizes."
                )
        self.block_size_factor: int = self._block_size_factor()
        self.offloaded_block_size: int = self.block_size_factor * max(
            self.gpu_block_size, default=self.hash_block_size
        )

    def _block_size_factor(self) -> int:
        size = self.extra_config.get("block_size")
        factor = self.extra_config.get("block_size_factor")
        if size is None and factor is None:
            return 1
        sizes = set(self.gpu_block_size)
        if len(sizes) != 1:
            raise ValueError(
                "extra_config: 'block_size' / 'block_size_factor' need at least one KV-cache "
                f"group and one GPU block size for all groups, got {list(self.gpu_block_size)}"
            )
        (gpu,) = sizes
        if factor is not None:
            factor = check_positive_int("extra_config['block_size_factor']", int(factor))
        if size is not None:
            size = check_positive_int("extra_config['block_size']", int(size))
            if size % gpu:
                raise ValueError(
                    f"extra_config['block_size']: {size} tokens is not a multiple of the GPU "
                    f"block size {gpu}"
                )
            if factor is not None and factor != size // gpu:
                raise ValueError(
                    f"extra_config: block_size={size} disagrees with "
                    f"block_size_factor={factor} x GPU block size {gpu}"
                )
            factor = size // gpu
        assert factor is not None
        return factor

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager of offloaded blocks (one per spec)."""

    @abstractmethod
    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """(source spec class, destination spec class, handler) for each direction the
        worker's ``kv_caches`` move in."""
