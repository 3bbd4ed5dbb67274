"""The CPU platform: no compute capability, so capability-gated (GPU-only) cases skip."""

from __future__ import annotations

import functools
import importlib.util
from typing import TYPE_CHECKING, ClassVar

from vllm.platforms.interface import CpuArchEnum, Platform

if TYPE_CHECKING:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig


_CPU_MLA_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
"""The cache dtypes of MLA layers on CPU: unquantized only."""


@functools.cache
def _cpu_vendor() -> str:
    """The ``vendor_id`` of /proc/cpuinfo (``""`` where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


class CpuPlatform(Platform):
    device_type: ClassVar[str] = "cpu"

    @classmethod
    def is_zen_cpu(cls) -> bool:
        """An AMD x86 host with the ``zentorch`` package installed (its kernels are then
        usable, as :func:`vllm.model_executor.kernels.linear.zentorch_utils.has_zentorch_op`
        checks op by op)."""
        return (
            cls.get_cpu_architecture() == CpuArchEnum.X86
            and _cpu_vendor() == "AuthenticAMD"
            and importlib.util.find_spec("zentorch") is not None
        )

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum | None,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        """The qualified class name of the backend that serves ``attn_selector_config`` on the
        CPU: ``selected_backend`` if given (it must serve it), else CPU_ATTN, then REFERENCE
        (MLA layers: the MLA backend). ``ValueError`` names the layer's needs and why each
        candidate refused (a ``kv_cache_dtype`` no CPU kernel reads, say)."""
        from vllm.v1.attention.backends.registry import get_attn_backend

        config = attn_selector_config
        if config.use_sparse:
            raise ValueError("use_sparse: expected False (no sparse attention on CPU), got True")
        if config.use_mla and config.kv_cache_dtype not in _CPU_MLA_KV_CACHE_DTYPES:
            # No CPU kernel reads quantized latents.
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(_CPU_MLA_KV_CACHE_DTYPES)} for MLA "
                f"attention on CPU, got {config.kv_cache_dtype!r}"
            )
        backend = get_attn_backend(
            config.head_size,
            config.dtype,
            config.kv_cache_dtype,
            config.block_size,
            None,
            backend=selected_backend,
            use_mla=config.use_mla,
        )
        return f"{backend.__module__}.{backend.__qualname__}"
