"""Checking and translating the KVCR tier's config into KVCR's own types.

Every check here runs before the tier opens a socket, maps memory or starts KVCR, so a bad
config fails with nothing to clean up.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvcr import (
    DURATION_METRIC,
    ROUTER_HINT_CAPABILITIES,
    STATE_METRIC,
    TRANSFER_BLOCKS_METRIC,
    TRANSFER_BYTES_METRIC,
)
from kvcr.config import G3Options
from kvcr.policy import FIFOPolicy, G3FIFOPolicy, G3LRUPolicy, KVCachePolicy, LRUPolicy
from kvcr.types import BlockKey

from vllm.v1.core.block_hashing import BlockHash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingKVEventsConfig,
    OffloadingMetricMetadata,
    OffloadKey,
    get_offload_block_hash,
)

BUILTIN_POLICIES: dict[str, type[KVCachePolicy]] = {
    "fifo": FIFOPolicy,
    "lru": LRUPolicy,
    "g3_fifo": G3FIFOPolicy,
    "g3_lru": G3LRUPolicy,
}

_MAX_PORT = 65535


def vllm_metric_name(name: str) -> str:
    """KVCR's metric ``name`` in vLLM's namespace (KVCR itself is framework neutral)."""
    return f"vllm:{name}"


def kvcr_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The Prometheus metrics KVCR reports when its telemetry is on, by vLLM name."""
    return {
        vllm_metric_name(DURATION_METRIC): OffloadingHistogramMetadata(
            documentation="Duration of KVCR operations and their stages, in seconds.",
            labelnames=("scope", "result"),
        ),
        vllm_metric_name(TRANSFER_BYTES_METRIC): OffloadingCounterMetadata(
            documentation="Bytes moved by successful KVCR operations.",
            labelnames=("operation",),
        ),
        vllm_metric_name(TRANSFER_BLOCKS_METRIC): OffloadingCounterMetadata(
            documentation="KV blocks moved by successful KVCR operations.",
            labelnames=("operation",),
        ),
        vllm_metric_name(STATE_METRIC): OffloadingGaugeMetadata(
            documentation="KVCR's current counts of metadata records and operations.",
            labelnames=("resource",),
        ),
    }


def resolve_policy(policy: str | None) -> KVCachePolicy | None:
    """A fresh KVCR placement policy: a built-in name, or ``package.module.Class`` of an
    external :class:`KVCachePolicy` subclass; None keeps KVCR's default."""
    if policy is None:
        return None
    if not isinstance(policy, str):
        raise TypeError(f"policy: expected a str or None, got {policy!r}")
    policy_cls: object = BUILTIN_POLICIES.get(policy)
    if policy_cls is None:
        module_path, _, class_name = policy.rpartition(".")
        if not module_path:
            raise ValueError(
                f"policy: expected one of {sorted(BUILTIN_POLICIES)} or a fully qualified "
                f"module.Class path, got {policy!r}"
            )
        policy_cls = getattr(importlib.import_module(module_path), class_name, None)
        if not (isinstance(policy_cls, type) and issubclass(policy_cls, KVCachePolicy)):
            raise TypeError(f"policy: expected a KVCachePolicy subclass, got {policy_cls!r}")
    return policy_cls()


def check_service_pair(socket_path: str | None, compatibility_digest: str | None) -> None:
    """The guard service needs its socket and its digest: both or neither."""
    if (socket_path is None) != (compatibility_digest is None):
        raise ValueError(
            "kvcr_service_socket_path, compatibility_digest: expected both or neither "
            "(they are configured together), got "
            f"{socket_path!r} and {compatibility_digest!r}"
        )


def check_router_capabilities(router_capabilities: Iterable[str] | None) -> None:
    """KVCR reads router hints, so the router must declare it sends them."""
    declared = set(router_capabilities or ())
    missing = ROUTER_HINT_CAPABILITIES - declared
    if missing:
        raise ValueError(
            f"router_capabilities: expected to include {sorted(ROUTER_HINT_CAPABILITIES)}, "
            f"got {sorted(declared)}"
        )


def check_int(name: str, value: object, lowest: int) -> int:
    """``value`` (config field ``name``) as an int >= ``lowest``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{name}: expected an int >= {lowest}, got {value!r}")
    return value


def check_inventory_events(events: OffloadingKVEventsConfig, keeps_local_inventory: bool) -> None:
    """Blocks KVCR keeps in its own DRAM or G3 are published as events of their medium, which
    only self-describing events can say."""
    needed = events.enable_kv_cache_events and keeps_local_inventory
    if needed and not events.self_describing_kv_events:
        raise ValueError(
            "self_describing_kv_events: expected True when KV cache events are enabled "
            "and KVCR keeps local G2/G3 blocks, got False"
        )


def select_control_port(control_ports: list[int] | None, dp_rank_local: int | None) -> int:
    """The control port of this engine: ``control_ports[dp_rank_local]``, or the only port
    when the local data-parallel rank is unset."""
    if not isinstance(control_ports, list | tuple) or not control_ports:
        raise ValueError(
            f"control_ports: expected a non-empty list of ports, got {control_ports!r}"
        )
    for port in control_ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= _MAX_PORT:
            raise ValueError(f"control_ports: expected ports in [1, {_MAX_PORT}], got {port!r}")
    if dp_rank_local is None:
        if len(control_ports) != 1:
            raise ValueError(
                "control_ports: expected exactly one port when data_parallel_rank_local is "
                f"unset, got {list(control_ports)}"
            )
        return control_ports[0]
    if not 0 <= dp_rank_local < len(control_ports):
        raise ValueError(
            f"control_ports: expected a port for local data-parallel rank {dp_rank_local}, "
            f"got {list(control_ports)}"
        )
    return control_ports[dp_rank_local]


def g3_options(g3: Mapping[str, Any] | None) -> G3Options | None:
    """KVCR's G3 (file-backed storage) options from the config's ``g3`` mapping, whose
    ``paths`` may be strings; its other keys are :class:`G3Options` fields."""
    if g3 is None:
        return None
    if not isinstance(g3, Mapping):
        raise TypeError(f"g3: expected a mapping or None, got {g3!r}")
    paths = g3.get("paths")
    if isinstance(paths, str | bytes) or not isinstance(paths, Iterable):
        raise ValueError(f"g3.paths: expected a list of file paths, got {paths!r}")
    fields = dict(g3)
    fields["paths"] = tuple(Path(path) for path in paths)
    try:
        return G3Options(**fields)
    except TypeError as exc:
        raise TypeError(f"g3: expected G3Options fields, got {sorted(g3)} ({exc})") from exc


class VllmKeyAdapter:
    """vLLM's offload keys (block hash + group index bytes) as KVCR block keys."""

    def encode(self, framework_key: object) -> BlockKey:
        """The KVCR key of an :data:`OffloadKey`."""
        if not isinstance(framework_key, bytes):
            raise TypeError(f"framework_key: expected bytes, got {type(framework_key).__name__}")
        return BlockKey(framework_key)

    def decode(self, key: BlockKey) -> int | bytes:
        """The block hash a KV event publishes for ``key`` (the group index dropped)."""
        return maybe_convert_block_hash(BlockHash(get_offload_block_hash(OffloadKey(key))))
