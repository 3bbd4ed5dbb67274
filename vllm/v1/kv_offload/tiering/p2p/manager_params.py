"""Per-request routing state and settings of the peer-to-peer tier's manager.

A request's ``kv_transfer_params`` name its role toward a peer: ``remote_prefiller`` (PD
decoder: load every block from the prefiller named by ``remote_host``/``remote_port``),
``remote_kv_source`` (symmetric P2P consumer: probe the named peer for each key first) or
``remote_decoder`` (producer: keep the stored blocks for the consumer that will fetch them by
``kv_request_id``). They are parsed once, in ``on_new_request``, and cached on the
:class:`~vllm.v1.kv_offload.base.ReqContext`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext


@dataclass(slots=True)
class P2PSourceInfo:
    """Consumer side: the request loads its blocks from peer ``peer_id`` (``host:port``).

    ``do_probe``: ask the peer key by key first (symmetric P2P); PD decoders do not, since
    the prefiller holds every block.
    """

    kv_request_id: str
    peer_id: str
    do_probe: bool


@dataclass(slots=True)
class P2PDestInfo:
    """Producer side: a peer will fetch this request's blocks by ``kv_request_id``.

    ``None`` when the ``remote_decoder`` block has no id: still a remote-decode request, whose
    stores must then fail rather than succeed locally.
    """

    kv_request_id: str | None


@dataclass
class _UnboundStoreBatch:
    """Blocks of one store job kept for a ``kv_request_id`` no peer has fetched yet; handed
    to the session whose peer fetches the id, or failed after the unbound-store timeout.
    ``submitted_at``: ``time.monotonic()`` seconds."""

    job_id: int
    keys: list[OffloadKey]
    block_ids: Sequence[int]
    submitted_at: float = field(default_factory=time.monotonic)


def _peer_id_from_params(role_params: dict) -> str | None:
    """``host:port`` from a role's ``remote_host`` and ``remote_port``, else ``None``."""
    host = role_params.get("remote_host")
    port = role_params.get("remote_port")
    if host and port:
        return f"{host}:{port}"
    return None


def _parse_source(kv_params: dict | None) -> P2PSourceInfo | None:
    """The consumer role (``remote_prefiller``, else ``remote_kv_source``), or ``None`` when
    absent or missing its peer address or id."""
    if not kv_params:
        return None
    role = kv_params.get("remote_prefiller")
    do_probe = role is None
    if do_probe:
        role = kv_params.get("remote_kv_source")
    if not role:
        return None
    peer_id = _peer_id_from_params(role)
    kv_request_id = role.get("kv_request_id")
    if peer_id is None or not kv_request_id:
        return None
    return P2PSourceInfo(kv_request_id=kv_request_id, peer_id=peer_id, do_probe=do_probe)


def _parse_dest(kv_params: dict | None) -> P2PDestInfo | None:
    """The producer role (``remote_decoder``), or ``None`` when the block is absent."""
    if not kv_params:
        return None
    role = kv_params.get("remote_decoder")
    if role is None:
        return None
    return P2PDestInfo(kv_request_id=role.get("kv_request_id") or None)


def _annotate_req_context(req_context: ReqContext) -> None:
    """Parse the request's P2P roles once and cache them on ``req_context``."""
    source = _parse_source(req_context.kv_transfer_params)
    if source is not None:
        req_context.set_state(source)
    dest = _parse_dest(req_context.kv_transfer_params)
    if dest is not None:
        req_context.set_state(dest)
