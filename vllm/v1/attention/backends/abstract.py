"""The ``AttentionBackend`` base: what a backend serves, and the KV-cache shape it expects.

A backend class is never instantiated; everything is a class method. Units: ``block_size`` is
in tokens (or stored slots) per page, ``head_size`` in elements, shapes in elements of the
cache's storage dtype (bytes for FP8 / NVFP4 caches, which are uint8).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from vllm.kv_quant.formats import (
    AUTO,
    BFLOAT16,
    FLOAT16,
    accepted_names_of,
    cache_dtype_names,
    find_format,
    lookup,
)
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.platforms.interface import DeviceCapability
from vllm.utils import check_device
from vllm.v1.attention.backends.utils import get_kv_cache_layout, validate_kv_cache_layout

if TYPE_CHECKING:
    from vllm.kv_quant.scale_layout import ScaleLayout


def as_device_capability(
    capability: DeviceCapability | tuple[int, int] | None,
) -> DeviceCapability | None:
    """Coerce ``(major, minor)`` to :class:`DeviceCapability`; ``None`` means "no CUDA device"."""
    if capability is None or isinstance(capability, DeviceCapability):
        return capability
    if (
        isinstance(capability, tuple)
        and len(capability) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in capability)
    ):
        return DeviceCapability(*capability)
    raise ValueError(
        f"device_capability: expected None (CPU) or a (major, minor) tuple, got {capability!r}"
    )


def get_device_capability(device: torch.device | str) -> DeviceCapability | None:
    """Compute capability of a CUDA ``device``; ``None`` for any other device type.
    ``ValueError`` for a device this torch cannot use (:func:`~vllm.utils.check_device`)."""
    device = check_device("device", device)
    if device.type != "cuda":
        return None
    return DeviceCapability(*torch.cuda.get_device_capability(device))


@dataclass(frozen=True)
class MultipleOf:
    """A supported kernel block size: any multiple of ``base`` tokens."""

    base: int


class KVCacheScaleLayouts(NamedTuple):
    """NVFP4 block-scale layout of each side of one layer's cache (K and V may differ).

    A property of the cache, chosen with its backend
    (:meth:`AttentionBackend.get_kv_cache_scale_layouts`): the writer
    (``reshape_and_cache_flash``'s ``k_scale_layout`` / ``v_scale_layout``) and the reader
    must both use it. Meaningless (but harmless) for unquantized and FP8 caches.
    """

    k_scale_layout: ScaleLayout
    v_scale_layout: ScaleLayout


class AttentionLayer(Protocol):
    """What an attention impl reads from its layer: the fp32 KV dequantization scales."""

    _k_scale: torch.Tensor
    _v_scale: torch.Tensor


class AttentionLayerScales:
    """A minimal :class:`AttentionLayer`: holds ``k_scale`` / ``v_scale``, the dequantization
    scales of a quantized cache (fp32, one value in any shape, e.g. 0-d as upstream layers hold
    them, or ``[H]``; default ``[1.0]``).

    The impls read upstream's private ``_k_scale`` / ``_v_scale``; an engine reads
    :attr:`k_scale` / :attr:`v_scale` and sets both with :meth:`set_kv_scales` (e.g. from
    :meth:`vllm.kv_quant.KVScaleObserver.scales`). The constructor stores what it is given
    unchecked (the impls check at each call). Everything else an encoding needs (key offset,
    RoPE, sink rows) is the impl's or the pages'."""

    def __init__(
        self, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
    ) -> None:
        self._k_scale = torch.ones(1, dtype=torch.float32) if k_scale is None else k_scale
        self._v_scale = torch.ones(1, dtype=torch.float32) if v_scale is None else v_scale

    @property
    def k_scale(self) -> torch.Tensor:
        """The K dequantization scale the impls read (``_k_scale``)."""
        return self._k_scale

    @property
    def v_scale(self) -> torch.Tensor:
        """The V dequantization scale the impls read (``_v_scale``)."""
        return self._v_scale

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Replace both scales after checking both (nothing changes on an error): fp32, one
        value in any shape or ``[H]``, finite and > 0 (a host sync for a device tensor)."""
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            per_head = isinstance(scale, torch.Tensor) and scale.dim() == 1
            kv_scale_as_1d(scale, name, scale.shape[0] if per_head else None)
            if not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise ValueError(
                    f"{name}: expected finite scales > 0, got {scale.flatten().tolist()}"
                )
        self._k_scale, self._v_scale = k_scale, v_scale


class AttentionBackend(ABC):
    """Base of all attention backends.

    Subclasses set the class variables and implement :meth:`get_name` and
    :meth:`get_kv_cache_shape`. The default cache is the paged K/V cache of logical shape
    ``(num_blocks, 2, block_size, num_kv_heads, D')`` whose physical order follows the
    layout setting (:func:`~vllm.v1.attention.backends.utils.get_kv_cache_layout`).
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    """Model (query) dtypes."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = accepted_names_of(AUTO, FLOAT16, BFLOAT16)
    """Accepted ``kv_cache_dtype`` strings."""

    supported_head_sizes: ClassVar[list[int]] = []
    """Head sizes served; empty means any positive size."""

    supported_kernel_block_sizes: ClassVar[list[int | MultipleOf]] = [MultipleOf(1)]
    """Page sizes (tokens) the kernels take; a ``MultipleOf`` accepts any multiple."""

    supports_head_size_v: ClassVar[bool] = False
    """Whether V may have a head size different from K (separate K and V page regions)."""

    is_mla: ClassVar[bool] = False
    """Whether this backend serves MLA (latent) caches."""

    @staticmethod
    @abstractmethod
    def get_name() -> str:
        """Registry name, e.g. ``"FLASHINFER"``."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """Logical shape of one layer's cache for ``num_blocks`` pages of ``block_size``."""

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.supported_head_sizes)

    @classmethod
    def get_supported_kernel_block_sizes(cls) -> list[int | MultipleOf]:
        return list(cls.supported_kernel_block_sizes)

    @classmethod
    def get_supported_kv_cache_dtypes(cls) -> list[str]:
        return list(cls.supported_kv_cache_dtypes)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        sizes = cls.get_supported_head_sizes()
        return head_size > 0 and (not sizes or head_size in sizes)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: str) -> bool:
        return kv_cache_dtype in cls.get_supported_kv_cache_dtypes()

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        """True when some supported kernel block size divides ``block_size`` (a page may be
        split into several kernel pages)."""
        if block_size <= 0:
            return False
        for size in cls.get_supported_kernel_block_sizes():
            base = size.base if isinstance(size, MultipleOf) else size
            if block_size % base == 0:
                return True
        return False

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """Whether the backend runs on this device (``None`` = CPU). Default: anywhere."""
        return True

    @classmethod
    def is_kvcache_nvfp4(cls, cache_dtype_str: str) -> bool:
        """True when the cache holds packed NVFP4 (last dim ``F(D)`` bytes)."""
        fmt = find_format(cache_dtype_str)
        return fmt is not None and fmt.is_nvfp4

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        """Physical order of the logical ``(B, 2, N, H, D')`` dims for the current layout:
        NHD ``(0, 1, 2, 3, 4)``, HND ``(0, 1, 3, 2, 4)``; an unknown layout raises."""
        layout = validate_kv_cache_layout(get_kv_cache_layout(), "kv_cache_layout")
        if layout == "NHD":
            return (0, 1, 2, 3, 4)
        return (0, 1, 3, 2, 4)

    @classmethod
    def get_required_kv_cache_layout(
        cls, device_capability: DeviceCapability | tuple[int, int] | None = None
    ) -> str | None:
        """The layout the backend needs on this device, or ``None`` when either works."""
        return None

    @classmethod
    def get_nvfp4_scale_layout(cls, block_size: int, head_size: int) -> ScaleLayout:
        """Scale layout of the NVFP4 caches (pages of ``block_size`` tokens, heads of
        ``head_size`` elements) that this backend's reader expects; by default the op's,
        :meth:`ScaleLayout.default_for` (upstream's interleave4 where it fits)."""
        from vllm.kv_quant.scale_layout import ScaleLayout

        return ScaleLayout.default_for(block_size, head_size)

    @classmethod
    def get_kv_cache_scale_layouts(
        cls, block_size: int, head_size: int, head_size_v: int | None = None
    ) -> KVCacheScaleLayouts:
        """NVFP4 scale layouts (K, V) of the caches this backend reads: each side's
        :meth:`get_nvfp4_scale_layout` (``head_size_v`` defaults to ``head_size``). Record them
        with the cache and pass them to the writer and the reader (see
        :func:`~vllm.v1.worker.gpu.attn_utils.get_kv_cache_scale_layouts`)."""
        head_size_v = head_size if head_size_v is None else head_size_v
        return KVCacheScaleLayouts(
            cls.get_nvfp4_scale_layout(block_size, head_size),
            cls.get_nvfp4_scale_layout(block_size, head_size_v),
        )

    @classmethod
    def _validate_common(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        block_size: int,
        head_size_v: int | None,
        use_mla: bool,
    ) -> list[str]:
        name = cls.get_name()
        reasons: list[str] = []
        if use_mla != cls.is_mla:
            reasons.append(
                f"{name} serves {'only MLA' if cls.is_mla else 'no MLA'} layers, "
                f"got use_mla={use_mla}"
            )
        if not cls.supports_dtype(dtype):
            reasons.append(
                f"model dtype {dtype} not supported by {name} (supported: "
                f"{', '.join(str(d) for d in cls.supported_dtypes)})"
            )
        fmt = find_format(kv_cache_dtype)
        if fmt is None:
            reasons.append(
                f"kv_cache_dtype {kv_cache_dtype!r} is not a KV-cache dtype (accepted: "
                f"{', '.join(cache_dtype_names(include_mla_only=True))})"
            )
        elif not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append(
                f"kv_cache_dtype {kv_cache_dtype!r} not supported by {name} (supported: "
                f"{', '.join(cls.get_supported_kv_cache_dtypes())})"
            )
        if not cls.supports_head_size(head_size):
            sizes = cls.get_supported_head_sizes()
            reasons.append(
                f"head size {head_size} not supported by {name} (supported: "
                f"{', '.join(map(str, sizes)) if sizes else 'any positive size'})"
            )
        if head_size_v is not None and head_size_v != head_size:
            if not cls.supports_head_size_v:
                reasons.append(
                    f"head_size_v={head_size_v} != head_size={head_size} not supported by "
                    f"{name} (its paged cache shares one last dim between K and V)"
                )
            elif not cls.supports_head_size(head_size_v):
                reasons.append(f"head_size_v {head_size_v} not supported by {name}")
        if not cls.supports_block_size(block_size):
            sizes = ", ".join(
                f"multiples of {s.base}" if isinstance(s, MultipleOf) else str(s)
                for s in cls.get_supported_kernel_block_sizes()
            )
            reasons.append(
                f"block size {block_size} not supported by {name}: no kernel block size "
                f"({sizes}) divides it"
            )
        group = None if fmt is None else fmt.block_scale_group
        if fmt is not None and group is not None:
            for label, size in (("head size", head_size), ("head_size_v", head_size_v)):
                if size is not None and size % group != 0:
                    reasons.append(
                        f"{fmt.label.upper()} KV cache needs a {label} that is a multiple of "
                        f"{group}, got {size}"
                    )
        return reasons

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str,
        block_size: int,
        device_capability: DeviceCapability | tuple[int, int] | None,
        *,
        head_size_v: int | None = None,
        use_mla: bool = False,
        kv_cache_layout: str | None = None,
    ) -> list[str]:
        """Reasons this backend cannot serve the configuration; empty when it can.

        ``device_capability`` is ``None`` for CPU. ``kv_cache_layout`` defaults to the
        current layout setting. Runs on the host, allocates nothing.
        """
        capability = as_device_capability(device_capability)
        reasons = cls._validate_common(
            head_size, dtype, kv_cache_dtype, block_size, head_size_v, use_mla
        )
        if not cls.supports_compute_capability(capability):
            where = "CPU" if capability is None else str(capability)
            reasons.append(f"{cls.get_name()} does not run on {where}")
        required = cls.get_required_kv_cache_layout(capability)
        layout = get_kv_cache_layout() if kv_cache_layout is None else kv_cache_layout
        layout = validate_kv_cache_layout(layout, "kv_cache_layout")
        if required is not None and layout != required:
            reasons.append(
                f"{cls.get_name()} on {capability} needs the {required} KV-cache layout, "
                f"the current layout is {layout} (set VLLM_KV_CACHE_LAYOUT={required} or "
                "call set_kv_cache_layout)"
            )
        return reasons

    @classmethod
    def check_configuration(cls, *args: Any, **kwargs: Any) -> None:
        """:meth:`validate_configuration`, raising ``ValueError`` with every reason."""
        reasons = cls.validate_configuration(*args, **kwargs)
        if reasons:
            raise ValueError(
                f"attention backend {cls.get_name()} cannot serve this configuration: "
                + "; ".join(reasons)
            )


