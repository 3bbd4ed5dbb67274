"""Secondary tiers by type name (upstream v0.33's ``kv_offload.tiering.factory``).

A tier config is a dict with ``"type"`` (a registered name, or with ``"module_path"`` the name
of a tier class in that module: an out-of-tree tier needs no registration) and keyword
arguments for the tier's constructor; tier modules are imported when a tier is looked up.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector, BackpressurePolicy
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

_BACKPRESSURE_MODULE = "vllm.v1.kv_offload.tiering.backpressure"

# v0.22's tier type names of tiers registered under v0.33's.
_TIER_ALIASES = {"fs_python": "fs"}


class TierClassError(TypeError, AssertionError):
    """A tier name resolves to something that is not a ``SecondaryTierManager`` subclass
    (an ``AssertionError`` too, as upstream raises)."""


def _tier_class(module_path: str, class_name: str) -> type[SecondaryTierManager]:
    tier_cls = getattr(importlib.import_module(module_path), class_name)
    if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
        raise TierClassError(
            f"{module_path}.{class_name}: expected a SecondaryTierManager subclass, got "
            f"{tier_cls!r}"
        )
    return tier_cls


class SecondaryTierFactory:
    """Tier type -> lazily imported :class:`SecondaryTierManager` subclass."""

    _registry: dict[str, Callable[[], type[SecondaryTierManager]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``tier_type`` (once; else ``ValueError``)."""
        if tier_type in cls._registry:
            raise ValueError(f"Tier '{tier_type}' is already registered.")
        cls._registry[tier_type] = lambda: _tier_class(module_path, class_name)

    @classmethod
    def get_tier_class(cls, tier_config: dict) -> type[SecondaryTierManager]:
        """The class of the tier ``tier_config`` names: its registered ``"type"``, else class
        ``"type"`` of module ``"module_path"`` (``ValueError`` without either)."""
        tier_type = tier_config.get("type")
        if not tier_type:
            raise ValueError("Secondary tier configuration must include 'type'")
        load = cls._registry.get(_TIER_ALIASES.get(tier_type, tier_type))
        if load is not None:
            return load()
        module_path = tier_config.get("module_path")
        if module_path is None:
            raise ValueError(
                f"Unknown secondary tier type: {tier_type!r}. Supported types: "
                f"{list(cls._registry)}. For an out-of-tree tier, also set 'module_path'."
            )
        logger.info("loading out-of-tree secondary tier %r from %r", tier_type, module_path)
        return _tier_class(module_path, tier_type)

    @classmethod
    def create_secondary_tier(
        cls, tier_config: dict, primary_kv_view: memoryview, offloading_spec: OffloadingSpec
    ) -> SecondaryTierManager:
        """The tier ``tier_config`` describes, over the primary rows ``primary_kv_view``
        (``tier_config`` is left as it is).

        A ``"backpressure"`` entry configures the tier's store back-pressure:
        ``"backpressure_cls"`` (required) and ``"policy_cls"`` (optional) name classes, a bare
        name being one of :mod:`.backpressure`; the other keys are the detector's arguments,
        defaulting to its ``default_config`` for the tier's type and ``"locality"``.
        """
        tier_cls = cls.get_tier_class(tier_config)
        kwargs: dict[str, Any] = dict(tier_config)
        tier_type = kwargs.pop("type")
        kwargs.pop("module_path", None)
        bp_config = kwargs.pop("backpressure", None)
        if bp_config is not None:
            # Only when configured: a v0.22 tier's constructor has no such argument.
            kwargs["backpressure_detector"] = _backpressure_detector(
                bp_config, tier_type, kwargs.get("locality")
            )
        return tier_cls(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            **kwargs,
        )


def _import_class(name: str, expected: type) -> type:
    """Class ``name`` (``"pkg.module.Class"``, or a bare name in :mod:`.backpressure`)."""
    module_path, _, class_name = name.rpartition(".")
    module = importlib.import_module(module_path or _BACKPRESSURE_MODULE)
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, expected)):
        raise ValueError(f"{name}: expected a {expected.__name__} class, got {found!r}")
    return found


def _backpressure_detector(
    bp_config: Any, tier_type: str, locality: str | None
) -> BackpressureDetector:
    if not isinstance(bp_config, dict):
        raise TypeError(f"backpressure: expected a dict, got {type(bp_config).__name__}")
    kwargs = dict(bp_config)
    detector_name = kwargs.pop("backpressure_cls", None)
    if not isinstance(detector_name, str):
        raise ValueError(
            "backpressure: expected a 'backpressure_cls' (e.g. 'EMABackpressureDetector'), got "
            f"{detector_name!r}"
        )
    policy_name = kwargs.pop("policy_cls", None)
    policy = _import_class(policy_name, BackpressurePolicy)() if policy_name else None
    detector_cls = _import_class(detector_name, BackpressureDetector)
    for key, value in (detector_cls.default_config(tier_type, locality=locality) or {}).items():
        kwargs.setdefault(key, value)
    return detector_cls(policy=policy, **kwargs)


SecondaryTierFactory.register_tier(
    "example", "vllm.v1.kv_offload.tiering.example.manager", "ExampleSecondaryTierManager"
)
SecondaryTierFactory.register_tier(
    "fs", "vllm.v1.kv_offload.tiering.fs.manager", "FileSystemTierManager"
)
SecondaryTierFactory.register_tier(
    "mooncake", "vllm.v1.kv_offload.tiering.mooncake.manager", "MooncakeTierManager"
)
SecondaryTierFactory.register_tier(
    "obj", "vllm.v1.kv_offload.tiering.obj.manager", "ObjectStoreSecondaryTierManager"
)
SecondaryTierFactory.register_tier(
    "kvcr", "vllm.v1.kv_offload.tiering.kvcr.manager", "KVCRSecondaryTierManager"
)
SecondaryTierFactory.register_tier(
    "p2p", "vllm.v1.kv_offload.tiering.p2p.manager", "P2PSecondaryTierManager"
)
