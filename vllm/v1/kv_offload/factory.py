"""Offloading specs by name (upstream v0.22's ``kv_offload.factory``).

``kv_connector_extra_config["spec_name"]`` (default ``"CPUOffloadingSpec"``) picks the spec: a
registered name, or a class of that name in the module ``extra_config["spec_module_path"]``.
Registered modules are imported only when their spec is created.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadingSpec

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
    def create_spec(cls, config: VllmConfig, kv_cache_config: KVCacheConfig) -> OffloadingSpec:
        """The spec ``config.kv_transfer_config`` names, built for ``kv_cache_config``."""
        transfer = config.kv_transfer_config
        if transfer is None:
            raise ValueError("kv_transfer_config: offloading needs one, got None")
        extra = transfer.kv_connector_extra_config or {}
        name = extra.get("spec_name", _DEFAULT_SPEC)
        loader = cls._registry.get(name)
        if loader is not None:
            spec_cls = loader()
        else:
            module_path = extra.get("spec_module_path")
            if module_path is None:
                raise ValueError(f"Unsupported spec type: {name}")
            spec_cls = _load_class(module_path, name)
        logger.info("Creating offloading spec %s", name)
        return spec_cls(config, kv_cache_config)


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec"
)
OffloadingSpecFactory.register_spec(
    "TieringOffloadingSpec", "vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec"
)
