"""The HiSparse connector's scheduler side (upstream's
``vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector``).

Each step, :class:`HiSparseConnectorScheduler` runs the coordinator's residency work for the
scheduled requests and packs what the workers need into a
:class:`HiSparseConnectorMetadata`; the workers' :class:`HiSparseConnectorWorkerMetadata`
(summed over workers) comes back through :meth:`HiSparseConnectorScheduler.update_connector_output`.
The engine's connector base classes are not part of this library, so :class:`HiSparseConnector`
is a plain class with the scheduler role's methods of upstream's connector.

Units: token positions and counts in tokens; block ids index their own pool's pages.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.stats import (
    HiSparseKVConnectorStats,
    HiSparsePromMetrics,
)
from vllm.v1.core.kv_cache_block import KVCacheBlockCopy
from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
from vllm.v1.hisparse.types import (
    SparseKVOffloadCommand,
    SparseKVResidencyUpdate,
    SparseKVRowMirror,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "HiSparseConnector",
    "HiSparseConnectorMetadata",
    "HiSparseConnectorScheduler",
    "HiSparseConnectorWorkerMetadata",
]


@dataclass
class HiSparseConnectorMetadata:
    """One step's HiSparse work for the workers."""

    command: SparseKVOffloadCommand | None
    host_block_copies: tuple[KVCacheBlockCopy, ...]
    # Host pages newly given to the scheduled requests (the source group's block ids).
    source_block_ids: tuple[int, ...]
    row_mirrors: dict[str, tuple[SparseKVRowMirror, ...]]
    all_context_pages_resident: bool
    residency_updates: dict[str, SparseKVResidencyUpdate]


def _add_counts(first: dict[int, int], second: dict[int, int]) -> dict[int, int]:
    combined = dict(first)
    for transfer_id, count in second.items():
        combined[transfer_id] = combined.get(transfer_id, 0) + count
    return combined


@dataclass
class HiSparseConnectorWorkerMetadata:
    """Workers' reports: transfer id -> how many workers enqueued / completed it, and the
    destination ids of the host copies they ran."""

    enqueued_transfer_counts: dict[int, int]
    completed_transfer_counts: dict[int, int]
    completed_host_copy_dst_ids: tuple[int, ...] = ()

    def aggregate(self, other: HiSparseConnectorWorkerMetadata) -> HiSparseConnectorWorkerMetadata:
        """Sum two workers' reports. Every worker runs the same host copies, so their
        union is the acknowledgement."""
        if not isinstance(other, HiSparseConnectorWorkerMetadata):
            raise TypeError(
                f"other: expected HiSparseConnectorWorkerMetadata, got {type(other).__name__}"
            )
        return HiSparseConnectorWorkerMetadata(
            enqueued_transfer_counts=_add_counts(
                self.enqueued_transfer_counts, other.enqueued_transfer_counts
            ),
            completed_transfer_counts=_add_counts(
                self.completed_transfer_counts, other.completed_transfer_counts
            ),
            completed_host_copy_dst_ids=tuple(
                {*self.completed_host_copy_dst_ids, *other.completed_host_copy_dst_ids}
            ),
        )


