"""The medium-independent types of KV-cache offloading (upstream v0.33's ``kv_offload.base``).

- Keys: an :data:`OffloadKey` names one offloaded block, a block hash plus its KV-cache group.
- Requests: :class:`ReqContext` (with per-request state and key positions),
  :class:`LookupResult`, :class:`RequestOffloadingContext`.
- Load/store specs: where a transfer reads or writes (:class:`LoadStoreSpec`; GPU pages are a
  :class:`GPULoadStoreSpec` of per-group block ids).
- :class:`OffloadingManager`: the scheduler-side bookkeeping of offloaded chunks.
- :class:`CanonicalKVCaches` (from :mod:`.canonical`): the worker's KV cache as byte pages.
- :class:`OffloadingWorker`: a medium's worker-side transfers; v0.22's
  :class:`OffloadingHandler` moves blocks between two media (jobs).
- :class:`OffloadingSpec`: one offloading medium: its manager and its worker.
- Metric and config-info records (from :mod:`.metrics`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, NewType, TypeVar

import numpy as np

from vllm.v1.core.block_hashing import (
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_offload.canonical import (
    CanonicalKVCacheRef,  # noqa: F401
    CanonicalKVCaches,
    CanonicalKVCacheTensor,  # noqa: F401
    CanonicalPageMapping,  # noqa: F401
    CopyRun,  # noqa: F401
)
from vllm.v1.kv_offload.config import OffloadingConfig

# Re-exported: upstream v0.33 defines these here.
from vllm.v1.kv_offload.metrics import (
    ConfigInfo,  # noqa: F401
    ConfigInfoMapping,  # noqa: F401
    OffloadingConnectorStats,  # noqa: F401
    OffloadingCounterMetadata,  # noqa: F401
    OffloadingGaugeMetadata,  # noqa: F401
    OffloadingHistogramMetadata,  # noqa: F401
    OffloadingKVEventsConfig,  # noqa: F401
    OffloadingMetricMetadata,  # noqa: F401
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_hints import KvHintsEnvelope


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


_T = TypeVar("_T")


class Medium(str, Enum):
    """Where an offloading tier keeps blocks (equal to its name, as v0.22's plain strings)."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(str, Enum):
    """Whether a tier's storage is this instance's own or shared with others."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class TierMatcher(NamedTuple):
    """Selects tiers by medium and locality; a None field (on either side) matches any."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        """Whether a tier of ``medium`` and ``locality`` (None: unknown) is selected."""
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True)
class TierFilter:
    """The tiers a request may use: those any of ``matchers`` selects (none: no tier).
    :attr:`ALL` allows every tier."""

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        """Whether a tier of ``medium`` and ``locality`` may serve the request."""
        return self is TierFilter.ALL or any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter(matchers=(TierMatcher(),))


@dataclass
class ReqContext:
    """What a manager may know of the request a call is made for.

    ``load_tier_filter`` selects the tiers the request may load from (all by default).
    Managers may keep per-request scratch state here, one value per type
    (:meth:`set_state` / :meth:`get_state`), and the scheduler records each key's end-token
    position (:meth:`set_offload_key_position`) so a manager can recover prefix order even
    when stores arrive out of order.
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: KvHintsEnvelope | None = None
    load_tier_filter: TierFilter = TierFilter.ALL
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[OffloadKey, int] = field(
        default_factory=dict, repr=False, init=False
    )

    def set_state(self, value: Any) -> None:
        """Keep ``value`` as this request's state of its type (replacing an older one)."""
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        """This request's state of type ``cls``, or None."""
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        """Record that ``key``'s block ends at token ``end_token`` of the request."""
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        """The end-token position recorded for ``key``, or None."""
        return self._offload_key_positions.get(key)


class LookupResult(Enum):
    """What :meth:`OffloadingManager.lookup` found: ``HIT`` (loadable now), ``MISS``,
    ``HIT_PENDING`` (held, its store still in flight) or ``RETRY`` (ask again later)."""

    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()
    RETRY = auto()


class OffloadPolicy(Enum):
    """Which of a request's chunks are offloaded: only newly computed ones (``CHUNK_LEVEL``)
    or all of them, prefix hits included (``REQUEST_LEVEL``)."""

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """A manager's answer to :meth:`OffloadingManager.on_new_request`."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class ScheduleEndContext(NamedTuple):
    """One scheduler step's new and preempted request ids."""

    new_req_ids: Collection[str]
    preempted_req_ids: Collection[str]


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
    """Keys that became loadable (``removed=False``) or were dropped from ``medium``.

    ``metadata_only`` marks the release of keys whose store failed (never announced as
    stored, so no public eviction); ``ownership`` names the secondary tier that emitted it
    (None: the primary tier).
    """

    keys: list[OffloadKey]
    medium: Medium | str
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False


class OffloadingManager(ABC):
    """Scheduler-side record of which blocks are offloaded, and where.

    A block is loadable after :meth:`complete_store`; blocks passed to :meth:`prepare_load`
    or :meth:`prepare_store` are protected from eviction until the matching ``complete_*``.
    Callers hold :attr:`lock` around every call but :meth:`shutdown` (across a ``lookup``
    hit and the ``prepare_load`` that pins it, say).
    """

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """Exclusive access to this manager's state; a no-op for managers entered from one
        thread only. Not reentrant in general."""
        return nullcontext()

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether ``key`` is offloaded and loadable (see :class:`LookupResult`)."""

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Which cache tier served ``key`` (asked only after :meth:`lookup` said ``HIT``);
        unknown unless a manager knows better."""
        return CacheHitSource.EXTERNAL_UNSPECIFIED

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

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """A request is first seen; says how its chunks are offloaded."""
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more ``prepare_*`` calls come for this request (completions still may)."""
        return

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call."""
        return ()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The last call of a scheduler step (deferred work may be flushed here)."""
        return

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping for this manager."""
        return False

    def reset_cache(self) -> None:
        """Forget every tracked block."""
        return

    def on_reset_flushed(self) -> None:
        """Workers finished every job in flight at the last :meth:`reset_cache`."""
        return

    def get_stats(self) -> OffloadingConnectorStats | None:
        """Observations since the last call, or None when not collected."""
        return None

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """The info-metric labels, one mapping per series (see :class:`ConfigInfo`)."""
        return [{}]

    def shutdown(self) -> None:
        """Release resources (called without :attr:`lock`)."""
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


class OffloadingWorker(ABC):
    """Worker-side transfers of one offloading medium, the direction given by the call:
    :meth:`submit_store` (GPU -> medium) or :meth:`submit_load` (medium -> GPU)."""

    @abstractmethod
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Start copying GPU pages out; True when submitted (never waits for the copy)."""

    @abstractmethod
    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Start copying into GPU pages; True when submitted. An ``expedited`` load is waited
        for within the step, so it should not queue behind other loads."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs that finished since the last call (each reported once)."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until ``job_ids`` have finished."""

    def shutdown(self) -> None:
        """Release resources."""
        return


class OffloadingSpec(ABC):
    """One offloading medium: the scheduler-side manager and the worker-side transfers.

    Built from an :class:`~vllm.v1.kv_offload.config.OffloadingConfig` (upstream v0.33), or
    the v0.22 way from ``(vllm_config, kv_cache_config)``, whose config is then derived by
    :func:`~vllm.v1.kv_offload.engine_config.offloading_config_from_engine` (those two stay
    readable as attributes; None for a config-built spec).

    - ``tokens_per_block`` (v0.22: ``gpu_block_size``): per cache group, tokens per GPU block
      across context-parallel ranks.
    - ``tokens_per_hash`` (v0.22: ``hash_block_size``): tokens per request block hash.
    - ``blocks_per_chunk`` (v0.22: ``block_size_factor``): GPU blocks per offloaded chunk.
    - ``offloaded_block_size`` (ours): tokens per chunk, of the largest GPU block size.
    - ``offload_prompt_only``: only prompt chunks are offloaded (``extra_config``, default on).
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """The metrics this spec's manager reports, by name."""
        return {}

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The info-metric label names the manager fills (see :class:`ConfigInfo`)."""
        return ()

    def __init__(
        self,
        config: OffloadingConfig | VllmConfig,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        # Imported here: the engine derivation reads page views, which import this module.
        from vllm.v1.kv_offload.engine_config import offloading_config_from_engine

        self.vllm_config: VllmConfig | None = None
        self.kv_cache_config: KVCacheConfig | None = kv_cache_config
        if isinstance(config, OffloadingConfig):
            if kv_cache_config is not None:
                raise TypeError(
                    "kv_cache_config: expected None with an OffloadingConfig, got a "
                    f"{type(kv_cache_config).__name__}"
                )
        elif kv_cache_config is None:
            raise TypeError(
                "kv_cache_config: expected a KVCacheConfig with a VllmConfig (v0.22 "
                f"construction), got None and a {type(config).__name__}"
            )
        else:
            self.vllm_config = config
            config = offloading_config_from_engine(config, kv_cache_config)
        self.config: OffloadingConfig = config
        self.extra_config: dict[str, Any] = dict(config.extra_config)
        self.replicated_layout: bool = False
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=config.enable_kv_cache_events,
            self_describing_kv_events=bool(self.extra_config.get("self_describing_kv_events")),
        )
        self.offload_prompt_only: bool = bool(self.extra_config.get("offload_prompt_only", True))
        self.tokens_per_block: tuple[int, ...] = tuple(g.tokens_per_block for g in config.groups)
        self.tokens_per_hash: int = config.cache.tokens_per_hash
        self.blocks_per_chunk: int = config.cache.blocks_per_chunk
        self.offloaded_block_size: int = self.blocks_per_chunk * max(
            self.tokens_per_block, default=self.tokens_per_hash
        )

    @property
    def gpu_block_size(self) -> tuple[int, ...]:
        """v0.22's name of :attr:`tokens_per_block`."""
        return self.tokens_per_block

    @property
    def hash_block_size(self) -> int:
        """v0.22's name of :attr:`tokens_per_hash`."""
        return self.tokens_per_hash

    @property
    def block_size_factor(self) -> int:
        """v0.22's name of :attr:`blocks_per_chunk`."""
        return self.blocks_per_chunk

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager of offloaded chunks (one per spec)."""

    def get_handlers(
        self, kv_caches: CanonicalKVCaches
    ) -> Iterator[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """v0.22: (source spec class, destination spec class, handler) for each direction the
        worker's ``kv_caches`` move in; none unless a spec offers them."""
        yield from ()

    @abstractmethod
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The worker-side transfers over ``kv_caches`` (one per spec)."""
