"""P2PSession: the whole protocol toward one peer over one control connection.

Each side of a peer pair runs one session that both requests blocks (:mod:`.client`) and
serves them (:mod:`.server`). The session owns the connection and the handshake, parses
incoming messages and hands them to the right role, and holds outgoing messages back until
the peer acknowledged our ConnectMsg. The peer's ConnectMsg starts registering its memory
with the data transport off-thread; our ConnectAckMsg goes out only once that registration
landed, so a peer never sends before we can serve it. Times are ``time.monotonic()``
seconds.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, NamedTuple

import vllm.envs as envs
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection
from vllm.v1.kv_offload.tiering.p2p.session.client import ClientRole, LoadResult
from vllm.v1.kv_offload.tiering.p2p.session.protocol import (
    TYPE_KEY,
    AbortAckMsg,
    AbortFetchMsg,
    ConnectAckMsg,
    ConnectMsg,
    DisconnectMsg,
    FetchMsg,
    LookupMsg,
    LookupRespMsg,
    TransferDoneMsg,
)
from vllm.v1.kv_offload.tiering.p2p.session.server import ServerRole, StoreResult

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import JobId, ParentManager
    from vllm.v1.kv_offload.tiering.p2p.data import DataTransport

logger = logging.getLogger(__name__)

# Consecutive unexpected errors while handling messages before the session gives up on the
# peer (a malformed message disconnects at once; a streak suggests a wedged state).
_MAX_CONSECUTIVE_DISPATCH_ERRORS = 5
# Seconds a data-plane fault waits for in-flight writes to drain before disconnecting.
_PEER_FAULT_DRAIN_S = 10.0


class SessionPollResult(NamedTuple):
    """One poll's output: finished loads and stores, and the kv_request_ids whose FetchMsg
    arrived (the manager binds them to this session and replays parked stores)."""

    loads: list[LoadResult]
    stores: list[StoreResult]
    new_fetch_ids: list[str]


class SessionCloseResult(NamedTuple):
    """What a closed session leaves for the manager to fail or release.

    ``failed_jobs``: load job ids; ``failed_req_ids``: kv_request_ids with a load in flight
    or an unanswered probe; ``failed_stores``: store job ids; ``failed_serves``: synthetic
    lookup contexts still owing ``on_request_finished``.
    """

    failed_jobs: list[int]
    failed_req_ids: list[str]
    failed_stores: list[int]
    failed_serves: list[ReqContext]


def _keys(raw: list) -> list[OffloadKey]:
    """Wire keys as OffloadKeys; anything but bytes is a protocol violation."""
    for key in raw:
        if not isinstance(key, (bytes, bytearray)):
            raise ValueError(f"keys: expected bytes, got {type(key).__name__}")
    return [OffloadKey(bytes(k)) for k in raw]


class P2PSession:
    """Session toward ``peer_id``; pending (``conn=None``) until a connection is attached.

    A pending session already accepts stored blocks (a prefiller may store before the
    decoder connects) but sends nothing.
    """

    def __init__(
        self,
        peer_id: str,
        local_id: str,
        transport: DataTransport,
        local_block_len: int,
        local_hash_seed: str,
        conn: ControlConnection | None = None,
    ) -> None:
        self.peer_id = peer_id
        self._local_id = local_id
        self._transport = transport
        self._local_block_len = local_block_len
        self._local_hash_seed = local_hash_seed
        self._conn: ControlConnection | None = None
        self._send_ready = False  # the peer acked our ConnectMsg
        self._queued: list[dict] = []  # held back until then
        self._dispatch_error_count = 0
        self._death_reason: str | None = None
        self._peer_fault_at: float | None = None
        self._connected_at: float | None = None
        self._last_activity_at = time.monotonic()
        self._new_fetch_ids: list[str] = []
        # Registration of the peer's memory, started by its ConnectMsg; acked when done.
        self._pending_registration: Future[None] | None = None
        self._client = ClientRole(peer_id=peer_id, send=self._send)
        self._server = ServerRole(peer_id=peer_id, transport=transport, send=self._send)
        if conn is not None:
            self.attach_connection(conn)

    @property
    def alive(self) -> bool:
        """False once the connection died; a pending session is alive."""
        return self._conn is None or self._conn.alive

    @property
    def connected(self) -> bool:
        return self._conn is not None

    @property
    def ready(self) -> bool:
        """True once the peer acked our ConnectMsg."""
        return self._send_ready

    @property
    def has_pending_work(self) -> bool:
        """True while a registration, a load or an outbound transfer is outstanding."""
        return (
            self._pending_registration is not None
            or self._client.has_active_loads
            or self._server.has_inflight_transfers
        )

    @property
    def death_reason(self) -> str:
        """Why the connection died (the transport's own detection records no cause)."""
        return self._death_reason or "control connection lost"

    @property
    def data_plane_fault(self) -> str | None:
        return self._server.peer_fault

    @property
    def last_activity_at(self) -> float:
        """Monotonic time of the last message received or sent."""
        return self._last_activity_at

    def attach_connection(self, conn: ControlConnection) -> None:
        """Give a pending session its connection and send our ConnectMsg."""
        if self._conn is not None:
            raise ValueError(f"P2PSession {self.peer_id}: already connected")
        self._conn = conn
        self._connected_at = self._last_activity_at = time.monotonic()
        t = self._transport
        conn.send(
            {
                TYPE_KEY: ConnectMsg.TYPE,
                ConnectMsg.PEER_ID: self._local_id,
                ConnectMsg.AGENT_METADATA: t.get_agent_metadata(),
                ConnectMsg.BASE_ADDR: t.base_addr,
                ConnectMsg.NUM_BLOCKS: t.num_blocks,
                ConnectMsg.BLOCK_LEN: t.block_len,
                ConnectMsg.CONFIG_FINGERPRINT: t.config_fingerprint,
                ConnectMsg.HASH_SEED: self._local_hash_seed,
            }
        )

    @staticmethod
    def _check_pairs(keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> None:
        if len(keys) != len(block_ids):
            raise ValueError(
                f"block_ids: expected {len(keys)} entries (one per key), got {len(block_ids)}"
            )

    def request_blocks(
        self,
        job_id: JobId,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        block_ids: Sequence[int],
    ) -> None:
        """Ask the peer to write ``keys`` into local blocks ``block_ids`` (load job)."""
        self._check_pairs(keys, block_ids)
        self._client.request_blocks(
            job_id, kv_request_id, keys, block_ids, send_ready=self._send_ready
        )

    def add_stored_blocks(
        self,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        block_ids: Sequence[int],
        job_id: JobId,
    ) -> None:
        """Offer locally stored blocks (store job) to the peer's demand."""
        self._check_pairs(keys, block_ids)
        self._server.add_stored_blocks(kv_request_id, keys, block_ids, job_id)

    def finish_request(self, kv_request_id: str) -> None:
        """The request ended locally: wind down both roles' state for it."""
        self._client.finish(kv_request_id)
        self._server.finish(kv_request_id)

    def register_lookup(self, kv_request_id: str, key: bytes) -> bool | None:
        """Probe ``key`` on the peer: None until answered, then whether it hit."""
        return self._client.register_lookup(kv_request_id, key)

    def flush_pending_lookups(self) -> None:
        """Send this step's new probes (once per scheduler step, after the handshake)."""
        self._client.flush_pending_lookups(send_ready=self._send_ready)

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer the peer's probes; ``parent`` is valid for this call only."""
        self._server.serve_external_requests(parent)

    def poll(self) -> SessionPollResult:
        """Handle received messages, advance the handshake and transfers, apply timeouts."""
        if self._conn is None:
            return SessionPollResult([], self._server.collect_idle_timeouts(), [])
        # Messages first: an ack already buffered at the deadline still completes the
        # handshake.
        messages = self._conn.recv()
        if messages:
            self._last_activity_at = time.monotonic()
        for msg in messages:
            self._on_message(msg)
        self._poll_registration()
        if (
            not self._send_ready
            and self._conn.alive
            and self._connected_at is not None
            and time.monotonic() - self._connected_at > envs.VLLM_P2P_HANDSHAKE_TIMEOUT_S
        ):
            logger.warning("P2PSession %s: handshake timed out", self.peer_id)
            self._mark_dead("handshake timed out")
        loads = self._client.collect_results()
        stores = self._server.collect_results()
        self._server.drain_pending_aborts()
        self._escalate_peer_fault()
        expired = self._client.get_expired_lookup()
        if expired is not None:
            logger.warning(
                "P2PSession %s: no lookup progress for %s in %.1fs; disconnecting",
                self.peer_id,
                *expired,
            )
            self._disconnect("lookup response timed out")
        new_fetch_ids, self._new_fetch_ids = self._new_fetch_ids, []
        return SessionPollResult(loads, stores, new_fetch_ids)

    def close(self) -> SessionCloseResult:
        """Tear down; return what the manager must fail or release."""
        if self._pending_registration is not None:
            self._pending_registration.cancel()
            self._pending_registration = None
        client = self._client.close()
        failed_stores, failed_serves = self._server.close()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send({TYPE_KEY: DisconnectMsg.TYPE})
            self._conn.close()
            self._conn = None
        return SessionCloseResult(
            failed_jobs=client.failed_jobs,
            failed_req_ids=client.failed_req_ids,
            failed_stores=failed_stores,
            failed_serves=failed_serves,
        )

    def _on_message(self, msg: dict) -> None:
        msg_type = msg.get(TYPE_KEY) if isinstance(msg, dict) else msg
        try:
            self._dispatch_message(msg)
        except ValueError as exc:
            # The peer broke the protocol: retrying cannot help.
            self._protocol_error(f"malformed {msg_type!r}: {exc}")
            return
        except Exception:
            # Most likely our own bug: survive one, but not a streak.
            self._dispatch_error_count += 1
            logger.exception(
                "P2PSession %s: error handling %r (%d in a row)",
                self.peer_id,
                msg_type,
                self._dispatch_error_count,
            )
            if self._dispatch_error_count >= _MAX_CONSECUTIVE_DISPATCH_ERRORS:
                self._protocol_error(
                    f"too many consecutive dispatch errors ({self._dispatch_error_count})"
                )
            return
        self._dispatch_error_count = 0

    def _dispatch_message(self, msg: dict) -> None:
        # A batch may hold messages after a DisconnectMsg: they must not touch state.
        if self._conn is not None and not self._conn.alive:
            return
        msg_type = msg.get(TYPE_KEY) if isinstance(msg, dict) else None
        if msg_type == ConnectMsg.TYPE:
            self._on_connect(msg)
        elif msg_type == ConnectAckMsg.TYPE:
            ConnectAckMsg.validate(msg)
            self._on_connect_ack()
        elif msg_type == FetchMsg.TYPE:
            FetchMsg.validate(msg)
            req_id = msg[FetchMsg.KV_REQUEST_ID]
            self._server.on_fetch(
                req_id,
                _keys(msg[FetchMsg.KEYS]),
                msg[FetchMsg.BLOCK_INDEXES],
                msg[FetchMsg.ROUND_SEQ],
            )
            self._new_fetch_ids.append(req_id)
        elif msg_type == AbortFetchMsg.TYPE:
            AbortFetchMsg.validate(msg)
            self._server.on_abort_fetch(
                msg[AbortFetchMsg.KV_REQUEST_ID], msg[AbortFetchMsg.ROUND_SEQ]
            )
        elif msg_type == TransferDoneMsg.TYPE:
            TransferDoneMsg.validate(msg)
            self._client.on_transfer_done(
                msg[TransferDoneMsg.KV_REQUEST_ID],
                msg[TransferDoneMsg.SUCCESS],
                msg[TransferDoneMsg.ROUND_SEQ],
            )
        elif msg_type == AbortAckMsg.TYPE:
            AbortAckMsg.validate(msg)
            self._client.on_abort_ack(msg[AbortAckMsg.KV_REQUEST_ID], msg[AbortAckMsg.ROUND_SEQ])
        elif msg_type == LookupMsg.TYPE:
            LookupMsg.validate(msg)
            self._server.on_lookup(
                msg[LookupMsg.KV_REQUEST_ID], _keys(msg[LookupMsg.KEYS]), msg[LookupMsg.ROUND_SEQ]
            )
        elif msg_type == LookupRespMsg.TYPE:
            LookupRespMsg.validate(msg)
            self._client.on_lookup_resp(
                msg[LookupRespMsg.KV_REQUEST_ID],
                _keys(msg[LookupRespMsg.KEYS]),
                msg[LookupRespMsg.HITS],
            )
        elif msg_type == DisconnectMsg.TYPE:
            self._mark_dead("peer disconnected")
        else:
            logger.warning("P2PSession %s: unknown message type %r", self.peer_id, msg_type)

    def _on_connect(self, msg: dict) -> None:
        """Check the peer's ConnectMsg and start registering its memory."""
        if self._send_ready or self._pending_registration is not None:
            # Registering twice would corrupt the data transport's state.
            self._protocol_error("duplicate connect after handshake")
            return
        try:
            ConnectMsg.validate(msg)
            remote_len = msg[ConnectMsg.BLOCK_LEN]
            if remote_len != self._local_block_len:
                raise ValueError(
                    f"block_len mismatch from {self.peer_id}: "
                    f"remote={remote_len}, local={self._local_block_len}"
                )
            remote_fp = msg.get(ConnectMsg.CONFIG_FINGERPRINT, "")
            local_fp = self._transport.config_fingerprint
            if local_fp and remote_fp and remote_fp != local_fp:
                raise ValueError(
                    f"config fingerprint mismatch from {self.peer_id}: "
                    f"remote={remote_fp!r}, local={local_fp!r}"
                )
            remote_seed = msg[ConnectMsg.HASH_SEED]
            if remote_seed != self._local_hash_seed:
                raise ValueError(
                    f"hash seed mismatch from {self.peer_id}: remote={remote_seed!r}, "
                    f"local={self._local_hash_seed!r}; set the same PYTHONHASHSEED on all peers"
                )
            self._pending_registration = self._transport.add_remote_peer_async(
                self.peer_id,
                agent_metadata=msg[ConnectMsg.AGENT_METADATA],
                base_addr=msg[ConnectMsg.BASE_ADDR],
                num_blocks=msg[ConnectMsg.NUM_BLOCKS],
                block_len=remote_len,
            )
        except ValueError as exc:
            logger.error("P2PSession %s: rejecting peer: %s", self.peer_id, exc)
            self._mark_dead(f"rejected peer connect: {exc}")

    def _poll_registration(self) -> None:
        """Ack the peer once its registration succeeded; drop it if it failed."""
        registration = self._pending_registration
        if registration is None or not registration.done():
            return
        self._pending_registration = None
        try:
            registration.result()
        except Exception as exc:
            logger.error("P2PSession %s: peer registration failed: %s", self.peer_id, exc)
            self._mark_dead(f"peer registration failed: {exc}")
            return
        if self._conn is not None and self._conn.alive:
            self._do_send({TYPE_KEY: ConnectAckMsg.TYPE, ConnectAckMsg.PEER_ID: self._local_id})

    def _on_connect_ack(self) -> None:
        self._send_ready = True
        queued, self._queued = self._queued, []
        for msg in queued:
            self._do_send(msg)

    def _protocol_error(self, reason: str) -> None:
        logger.error("P2PSession %s: protocol error: %s; disconnecting", self.peer_id, reason)
        self._disconnect(f"protocol error: {reason}")

    def _escalate_peer_fault(self) -> None:
        """After a data-plane fault, disconnect once in-flight writes drained (or after
        ``_PEER_FAULT_DRAIN_S``): the peer frees its blocks on DisconnectMsg."""
        fault = self._server.peer_fault
        if fault is None or self._conn is None or not self._conn.alive:
            return
        now = time.monotonic()
        if self._peer_fault_at is None:
            self._peer_fault_at = now
            logger.warning("P2PSession %s: data plane faulted: %s", self.peer_id, fault)
        if self._server.has_inflight_transfers and now - self._peer_fault_at < _PEER_FAULT_DRAIN_S:
            return
        self._disconnect(f"data plane: {fault}")

    def _disconnect(self, reason: str) -> None:
        """Tell the peer (best effort), then mark the connection dead."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send({TYPE_KEY: DisconnectMsg.TYPE})
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        """Mark the connection dead; the first reason is the one reported."""
        if self._conn is None:
            return
        if self._death_reason is None:
            self._death_reason = reason
        self._conn.mark_dead()

    def _send(self, msg: dict) -> None:
        """Send, or hold back until the peer acked our ConnectMsg."""
        if self._conn is None or not self._send_ready:
            self._queued.append(msg)
        else:
            self._do_send(msg)

    def _do_send(self, msg: dict) -> None:
        if self._conn is None:
            return
        try:
            self._conn.send(msg)
        except Exception as exc:
            # A broken connection must be reaped, or every load and probe toward this
            # peer would wait forever.
            logger.warning(
                "P2PSession %s: send of %s failed (%s)", self.peer_id, msg.get(TYPE_KEY), exc
            )
            self._mark_dead(f"send of {msg.get(TYPE_KEY)} failed")
            return
        self._last_activity_at = time.monotonic()
