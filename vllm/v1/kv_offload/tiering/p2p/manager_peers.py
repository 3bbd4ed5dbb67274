"""Peer sessions of the peer-to-peer tier's manager: opening, accepting, reaping, backoff.

One :class:`~vllm.v1.kv_offload.tiering.p2p.session.P2PSession` per remote peer (``host:port``)
carries both directions. Sessions end when their connection dies (reaped, their jobs failed),
when they sit idle while peer slots run short, or at shutdown. A session that ended on a
data-plane fault holds its peer off for a backoff that doubles on repeats.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import vllm.envs as envs
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.p2p.manager_params import (
    _UnboundStoreBatch,
)
from vllm.v1.kv_offload.tiering.p2p.session.protocol import TYPE_KEY, DisconnectMsg

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.p2p.control import ControlTransport
    from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection
    from vllm.v1.kv_offload.tiering.p2p.data import DataTransport
    from vllm.v1.kv_offload.tiering.p2p.session import P2PSession

# The manager's logger (one object, so that patching the manager module's logger covers the
# messages logged here too).
logger = logging.getLogger("vllm.v1.kv_offload.tiering.p2p.manager")

# How long a reaped kv_request_id is remembered, to reject a late fetch of it at once, in
# seconds; longer than the consumer's own load timeout, after which nobody waits for it.
_REAPED_ID_RETENTION_S = 60.0

# Idle sessions are evicted only when at most this many peer slots are left: setting up a
# session costs a handshake, so idle peers are kept while there is room.
_IDLE_REAP_HEADROOM = 8

# Reconnect backoff after a data-plane fault, in seconds: the first fault reconnects at once;
# a repeat within the max of the previous wait's end doubles the wait (from the min, up to the
# max). Expiry is by time alone.
_RECONNECT_MIN_BACKOFF_S = 1.0
_RECONNECT_MAX_BACKOFF_S = 60.0


class _PeerSessionsMixin:
    """Session bookkeeping of :class:`~.manager.P2PSecondaryTierManager` (its attributes)."""

    _local_id: str
    _data: DataTransport
    _control: ControlTransport
    _sessions: dict[str, P2PSession]
    _reconnect_backoff: dict[str, tuple[float, float]]
    _data_plane_faults: dict[str, int]
    _kv_to_session: dict[str, P2PSession]
    _unbound_stores: dict[str, list[_UnboundStoreBatch]]
    _reaped_stores: dict[str, float]
    _unbound_store_timeout_s: float
    _finished_jobs: list[JobResult]
    _failed_req_ids: set[str]
    _failed_serve_ctxs: list[ReqContext]

    # Provided by the manager: a new session over ``conn`` toward a peer.
    _new_session: Callable[[str, ControlConnection], P2PSession]

    def _get_or_create_session(self, peer_id: str) -> P2PSession | None:
        """The session toward ``peer_id``, opened (outbound) when there is none; ``None``
        when the peer is in reconnect backoff, the peer limit is reached, or opening failed."""
        session = self._sessions.get(peer_id)
        if session is not None:
            return session
        if self._reconnect_wait(peer_id) > 0:
            return None
        max_peers = envs.VLLM_P2P_MAX_PEERS
        if len(self._sessions) >= max_peers:
            logger.warning(
                "P2P %s: not connecting to %s: %d of %d sessions open "
                "(raise VLLM_P2P_MAX_PEERS for more)",
                self._local_id,
                peer_id,
                len(self._sessions),
                max_peers,
            )
            return None
        conn = None
        try:
            conn = self._control.connect(peer_id)
            session = self._new_session(peer_id, conn)
        except Exception:
            logger.exception("P2P %s: cannot open a session to %s", self._local_id, peer_id)
            if conn is not None:
                conn.close()
            return None
        self._sessions[peer_id] = session
        return session

    def _accept_new_peers(self, new_connections: Sequence[ControlConnection]) -> None:
        """Open a session for each inbound connection, or refuse it (peer limit, reconnect
        backoff, a session to that peer already open, or a bad handshake)."""
        max_peers = envs.VLLM_P2P_MAX_PEERS
        for conn in new_connections:
            peer_id = conn.peer_id
            if len(self._sessions) >= max_peers:
                logger.warning(
                    "P2P %s: refusing %s: %d of %d sessions open "
                    "(raise VLLM_P2P_MAX_PEERS for more)",
                    self._local_id,
                    peer_id,
                    len(self._sessions),
                    max_peers,
                )
                conn.close()
                continue
            wait = self._reconnect_wait(peer_id)
            if wait > 0:
                logger.info(
                    "P2P %s: refusing %s for %.1f s more (backoff after a data-plane fault)",
                    self._local_id,
                    peer_id,
                    wait,
                )
                # Told, the peer's lookups fall back now instead of at its handshake deadline.
                with contextlib.suppress(Exception):
                    conn.send({TYPE_KEY: DisconnectMsg.TYPE})
                conn.close()
                continue
            try:
                if peer_id in self._sessions:
                    raise ValueError(f"duplicate connection from {peer_id}")
                self._sessions[peer_id] = self._new_session(peer_id, conn)
            except (ValueError, KeyError, TypeError, AssertionError) as exc:
                logger.error("P2P %s: refusing peer %s: %s", self._local_id, peer_id, exc)
                conn.close()
                continue
            logger.info("P2P %s: session opened by %s", self._local_id, peer_id)

    def _close_session(self, peer_id: str) -> P2PSession:
        """Remove ``peer_id``'s session and its registration; fail what it still owed."""
        session = self._sessions.pop(peer_id)
        for kid in [kid for kid, s in self._kv_to_session.items() if s is session]:
            del self._kv_to_session[kid]
        closed = session.close()
        for job_id in (*closed.failed_jobs, *closed.failed_stores):
            self._finished_jobs.append(JobResult(job_id=job_id, success=False))
        # Requests toward the peer (loads and probes) fall back to local prefill, even if a
        # new session to it opens later.
        self._failed_req_ids.update(closed.failed_req_ids)
        # Released through the parent at the next serve_external_requests (no handle now).
        self._failed_serve_ctxs.extend(closed.failed_serves)
        self._data.remove_remote_peer(peer_id)
        return session

    def _reap_dead_sessions(self) -> None:
        """Close the sessions whose connection died."""
        dead = [pid for pid, s in self._sessions.items() if s.connected and not s.alive]
        for pid in dead:
            session = self._close_session(pid)
            fault_info = ""
            if session.data_plane_fault is not None:
                faults = self._data_plane_faults[pid] = self._data_plane_faults.get(pid, 0) + 1
                fault_info = f"; data-plane fault #{faults}"
                backoff = self._schedule_reconnect_backoff(pid)
                if backoff:
                    fault_info += f"; reconnect backoff {backoff:.0f}s"
            logger.warning(
                "P2P %s: peer %s down (%s)%s",
                self._local_id,
                pid,
                session.death_reason,
                fault_info,
            )

    def _reap_idle_sessions(self) -> None:
        """Close sessions without pending work that were idle longer than
        ``VLLM_P2P_IDLE_TIMEOUT_S`` seconds (0: never), only while at most
        ``_IDLE_REAP_HEADROOM`` peer slots are left."""
        idle_timeout = envs.VLLM_P2P_IDLE_TIMEOUT_S
        if idle_timeout <= 0:
            return
        max_peers = envs.VLLM_P2P_MAX_PEERS
        headroom = min(_IDLE_REAP_HEADROOM, max(0, max_peers - 1))
        if len(self._sessions) < max_peers - headroom:
            return
        deadline = time.monotonic() - idle_timeout
        idle = [
            pid
            for pid, s in self._sessions.items()
            if not s.has_pending_work and s.last_activity_at <= deadline
        ]
        for pid in idle:
            self._close_session(pid)
            logger.info(
                "P2P %s: closed idle session to %s (idle > %d s)",
                self._local_id,
                pid,
                idle_timeout,
            )

    def _schedule_reconnect_backoff(self, peer_id: str) -> float:
        """Record a data-plane fault of ``peer_id``; its reconnect wait in seconds."""
        now = time.monotonic()
        for pid, (_, retry_at) in list(self._reconnect_backoff.items()):
            if now - retry_at > _RECONNECT_MAX_BACKOFF_S:
                del self._reconnect_backoff[pid]
        prev = self._reconnect_backoff.get(peer_id)
        backoff = 0.0
        if prev is not None:
            backoff = min(max(2 * prev[0], _RECONNECT_MIN_BACKOFF_S), _RECONNECT_MAX_BACKOFF_S)
        self._reconnect_backoff[peer_id] = (backoff, now + backoff)
        return backoff

    def _reconnect_wait(self, peer_id: str) -> float:
        """Seconds left of ``peer_id``'s reconnect backoff (<= 0: none)."""
        entry = self._reconnect_backoff.get(peer_id)
        return 0.0 if entry is None else entry[1] - time.monotonic()

    def _reap_unbound_stores(self) -> None:
        """Fail the parked store batches of ids no peer fetched within the unbound-store
        timeout, remembering the ids (so that a late fetch or store of them fails at once);
        forget remembered ids after ``_REAPED_ID_RETENTION_S``."""
        now = time.monotonic()
        if self._reaped_stores:
            forget_before = now - _REAPED_ID_RETENTION_S
            for kid in [k for k, at in self._reaped_stores.items() if at <= forget_before]:
                del self._reaped_stores[kid]
        if not self._unbound_stores:
            return
        deadline = now - self._unbound_store_timeout_s
        # Batches are kept in arrival order: the first is the oldest.
        expired = [
            kid
            for kid, batches in self._unbound_stores.items()
            if batches and batches[0].submitted_at <= deadline
        ]
        for kid in expired:
            batches = self._unbound_stores.pop(kid)
            self._reaped_stores[kid] = now
            self._fail_batches(batches)
            logger.warning(
                "P2P %s: no peer fetched kv_request_id=%s within %.0f s; failing %d job(s)",
                self._local_id,
                kid,
                self._unbound_store_timeout_s,
                len(batches),
            )

    def _fail_batches(self, batches: Sequence[_UnboundStoreBatch]) -> None:
        for batch in batches:
            self._finished_jobs.append(JobResult(job_id=batch.job_id, success=False))
