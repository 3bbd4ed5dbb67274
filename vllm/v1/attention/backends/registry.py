"""Backend registry and selector.

Registry: :class:`AttentionBackendEnum` names each backend by its class path; ``CUSTOM`` is a
slot with no class, for a third-party backend. :class:`MambaAttentionBackendEnum` is the same
for the backends of state-space (Mamba) layers, of which the library ships none (only
``CUSTOM``). :func:`register_backend` points a member at another class (an override, undone by
``clear_override``) or adds a member by name; ``get_class`` resolves a member, honouring
overrides, by importing its class path.

Selector: ``get_attn_backend`` validates a configuration against a named backend (or picks the
first backend that serves it) before anything is allocated, and raises ``ValueError`` naming
every missing piece otherwise. The order: on a GPU FLASHINFER, the packed-slot TURBOQUANT and
ULTRAQUANT (each serves only its own formats, which upstream resolves to them), TRITON_ATTN then
REFERENCE (FLASHINFER left out on a CUDA host where the flashinfer package does not import,
unless it was overridden), on the CPU the compiled CPU_ATTN then REFERENCE (the reference backend
is pure torch: it serves everything, slowly).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from collections.abc import Callable
from enum import Enum, EnumMeta
from typing import Any, TypeVar

import torch

from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    DeviceCapability,
    as_device_capability,
)

logger = logging.getLogger(__name__)

_OVERRIDES: dict[_BackendRegistry, str] = {}
"""Member (of either enum) -> the class path registered in place of its own."""

_E = TypeVar("_E", bound="_BackendRegistry")
_C = TypeVar("_C", bound=type)


def _check_class_path(arg: str, path: object) -> str:
    module, _, name = path.rpartition(".") if isinstance(path, str) else ("", "", "")
    if not (module and name.isidentifier()):
        raise ValueError(f"{arg}: expected a class path 'package.module.Class', got {path!r}")
    return path  # type: ignore[return-value]


class _BackendEnumMeta(EnumMeta):
    """Looking a member up by an unknown name raises ``ValueError`` listing the names."""

    def __getitem__(cls, name: str) -> Any:
        try:
            return super().__getitem__(name)
        except KeyError:
            raise cls._unknown_name(name) from None

    def _unknown_name(cls, name: object) -> ValueError:
        return ValueError(
            f"backend: unknown attention backend {name!r}; expected one of "
            f"{', '.join(cls.__members__)}"
        )


class _BackendRegistry:
    """What both backend enums do: each member's value is its default class path (``None`` for
    a slot to be registered)."""

    name: str
    value: str | None

    @classmethod
    def register(cls: type[_E], name: str, value: str | None = None) -> _E:
        """Add the member ``name`` (default class path ``value``, ``None`` for none) to this
        enum and return it. ``ValueError`` for a name it already has (use
        :func:`register_backend` on that member to override it) or one that is not an
        identifier or names an attribute of the enum."""
        members: dict[str, Any] = cls._member_map_  # type: ignore[attr-defined]
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(
                f"name: Invalid or reserved backend name; expected an identifier, got {name!r}"
            )
        if name in members:
            raise ValueError(
                f"name: backend {name!r} already exists in {cls.__name__}; override it with "
                f"register_backend({cls.__name__}.{name}, 'package.module.Class')"
            )
        if hasattr(cls, name):
            raise ValueError(
                f"name: Invalid or reserved backend name; expected one that is not an "
                f"attribute of {cls.__name__}, got {name!r}"
            )
        if value is not None:
            _check_class_path("value", value)
        # An Enum has no public way to grow after its class is made: fill in what its
        # metaclass would have for a member declared in the class body.
        member = object.__new__(cls)
        member._name_ = name  # type: ignore[attr-defined]
        member._value_ = value  # type: ignore[attr-defined]
        setattr(cls, name, member)
        members[name] = member
        cls._member_names_.append(name)  # type: ignore[attr-defined]
        if value is not None:  # a None lookup keeps finding CUSTOM
            cls._value2member_map_.setdefault(value, member)  # type: ignore[attr-defined]
        logger.info("registered attention backend %s.%s -> %s", cls.__name__, name, value)
        return member

    @classmethod
    def parse(cls: type[_E], name: str | _E) -> _E:
        """The member named ``name`` (exactly, else upper-cased); ``ValueError`` listing all
        names."""
        if isinstance(name, cls):
            return name
        if not isinstance(name, str):
            raise ValueError(
                f"backend: expected a backend name or a member of {cls.__name__}, got {name!r}"
            )
        members: dict[str, _E] = cls.__members__  # type: ignore[attr-defined]
        found = members.get(name, members.get(name.upper()))
        if found is None:
            raise cls._unknown_name(name)  # type: ignore[attr-defined]
        return found

    def get_path(self, include_classname: bool = True) -> str:
        """The class path this member resolves to (its override, else its value); without
        ``include_classname``, the module's. ``ValueError`` for a slot never registered."""
        path = _OVERRIDES.get(self, self.value)
        if not path:
            kind = type(self).__name__
            raise ValueError(
                f"{kind}.{self.name}: no backend class registered; call "
                f"register_backend({kind}.{self.name}, 'package.module.Class') first"
            )
        return path if include_classname else path.rpartition(".")[0]

    def get_class(self) -> type[AttentionBackend]:
        """The backend class of :meth:`get_path`, imported. ``ImportError`` when its module
        does not import or lacks the class, ``ValueError`` when it is not a backend class."""
        path = self.get_path()
        module_name, _, class_name = path.rpartition(".")
        found = getattr(importlib.import_module(module_name), class_name, None)
        if found is None:
            raise ImportError(
                f"{type(self).__name__}.{self.name}: {module_name} has no "
                f"{class_name} (class path {path!r})"
            )
        if not (isinstance(found, type) and issubclass(found, AttentionBackend)):
            raise ValueError(
                f"{type(self).__name__}.{self.name}: expected {path!r} to be an "
                f"AttentionBackend subclass, got {found!r}"
            )
        return found

    def is_overridden(self) -> bool:
        """Whether :func:`register_backend` pointed this member at a class."""
        return self in _OVERRIDES

    def clear_override(self) -> None:
        """Back to the member's own class path (nothing happens without an override)."""
        _OVERRIDES.pop(self, None)


