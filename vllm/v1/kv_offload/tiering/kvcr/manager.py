"""The KVCR secondary tier (upstream v0.33's ``kv_offload.tiering.kvcr.manager``).

KVCR (the ``kvcr`` package, "KV Cache Runner") moves KV blocks between this engine's primary
(CPU) tier and other places: peer engines' primary tiers (remote G2), DRAM it owns (local G2)
and files (G3). This tier is the adapter: loads become KVCR ``deliver`` operations into primary
rows, stores become ``deposit`` operations out of them, peers' requests to read our primary
tier become pinned store jobs (:mod:`.pins`), and router hints attached to a request are
handed to KVCR, which uses them to find where a prefix lives.

KVCR registers the primary tier's memory (and its own DRAM) with native transfer engines.
If its start-up fails in a way that may leave native work running, those buffers are kept
exported for the life of the process (:data:`_RETAINED_NATIVE_BUFFERS`) so nothing can unmap
memory a transfer may still write.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
from kvcr import KVCR, KVCRBindings
from kvcr.config import (
    KVCRBackendConfigs,
    KVCRConfig,
    KVCRGuardConfig,
    LocalDramOptions,
    RemoteFWDramOptions,
)
from kvcr.control_channels import ZmqPeerControlChannel
from kvcr.types import (
    CacheTier,
    InventoryEvent,
    KVCRStartupError,
    MemoryRef,
    OpHandle,
    QueryStatus,
    RegionDescriptor,
)

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ParentManager,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.kv_offload.tiering.kvcr import settings
from vllm.v1.kv_offload.tiering.kvcr.pins import FrameworkPinServer

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

# Buffer exports kept after a start-up (or close) failure that may leave native transfers
# running: an export makes the buffer's owner refuse to unmap it (BufferError) and keeps it
# alive, for the rest of the process.
_RETAINED_NATIVE_BUFFERS: list[object] = []

# FETCHABLE: a peer holds it, the load pulls it over; FETCHING: on its way, ask again.
_LOOKUP_RESULTS = {
    QueryStatus.HIT: LookupResult.HIT,
    QueryStatus.FETCHABLE: LookupResult.HIT,
    QueryStatus.FETCHING: LookupResult.RETRY,
    QueryStatus.MISS: LookupResult.MISS,
}
# The tiers whose inventory KVCR owns on this host, as the medium events publish.
_INVENTORY_MEDIA = {CacheTier.LOCAL_G2: Medium.CPU, CacheTier.G3: Medium.STORAGE}
_OWNERSHIP = "kvcr"
# The single pool of fixed-size blocks this tier registers (KVCR allows named pools).
_POOL = ""
_DRAIN_POLL_S = 0.001


def _buffer_address(name: str, buffer: Any) -> int:
    """The address of writable ``buffer`` (its temporary export is released on return)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a writable, non-empty buffer, got {buffer!r}") from exc


def _retain_native_buffers(*buffers: Any) -> None:
    """Keep an export of each buffer (None skipped) until the process exits."""
    _RETAINED_NATIVE_BUFFERS.extend(
        ctypes.c_char.from_buffer(buffer) for buffer in buffers if buffer is not None
    )


