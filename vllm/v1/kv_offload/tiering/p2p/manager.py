"""The peer-to-peer secondary tier (upstream v0.33's ``tiering.p2p.manager``).

Engines exchange KV blocks directly: a consumer (a PD decoder, or a symmetric-P2P peer) loads
a request's blocks from the producer that computed them. The producer keeps the blocks it
stores for a ``kv_request_id`` until the consumer fetches that id; the fetch binds the id to
the consumer's session, which WRITEs the blocks into the consumer's primary tier over the data
plane (NIXL). One :class:`P2PSession` per peer carries both directions over one control
connection (ZeroMQ). Session bookkeeping is in :mod:`.manager_peers`; request parsing and
settings in :mod:`.manager_params`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override

import vllm.envs as envs
from vllm.v1.core.kv_cache_utils import get_none_hash_seed
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.p2p.control import ControlTransport, ZmqTransport
from vllm.v1.kv_offload.tiering.p2p.data import DataTransport, NixlTransport
from vllm.v1.kv_offload.tiering.p2p.manager_params import (
    P2PDestInfo,
    P2PSourceInfo,
    _annotate_req_context,
    _peer_id_from_params,
    _UnboundStoreBatch,
)
from vllm.v1.kv_offload.tiering.p2p.manager_peers import (
    _RECONNECT_MAX_BACKOFF_S,
    _PeerSessionsMixin,
    logger,
)
from vllm.v1.kv_offload.tiering.p2p.session import P2PSession
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.base import ParentManager
    from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection

__all__ = [
    "_RECONNECT_MAX_BACKOFF_S",
    "_UNBOUND_STORE_TIMEOUT_S",
    "P2PDestInfo",
    "P2PSecondaryTierManager",
    "P2PSourceInfo",
    "_UnboundStoreBatch",
    "_annotate_req_context",
    "_peer_id_from_params",
]

# Seconds a producer keeps stored blocks for a consumer that has not fetched them (the
# ``unbound_store_timeout_s`` tier setting); once fetched, the session's own timeout applies.
_UNBOUND_STORE_TIMEOUT_S = 60.0

# Seconds shutdown waits for in-flight WRITEs to stop before releasing them regardless (a
# wedged peer must not hang shutdown).
_SHUTDOWN_DRAIN_TIMEOUT_S = 3.0

# Seconds between rounds of the drain loops (short for latency, nonzero to not spin).
_DRAIN_SLEEP_S = 0.001

# Seconds of draining after which drain_jobs warns that a transfer looks stuck.
_DRAIN_WARN_S = 5.0

_BACKPRESSURE_UNSUPPORTED = (
    "Backpressure is not supported for the P2P secondary tier: its store-latency detector "
    "cannot fail a PD decoder fast, and rendezvous time makes store latency no pressure "
    "signal. Remove the 'backpressure' setting from the p2p tier."
)


class P2PSecondaryTierManager(_PeerSessionsMixin, SecondaryTierManager):
    """Secondary tier whose blocks live in other engines' primary tiers.

    Settings (the tier's ``secondary_tiers`` entry): ``host`` / ``port``: the control socket's
    address, used verbatim as this node's identity to peers (default
    ``VLLM_P2P_SIDE_CHANNEL_HOST`` / ``VLLM_P2P_SIDE_CHANNEL_PORT``: ``localhost:5710``); the
    data-parallel index is added to the port. ``backends`` / ``num_threads``: NIXL's (see
    :class:`NixlTransport`). ``unbound_store_timeout_s``: seconds stored blocks wait for their
    consumer's fetch (> 0). Store back-pressure is not supported (``ValueError``).

    Polled from the tier-poll thread too (peers are not driven by this engine's steps), and
    :meth:`has_pending_work` is always true so that the engine keeps polling peers.
    """

    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "p2p",
        host: str | None = None,
        port: int | None = None,
        backends: list[str] | None = None,
        num_threads: int = 4,
        unbound_store_timeout_s: float = _UNBOUND_STORE_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("backpressure_detector", None) is not None:
            raise ValueError(_BACKPRESSURE_UNSUPPORTED)
        if kwargs:
            # Accepted, as upstream reserves them for later settings, but a typo must show.
            logger.warning("P2P tier: ignoring unknown settings %s", sorted(kwargs))
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        try:
            timeout_s = float(unbound_store_timeout_s)
        except (TypeError, ValueError):
            timeout_s = float("nan")
        if not timeout_s > 0:  # also rejects NaN
            raise ValueError(
                "unbound_store_timeout_s: expected a positive number of seconds, got "
                f"{unbound_store_timeout_s!r}"
            )
        self._unbound_store_timeout_s = timeout_s
        # The seed block hashes chain from: peers must share it or no lookup ever hits. Read
        # at the first session, since NONE_HASH may be seeded after this tier is built.
        self._hash_seed: str | None = None
        if host is None:
            host = envs.VLLM_P2P_SIDE_CHANNEL_HOST
        if port is None:
            port = envs.VLLM_P2P_SIDE_CHANNEL_PORT
        # One control socket per data-parallel replica.
        port = int(port) + offloading_spec.config.parallel.data_parallel_index
        # Peers dial host:port back; the NIXL agent name only travels inside the agent
        # metadata, and a fresh uuid keeps it unique even for peers sharing a host:port.
        self._local_id = f"{host}:{port}"
        self._nixl_agent_name = str(uuid.uuid4())
        config_fields = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        ).get_run_config()
        self._data: DataTransport = NixlTransport(
            self._nixl_agent_name,
            primary_kv_view,
            config_fields=config_fields,
            backends=backends,
            num_threads=int(num_threads),
        )
        try:
            self._control: ControlTransport = ZmqTransport(self._local_id, host, port)
        except BaseException:
            self._data.close()  # the memory registration must not outlive a failed build
            raise
        self._sessions: dict[str, P2PSession] = {}
        # peer_id -> (backoff, retry_at) after data-plane faults; see manager_peers.
        self._reconnect_backoff: dict[str, tuple[float, float]] = {}
        # peer_id -> data-plane faults over this process's life (never expires).
        self._data_plane_faults: dict[str, int] = {}
        # kv_request_id -> the session whose peer fetched it (stores go straight there).
        self._kv_to_session: dict[str, P2PSession] = {}
        # kv_request_id -> store batches kept until a peer fetches the id.
        self._unbound_stores: dict[str, list[_UnboundStoreBatch]] = {}
        # kv_request_id -> when its batches timed out (fetches and stores of it fail).
        self._reaped_stores: dict[str, float] = {}
        self._finished_jobs: list[JobResult] = []
        # kv_request_ids whose transfer or session failed: their lookups miss.
        self._failed_req_ids: set[str] = set()
        # Lookup contexts of closed sessions, released at the next serve_external_requests.
        self._failed_serve_ctxs: list[ReqContext] = []

    # SecondaryTierManager -------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        source = req_context.get_state(P2PSourceInfo)
        if source is None or source.kv_request_id in self._failed_req_ids:
            return LookupResult.MISS
        if not source.do_probe:
            return LookupResult.HIT  # a PD prefiller holds every block of the request
        session = self._sessions.get(source.peer_id)
        if session is None:
            return LookupResult.MISS
        # Registered now, asked in on_schedule_end's batch, answered in a later step.
        found = session.register_lookup(source.kv_request_id, key)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Cache the request's P2P roles; a consumer opens its session to the producer now,
        and a producer asks for every block of the request (its peer needs all of them)."""
        _annotate_req_context(req_context)
        source = req_context.get_state(P2PSourceInfo)
        if source is not None and self._get_or_create_session(source.peer_id) is None:
            self._failed_req_ids.add(source.kv_request_id)
        dest = req_context.get_state(P2PDestInfo)
        if dest is not None and dest.kv_request_id:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        """Drop the request's state in its session: a consumer's by the producer's address,
        a producer's by the fetched id (batches no peer fetched stay until they time out)."""
        source = req_context.get_state(P2PSourceInfo)
        dest = req_context.get_state(P2PDestInfo)
        kv_request_id = source.kv_request_id if source is not None else None
        if kv_request_id is None and dest is not None:
            kv_request_id = dest.kv_request_id
        if not kv_request_id:
            return
        self._failed_req_ids.discard(kv_request_id)
        if source is not None:
            session = self._sessions.get(source.peer_id)
        else:
            session = self._kv_to_session.pop(kv_request_id, None)
        if session is not None:
            session.finish_request(kv_request_id)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        block_ids = job_metadata.chunk_ids.tolist()
        dest = job_metadata.req_context.get_state(P2PDestInfo)
        if dest is None:
            # Not a remote-decode request: nothing to keep for a peer.
            self._finished_jobs.append(JobResult(job_id=job_id, success=True))
            return
        kv_request_id = dest.kv_request_id
        if not kv_request_id or kv_request_id in self._reaped_stores:
            # No id to be fetched by, or its earlier batches timed out (keeping more would
            # pin primary rows for another timeout that nobody will fetch them in).
            logger.warning(
                "P2P %s: store job %d failed: kv_request_id %r %s",
                self._local_id,
                job_id,
                kv_request_id,
                "timed out" if kv_request_id else "missing",
            )
            self._finished_jobs.append(JobResult(job_id=job_id, success=False))
            return
        session = self._kv_to_session.get(kv_request_id)
        if session is not None:
            session.add_stored_blocks(kv_request_id, keys, block_ids, job_id)
            return
        self._unbound_stores.setdefault(kv_request_id, []).append(
            _UnboundStoreBatch(job_id=job_id, keys=keys, block_ids=block_ids)
        )

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        source = job_metadata.req_context.get_state(P2PSourceInfo)
        if source is None:
            logger.debug("P2P %s: load job %d has no P2P source", self._local_id, job_id)
            self._finished_jobs.append(JobResult(job_id=job_id, success=False))
            return
        if not keys:
            self._finished_jobs.append(JobResult(job_id=job_id, success=True))
            return
        session = self._sessions.get(source.peer_id)
        if session is None:
            logger.warning(
                "P2P %s: load job %d failed: no session to %s",
                self._local_id,
                job_id,
                source.peer_id,
            )
            self._finished_jobs.append(JobResult(job_id=job_id, success=False))
            self._failed_req_ids.add(source.kv_request_id)
            return
        session.request_blocks(job_id, source.kv_request_id, keys, job_metadata.chunk_ids)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        # Each call (per engine step, and from the tier-poll thread between steps) is also
        # what drives the peers.
        self._poll_once()
        finished, self._finished_jobs = self._finished_jobs, []
        return finished

    @override
    def has_pending_work(self) -> bool:
        # Polling is the only driver of inbound connections and peers' messages.
        return True

    @override
    def drain_jobs(self) -> None:
        """Poll until no session has a load or a WRITE outstanding (nothing is cancelled:
        the caller needs the primary rows quiet, not aborted); results come out of the next
        :meth:`get_finished_jobs`."""
        start = time.monotonic()
        warned = False
        while True:
            self._poll_once()
            if not any(s.has_pending_work for s in self._sessions.values()):
                return
            if not warned and time.monotonic() - start > _DRAIN_WARN_S:
                logger.warning(
                    "P2PSecondaryTierManager.drain_jobs: still draining after %.0fs; a "
                    "stuck transfer blocks the engine",
                    _DRAIN_WARN_S,
                )
                warned = True
            time.sleep(_DRAIN_SLEEP_S)

    @override
    def serve_external_requests(self, parent: ParentManager) -> None:
        """Release closed sessions' lookups, then let each session answer its peer's lookups
        through ``parent`` (valid only during this call)."""
        if self._failed_serve_ctxs:
            for ctx in self._failed_serve_ctxs:
                parent.on_request_finished(ctx)
            self._failed_serve_ctxs = []
        for session in self._sessions.values():
            session.serve_external_requests(parent)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # One lookup message per (peer, kv_request_id) registered during the step.
        for session in self._sessions.values():
            session.flush_pending_lookups()

    # Sessions and polling -------------------------------------------------------------------

    def _get_hash_seed(self) -> str:
        """The seed of NONE_HASH, read at the first session."""
        if self._hash_seed is None:
            self._hash_seed = get_none_hash_seed()
        return self._hash_seed

    def _new_session(self, peer_id: str, conn: ControlConnection) -> P2PSession:
        return P2PSession(
            peer_id=peer_id,
            local_id=self._local_id,
            transport=self._data,
            local_block_len=self._data.block_len,
            local_hash_seed=self._get_hash_seed(),
            conn=conn,
        )

    def _poll_once(self) -> None:
        """Accept new peers, poll every session (collecting its results, binding fetched ids),
        then reap dead sessions, timed-out stores and idle sessions."""
        new_connections = self._control.poll()
        if new_connections:
            logger.info(
                "P2P %s: %d new connection(s): %s",
                self._local_id,
                len(new_connections),
                [c.peer_id for c in new_connections],
            )
        self._accept_new_peers(new_connections)
        for session in self._sessions.values():
            result = session.poll()
            for load in result.loads:
                self._finished_jobs.append(JobResult(job_id=load.job_id, success=load.success))
                if not load.success:
                    self._failed_req_ids.add(load.kv_request_id)
            for store in result.stores:
                self._finished_jobs.append(JobResult(job_id=store.job_id, success=store.success))
            for kv_request_id in result.new_fetch_ids:
                self._bind_fetch(session, kv_request_id)
        self._reap_dead_sessions()
        self._reap_unbound_stores()
        self._reap_idle_sessions()

    def _bind_fetch(self, session: P2PSession, kv_request_id: str) -> None:
        """A peer fetched ``kv_request_id`` over ``session``: hand it the kept batches."""
        batches = self._unbound_stores.pop(kv_request_id, ())
        if kv_request_id in self._reaped_stores:
            # Nothing will ever be stored for it: end the round now, so the peer falls back at
            # once instead of at its load timeout. Left unbound, so later stores still fail.
            session.finish_request(kv_request_id)
            self._fail_batches(batches)
            return
        self._kv_to_session[kv_request_id] = session
        for batch in batches:
            session.add_stored_blocks(kv_request_id, batch.keys, batch.block_ids, batch.job_id)

    @override
    def shutdown(self) -> None:
        self._drain_inflight_for_shutdown()
        for session in self._sessions.values():
            # What close() leaves to release has nobody left to release it.
            session.close()
        self._sessions.clear()
        self._kv_to_session.clear()
        for batches in self._unbound_stores.values():
            self._fail_batches(batches)
        self._unbound_stores.clear()
        self._reaped_stores.clear()
        self._control.close()
        self._data.close()

    def _drain_inflight_for_shutdown(self) -> None:
        """Wait (up to ``_SHUTDOWN_DRAIN_TIMEOUT_S``) for the sessions' WRITEs to stop before
        the data plane closes under them, then release the rest regardless."""
        still = [tid for s in self._sessions.values() for tid in s._server._inflight]
        if not still:
            return
        deadline = time.monotonic() + _SHUTDOWN_DRAIN_TIMEOUT_S
        while still and time.monotonic() < deadline:
            still = list(self._data.cancel(still, mode="wait"))
            if not still:
                return
            self._data.poll()  # advances NIXL's view of the handles
            time.sleep(_DRAIN_SLEEP_S)
        if still:
            logger.warning(
                "P2P %s: %d transfer(s) still in flight after %.1f s at shutdown; releasing them",
                self._local_id,
                len(still),
                _SHUTDOWN_DRAIN_TIMEOUT_S,
            )
            self._data.cancel(still, mode="immediate")