class HiSparseConnectorScheduler:
    """Per-step glue between the scheduler and the HiSparse coordinator.

    ``async_speculative``: drafts of the previous step are still unresolved when this step
    is scheduled, so the host mirror also covers the positions they may have written.
    ``draft_kv_lookahead`` (tokens): KV the drafter writes past the scheduled tokens.
    """

    def __init__(self, *, async_speculative: bool, draft_kv_lookahead: int = 0) -> None:
        if isinstance(draft_kv_lookahead, bool) or not isinstance(draft_kv_lookahead, int):
            raise TypeError(f"draft_kv_lookahead: expected an int, got {draft_kv_lookahead!r}")
        if draft_kv_lookahead < 0:
            raise ValueError(f"draft_kv_lookahead: expected >= 0, got {draft_kv_lookahead}")
        self.coordinator: HiSparseCoordinator | None = None
        self.async_speculative = async_speculative
        self.draft_kv_lookahead = draft_kv_lookahead
        # The running requests, by id (their live token and placeholder counts are read).
        self.requests: dict[str, Request] = {}

    def bind_coordinator(self, coordinator: HiSparseCoordinator) -> None:
        if self.coordinator is not None:
            raise ValueError("coordinator: expected one binding, got a second")
        self.coordinator = coordinator

    def _bound(self) -> HiSparseCoordinator:
        if self.coordinator is None:
            raise ValueError("coordinator: expected bind_coordinator first, got None")
        return self.coordinator

    def get_kv_connector_stats(self) -> HiSparseKVConnectorStats | None:
        """The host tier's usage, transfers in flight and sampled evictions."""
        if self.coordinator is None:
            return None
        host_pool = self.coordinator.get_host_block_pool()
        if host_pool is None:
            return None
        stats = HiSparseKVConnectorStats()
        stats.record_host_usage(host_pool.get_usage(), len(self.coordinator.pending_spills))
        if host_pool.metrics_collector is not None:
            stats.record_host_evictions(host_pool.metrics_collector.drain_events())
        return stats

    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        """Run the step's residency work and pack it (``scheduler_output``: the engine's
        ``SchedulerOutput``)."""
        coordinator = self._bound()
        # The workers rebind their state every step, so loading must start before the
        # forward pass, never after it.
        scheduler_output.has_sync_kv_loads = True
        cached = scheduler_output.scheduled_cached_reqs
        start_of = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        start_of.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        scheduled = tuple(
            (request_id, start_of[request_id], count)
            for request_id, count in scheduler_output.num_scheduled_tokens.items()
        )
        # First: this plans the step's transfers and residency changes read below.
        coordinator.advance_scheduled(
            (request_id, min(start + count, self.requests[request_id].num_tokens))
            for request_id, start, count in scheduled
        )
        command = coordinator.build_offload_command()
        host_block_copies = coordinator.take_host_block_copies()
        source_group_id = coordinator.host_group_id
        if source_group_id is None:
            raise ValueError("coordinator.host_group_id: expected a source group, got None")
        source_block_ids = [
            block_id
            for request in scheduler_output.scheduled_new_reqs
            for block_id in request.block_ids[source_group_id]
        ]
        for new_block_ids in cached.new_block_ids:
            if new_block_ids is not None:
                source_block_ids.extend(new_block_ids[source_group_id])
        row_mirrors = {
            request_id: coordinator.build_row_mirrors((self._mirror_window(request_id, start, n),))
            for request_id, start, n in scheduled
        }
        return HiSparseConnectorMetadata(
            command,
            host_block_copies,
            tuple(source_block_ids),
            row_mirrors,
            coordinator.all_context_pages_resident(scheduled),
            coordinator.take_residency_updates(scheduler_output.num_scheduled_tokens),
        )

    def _mirror_window(self, request_id: str, start: int, count: int) -> tuple[str, int, int]:
        """The rows (start, count) this step may write: with async speculation it reaches
        back over the unresolved drafts, read live (acceptance lands between steps)."""
        mirror_start = start
        if self.async_speculative:
            placeholders = self.requests[request_id].num_output_placeholders
            mirror_start = max(0, start - placeholders)
        return request_id, mirror_start, count + start - mirror_start + self.draft_kv_lookahead

    def update_connector_output(self, connector_output: Any) -> None:
        """Take the workers' step output (the engine's ``KVConnectorOutput``)."""
        coordinator = self._bound()
        failed = connector_output.failed_recving or set()
        for request_id in connector_output.finished_recving or ():
            coordinator.finish_host_import(request_id, failed=request_id in failed)
        metadata = connector_output.kv_connector_worker_meta
        if metadata is None:
            return
        if not isinstance(metadata, HiSparseConnectorWorkerMetadata):
            raise TypeError(
                "connector_output.kv_connector_worker_meta: expected "
                f"HiSparseConnectorWorkerMetadata, got {type(metadata).__name__}"
            )
        coordinator.release_completed_host_copies(metadata.completed_host_copy_dst_ids)
        coordinator.update_spills(
            metadata.enqueued_transfer_counts, metadata.completed_transfer_counts
        )


def _is_scheduler_role(role: Any) -> bool:
    return str(getattr(role, "name", role)).upper() == "SCHEDULER"


class HiSparseConnector:
    """The scheduler role of upstream's HiSparse connector."""

    connector_scheduler: HiSparseConnectorScheduler | None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str:
        return "BLHNC"

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: KVCacheConfig) -> None:
        if kv_cache_config.hisparse_host_num_blocks is None:
            raise ValueError(
                "kv_cache_config.hisparse_host_num_blocks: expected a HiSparse host pool, got None"
            )
        if not _is_scheduler_role(role):
            raise ValueError(
                f"role: expected the scheduler role (this library has no HiSparse worker "
                f"connector), got {role!r}"
            )
        speculative = vllm_config.speculative_config is not None
        self.connector_scheduler = HiSparseConnectorScheduler(
            async_speculative=bool(vllm_config.scheduler_config.async_scheduling and speculative),
            # Older configs lack the property: no drafter lookahead then.
            draft_kv_lookahead=int(getattr(vllm_config, "num_lookahead_tokens", 0) or 0),
        )

    def _scheduler(self) -> HiSparseConnectorScheduler:
        if self.connector_scheduler is None:
            raise ValueError("connector_scheduler: expected the scheduler role, got None")
        return self.connector_scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        self._scheduler().bind_coordinator(get_hisparse_coordinator(kv_cache_manager))

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def has_pending_push_work(self) -> bool:
        return self._scheduler()._bound().has_pending_work()

    def has_pending_block_frees(self) -> bool:
        return self._scheduler()._bound().has_pending_reclamation()

    def get_kv_connector_stats(self) -> HiSparseKVConnectorStats | None:
        return self._scheduler().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> HiSparseKVConnectorStats | None:
        return HiSparseKVConnectorStats() if data is None else HiSparseKVConnectorStats(data=data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> HiSparsePromMetrics:
        """The connector's Prometheus metrics (the engine's ``KVConnectorProm`` asks)."""
        return HiSparsePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """HiSparse loads nothing from outside: its host tier is the prefix cache."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        self._scheduler().requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def request_finished_all_groups(
        self, request: Request, block_ids: Iterable[list[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its pages are freed at once (nothing is sent)."""
        self._scheduler().requests.pop(request.request_id, None)
        return False, None