class AttentionBackendEnum(_BackendRegistry, Enum, metaclass=_BackendEnumMeta):
    """Registered backends: member name = registry name, value = class path."""

    FLASHINFER = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    REFERENCE = "vllm.v1.attention.backends.reference.ReferenceAttentionBackend"
    CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    MLA_COMMON = "vllm.v1.attention.backends.mla.common.MLACommonBackend"
    TURBOQUANT = "vllm.v1.attention.backends.turboquant_attn.TurboQuantAttentionBackend"
    ULTRAQUANT = "vllm.v1.attention.backends.ultraquant_attn.UltraQuantAttentionBackend"
    # A slot for a third-party backend. None, not "": a value equal to another member's would
    # make CUSTOM an alias of that member, and registering CUSTOM would override it.
    CUSTOM = None


class MambaAttentionBackendEnum(_BackendRegistry, Enum, metaclass=_BackendEnumMeta):
    """Backends of state-space (Mamba) layers: none ships here, only the ``CUSTOM`` slot and
    members added with :func:`register_backend` (``is_mamba=True``)."""

    CUSTOM = None


def register_backend(
    backend: AttentionBackendEnum | MambaAttentionBackendEnum | str,
    class_path: str | None = None,
    is_mamba: bool = False,
) -> Callable[[_C], _C]:
    """Point ``backend`` at another class, or add a backend.

    ``backend`` is a member of :class:`AttentionBackendEnum` (of
    :class:`MambaAttentionBackendEnum` with ``is_mamba``), or a new name, which becomes a new
    member of that enum. With ``class_path`` the override is made now and the returned
    decorator does nothing; without it, the returned decorator registers the class it decorates
    (a module-level class: its path is imported again by ``get_class``)::

        register_backend(AttentionBackendEnum.CUSTOM, "my_pkg.attn.MyBackend")

        @register_backend("MY_MLA")
        class MyMLABackend(AttentionBackend): ...
    """
    enum_cls: type[AttentionBackendEnum | MambaAttentionBackendEnum] = (
        MambaAttentionBackendEnum if is_mamba else AttentionBackendEnum
    )
    if class_path is not None:
        _check_class_path("class_path", class_path)
    if isinstance(backend, str):
        member = enum_cls.register(backend, class_path)
    elif isinstance(backend, enum_cls):
        member = backend
    else:
        raise ValueError(
            f"backend: expected a {enum_cls.__name__} member or a new backend name "
            f"(is_mamba={is_mamba}), got {backend!r}"
        )

    def decorator(cls: _C) -> _C:
        path = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else ""
        if not path or "<locals>" in path:
            raise ValueError(
                "cls: expected a module-level class (get_class imports its path), "
                f"got {path or repr(cls)}"
            )
        _OVERRIDES[member] = path
        return cls

    if class_path is None:
        return decorator
    _OVERRIDES[member] = class_path
    return lambda cls: cls


