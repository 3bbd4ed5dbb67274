"""The offloading connector's stats payload at upstream v0.33's path
(``kv_connector.v1.offloading.metrics``); the library defines it in
:mod:`vllm.v1.kv_offload.metrics`, below the connector, so tiers and managers can use it."""

from vllm.v1.kv_offload.metrics import OffloadingConnectorStats

__all__ = ["OffloadingConnectorStats"]
