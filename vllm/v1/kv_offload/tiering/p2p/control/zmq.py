"""ZeroMQ control transport: one ROUTER to receive, one DEALER per peer to send.

Every engine binds a ROUTER on its own ``host:port``. To talk to a peer it opens a DEALER
whose identity is its own ``local_id`` and connects it to the peer's ROUTER, so the ROUTER
learns who sent each frame; a peer that speaks first gets a DEALER back to it on the next
:meth:`ZmqTransport.poll`. Messages are dicts encoded with msgpack (msgspec). A socket
monitor on each DEALER reports disconnects.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.utils.monitor

from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport

logger = logging.getLogger(__name__)

# ZMTP heartbeats (milliseconds): a peer that vanishes without closing its socket is found
# within _HEARTBEAT_TIMEOUT_MS instead of never.
_HEARTBEAT_IVL_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 10000
_HEARTBEAT_TTL_MS = 10000

# Messages one DEALER may queue before send() fails. Control messages are small, so a full
# queue means the peer stopped reading; set explicitly rather than trusting libzmq's default.
_SNDHWM = 1000
# Milliseconds a closed DEALER keeps trying to deliver what it queued (the farewell
# DisconnectMsg). Bounded: libzmq's default (forever) would hang Context.destroy() on an
# unreachable peer.
_DEALER_LINGER_MS = 500


def _fatal_events() -> frozenset[int]:
    """Monitor events after which the DEALER will not reach its peer again."""
    names = (
        "EVENT_DISCONNECTED",
        "EVENT_CLOSED",
        "EVENT_HANDSHAKE_FAILED_AUTH",
        "EVENT_HANDSHAKE_FAILED_PROTOCOL",
        "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
    )
    # The handshake-failure events are missing from older libzmq builds.
    return frozenset(getattr(zmq, name) for name in names if hasattr(zmq, name))


_FATAL_MONITOR_EVENTS: frozenset[int] = _fatal_events()
_MONITOR_EVENT_MASK: int = 0
for _event in _FATAL_MONITOR_EVENTS:
    _MONITOR_EVENT_MASK |= _event

_NOTHING: tuple = ()


def _tcp_addr(host: str, port: int | str) -> str:
    return f"tcp://{host}:{port}"


def _peer_id_of(identity: bytes) -> str | None:
    """The ``host:port`` peer id a DEALER identity names, or None if it names none."""
    try:
        peer_id = identity.decode()
    except UnicodeDecodeError:
        return None
    host, sep, port = peer_id.rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        return None
    return peer_id


def _set_heartbeat(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, _HEARTBEAT_TTL_MS)


@dataclass
class _Sockets:
    """The sockets one connection owns: its DEALER and the PAIR reading its monitor."""

    dealer: zmq.Socket
    monitor: zmq.Socket


class ZmqConnection(ControlConnection):
    """Channel to one peer: sends through its DEALER; the transport fills its inbox."""

    def __init__(self, peer_id: str, sockets: _Sockets) -> None:
        super().__init__(peer_id)
        self._sockets = sockets
        # Two flags: a dead connection still owns sockets that close() must release.
        self._dead = False
        self._closed = False
        self._inbox: list[dict] = []

    @property
    def alive(self) -> bool:
        return not (self._dead or self._closed)

    @property
    def monitor_socket(self) -> zmq.Socket:
        """The PAIR socket receiving the DEALER's monitor events."""
        return self._sockets.monitor

    def send(self, msg: dict) -> None:
        """Queue ``msg`` without blocking (the caller holds the tiering manager's lock).

        Raises RuntimeError on a dead or closed connection and ConnectionError once
        ``_SNDHWM`` messages wait for a peer that does not read.
        """
        if not self.alive:
            raise RuntimeError(f"ZmqConnection: send on closed connection to {self.peer_id}")
        try:
            self._sockets.dealer.send(msgspec.msgpack.encode(msg), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise ConnectionError(f"ZmqConnection: send queue to {self.peer_id} is full") from exc

    def recv(self) -> Sequence[dict]:
        if not self._inbox:
            return _NOTHING
        msgs, self._inbox = self._inbox, []
        return msgs

    def enqueue(self, msg: dict) -> None:
        """Add a received message to the inbox (called by the transport)."""
        self._inbox.append(msg)

    def mark_dead(self) -> None:
        # Sockets stay open so the owner can still drain recv() before close().
        self._dead = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dead = True
        logger.info("ZmqConnection: closing connection to %s", self.peer_id)
        self._sockets.monitor.close()
        self._sockets.dealer.close()


class ZmqTransport(ControlTransport):
    """:class:`ControlTransport` over ZeroMQ; binds its ROUTER on ``host:port``."""

    def __init__(self, local_id: str, host: str, port: int) -> None:
        self._local_id = local_id
        self._closed = False
        self._connections: dict[str, ZmqConnection] = {}
        # Messages from peers without a connection yet, in arrival order.
        self._pending_inbound: list[tuple[str, dict]] = []
        # Makes every monitor endpoint unique: libzmq frees an inproc address only after
        # close() returned, so reusing one per peer fails a quick reconnect (EADDRINUSE).
        self._monitor_seq = 0
        self._zmq_ctx = zmq.Context()
        self._router: zmq.Socket = self._zmq_ctx.socket(zmq.ROUTER)
        _set_heartbeat(self._router)
        # A reconnecting peer reuses its identity, and its old connection may still hold
        # that identity here (the disconnect reaches this socket asynchronously). Without
        # handover the ROUTER silently drops every frame of the newer connection.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self._router.bind(_tcp_addr(host, port))
        except zmq.ZMQError:
            self._router.close(linger=0)
            self._zmq_ctx.destroy(linger=0)
            raise
        logger.info("ZmqTransport %s: ROUTER bound on %s", local_id, _tcp_addr(host, port))

    def connect(self, peer_id: str) -> ZmqConnection:
        """Open a DEALER to ``peer_id``.

        A session may kill its connection after this poll's sweep, so a dead one can still
        be registered here: retire it. A live one is a duplicate (AssertionError).
        """
        existing = self._connections.get(peer_id)
        if existing is not None:
            assert not existing.alive, f"ZmqConnection to {peer_id} already exists"
            logger.info("ZmqTransport %s: retiring dead connection to %s", self._local_id, peer_id)
            self._connections.pop(peer_id).close()
        return self._open_connection(peer_id, "outbound")

    def poll(self) -> Sequence[ControlConnection]:
        # Sweep first: a connection killed since the last poll must not swallow the first
        # message of the same peer reconnecting.
        self._sweep_dead()
        self._recv_router()
        self._check_monitors()
        self._sweep_dead()
        if not self._pending_inbound:
            return _NOTHING
        accepted: list[ControlConnection] = []
        for sender_id, msg in self._pending_inbound:
            conn = self._connections.get(sender_id)
            if conn is None:
                conn = self._open_connection(sender_id, "inbound")
                accepted.append(conn)
            conn.enqueue(msg)
        self._pending_inbound.clear()
        return accepted

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
        self._router.close(linger=0)
        self._zmq_ctx.destroy(linger=0)

    def _open_connection(self, peer_id: str, direction: str) -> ZmqConnection:
        """Create, monitor and register a DEALER connected to ``peer_id``."""
        host, port = peer_id.rsplit(":", 1)
        dealer = self._zmq_ctx.socket(zmq.DEALER)
        _set_heartbeat(dealer)
        dealer.identity = self._local_id.encode()
        # ZMQ_IMMEDIATE stays off so messages queue before the TCP connect completes.
        dealer.setsockopt(zmq.SNDHWM, _SNDHWM)
        dealer.setsockopt(zmq.LINGER, _DEALER_LINGER_MS)
        safe_id = peer_id.replace(":", "-").replace("/", "-")
        monitor_addr = f"inproc://p2p-monitor-{safe_id}-{self._monitor_seq}"
        self._monitor_seq += 1
        dealer.monitor(monitor_addr, _MONITOR_EVENT_MASK)
        monitor = self._zmq_ctx.socket(zmq.PAIR)
        monitor.connect(monitor_addr)
        dealer.connect(_tcp_addr(host, port))
        conn = ZmqConnection(peer_id, _Sockets(dealer=dealer, monitor=monitor))
        self._connections[peer_id] = conn
        logger.info(
            "ZmqTransport %s: %s connection to %s (%d active)",
            self._local_id,
            direction,
            peer_id,
            len(self._connections),
        )
        return conn

    def _sweep_dead(self) -> None:
        """Unregister and close every connection that is no longer alive."""
        for peer_id in [p for p, c in self._connections.items() if not c.alive]:
            self._connections.pop(peer_id).close()

    def _recv_router(self) -> None:
        """Read every frame waiting on the ROUTER without blocking."""
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                logger.warning("ZmqTransport %s: recv error: %s", self._local_id, exc)
                return
            if len(frames) != 2:
                logger.warning(
                    "ZmqTransport %s: dropping message of %d frames (expected 2)",
                    self._local_id,
                    len(frames),
                )
                continue
            sender_id = _peer_id_of(frames[0])
            if sender_id is None:
                # Not one of ours (an anonymous socket, a scanner): there is no address to
                # answer, and opening a DEALER toward it would fail.
                logger.warning(
                    "ZmqTransport %s: dropping message from identity %r (not host:port)",
                    self._local_id,
                    frames[0][:64],
                )
                continue
            try:
                msg = msgspec.msgpack.decode(frames[1])
            except msgspec.DecodeError as exc:
                logger.warning(
                    "ZmqTransport %s: undecodable message from %s: %s",
                    self._local_id,
                    sender_id,
                    exc,
                )
                continue
            conn = self._connections.get(sender_id)
            if conn is not None:
                conn.enqueue(msg)
            else:
                self._pending_inbound.append((sender_id, msg))

    def _check_monitors(self) -> None:
        """Mark dead every connection whose monitor reported a fatal event."""
        for conn in self._connections.values():
            while conn.alive:
                try:
                    event = zmq.utils.monitor.recv_monitor_message(conn.monitor_socket, zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:
                    logger.warning(
                        "ZmqTransport %s: monitor error for %s: %s",
                        self._local_id,
                        conn.peer_id,
                        exc,
                    )
                    break
                if event["event"] in _FATAL_MONITOR_EVENTS:
                    logger.debug(
                        "ZmqTransport %s: peer %s fatal event 0x%x",
                        self._local_id,
                        conn.peer_id,
                        event["event"],
                    )
                    conn.mark_dead()
