"""Data plane of the peer-to-peer tier: block WRITEs between peers' host memory."""

from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport, PollResult
from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

__all__ = ["DataTransport", "NixlTransport", "PollResult"]
