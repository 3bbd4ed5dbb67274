"""Control plane of the P2P tier: peer connections carrying msgpack-encoded dicts."""

from vllm.v1.kv_offload.tiering.p2p.control.base import ControlConnection, ControlTransport
from vllm.v1.kv_offload.tiering.p2p.control.zmq import ZmqConnection, ZmqTransport

__all__ = ["ControlConnection", "ControlTransport", "ZmqConnection", "ZmqTransport"]
