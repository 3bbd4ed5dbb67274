"""Which single-type manager serves each KV cache spec, and which specs group together
(upstream's ``vllm.v1.kv_cache_spec_registry``).

Out-of-tree code registers a custom spec with :func:`register_kv_cache_spec` (or
:meth:`KVCacheSpecRegistry.register`) instead of editing the built-in table; a spec class
that is not registered resolves through its MRO to the nearest registered ancestor. A group
*role* (``KVCacheGroupRole``) may pick a manager of its own, ahead of the spec's.

Layering: this table belongs to the block-manager layer (:mod:`vllm.v1.core`): it names
manager classes, and the built-in entries (:mod:`vllm.v1.core.kv_cache_spec_table`) are filled
in on first use by :func:`register_all_kvcache_specs`. Spec modules do not import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_spec_table import BUILTIN_ROLE_MANAGERS, BUILTIN_SPECS, HISPARSE_SPECS

if TYPE_CHECKING:
    from vllm.v1.core.single_type_manager_base import SingleTypeKVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "KVCacheSpecMetadata",
    "KVCacheSpecRegistry",
    "register_all_kvcache_specs",
    "register_kv_cache_spec",
]


@dataclass(frozen=True)
class KVCacheSpecMetadata:
    """One registered spec class: its manager and the base class it groups with (specs
    sharing a ``uniform_type_base_spec`` may share one KV cache group)."""

    kvcache_spec_cls: type[KVCacheSpec]
    manager_class: type[SingleTypeKVCacheManager]
    uniform_type_base_spec: type[KVCacheSpec]


_REGISTRY_KVCACHESPEC_LIST: dict[type[KVCacheSpec], KVCacheSpecMetadata] = {}
_REGISTRY_ROLE_MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {}
_BUILTINS_REGISTERED = False


def _nearest_registered(kvcache_spec: KVCacheSpec) -> KVCacheSpecMetadata | None:
    for base in type(kvcache_spec).__mro__:
        metadata = _REGISTRY_KVCACHESPEC_LIST.get(base)
        if metadata is not None:
            return metadata
    return None


class KVCacheSpecRegistry:
    """The process-wide spec -> manager table (class methods only)."""

    @classmethod
    def _ensure_registered(cls, vllm_config: Any = None) -> None:
        """Fill in the built-in specs on first use (specs registered earlier are kept)."""
        if not _BUILTINS_REGISTERED:
            register_all_kvcache_specs(vllm_config)

    @classmethod
    def register(
        cls,
        kvcache_spec_cls: type[KVCacheSpec],
        manager_class: type[SingleTypeKVCacheManager] | None = None,
        uniform_type_base_spec: type[KVCacheSpec] | None = None,
    ) -> None:
        """Serve ``kvcache_spec_cls`` (and unregistered subclasses) with ``manager_class``
        and group it with ``uniform_type_base_spec`` (default: itself, a new base kind).
        Registering a class again is allowed only with the same manager and base."""
        # AssertionError, as upstream: callers and its tests match on it.
        assert manager_class is not None, "manager_class is required"
        if uniform_type_base_spec is None:
            uniform_type_base_spec = kvcache_spec_cls
        assert issubclass(kvcache_spec_cls, uniform_type_base_spec), (
            f"{kvcache_spec_cls.__name__} must inherit from its declared "
            f"uniform_type_base_spec {uniform_type_base_spec.__name__}"
        )
        metadata = KVCacheSpecMetadata(
            kvcache_spec_cls=kvcache_spec_cls,
            manager_class=manager_class,
            uniform_type_base_spec=uniform_type_base_spec,
        )
        registered = _REGISTRY_KVCACHESPEC_LIST.get(kvcache_spec_cls)
        assert registered is None or registered == metadata, (
            f"Conflicting registration for KVCacheSpec {kvcache_spec_cls.__name__}"
        )
        _REGISTRY_KVCACHESPEC_LIST[kvcache_spec_cls] = metadata

    @classmethod
    def register_role_manager(
        cls, role: str, manager_class: type[SingleTypeKVCacheManager]
    ) -> None:
        """Serve every group of ``role`` with ``manager_class``, whatever its spec."""
        registered = _REGISTRY_ROLE_MANAGERS.get(role)
        assert registered is None or registered is manager_class, (
            f"Conflicting manager registration for group role {role}"
        )
        _REGISTRY_ROLE_MANAGERS[role] = manager_class

    @classmethod
    def get_manager_class(
        cls, kvcache_spec: KVCacheSpec, role: str | None = None
    ) -> type[SingleTypeKVCacheManager] | None:
        """The manager of a group with ``kvcache_spec`` (and ``role``, whose manager wins
        when one is registered); None when neither is registered."""
        cls._ensure_registered()
        if role is not None:
            manager_class = _REGISTRY_ROLE_MANAGERS.get(role)
            if manager_class is not None:
                return manager_class
        metadata = _nearest_registered(kvcache_spec)
        return None if metadata is None else metadata.manager_class

    @classmethod
    def get_uniform_type_base_spec(cls, kvcache_spec: KVCacheSpec) -> type[KVCacheSpec] | None:
        """The base class ``kvcache_spec`` groups with; None when it is not registered."""
        cls._ensure_registered()
        metadata = _nearest_registered(kvcache_spec)
        return None if metadata is None else metadata.uniform_type_base_spec

    @classmethod
    def registered_spec_classes(cls) -> tuple[type[KVCacheSpec], ...]:
        """The spec classes registered so far (the built-ins included), in registration
        order."""
        cls._ensure_registered()
        return tuple(_REGISTRY_KVCACHESPEC_LIST)

    @classmethod
    def check_kv_cache_spec_registry(cls, kv_cache_spec: dict[str, KVCacheSpec]) -> None:
        """``ValueError`` naming the first layer of ``kv_cache_spec`` (layer name -> spec)
        whose spec has no registered manager."""
        cls._ensure_registered()
        for layer_name, spec in kv_cache_spec.items():
            if _nearest_registered(spec) is None:
                raise ValueError(
                    f"Unsupported KV cache spec type for layer {layer_name}: "
                    f"{type(spec).__name__}; register it with @register_kv_cache_spec"
                )


def register_kv_cache_spec(
    manager_class: type[SingleTypeKVCacheManager] | None = None,
    uniform_type_base_spec: type[KVCacheSpec] | None = None,
) -> Any:
    """Class decorator: :meth:`KVCacheSpecRegistry.register` the decorated spec class."""

    def decorator(kvcache_spec_cls: type[KVCacheSpec]) -> type[KVCacheSpec]:
        KVCacheSpecRegistry.register(kvcache_spec_cls, manager_class, uniform_type_base_spec)
        return kvcache_spec_cls

    return decorator


def register_all_kvcache_specs(vllm_config: Any = None) -> None:
    """Register the built-in specs and group roles, then whatever the current platform adds
    (its optional ``register_custom_kv_cache_specs(vllm_config)``). Safe to call again."""
    global _BUILTINS_REGISTERED
    _BUILTINS_REGISTERED = True
    for role, manager in BUILTIN_ROLE_MANAGERS.items():
        KVCacheSpecRegistry.register_role_manager(role, manager)
    for spec, (manager, base) in (BUILTIN_SPECS | HISPARSE_SPECS).items():
        KVCacheSpecRegistry.register(spec, manager, uniform_type_base_spec=base)
    # Imported here: the platform module pulls in torch device probing.
    from vllm.platforms import current_platform

    register_platform_specs = getattr(current_platform, "register_custom_kv_cache_specs", None)
    if register_platform_specs is not None:
        register_platform_specs(vllm_config)
