"""The attention backend contract, at upstream vLLM's path (``vllm.v1.attention.backend``): the
``AttentionBackend`` base (what a backend serves, and the KV-cache shape it expects), the
``AttentionImpl`` base (one layer's forward pass), ``AttentionType`` and the small types they
share. :mod:`vllm.v1.attention.backends.abstract` re-exports them for the older import path.

A backend class is never instantiated; everything is a class method. Units: ``block_size`` is
in tokens (or stored slots) per page, ``head_size`` in elements, shapes in elements of the
cache's storage dtype (bytes for FP8 / NVFP4 caches, which are uint8).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import torch

from vllm.config.compilation import AttentionCGSupport
from vllm.kv_quant.formats import (
    AUTO,
    BFLOAT16,
    FLOAT16,
    accepted_names_of,
    cache_dtype_names,
    find_format,
)
from vllm.platforms.interface import DeviceCapability
from vllm.utils import check_device
from vllm.v1.attention.backend_metadata import (
    AttentionImplBase,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

if TYPE_CHECKING:
    from vllm.kv_quant.scale_layout import ScaleLayout
    from vllm.v1.attention.backends.utils import KVCacheLayoutType
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

__all__ = [
    "FEATURE_HOOKS",
    "AttentionBackend",
    "AttentionCGSupport",
    "AttentionImpl",
    "AttentionImplBase",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionLayer",
    "AttentionType",
    "CommonAttentionMetadata",
    "DeviceCapability",
    "KVCacheScaleLayouts",
    "MultipleOf",
    "as_device_capability",
    "get_device_capability",
]


class AttentionType(str, Enum):
    """What a layer attends over (upstream's values; a ``str`` so that ``torch.compile`` takes
    it). The backends of this library serve ``DECODER``."""

    DECODER = "decoder"
    """Self-attention of a decoder layer, over its paged KV cache."""
    ENCODER = "encoder"
    """Self-attention of the encoder of an encoder-decoder model."""
    ENCODER_ONLY = "encoder_only"
    """Self-attention of an encoder-only model."""
    ENCODER_DECODER = "encoder_decoder"
    """Decoder queries over the encoder's keys and values (cross-attention)."""


FEATURE_HOOKS: dict[str, tuple[str, str]] = {
    "has_sink": ("supports_sink", "attention sinks"),
    "use_mm_prefix": ("supports_mm_prefix", "partial multimodal token full attention"),
    "use_per_head_quant_scales": ("supports_per_head_quant_scales", "per-head quant scales"),
    "has_sliding_window": ("supports_sliding_window", "sliding window"),
    "use_rswa": ("supports_rswa", "R-SWA"),
    "use_non_causal": ("supports_non_causal", "non-causal attention"),
    "use_batch_invariant": ("supports_batch_invariance", "batch invariance"),
    "use_kv_connector": ("supports_kv_connector", "KV connector"),
    "use_pcp": ("supports_pcp", "PCP"),
    "use_dcp": ("supports_dcp", "DCP"),
    "use_adaptive_verification": (
        "supports_device_cpu_query_lens_mismatch",
        "device-cpu query lens mismatch (adaptive verification)",
    ),
}
"""Upstream's boolean feature flags of :meth:`AttentionBackend.validate_configuration`: flag ->
(the class method that says the backend serves it, the feature as upstream's reasons name it)."""


