"""Offloading specs by name (upstream v0.33's ``kv_offload.factory``).

``kv_connector_extra_config["spec_name"]`` (default ``"CPUOffloadingSpec"``) picks the spec: a
registered name, or a class of that name in the module ``extra_config["spec_module_path"]``.
Registered modules are imported only when their spec is created.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

_DEFAULT_SPEC = "CPUOffloadingSpec"


def _load_class(module_path: str, class_name: str) -> type[OffloadingSpec]:
    cls = getattr(importlib.import_module(module_path), class_name)
    if not (isinstance(cls, type) and issubclass(cls, OffloadingSpec)):
        raise TypeError(f"{module_path}.{class_name}: expected an OffloadingSpec subclass")
    return cls


class OffloadingSpecFactory:
    """Name → lazily imported :class:`OffloadingSpec` subclass."""

    _registry: dict[str, Callable[[], type[OffloadingSpec]]] = {}

    @classmethod
    def register_spec(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` as ``name``; a name registers once
        (``ValueError`` on a second time)."""
        if name in cls._registry:
            raise ValueError(f"Connector '{name}' is already registered.")
        cls._registry[name] = lambda: _load_class(module_path, class_name)

    @classmethod
    def get_spec_cls(cls, extra_config: Mapping[str, Any]) -> type[OffloadingSpec]:
        """The spec class ``extra_config`` names (see the module docstring)."""
        name = extra_config.get("spec_name", _DEFAULT_SPEC)
        loader = cls._registry.get(name)
        if loader is not None:
            return loader()
        module_path = extra_config.get("spec_module_path")
        if module_path is None:
            raise ValueError(f"Unsupported spec type: {name}")
        logger.info("Loading out-of-tree offloading spec %r from %r", name, module_path)
        return _load_class(module_path, name)

    @classmethod
    def create_spec(
        cls, config: OffloadingConfig | VllmConfig, kv_cache_config: KVCacheConfig | None = None
    ) -> OffloadingSpec:
        """The spec ``config``'s options name, built from ``config`` (v0.33), or the v0.22
        way from the engine's ``VllmConfig`` and ``kv_cache_config``."""
        if isinstance(config, OffloadingConfig):
            extra = config.extra_config
            args: tuple[Any, ...] = (config,)
        else:
            transfer = config.kv_transfer_config
            if transfer is None:
                raise ValueError("kv_transfer_config: offloading needs one, got None")
            extra = transfer.kv_connector_extra_config or {}
            args = (config, kv_cache_config)
        spec_cls = cls.get_spec_cls(extra)
        logger.info("Creating offloading spec %s", spec_cls.__name__)
        return spec_cls(*args)


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec"
)
OffloadingSpecFactory.register_spec(
    "TieringOffloadingSpec", "vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec"
)
