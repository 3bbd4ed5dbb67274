"""Secondary tiers by type name (upstream v0.22's ``kv_offload.tiering.factory``).

A tier config is a dict with ``"type"`` (a registered name) and keyword arguments for the
tier's constructor; registered modules are imported when a tier of their type is created.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec


class SecondaryTierFactory:
    """Tier type → lazily imported :class:`SecondaryTierManager` subclass."""

    _registry: dict[str, Callable[[], type[SecondaryTierManager]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``tier_type`` (once; else ``ValueError``)."""
        if tier_type in cls._registry:
            raise ValueError(f"Tier '{tier_type}' is already registered.")

        def load() -> type[SecondaryTierManager]:
            tier_cls = getattr(importlib.import_module(module_path), class_name)
            if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
                raise TypeError(
                    f"{module_path}.{class_name}: expected a SecondaryTierManager subclass"
                )
            return tier_cls

        cls._registry[tier_type] = load

    @classmethod
    def create_secondary_tier(
        cls, tier_config: dict, primary_kv_view: memoryview, offloading_spec: OffloadingSpec
    ) -> SecondaryTierManager:
        """The tier ``tier_config`` describes, over the primary rows ``primary_kv_view``."""
        kwargs: dict[str, Any] = dict(tier_config)
        tier_type = kwargs.pop("type", None)
        if not tier_type:
            raise ValueError("Secondary tier configuration must include 'type'")
        load = cls._registry.get(tier_type)
        if load is None:
            raise ValueError(
                f"Unknown secondary tier type: {tier_type!r}. "
                f"Supported types: {list(cls._registry)}"
            )
        return load()(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            **kwargs,
        )


SecondaryTierFactory.register_tier(
    "example", "vllm.v1.kv_offload.tiering.example.manager", "ExampleSecondaryTierManager"
)
SecondaryTierFactory.register_tier(
    "fs_python", "vllm.v1.kv_offload.tiering.fs.manager", "FileSystemTierManager"
)
SecondaryTierFactory.register_tier(
    "mooncake", "vllm.v1.kv_offload.tiering.mooncake.manager", "MooncakeTierManager"
)