def _kv_cache_layout(layout: str | None) -> KVCacheLayoutType:
    """``layout`` checked, or the current layout setting for ``None``."""
    # Deferred: importing vllm.v1.attention.backends runs its __init__, which imports this module.
    from vllm.v1.attention.backends.utils import get_kv_cache_layout, validate_kv_cache_layout

    return validate_kv_cache_layout(
        get_kv_cache_layout() if layout is None else layout, "kv_cache_layout"
    )


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

    supported_features: ClassVar[frozenset[str]] = frozenset(
        {"use_kv_connector", "use_adaptive_verification"}
    )
    """Feature flags served (keys of :data:`FEATURE_HOOKS`; not ``use_pcp`` / ``use_dcp``, which
    the impl opts into). Upstream's defaults: a backend claims any other feature itself."""

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
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The page size (tokens) to use when the engine would use ``default_block_size``: it
        when the kernels take it, else the smallest kernel block size they take."""
        sizes = cls.get_supported_kernel_block_sizes()
        if not sizes or cls.supports_block_size(default_block_size):
            return default_block_size
        return min(s.base if isinstance(s, MultipleOf) else s for s in sizes)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """Whether the backend runs on this device (``None`` = CPU). Default: anywhere."""
        return True

    # Upstream's feature hooks (validate_configuration asks them through FEATURE_HOOKS): most
    # answer from supported_features; PCP and DCP are the impl's opt-in, as upstream.

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl] | None:
        """The impl that runs this backend's forward pass; ``None`` for a backend that only
        plans caches (FLASHINFER and MLA_COMMON here)."""
        return None

    @classmethod
    def _impl_opts_in(cls, flag: str) -> bool:
        return bool(getattr(cls.get_impl_cls(), flag, False))

    @classmethod
    def supports_pcp(cls) -> bool:
        """Prefill context parallelism: the impl's ``supports_pcp`` opt-in."""
        return cls._impl_opts_in("supports_pcp")

    @classmethod
    def supports_dcp(cls) -> bool:
        """Decode context parallelism: the impl's ``supports_dcp`` opt-in."""
        return cls._impl_opts_in("supports_dcp")

    @classmethod
    def supports_sink(cls) -> bool:
        """Per-head logit sinks added to each softmax denominator (GPT-OSS)."""
        return "has_sink" in cls.supported_features

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return "has_sliding_window" in cls.supported_features

    @classmethod
    def supports_rswa(cls) -> bool:
        """Upstream's R-SWA sliding-window variant."""
        return "use_rswa" in cls.supported_features

    @classmethod
    def supports_non_causal(cls) -> bool:
        """Bidirectional attention over the paged cache of a decoder layer."""
        return "use_non_causal" in cls.supported_features

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        """Full (non-causal) attention within a multimodal prefix of the sequence."""
        return "use_mm_prefix" in cls.supported_features

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        """KV dequantization scales per KV head (``[H]``) instead of one per layer."""
        return "use_per_head_quant_scales" in cls.supported_features

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """Results that do not depend on how requests are batched."""
        return "use_batch_invariant" in cls.supported_features

    @classmethod
    def supports_kv_connector(cls) -> bool:
        """Caches that a KV connector may fill or read (transfer, offload)."""
        return "use_kv_connector" in cls.supported_features

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """Batches whose device query lengths differ from the host's (adaptive verification
        trims drafts on the device)."""
        return "use_adaptive_verification" in cls.supported_features

    @classmethod
    def is_sparse(cls) -> bool:
        """Whether this backend reads only a selected subset of each sequence's tokens."""
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Decoder self-attention only, by default."""
        return attn_type == AttentionType.DECODER

    @classmethod
    def is_kvcache_nvfp4(cls, cache_dtype_str: str) -> bool:
        """True when the cache holds packed NVFP4 (last dim ``F(D)`` bytes)."""
        fmt = find_format(cache_dtype_str)
        return fmt is not None and fmt.is_nvfp4

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        """Physical order of the logical ``(B, 2, N, H, D')`` dims for the current layout:
        NHD ``(0, 1, 2, 3, 4)``, HND ``(0, 1, 3, 2, 4)``; an unknown layout raises."""
        if _kv_cache_layout(None) == "NHD":
            return (0, 1, 2, 3, 4)
        return (0, 1, 3, 2, 4)

    @classmethod
    def get_required_kv_cache_layout(
        cls, device_capability: DeviceCapability | tuple[int, int] | None = None
    ) -> str | None:
        """The layout the backend needs on this device, or ``None`` when either works."""
        return None

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...] | None:
        """The whole-cache layouts (upstream v0.33's ``KVCacheLayout``) the backend reads on
        this host's device, most preferred first; ``None`` when any works. Derived from
        :meth:`get_required_kv_cache_layout`: a required block interior keeps the block-compact
        layouts that have it."""
        from vllm.v1.kv_cache_layout import KVCacheLayout

        device = "cuda" if torch.cuda.is_available() else "cpu"
        required = cls.get_required_kv_cache_layout(get_device_capability(device))
        if required is None:
            return None
        return tuple(
            m for m in KVCacheLayout if m.is_block_compact and m.block_interior == required
        )

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """The layer's spec as this backend stores it (upstream v0.33's hook). Unchanged here:
        a spec's encoding already sizes everything its pages hold (per-token-head scales, NVFP4
        block scales, sink rows)."""
        return spec

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
        use_sparse: bool = False,
        attn_type: str = AttentionType.DECODER,
        **features: bool,
    ) -> list[str]:
        """Reasons this backend cannot serve the configuration; empty when it can.

        ``device_capability`` is ``None`` for CPU. ``kv_cache_layout`` defaults to the current
        layout setting. ``use_sparse``, ``attn_type`` and ``features`` (the keys of
        :data:`FEATURE_HOOKS`) are upstream's feature flags, the fields of
        :class:`~vllm.v1.attention.selector.AttentionSelectorConfig`; each is asked of its hook
        (``is_sparse``, ``supports_attn_type``, ``supports_*``). Runs on the host, allocates
        nothing.
        """
        capability = as_device_capability(device_capability)
        reasons = cls._validate_common(
            head_size, dtype, kv_cache_dtype, block_size, head_size_v, use_mla
        )
        if not cls.supports_compute_capability(capability):
            where = "CPU" if capability is None else str(capability)
            reasons.append(f"{cls.get_name()} does not run on {where}")
        required = cls.get_required_kv_cache_layout(capability)
        layout = _kv_cache_layout(kv_cache_layout)
        if required is not None and layout != required:
            reasons.append(
                f"{cls.get_name()} on {capability} needs the {required} KV-cache layout, "
                f"the current layout is {layout} (set VLLM_KV_CACHE_LAYOUT={required} or "
                "call set_kv_cache_layout)"
            )
        return (
            reasons
            + cls._unserved_features(use_sparse, attn_type, features)
            + (cls._runtime_reasons())
        )

    @classmethod
    def _runtime_reasons(cls) -> list[str]:
        """What this process lacks to run the backend at all (a compiled kernel, a package),
        so that the selector falls back instead of failing at the first call; none here."""
        return []

    @classmethod
    def _unserved_features(
        cls, use_sparse: bool, attn_type: str, features: dict[str, bool]
    ) -> list[str]:
        """Upstream's reasons (its wording) for the features asked that this backend lacks."""
        reasons = []
        for arg, asked in [*features.items(), ("use_sparse", use_sparse)]:
            if not isinstance(asked, bool):
                raise ValueError(f"{arg}: expected a bool, got {asked!r}")
        for arg, asked in features.items():
            if arg not in FEATURE_HOOKS:
                raise ValueError(
                    f"features: expected keywords among {', '.join(FEATURE_HOOKS)}, got {arg!r}"
                )
            hook, what = FEATURE_HOOKS[arg]
            if asked and not getattr(cls, hook)():
                reasons.append(f"{what} not supported")
        # A sparse backend serves only sparse layers, so a mismatch either way is a reason.
        if use_sparse != cls.is_sparse():
            reasons.append("sparse not supported" if use_sparse else "non-sparse not supported")
        if not isinstance(attn_type, str):
            raise ValueError(f"attn_type: expected an AttentionType (a str), got {attn_type!r}")
        if not cls.supports_attn_type(attn_type):
            # The value: formatting a str-mixin Enum member differs between Python versions.
            value = attn_type.value if isinstance(attn_type, AttentionType) else attn_type
            reasons.append(f"attention type {value} not supported")
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


class AttentionImpl(AttentionImplBase):
    """Base of attention implementations (the forward pass of one layer)."""

    supports_pcp: ClassVar[bool] = False
    """Whether the impl serves prefill context parallelism (upstream's opt-in; none here)."""

    supports_dcp: ClassVar[bool] = False
    """Whether the impl serves decode context parallelism (upstream's opt-in; none here)."""

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
