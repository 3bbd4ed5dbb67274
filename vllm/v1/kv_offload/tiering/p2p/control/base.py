"""Interfaces of the P2P control plane.

A :class:`ControlTransport` (one per engine) listens for peers, opens connections to them
and, each time the owner calls :meth:`ControlTransport.poll`, moves bytes: it fills every
connection's inbox, creates connections for peers that spoke first, and notices peers that
went away. A :class:`ControlConnection` (one per peer) carries dicts; it never interprets
them. Nothing here runs a thread of its own: the owner drives every call, one at a time
(the sockets underneath are not thread-safe).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class ControlConnection(ABC):
    """Message channel to one remote peer, named by ``peer_id`` (``"host:port"``).

    Created by the transport, used by one session, marked dead when the peer goes away
    (:meth:`mark_dead`), and released with :meth:`close`.
    """

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once :meth:`mark_dead` or :meth:`close` ran."""

    @abstractmethod
    def send(self, msg: dict) -> None:
        """Queue ``msg`` for the peer without blocking; raises if the connection is closed
        or the peer stopped reading."""

    @abstractmethod
    def recv(self) -> Sequence[dict]:
        """Every message received since the last call (maybe none); do not mutate it."""

    @abstractmethod
    def mark_dead(self) -> None:
        """Flag the peer as gone. Only :meth:`close` releases the sockets."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection's resources; idempotent."""


class ControlTransport(ABC):
    """Owner of the listening socket and of every peer connection of one engine."""

    @abstractmethod
    def connect(self, peer_id: str) -> ControlConnection:
        """Open a connection to ``peer_id`` (``"host:port"``); sends queue at once.

        A registered connection to ``peer_id`` that is no longer alive is replaced; a live
        one is a duplicate and is refused.
        """

    @abstractmethod
    def poll(self) -> Sequence[ControlConnection]:
        """Do the pending I/O; return connections accepted in this call only.

        Each returned connection already holds the first message(s) of its peer.
        """

    @abstractmethod
    def close(self) -> None:
        """Close the listening socket and every connection; idempotent."""