_PRIORITY = (
    AttentionBackendEnum.FLASHINFER,
    AttentionBackendEnum.TURBOQUANT,
    AttentionBackendEnum.ULTRAQUANT,
    AttentionBackendEnum.TRITON_ATTN,
    AttentionBackendEnum.REFERENCE,
)
_CPU_PRIORITY = (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.REFERENCE)
_MLA_PRIORITY = (AttentionBackendEnum.MLA_COMMON,)


@functools.cache
def flashinfer_missing() -> bool:
    """True on a CUDA host where the ``flashinfer`` package cannot be found: the selector then
    skips FLASHINFER. A host without CUDA (planning for a GPU, tests) assumes it is there."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is None


def get_attn_backend(
    head_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    block_size: int,
    device_capability: DeviceCapability | tuple[int, int] | None,
    *,
    backend: str | AttentionBackendEnum | None = None,
    use_mla: bool = False,
    head_size_v: int | None = None,
    kv_cache_layout: str | None = None,
) -> type[AttentionBackend]:
    """The backend class that serves this configuration.

    ``device_capability`` is ``None`` for CPU (see
    :func:`~vllm.v1.attention.backends.abstract.get_device_capability`). With ``backend``
    given, that backend must serve it; otherwise the first that does of FLASHINFER,
    TURBOQUANT, ULTRAQUANT, TRITON_ATTN, REFERENCE on a GPU (FLASHINFER skipped when
    :func:`flashinfer_missing`), CPU_ATTN, REFERENCE on the CPU (MLA: MLA_COMMON) is
    returned. ``ValueError`` lists each candidate's reasons.
    """
    capability = as_device_capability(device_capability)
    if backend is not None:
        candidates: tuple[AttentionBackendEnum, ...] = (AttentionBackendEnum.parse(backend),)
    elif use_mla:
        candidates = _MLA_PRIORITY
    else:
        candidates = _CPU_PRIORITY if capability is None else _PRIORITY
    failures: list[str] = []
    for member in candidates:
        if (
            member is AttentionBackendEnum.FLASHINFER
            and backend is None
            and not member.is_overridden()
            and flashinfer_missing()
        ):
            failures.append("FLASHINFER: the flashinfer package is not installed")
            continue
        cls = member.get_class()
        reasons = cls.validate_configuration(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            capability,
            head_size_v=head_size_v,
            use_mla=use_mla,
            kv_cache_layout=kv_cache_layout,
        )
        if not reasons:
            if failures:
                logger.warning(
                    "attention backend %s selected; skipped: %s", member.name, "; ".join(failures)
                )
            return cls
        failures.append(f"{member.name}: " + "; ".join(reasons))
    where = "CPU" if capability is None else str(capability)
    raise ValueError(
        f"no attention backend can serve head_size={head_size}, dtype={dtype}, "
        f"kv_cache_dtype={kv_cache_dtype!r}, block_size={block_size} on {where}: "
        + " | ".join(failures)
    )
