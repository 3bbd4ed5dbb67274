"""The secondary-tier interface (upstream v0.22's ``kv_offload.tiering.base``).

A secondary tier never touches GPU memory: stores copy primary-tier (CPU) rows into the tier
after the GPU -> CPU store completed (a cascade), loads copy tier blocks into freshly allocated
primary rows (a promotion) before the CPU -> GPU load. Rows are addressed through a memoryview
of the primary tier's buffer, row ``b`` being offloaded block ``b``. Every method runs in the
scheduler and must return quickly; copies happen elsewhere and are reported by
:meth:`SecondaryTierManager.get_finished`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vllm.v1.kv_offload.base import Medium, OffloadKey, ReqContext
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

_MEDIUM_HIT_SOURCE = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}

JobId = int
"""Identifies one asynchronous transfer between the primary tier and a secondary tier."""


@dataclass
class JobMetadata:
    """One transfer: ``keys[i]`` moves from / to primary row ``block_ids[i]``;
    ``is_promotion`` is True for secondary -> primary, False for primary -> secondary."""

    job_id: JobId
    keys: Collection[OffloadKey]
    block_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext


@dataclass
class JobResult:
    """A finished transfer; ``success`` is False if any of its blocks failed."""

    job_id: JobId
    success: bool


class SecondaryTierManager(ABC):
    """One secondary tier, as the tiering manager drives it.

    The primary rows of a submitted job stay reserved (not evicted, not reused) until the job
    is reported finished.

    ``medium``: where the tier keeps blocks (``None``: unknown, e.g. a remote store); hits it
    serves count as ``cache_hit_source``, derived from ``medium`` unless a subclass sets it.
    """

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cache_hit_source" not in cls.__dict__ and cls.medium is not None:
            cls.cache_hit_source = _MEDIUM_HIT_SOURCE[cls.medium]

    def __init__(
        self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str
    ) -> None:
        self._offloading_spec = offloading_spec
        self._primary_kv_view: memoryview = primary_kv_view
        self.tier_type = tier_type

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True: ``key`` is held and readable; False: not held; None: busy, ask again."""

    @abstractmethod
    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Start copying the job's primary rows into this tier (skipping keys held already,
        evicting as the tier needs); returns at once."""

    @abstractmethod
    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Start copying the job's keys from this tier into its primary rows; returns at once."""

    @abstractmethod
    def get_finished(self) -> Iterable[JobResult]:
        """The jobs, loads and stores, that finished since the previous call."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """``keys`` were used now (for the tier's eviction order)."""
        return

    def shutdown(self) -> None:
        """Release the tier's threads, files or connections."""
        return
