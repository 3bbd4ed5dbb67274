"""The data plane of the peer-to-peer tier (upstream v0.33's ``tiering.p2p.data.base``).

A :class:`DataTransport` owns this node's block region (``num_blocks`` rows of ``block_len``
bytes each, contiguous from ``base_addr``) and WRITEs rows of it into the same-shaped region of
a registered peer: ``write_blocks(peer, local_idxs=[0, 3], remote_idxs=[5, 7])`` copies local
row 0 to the peer's row 5 and local row 3 to its row 7. The control plane decides who talks to
whom; this layer only moves bytes.

Lifecycle of a transfer: the peer is registered (``add_remote_peer``, with the peer's
``get_agent_metadata()`` bytes and layout), ``write_blocks`` submits without blocking and
returns a transfer id (``None`` when it could not be submitted), ``poll`` reports the ids that
ended since the last poll, and ``cancel`` gives up on ids (``"wait"`` mode keeps those that
are still running, for the caller to poll to the end).

Failures never raise out of ``write_blocks`` or ``poll``: they come back as ``None``, as ids
in ``PollResult.failed``, and, once the transport judges a peer's registration unusable, as
``PollResult.peer_fault`` on every poll scoped to that peer until the peer is removed. The
transport never repairs a peer itself: the session treats a peer fault like a missed
heartbeat, and the manager's teardown (``remove_remote_peer``) is the only way back.

Peers whose :attr:`DataTransport.config_fingerprint` differ hold differently laid out blocks
and must not exchange any (checked in the control-plane handshake).

Threading: no background Python threads; ``poll`` drives progress. Callers serialize every
call themselves (the tiering manager's lock), though they may come from more than one thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Literal, NamedTuple

CancelMode = Literal["immediate", "wait"]

# Hex digits of the config fingerprint (a SHA-256 prefix: 64 bits).
_FINGERPRINT_HEX_DIGITS = 16


class PollResult(NamedTuple):
    """Transfers that ended since the previous poll.

    ``done`` / ``failed``: transfer ids. ``peer_fault``: on a poll scoped to one peer, why
    the transport judged that peer's registration unusable (``None`` while it is healthy).
    """

    done: Sequence[int]
    failed: Sequence[int]
    peer_fault: str | None = None


class DataTransport(ABC):
    """Block WRITEs from this node's region into registered peers' regions.

    ``view``: a 2-D byte memoryview, ``num_blocks`` rows of ``block_len`` bytes, over the
    local blocks. ``config_fields``: the model-layout values whose hash peers must share
    (``None`` or empty: no fingerprint, compatible with every peer).
    """

    def __init__(self, view: memoryview, config_fields: dict | None = None) -> None:
        if not isinstance(view, memoryview):
            raise TypeError(f"view: expected a memoryview, got {type(view).__name__}")
        if view.ndim != 2:
            raise ValueError(
                f"view: expected a 2-D memoryview (blocks x bytes), got {view.ndim} dimensions"
            )
        self._view = view
        self._base_addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        self._num_blocks, self._block_len = view.shape
        self._config_fingerprint = self._compute_fingerprint(config_fields)

    @property
    def base_addr(self) -> int:
        """Address of local block 0."""
        return self._base_addr

    @property
    def num_blocks(self) -> int:
        """Number of local blocks."""
        return self._num_blocks

    @property
    def block_len(self) -> int:
        """Size of one block, in bytes."""
        return self._block_len

    @property
    def config_fingerprint(self) -> str:
        """Hex hash of ``config_fields`` (``""`` when there were none)."""
        return self._config_fingerprint

    @staticmethod
    def _compute_fingerprint(config_fields: dict | None) -> str:
        if not config_fields:
            return ""
        # Canonical JSON, so that key order and spacing never change the hash.
        canonical = json.dumps(config_fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:_FINGERPRINT_HEX_DIGITS]

    @abstractmethod
    def get_agent_metadata(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_remote_peer`` to reach this node."""

    @abstractmethod
    def add_remote_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register ``peer_id`` (its metadata bytes, region address, block count and block
        size in bytes) so that ``write_blocks`` can target it; raises when it cannot."""

    def add_remote_peer_async(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> Future[None]:
        """``add_remote_peer`` without blocking the caller: a future that resolves once the
        peer is registered, or holds the registration's error.

        This default registers inline (for transports whose registration is cheap); the
        session acknowledges a peer only after the future resolves.
        """
        future: Future[None] = Future()
        try:
            self.add_remote_peer(
                peer_id,
                agent_metadata=agent_metadata,
                base_addr=base_addr,
                num_blocks=num_blocks,
                block_len=block_len,
            )
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)
        return future

    @abstractmethod
    def remove_remote_peer(self, peer_id: str) -> None:
        """Forget ``peer_id`` and release what its registration holds (its fault included)."""

    @abstractmethod
    def write_blocks(
        self,
        peer_id: str,
        local_idxs: list[int],
        remote_idxs: list[int],
    ) -> int | None:
        """Start copying local rows ``local_idxs`` into the peer's rows ``remote_idxs`` (same
        length): a transfer id, unique for the transport's life, or ``None`` when the peer is
        unknown or the submission failed."""

    @abstractmethod
    def poll(self, peer_id: str | None = None) -> PollResult:
        """Check the in-flight transfers (of ``peer_id`` only, when given) and hand back, once,
        those that ended.

        Scoping matters because one transport serves every peer session: an unscoped poll
        would consume the completions of the other sessions. ``None`` is for shutdown.
        """

    @abstractmethod
    def cancel(
        self,
        transfer_ids: Iterable[int],
        mode: CancelMode = "immediate",
    ) -> list[int]:
        """Give up on transfers (unknown ids are ignored).

        ``"immediate"``: release every one at once and return ``[]``. ``"wait"``: release
        only those that have stopped; return the ids still running (or not releasable yet),
        which the caller polls until each shows up as done or failed.
        """

    @abstractmethod
    def close(self) -> None:
        """Release everything (in-flight transfers, peers, the local registration).

        Idempotent; nothing else may be called afterwards.
        """