def _free_tcp_port() -> int:
    """A port free now, so that engines on one host give KVCR distinct listen ports."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@dataclass
class _Operation:
    """A submitted KVCR operation: the job it serves and what its block results added up to.
    ``loaded`` (loads only) collects the keys that arrived, for a partial failure."""

    job_id: int
    remaining: int
    success: bool = True
    loaded: set[OffloadKey] | None = None


class KVCRSecondaryTierManager(SecondaryTierManager):
    """A secondary tier backed by KVCR (peer engines' DRAM, KVCR's own DRAM, G3 files).

    Config keys (the tier's constructor arguments): ``router_capabilities`` (must include
    ``"router_hint"``), ``control_host`` / ``control_ports`` (one per local data-parallel rank)
    / ``control_advertise_host`` (KVCR's peer control channel), ``eager_ctrl_connect``,
    ``opportunistic_query``, ``metadata_retry_interval_ms`` and ``remote_fw_dram_backend``
    (peer reads), ``operation_timeout_ms`` / ``abandon_timeout_ms``, ``enable_telemetry``,
    ``secondary_g2_slots`` (blocks of local DRAM KVCR owns) and ``local_dram_backend``,
    ``kvcr_service_socket_path`` + ``compatibility_digest`` (a KVCR service owns the local
    DRAM instead), ``policy`` (placement policy) and ``g3`` (file storage).
    """

    # KVCR's own thread answers peers; the tier is served once per step only, as KVCR is not
    # known to tolerate being polled from the tiering manager's poll thread too.
    tolerates_off_thread_polling: ClassVar[bool] = False

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """KVCR's metrics, when ``enable_telemetry`` is set; none otherwise."""
        if not extra_config.get("enable_telemetry", False):
            return {}
        return settings.kvcr_metric_definitions()

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        router_capabilities: Iterable[str] | None = None,
        control_host: str = "0.0.0.0",
        control_ports: list[int] | None = None,
        control_advertise_host: str | None = None,
        eager_ctrl_connect: bool = True,
        opportunistic_query: bool = True,
        enable_telemetry: bool = False,
        operation_timeout_ms: int = 1000,
        abandon_timeout_ms: int = 5000,
        metadata_retry_interval_ms: int = 100,
        secondary_g2_slots: int = 0,
        kvcr_service_socket_path: str | None = None,
        compatibility_digest: str | None = None,
        policy: str | None = None,
        g3: dict[str, Any] | None = None,
        local_dram_backend: str = "UCX",
        remote_fw_dram_backend: str = "UCX",
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        # Everything is checked before a socket, a mapping or KVCR exists.
        selected_policy = settings.resolve_policy(policy)
        settings.check_service_pair(kvcr_service_socket_path, compatibility_digest)
        settings.check_router_capabilities(router_capabilities)
        slots = settings.check_int("secondary_g2_slots", secondary_g2_slots, 0)
        for name, value in (
            ("operation_timeout_ms", operation_timeout_ms),
            ("abandon_timeout_ms", abandon_timeout_ms),
            ("metadata_retry_interval_ms", metadata_retry_interval_ms),
        ):
            settings.check_int(name, value, 1)
        uses_service = kvcr_service_socket_path is not None
        events = offloading_spec.kv_events_config
        settings.check_inventory_events(events, bool(slots) or uses_service or g3 is not None)
        dp_rank_local = offloading_spec.config.parallel.data_parallel_rank_local
        control_port = settings.select_control_port(control_ports, dp_rank_local)
        g3_config = settings.g3_options(g3)
        primary_address = _buffer_address("primary_kv_view", primary_kv_view)

        if slots and uses_service:
            logger.warning(
                "KVCR tier: secondary_g2_slots is ignored, the KVCR service at %s owns the "
                "local DRAM",
                kvcr_service_socket_path,
            )
            slots = 0
        if (slots or uses_service) and not events.enable_kv_cache_events:
            logger.warning(
                "KVCR tier: KV cache events are off, so blocks in KVCR's local DRAM are not "
                "published"
            )
        guard_config = None
        if kvcr_service_socket_path is not None and compatibility_digest is not None:
            guard_config = KVCRGuardConfig(
                kvcr_service_socket_path=kvcr_service_socket_path,
                guard_index=dp_rank_local or 0,
                compatibility_digest=compatibility_digest,
            )

        self._agent_name = f"KVCR-{uuid.uuid4()}"
        self._key_adapter = settings.VllmKeyAdapter()
        self._pins = FrameworkPinServer(self._make_ref)
        # Filled by KVCR's thread, taken by the scheduler's.
        self._events_lock = threading.Lock()
        self._inventory_events: list[OffloadingEvent] = []
        self._finished_jobs: list[JobResult] = []
        self._operations: dict[OpHandle, _Operation] = {}

        with ExitStack() as cleanup:
            local_dram = None
            local_mapping = None
            if slots:
                local_mapping = mmap.mmap(-1, slots * self.block_size_bytes)
                cleanup.callback(local_mapping.close)
                local_dram = LocalDramOptions(
                    pools=[
                        (
                            _POOL,
                            _buffer_address("secondary_g2_slots mapping", local_mapping),
                            len(local_mapping),
                        )
                    ],
                    backend=local_dram_backend,
                )
            control = ZmqPeerControlChannel(
                control_host, control_port, control_advertise_host or socket.gethostname()
            )
            cleanup.callback(control.close)
            try:
                self._kvcr = KVCR(
                    KVCRConfig(
                        nixl_agent_name=self._agent_name,
                        pool_layouts=[(_POOL, self.block_size_bytes)],
                        enable_telemetry=enable_telemetry,
                        operation_timeout_ms=operation_timeout_ms,
                        abandon_timeout_ms=abandon_timeout_ms,
                        nixl_listen_port=_free_tcp_port(),
                    ),
                    KVCRBindings(
                        request_pin=self._pins.request_pin,
                        poll_pin_results=self._pins.poll_pin_results,
                        release_pin=self._pins.release_pin,
                        cancel_pin_request=self._pins.cancel_pin_request,
                        framework_control=control,
                        key_adapter=self._key_adapter,
                        inventory_sink=(
                            self._record_inventory if events.enable_kv_cache_events else None
                        ),
                        stats_factory=OffloadingConnectorStats if enable_telemetry else None,
                        policy=selected_policy,
                    ),
                    KVCRBackendConfigs(
                        framework_regions=[
                            RegionDescriptor(
                                addr=primary_address,
                                size=self.block_size_bytes,
                                count=len(primary_kv_view),
                            )
                        ],
                        local_dram=local_dram,
                        g3=g3_config,
                        remote_fw_dram=RemoteFWDramOptions(
                            eager_ctrl_connect=eager_ctrl_connect,
                            opportunistic_query=opportunistic_query,
                            metadata_retry_interval_ms=metadata_retry_interval_ms,
                            backend=remote_fw_dram_backend,
                        ),
                    ),
                    guard_config,
                )
            except BaseException as exc:
                # KVCRStartupError, or an interrupt mid start-up: native work may go on.
                if isinstance(exc, KVCRStartupError) or not isinstance(exc, Exception):
                    _retain_native_buffers(primary_kv_view, local_mapping)
                    cleanup.pop_all()
                raise
            cleanup.pop_all()
        self._local_mapping: mmap.mmap | None = local_mapping

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when KVCR holds ``key`` or a peer does, RETRY while it is being fetched."""
        status, _ = self._kvcr.query((self._key_adapter.encode(key),), req_context.req_id)[0]
        return _LOOKUP_RESULTS[status]

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Start delivering the job's blocks into its primary rows (a KVCR ``deliver``)."""
        self._submit(job_metadata, is_load=True)

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Start depositing the job's primary rows into KVCR (a KVCR ``deposit``)."""
        self._submit(job_metadata, is_load=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the previous call: loads, stores and released pins."""
        results, self._finished_jobs = self._finished_jobs, []
        results.extend(self._poll_finished_jobs())
        return results

    def get_stats(self) -> OffloadingConnectorStats | None:
        """KVCR's telemetry since the previous call, its metrics renamed into ``vllm:``."""
        stats = self._kvcr.get_stats()
        if stats is None:
            return None
        for section in stats.metric_sections():
            for name in list(section):
                section[settings.vllm_metric_name(name)] = section.pop(name)
        return stats

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer the pin requests KVCR queued for peers reading our primary tier."""
        self._pins.serve(parent)

    def has_pending_work(self) -> bool:
        """Always: peers' control messages and pin requests arrive without any job here."""
        return True

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Inventory events of KVCR's local DRAM and G3 since the previous call."""
        with self._events_lock:
            events, self._inventory_events = self._inventory_events, []
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Hand the request's router hints (if any) to KVCR as plain values."""
        if req_context.kv_hints is not None:
            self._kvcr.submit_hint(
                request_id=req_context.req_id, hints=msgspec.to_builtins(req_context.kv_hints)
            )
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop KVCR's hints of the request."""
        self._kvcr.discard_hint(req_context.req_id)

    def drain_jobs(self) -> None:
        """Wait until every operation and every granted pin has finished (KVCR's operation
        timeouts bound the wait); their results go to the next :meth:`get_finished_jobs`."""
        while self._operations or self._pins.has_active_pins():
            results = self._poll_finished_jobs()
            if results:
                self._finished_jobs.extend(results)
            else:
                time.sleep(_DRAIN_POLL_S)

    def shutdown(self) -> None:
        """Drain, stop KVCR and unmap the local DRAM. If KVCR fails to stop, the buffers it
        registered stay exported for the life of the process."""
        self.drain_jobs()
        try:
            self._kvcr.close()
        except BaseException:
            _retain_native_buffers(self._primary_kv_view, self._local_mapping)
            self._local_mapping = None
            raise
        if self._local_mapping is not None:
            self._local_mapping.close()
            self._local_mapping = None

    def _submit(self, job: TransferJob, *, is_load: bool) -> None:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(
                f"job_metadata.chunk_ids: expected one row per key ({len(keys)}), got "
                f"{len(job.chunk_ids)}"
            )
        blocks = {
            self._key_adapter.encode(key): [self._make_ref(int(row))]
            for key, row in zip(keys, job.chunk_ids, strict=True)
        }
        if not blocks:
            self._finished_jobs.append(JobResult(job_id=job.job_id, success=True))
            return
        if is_load:
            op = self._kvcr.deliver(blocks, request_id=job.req_context.req_id)
        else:
            op = self._kvcr.deposit(blocks)
        self._operations[op] = _Operation(
            job.job_id, len(blocks), loaded=set() if is_load else None
        )

    def _poll_finished_jobs(self) -> list[JobResult]:
        """Fold KVCR's block results into their jobs; the jobs all of whose blocks reported,
        then the pin jobs that ended."""
        results: list[JobResult] = []
        for op, entries in self._kvcr.poll_completed():
            operation = self._operations.get(op)
            if operation is None:
                # Not submitted by this tier: no job waits for it.
                continue
            operation.remaining -= len(entries)
            for key, entry in entries.items():
                if not entry.success:
                    operation.success = False
                elif operation.loaded is not None:
                    operation.loaded.add(OffloadKey(bytes(key)))
            if operation.remaining > 0:
                continue
            del self._operations[op]
            # On a partial load failure the keys that did arrive are kept.
            partial = None if operation.success else (operation.loaded or None)
            results.append(
                JobResult(
                    job_id=operation.job_id, success=operation.success, successful_keys=partial
                )
            )
        results.extend(self._pins.take_job_results())
        return results

    def _record_inventory(self, event: InventoryEvent) -> None:
        """KVCR's inventory sink (called on its thread): queue the event for the publisher."""
        medium = _INVENTORY_MEDIA.get(event.tier)
        if medium is None:
            raise ValueError(
                f"event.tier: expected one of {[tier.name for tier in _INVENTORY_MEDIA]}, got "
                f"{event.tier}"
            )
        published = OffloadingEvent(
            keys=[OffloadKey(bytes(key)) for key in event.keys],
            medium=medium,
            removed=event.removed,
            ownership=_OWNERSHIP,
            removal_expected=True,
        )
        with self._events_lock:
            self._inventory_events.append(published)

    def _make_ref(self, row: int) -> MemoryRef:
        """KVCR's reference to primary-tier row ``row``."""
        return MemoryRef(end_point_name=self._agent_name, element_index=row)
