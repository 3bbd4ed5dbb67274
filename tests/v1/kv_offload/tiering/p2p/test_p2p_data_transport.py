"""The P2P tier's data plane beyond upstream's tests: real NIXL WRITEs between two agents in
host memory (UCX loopback), the default asynchronous registration, and the input errors."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from unittest.mock import patch

import numpy as np
import pytest

from vllm.v1.kv_offload.tiering.p2p.data import DataTransport, NixlTransport, PollResult
from vllm.v1.kv_offload.tiering.p2p.data import nixl as nixl_module

_NUM_BLOCKS = 4
_BLOCK_LEN = 256

needs_nixl = pytest.mark.skipif(
    nixl_module._NixlAgent is None, reason="NIXL's Python package is not installed"
)


def _blocks(fill: bool) -> np.ndarray:
    if not fill:
        return np.zeros((_NUM_BLOCKS, _BLOCK_LEN), dtype=np.uint8)
    values = np.arange(_NUM_BLOCKS * _BLOCK_LEN, dtype=np.uint32) % 251
    return values.astype(np.uint8).reshape(_NUM_BLOCKS, _BLOCK_LEN)


def _wait(transport: NixlTransport, peer_id: str | None, timeout_s: float = 10.0) -> PollResult:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = transport.poll(peer_id)
        if result.done or result.failed:
            return result
        time.sleep(0.001)
    raise AssertionError("transfer did not finish")


@pytest.fixture
def pair() -> Iterator[tuple[NixlTransport, NixlTransport, np.ndarray, np.ndarray]]:
    src, dst = _blocks(fill=True), _blocks(fill=False)
    a = NixlTransport("p2p-data-test-a", memoryview(src), num_threads=0)
    b = NixlTransport("p2p-data-test-b", memoryview(dst), num_threads=0)
    try:
        a.add_remote_peer("b", b.get_agent_metadata(), b.base_addr, b.num_blocks, b.block_len)
        yield a, b, src, dst
    finally:
        a.close()
        b.close()


@needs_nixl
def test_write_lands_blocks_at_remote_indexes(pair):
    a, _, src, dst = pair
    tid = a.write_blocks("b", [0, 3], [2, 1])
    assert tid is not None
    assert _wait(a, "b") == PollResult(done=[tid], failed=(), peer_fault=None)
    np.testing.assert_array_equal(dst[2], src[0])
    np.testing.assert_array_equal(dst[1], src[3])
    assert not dst[0].any() and not dst[3].any()
    # Drained: a second poll has nothing, and the id is not reported twice.
    assert a.poll("b") == PollResult(done=(), failed=())


@needs_nixl
def test_scoped_poll_leaves_other_peers_transfers(pair):
    a, b, src, dst = pair
    a.add_remote_peer("b2", b.get_agent_metadata(), b.base_addr, b.num_blocks, b.block_len)
    tid_b2 = a.write_blocks("b2", [1], [0])
    assert tid_b2 is not None
    assert a.poll("b") == PollResult(done=(), failed=())
    assert _wait(a, "b2").done == [tid_b2]
    np.testing.assert_array_equal(dst[0], src[1])


@needs_nixl
def test_removed_peer_is_no_longer_writable(pair):
    a, _, _, _ = pair
    a.remove_remote_peer("b")
    assert a.write_blocks("b", [0], [0]) is None
    a.remove_remote_peer("b")  # removing twice is harmless


@needs_nixl
def test_close_is_idempotent(pair):
    a, _, _, _ = pair
    assert a.write_blocks("b", [0], [0]) is not None
    a.close()
    assert not a.available
    a.close()


def test_fingerprint_ignores_key_order():
    view = memoryview(_blocks(fill=False))
    with patch.object(nixl_module, "_NixlAgent", None):
        one = NixlTransport("x", view, config_fields={"a": 1, "b": [2, 3]})
        two = NixlTransport("y", view, config_fields={"b": [2, 3], "a": 1})
    assert one.config_fingerprint == two.config_fingerprint


class _InlineTransport(DataTransport):
    """A transport whose registration runs inline (the base class's default async path)."""

    def __init__(self, view: memoryview, fail: Exception | None = None) -> None:
        super().__init__(view)
        self.fail = fail
        self.peers: dict[str, tuple] = {}

    def get_agent_metadata(self) -> bytes:
        return b""

    def add_remote_peer(self, peer_id, agent_metadata, base_addr, num_blocks, block_len):
        if self.fail is not None:
            raise self.fail
        self.peers[peer_id] = (agent_metadata, base_addr, num_blocks, block_len)

    def remove_remote_peer(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)

    def write_blocks(self, peer_id, local_idxs, remote_idxs):
        return None

    def poll(self, peer_id=None):
        return PollResult(done=(), failed=())

    def cancel(self, transfer_ids, mode="immediate"):
        return []

    def close(self) -> None:
        self.peers.clear()


def test_default_async_registration_resolves_inline():
    transport = _InlineTransport(memoryview(_blocks(fill=False)))
    future = transport.add_remote_peer_async("p", b"m", 0x10, 2, _BLOCK_LEN)
    assert isinstance(future, Future) and future.done()
    assert future.result() is None
    assert transport.peers == {"p": (b"m", 0x10, 2, _BLOCK_LEN)}


def test_default_async_registration_carries_the_error():
    error = RuntimeError("registration refused")
    transport = _InlineTransport(memoryview(_blocks(fill=False)), fail=error)
    future = transport.add_remote_peer_async("p", b"m", 0x10, 2, _BLOCK_LEN)
    assert future.exception() is error


@pytest.mark.parametrize(
    ("view", "error", "match"),
    [
        (b"\0" * 16, TypeError, "view: expected a memoryview, got bytes"),
        (memoryview(bytearray(16)), ValueError, "view: expected a 2-D memoryview"),
    ],
)
def test_bad_view_is_rejected(view, error, match):
    with pytest.raises(error, match=match):
        _InlineTransport(view)


def _offline_transport() -> NixlTransport:
    with patch.object(nixl_module, "_NixlAgent", None):
        return NixlTransport("offline", memoryview(_blocks(fill=False)))


@pytest.mark.parametrize("num_threads", [-1, 1.5, True])
def test_bad_num_threads_is_rejected(num_threads):
    with (
        patch.object(nixl_module, "_NixlAgent", None),
        pytest.raises(ValueError, match="num_threads: expected an int >= 0"),
    ):
        NixlTransport("x", memoryview(_blocks(fill=False)), num_threads=num_threads)


def test_without_nixl_registration_fails_and_metadata_raises():
    transport = _offline_transport()
    with pytest.raises(RuntimeError, match="NIXL is not available"):
        transport.get_agent_metadata()
    future = transport.add_remote_peer_async("p", b"m", 0x10, 2, _BLOCK_LEN)
    with pytest.raises(RuntimeError, match="NIXL is not available"):
        future.result(timeout=0)
    with pytest.raises(RuntimeError, match="NIXL is not available"):
        transport.add_remote_peer("p", b"m", 0x10, 2, _BLOCK_LEN)
    transport.close()


@pytest.mark.parametrize(
    ("num_blocks", "block_len", "match"),
    [(0, _BLOCK_LEN, "num_blocks: expected an int >= 1, got 0"), (2, -4, "block_len")],
)
def test_bad_remote_layout_is_rejected(num_blocks, block_len, match):
    transport = _offline_transport()
    transport._agent = object()  # any agent: the layout is checked before it is used
    with pytest.raises(ValueError, match=match):
        transport.add_remote_peer_async("p", b"m", 0x10, num_blocks, block_len)


def test_mismatched_index_lists_are_rejected():
    transport = _offline_transport()
    with pytest.raises(ValueError, match="remote_idxs: expected 2 indexes"):
        transport.write_blocks("p", [0, 1], [0])


def test_bad_cancel_mode_is_rejected():
    transport = _offline_transport()
    with pytest.raises(ValueError, match="mode: expected 'immediate' or 'wait', got 'later'"):
        transport.cancel([1], mode="later")  # type: ignore[arg-type]