class AttentionImpl(ABC):
    """Base of attention implementations (the forward pass of one layer)."""

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: Any,
        attn_metadata: Any,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output ``[num_tokens, num_heads, head_size_v]``."""


def softmax_scale(scale: float | None, head_size: int) -> float:
    """An impl's softmax scale: ``1/sqrt(head_size)`` for ``None``, else ``scale`` as a float.
    Any finite value is taken, as upstream's impls take it (``float(scale)``); ``ValueError``
    for anything else: a NaN or infinite scale turns every output into NaN, and the compiled
    kernels would refuse it only after the new K/V were written."""
    if scale is None:
        return 1.0 / math.sqrt(head_size)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(
            f"scale: expected None or a finite float (the softmax scale), got {scale!r}"
        )
    return float(scale)


def kv_cache_dim(head_size: int, cache_dtype_str: str) -> int:
    """Last dim ``D'`` of a paged K/V cache (the registry's row size): ``F(D)`` bytes for NVFP4,
    else ``D``."""
    return lookup(cache_dtype_str, "cache_dtype_str").last_dim(head_size)


def check_kv_cache_shape_args(
    name: str, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> None:
    """``ValueError`` naming the first non-positive shape argument (``num_blocks`` ≥ 0)."""
    for arg, value, low in (
        ("num_blocks", num_blocks, 0),
        ("block_size", block_size, 1),
        ("num_kv_heads", num_kv_heads, 1),
        ("head_size", head_size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"{arg}: {name}.get_kv_cache_shape expects an int >= {low}, got {value!r}"
            )


def paged_kv_cache_shape(
    name: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype_str: str = "auto",
) -> tuple[int, ...]:
    """The paged K/V cache shape ``(num_blocks, 2, block_size, num_kv_heads, D')`` (``D'`` from
    :func:`kv_cache_dim`), after :func:`check_kv_cache_shape_args` on the arguments."""
    check_kv_cache_shape_args(name, num_blocks, block_size, num_kv_heads, head_size)
    return (num_blocks, 2, block_size, num_kv_heads, kv_cache_dim(head_size, cache_dtype_str))
