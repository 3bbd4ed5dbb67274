"""ZmqTransport over real sockets on 127.0.0.1: what upstream's tests do not pin.

Malformed traffic is dropped without disturbing the peer's later messages, a busy port is
refused cleanly, and a peer that spoke first is returned by poll() exactly once.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from vllm.v1.kv_offload.tiering.p2p.control import ControlConnection, ZmqTransport


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def transport():
    """A transport bound on a free port; yields (transport, its peer id)."""
    for _ in range(8):
        port = _free_port()
        try:
            t = ZmqTransport(f"127.0.0.1:{port}", "127.0.0.1", port)
        except zmq.ZMQError:
            continue  # another process took the port in between
        yield t, f"127.0.0.1:{port}"
        t.close()
        return
    pytest.fail("no free port")


@pytest.fixture
def raw_peer():
    """A hand-driven peer: a bare DEALER plus a ROUTER listening at the peer id it uses
    as identity (the transport connects back there). Yields (dealer factory, router)."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    socks: list[zmq.Socket] = [router]

    def connect(peer_id: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.identity = f"127.0.0.1:{port}".encode()
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{peer_id}")
        socks.append(sock)
        return sock

    yield connect, f"127.0.0.1:{port}"
    for sock in socks:
        sock.close()
    ctx.destroy(linger=0)


def _poll_until(transport: ZmqTransport, done, timeout_s: float = 3.0) -> list:
    """Poll until ``done(accepted)`` holds; returns every connection accepted meanwhile."""
    accepted: list[ControlConnection] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        accepted.extend(transport.poll())
        if done(accepted):
            return accepted
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def test_undecodable_payload_is_dropped_and_later_messages_arrive(transport, raw_peer):
    t, peer_id = transport
    connect, raw_id = raw_peer
    sock = connect(peer_id)
    sock.send(b"\xc1")  # 0xc1 is never valid msgpack
    sock.send(msgspec.msgpack.encode({"type": "hello"}))
    accepted = _poll_until(t, lambda acc: bool(acc))
    assert [c.peer_id for c in accepted] == [raw_id]
    assert list(accepted[0].recv()) == [{"type": "hello"}]


def test_message_with_extra_frames_is_dropped(transport, raw_peer):
    t, peer_id = transport
    sock = raw_peer[0](peer_id)
    sock.send_multipart([b"a", b"b"])  # the ROUTER sees three frames
    sock.send(msgspec.msgpack.encode({"seq": 1}))
    accepted = _poll_until(t, lambda acc: bool(acc))
    assert list(accepted[0].recv()) == [{"seq": 1}]


def test_peer_is_accepted_once_across_polls(transport, raw_peer):
    t, peer_id = transport
    sock = raw_peer[0](peer_id)
    sock.send(msgspec.msgpack.encode({"seq": 1}))
    (conn,) = _poll_until(t, lambda acc: bool(acc))
    sock.send(msgspec.msgpack.encode({"seq": 2}))
    received = list(conn.recv())
    end = time.monotonic() + 3.0
    while len(received) < 2 and time.monotonic() < end:
        assert not t.poll(), "an already accepted peer was returned again"
        received.extend(conn.recv())
        time.sleep(0.005)
    assert received == [{"seq": 1}, {"seq": 2}]


def test_busy_port_raises_and_leaves_no_transport(transport):
    _, peer_id = transport
    host, port = peer_id.rsplit(":", 1)
    with pytest.raises(zmq.ZMQError):
        ZmqTransport("other", host, int(port))


def test_closed_transport_closes_its_connections(transport):
    t, _ = transport
    conn = t.connect(f"127.0.0.1:{_free_port()}")
    t.close()
    assert not conn.alive
    with pytest.raises(RuntimeError, match="closed connection"):
        conn.send({"type": "late"})


@pytest.mark.parametrize("identity", [None, b"no-port", b"\xff\xfe:1", b"host:99999"])
def test_sender_without_peer_address_is_ignored(transport, raw_peer, identity):
    """A socket whose identity is not ``host:port`` cannot be answered: its messages are
    dropped and the transport keeps serving real peers."""
    t, peer_id = transport
    ctx = zmq.Context()
    stray = ctx.socket(zmq.DEALER)
    stray.setsockopt(zmq.LINGER, 0)
    if identity is not None:  # None: the ROUTER makes up a binary identity
        stray.identity = identity
    stray.connect(f"tcp://{peer_id}")
    try:
        stray.send(msgspec.msgpack.encode({"type": "stray"}))
        connect, raw_id = raw_peer
        sock = connect(peer_id)
        time.sleep(0.05)  # let the stray message arrive first
        sock.send(msgspec.msgpack.encode({"type": "real"}))
        accepted = _poll_until(t, lambda acc: bool(acc))
        assert [c.peer_id for c in accepted] == [raw_id]
        assert list(accepted[0].recv()) == [{"type": "real"}]
    finally:
        stray.close()
        ctx.destroy(linger=0)


def test_reconnect_is_heard_while_the_old_connection_is_still_up(transport, raw_peer):
    """A peer that reconnects reuses its identity. The ROUTER may not have retired the old
    connection yet (its disconnect reaches the socket asynchronously, late on a loaded
    machine), so the newest connection must take the identity over; otherwise every
    message of the reconnected peer is dropped and its handshake never completes."""
    t, peer_id = transport
    connect, _ = raw_peer
    old = connect(peer_id)
    old.send(msgspec.msgpack.encode({"seq": "old"}))
    (conn,) = _poll_until(t, lambda acc: bool(acc))
    assert list(conn.recv()) == [{"seq": "old"}]
    new = connect(peer_id)  # same identity; `old` stays connected
    new.send(msgspec.msgpack.encode({"seq": "new"}))
    received: list[dict] = []

    def heard(_accepted) -> bool:
        received.extend(conn.recv())
        return bool(received)

    _poll_until(t, heard)
    assert received == [{"seq": "new"}]
