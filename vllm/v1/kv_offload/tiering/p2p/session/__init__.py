"""Per-peer protocol sessions of the P2P tier (see :mod:`.session`)."""

from vllm.v1.kv_offload.tiering.p2p.session.session import (
    LoadResult,
    P2PSession,
    SessionCloseResult,
    SessionPollResult,
    StoreResult,
)

__all__ = ["LoadResult", "P2PSession", "SessionCloseResult", "SessionPollResult", "StoreResult"]
