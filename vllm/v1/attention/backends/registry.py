"""Backend registry and selector.

``get_attn_backend`` validates a configuration against a named backend (or picks the first
backend that serves it) before anything is allocated, and raises ``ValueError`` naming every
missing piece otherwise. The order: on a GPU FLASHINFER, TRITON_ATTN then REFERENCE (FLASHINFER
left out on a CUDA host where the flashinfer package does not import), on the CPU the compiled
CPU_ATTN then REFERENCE (the reference backend is pure torch: it serves everything, slowly).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from enum import Enum

import torch

from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    DeviceCapability,
    as_device_capability,
)

logger = logging.getLogger(__name__)


class AttentionBackendEnum(Enum):
    """Registered backends: member name = registry name, value = class path."""

    FLASHINFER = "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    REFERENCE = "vllm.v1.attention.backends.reference.ReferenceAttentionBackend"
    CPU_ATTN = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"
    MLA_COMMON = "vllm.v1.attention.backends.mla.common.MLACommonBackend"

    def get_path(self) -> str:
        return self.value

    def get_class(self) -> type[AttentionBackend]:
        module_name, class_name = self.value.rsplit(".", 1)
        return getattr(importlib.import_module(module_name), class_name)

    @classmethod
    def parse(cls, name: str | AttentionBackendEnum) -> AttentionBackendEnum:
        """The member named ``name`` (case-insensitive); ``ValueError`` listing all names."""
        if isinstance(name, AttentionBackendEnum):
            return name
        try:
            return cls[name.upper()]
        except (KeyError, AttributeError):
            raise ValueError(
                f"backend: unknown attention backend {name!r}; expected one of "
                f"{', '.join(m.name for m in cls)}"
            ) from None


_PRIORITY = (
    AttentionBackendEnum.FLASHINFER,
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
    TRITON_ATTN, REFERENCE on a GPU (FLASHINFER skipped when :func:`flashinfer_missing`),
    CPU_ATTN, REFERENCE on the CPU (MLA: MLA_COMMON) is returned. ``ValueError`` lists
    each candidate's reasons.
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
        if member is AttentionBackendEnum.FLASHINFER and backend is None and flashinfer_missing():
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
