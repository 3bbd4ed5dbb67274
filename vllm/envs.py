"""Environment settings, upstream's ``vllm.envs`` names and defaults.

Each setting is read from ``os.environ`` on every attribute access (``vllm.envs.NAME``), never
cached, so a change to the environment takes effect at the next read. A value that does not
parse raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "VLLM_MAX_EMBED_DECODE_BYTES",
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S",
    "VLLM_P2P_IDLE_TIMEOUT_S",
    "VLLM_P2P_MAX_PEERS",
    "VLLM_P2P_SIDE_CHANNEL_HOST",
    "VLLM_P2P_SIDE_CHANNEL_PORT",
]

VLLM_MAX_EMBED_DECODE_BYTES: int
"""Most bytes a sparse embedding payload may densify to (0: no limit)."""
VLLM_P2P_HANDSHAKE_TIMEOUT_S: int
"""Seconds a connected peer-to-peer session may wait for its handshake."""
VLLM_P2P_IDLE_TIMEOUT_S: int
"""Seconds an idle peer-to-peer session is kept before it is closed."""
VLLM_P2P_MAX_PEERS: int
"""Most peer-to-peer sessions one engine keeps open."""
VLLM_P2P_SIDE_CHANNEL_HOST: str
"""Host the peer-to-peer tier's control socket binds and advertises."""
VLLM_P2P_SIDE_CHANNEL_PORT: int
"""Port of the peer-to-peer tier's control socket."""


def _integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def _text(name: str, raw: str) -> str:
    return raw


_SETTINGS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "VLLM_MAX_EMBED_DECODE_BYTES": ("2147483648", _integer),
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S": ("30", _integer),
    "VLLM_P2P_IDLE_TIMEOUT_S": ("300", _integer),
    "VLLM_P2P_MAX_PEERS": ("128", _integer),
    "VLLM_P2P_SIDE_CHANNEL_HOST": ("localhost", _text),
    "VLLM_P2P_SIDE_CHANNEL_PORT": ("5710", _integer),
}


def __getattr__(name: str) -> Any:
    if name not in _SETTINGS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    default, parse = _SETTINGS[name]
    return parse(name, os.environ.get(name, default))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SETTINGS))


def is_set(name: str) -> bool:
    """Whether setting ``name`` is given in the environment (not left to its default)."""
    if name not in _SETTINGS:
        raise ValueError(f"name: expected one of {', '.join(_SETTINGS)}, got {name!r}")
    return name in os.environ
