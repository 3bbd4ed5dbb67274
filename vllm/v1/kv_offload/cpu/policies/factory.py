"""Cache policies by name: the built-in ``"lru"`` and ``"arc"``, policies registered under a
name of their own, and out-of-tree classes imported from a module path."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

logger = logging.getLogger(__name__)


def _import_policy(module_path: str, class_name: str) -> type[CachePolicy]:
    policy_cls = getattr(importlib.import_module(module_path), class_name)
    if not (isinstance(policy_cls, type) and issubclass(policy_cls, CachePolicy)):
        raise TypeError(
            f"{module_path}.{class_name}: expected a CachePolicy subclass, got {policy_cls!r}"
        )
    return policy_cls


class CachePolicyFactory:
    """The registry of cache policies; classes are imported when first asked for."""

    _registry: dict[str, Callable[[], type[CachePolicy]]] = {}

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Make ``module_path.class_name`` the policy called ``name``."""
        if name in cls._registry:
            raise ValueError(f"Cache policy '{name}' is already registered.")
        cls._registry[name] = lambda: _import_policy(module_path, class_name)

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type[CachePolicy]:
        """The policy registered as ``name``, else class ``name`` of ``module_path``."""
        if name in cls._registry:
            return cls._registry[name]()
        if module_path is None:
            raise ValueError(
                f"Unknown cache policy: {name!r}; registered: {sorted(cls._registry)}. An "
                "out-of-tree policy also needs cache_policy_module_path."
            )
        logger.info("Loading out-of-tree cache policy %r from %r.", name, module_path)
        return _import_policy(module_path, name)


CachePolicyFactory.register_cache_policy(
    "lru", "vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy"
)
CachePolicyFactory.register_cache_policy(
    "arc", "vllm.v1.kv_offload.cpu.policies.arc", "ARCCachePolicy"
)
