"""The KV hints a router or orchestrator may attach to one request (upstream v0.33's
``vllm.v1.kv_hints.protocol``).

They are msgspec structs so that they travel inside engine requests as they are and turn into
plain JSON-like values (``msgspec.to_builtins``) for the components that act on them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class KvHintAction(msgspec.Struct, frozen=True):  # type: ignore[call-arg]
    """One versioned action of an envelope.

    ``payload`` holds JSON-compatible values only; its schema belongs to the action type and is
    checked by the component that carries the action out, not here.
    """

    action_id: str
    action_type: str
    action_version: str
    payload: dict[str, Any]


class KvHintsEnvelope(msgspec.Struct, frozen=True):  # type: ignore[call-arg]
    """The hints of one request: a protocol version, a message id and its actions."""

    protocol_version: str
    message_id: str
    actions: list[KvHintAction]
