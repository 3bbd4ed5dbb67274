"""P2PSessions over real ZmqTransports on 127.0.0.1, and their handling of bad input.

The data plane is :class:`MemoryTransport`, which copies block bytes between in-process
regions the way an RDMA WRITE would, so a test can check the bytes that arrived.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import pytest
import zmq

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob
from vllm.v1.kv_offload.tiering.p2p.control import ZmqTransport
from vllm.v1.kv_offload.tiering.p2p.data.base import PollResult
from vllm.v1.kv_offload.tiering.p2p.session import LoadResult, P2PSession, StoreResult
from vllm.v1.kv_offload.tiering.p2p.session.protocol import (
    TYPE_KEY,
    ConnectAckMsg,
    ConnectMsg,
    FetchMsg,
)

# Every MemoryTransport's region by its local id: what agent metadata resolves to.
_REGIONS: dict[str, bytearray] = {}


class MemoryTransport:
    """In-process data plane: ``num_blocks`` blocks of ``block_len`` bytes per node."""

    def __init__(self, local_id: str, num_blocks: int, block_len: int) -> None:
        self.local_id = local_id
        self.num_blocks = num_blocks
        self.block_len = block_len
        self.base_addr = 0
        self.config_fingerprint = ""
        self.region = _REGIONS[local_id] = bytearray(num_blocks * block_len)
        self._peers: dict[str, bytearray] = {}
        self._done: dict[str, list[int]] = {}
        self._next_tid = 0

    def get_agent_metadata(self) -> bytes:
        return self.local_id.encode()

    def add_remote_peer_async(
        self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int
    ) -> Future[None]:
        self._peers[peer_id] = _REGIONS[agent_metadata.decode()]
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def remove_remote_peer(self, peer_id: str) -> None:
        self._peers.pop(peer_id, None)

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int:
        dst, n = self._peers[peer_id], self.block_len
        for src_idx, dst_idx in zip(local_idxs, remote_idxs, strict=True):
            dst[dst_idx * n : (dst_idx + 1) * n] = self.region[src_idx * n : (src_idx + 1) * n]
        tid = self._next_tid
        self._next_tid += 1
        self._done.setdefault(peer_id, []).append(tid)
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        return PollResult(done=self._done.pop(peer_id, []), failed=[])

    def cancel(self, transfer_ids: list[int], mode: str = "immediate") -> list[int]:
        return []

    def block(self, idx: int) -> bytes:
        return bytes(self.region[idx * self.block_len : (idx + 1) * self.block_len])


class Node:
    """One engine: a ZMQ control transport, a memory data plane and its peer sessions."""

    def __init__(self, num_blocks: int = 8, block_len: int = 32) -> None:
        for _ in range(8):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            try:
                self.control = ZmqTransport(f"127.0.0.1:{port}", "127.0.0.1", port)
                break
            except zmq.ZMQError:
                continue  # the port was taken in between
        else:
            raise RuntimeError("no free port")
        self.id = f"127.0.0.1:{port}"
        self.data = MemoryTransport(self.id, num_blocks, block_len)
        self.sessions: dict[str, P2PSession] = {}
        self.loads: list[LoadResult] = []
        self.stores: list[StoreResult] = []

    def _session(self, peer_id: str, conn) -> P2PSession:
        session = P2PSession(peer_id, self.id, self.data, self.data.block_len, "0", conn=conn)
        self.sessions[peer_id] = session
        return session

    def connect(self, other: Node) -> P2PSession:
        return self._session(other.id, self.control.connect(other.id))

    def tick(self) -> None:
        for conn in self.control.poll():
            self._session(conn.peer_id, conn)
        for session in self.sessions.values():
            result = session.poll()
            self.loads.extend(result.loads)
            self.stores.extend(result.stores)


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    a, b = Node(), Node()
    yield a, b
    for node in (a, b):
        for session in node.sessions.values():
            session.close()
        node.control.close()
        _REGIONS.pop(node.id, None)


def _run(a: Node, b: Node, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        a.tick()
        b.tick()
        if done():
            return
        time.sleep(0.002)
    raise AssertionError("condition not reached in time")


def _handshake(a: Node, b: Node) -> tuple[P2PSession, P2PSession]:
    """``b`` connects to ``a``; returns (a's session toward b, b's session toward a)."""
    b_to_a = b.connect(a)
    _run(a, b, lambda: b.id in a.sessions and a.sessions[b.id].ready and b_to_a.ready)
    return a.sessions[b.id], b_to_a


def test_fetch_writes_the_stored_bytes(nodes):
    a, b = nodes
    a_to_b, b_to_a = _handshake(a, b)
    n = a.data.block_len
    a.data.region[2 * n : 3 * n] = bytes(range(n))
    key = OffloadKey(b"block-key")
    a_to_b.add_stored_blocks("req-1", [key], [2], job_id=7)
    b_to_a.request_blocks(job_id=1, kv_request_id="req-1", keys=[key], block_ids=[5])
    _run(a, b, lambda: bool(b.loads) and bool(a.stores))
    assert b.loads == [LoadResult(job_id=1, kv_request_id="req-1", success=True)]
    assert a.stores == [StoreResult(job_id=7, success=True)]
    assert b.data.block(5) == bytes(range(n))


class _Parent(ParentManager):
    """Parent tiering manager holding ``held`` (key -> primary chunk id)."""

    def __init__(self, held: dict[OffloadKey, int]) -> None:
        self.held = held
        self.finished: list[str] = []

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.held else LookupResult.MISS

    def create_store_job(self, keys, req_context: ReqContext) -> TransferJob:
        keys = list(keys)
        chunk_ids = np.array([self.held[k] for k in keys], dtype=np.int64)
        return TransferJob(99, keys, chunk_ids, is_promotion=False, req_context=req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished.append(req_context.req_id)


def test_probe_then_fetch_round_trip(nodes):
    a, b = nodes
    a_to_b, b_to_a = _handshake(a, b)
    hit, miss = OffloadKey(b"hit"), OffloadKey(b"miss")
    n = a.data.block_len
    a.data.region[n : 2 * n] = b"\x07" * n
    parent = _Parent({hit: 1})
    assert b_to_a.register_lookup("req-2", hit) is None
    assert b_to_a.register_lookup("req-2", miss) is None
    b_to_a.flush_pending_lookups()

    def answered() -> bool:
        a_to_b.serve_external_requests(parent)
        return b_to_a.register_lookup("req-2", miss) is not None

    _run(a, b, answered)
    assert b_to_a.register_lookup("req-2", hit) is True
    assert b_to_a.register_lookup("req-2", miss) is False
    b_to_a.request_blocks(job_id=3, kv_request_id="req-2", keys=[hit], block_ids=[0])
    _run(a, b, lambda: bool(b.loads) and bool(a.stores))
    assert b.loads == [LoadResult(3, "req-2", True)]
    assert a.stores == [StoreResult(99, True)]
    assert b.data.block(0) == b"\x07" * n
    assert len(parent.finished) == 1


def test_peer_close_fails_inflight_load(nodes):
    a, b = nodes
    a_to_b, b_to_a = _handshake(a, b)
    b_to_a.request_blocks(job_id=4, kv_request_id="req-3", keys=[OffloadKey(b"k")], block_ids=[1])
    # a parks the demand (nothing stored for it yet). Wait for it: a fetch reaching a after
    # the close opens a new session toward b, whose ConnectMsg b would then take for a
    # protocol error instead of reading a's farewell.
    _run(a, b, lambda: "req-3" in a_to_b._server._requests)
    a_to_b.close()
    del a.sessions[b.id]
    _run(a, b, lambda: not b_to_a.alive)
    assert b_to_a.death_reason == "peer disconnected"
    closed = b_to_a.close()
    assert closed.failed_jobs == [4]
    assert closed.failed_req_ids == ["req-3"]


def _connect_msg(**overrides) -> dict:
    msg = {
        TYPE_KEY: ConnectMsg.TYPE,
        ConnectMsg.PEER_ID: "peer:1",
        ConnectMsg.AGENT_METADATA: b"local:1",  # resolves to the session's own region
        ConnectMsg.BASE_ADDR: 0,
        ConnectMsg.NUM_BLOCKS: 4,
        ConnectMsg.BLOCK_LEN: 64,
        ConnectMsg.HASH_SEED: "0",
    }
    msg.update(overrides)
    return msg


class _Conn:
    """Minimal ControlConnection recording what the session sends."""

    def __init__(self) -> None:
        self.peer_id = "peer:1"
        self.inbox: list = []
        self.sent: list[dict] = []
        self.alive = True

    def send(self, msg: dict) -> None:
        self.sent.append(msg)

    def recv(self) -> list:
        msgs, self.inbox = self.inbox, []
        return msgs

    def mark_dead(self) -> None:
        self.alive = False

    def close(self) -> None:
        self.alive = False


def _session(conn: _Conn | None = None) -> P2PSession:
    transport = MemoryTransport("local:1", num_blocks=4, block_len=64)
    return P2PSession("peer:1", "local:1", transport, 64, "0", conn=conn)


def _ready_session() -> tuple[P2PSession, _Conn]:
    conn = _Conn()
    session = _session(conn)
    conn.inbox = [_connect_msg(), {TYPE_KEY: ConnectAckMsg.TYPE, ConnectAckMsg.PEER_ID: "p"}]
    session.poll()
    assert session.ready and session.alive
    return session, conn


def test_non_bytes_fetch_key_disconnects():
    session, conn = _ready_session()
    conn.inbox = [
        {
            TYPE_KEY: FetchMsg.TYPE,
            FetchMsg.KV_REQUEST_ID: "r",
            FetchMsg.KEYS: [5],  # bytes(5) would silently become five zero bytes
            FetchMsg.BLOCK_INDEXES: [0],
            FetchMsg.ROUND_SEQ: 0,
        }
    ]
    session.poll()
    assert not session.alive
    assert "keys: expected bytes, got int" in session.death_reason


@pytest.mark.parametrize("method", ["request_blocks", "add_stored_blocks"])
def test_key_block_count_mismatch_raises_before_sending(method):
    session, conn = _ready_session()
    sent_before = len(conn.sent)
    keys = [OffloadKey(b"a"), OffloadKey(b"b")]
    with pytest.raises(ValueError, match="block_ids: expected 2 entries"):
        if method == "request_blocks":
            session.request_blocks(1, "r", keys, [0])
        else:
            session.add_stored_blocks("r", keys, [0], 1)
    assert len(conn.sent) == sent_before
    assert not session.has_pending_work
    assert session.poll().stores == []


def test_handshake_timeout_env_is_read_without_vllm_envs(monkeypatch):
    conn = _Conn()
    session = _session(conn)
    session._connected_at -= 5
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "60")
    session.poll()
    assert session.alive
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "2")
    session.poll()
    assert not session.alive
    assert session.death_reason == "handshake timed out"


def test_bad_handshake_timeout_env_raises(monkeypatch):
    session = _session(_Conn())
    monkeypatch.setenv("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="VLLM_P2P_HANDSHAKE_TIMEOUT_S: expected an integer"):
        session.poll()


def test_pending_session_queues_until_attached_and_acked():
    session = _session()
    assert session.alive and not session.connected
    session.request_blocks(1, "r", [OffloadKey(b"a")], [0])
    conn = _Conn()
    session.attach_connection(conn)
    assert [m[TYPE_KEY] for m in conn.sent] == [ConnectMsg.TYPE]
    conn.inbox = [_connect_msg(), {TYPE_KEY: ConnectAckMsg.TYPE, ConnectAckMsg.PEER_ID: "p"}]
    session.poll()
    assert sorted(m[TYPE_KEY] for m in conn.sent[1:]) == [ConnectAckMsg.TYPE, FetchMsg.TYPE]
