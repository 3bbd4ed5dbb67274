"""KV-transfer settings (upstream's ``KVTransferConfig``, reduced to what the offloading
specs and connectors here read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["KVTransferConfig"]

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


@dataclass
class KVTransferConfig:
    """Which KV connector runs, in which role, with which connector options.

    ``kv_connector_extra_config`` holds the connector's own options (for offloading: the
    ``OffloadingSpec`` options, e.g. ``cpu_bytes_to_use``, ``block_size``).
    """

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_role: KVRole | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if self.kv_role is not None and self.kv_role not in (
            "kv_producer",
            "kv_consumer",
            "kv_both",
        ):
            raise ValueError(
                f"kv_role: expected 'kv_producer', 'kv_consumer' or 'kv_both', got {self.kv_role!r}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_connector_extra_config: expected a dict, got "
                f"{type(self.kv_connector_extra_config).__name__}"
            )

    @property
    def is_kv_transfer_instance(self) -> bool:
        """True when a connector is set and a role is given."""
        return self.kv_connector is not None and self.kv_role is not None

    @property
    def is_kv_producer(self) -> bool:
        """True when this instance sends KV (``kv_producer`` or ``kv_both``)."""
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """True when this instance receives KV (``kv_consumer`` or ``kv_both``)."""
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """``kv_connector_extra_config[key]``, or ``default`` when unset."""
        return self.kv_connector_extra_config.get(key, default)
