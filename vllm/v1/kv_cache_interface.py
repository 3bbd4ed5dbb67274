"""KV-cache specs: what one page of a layer's cache holds, and how many bytes it takes.

Units: ``block_size`` is in tokens per page, every ``*_bytes`` quantity is in bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm.kv_quant.formats import (
    FP8_DS_MLA,
    FP8_DS_MLA_HEAD_SIZE,  # re-exported: its home before the format registry
    FP8_DS_MLA_RECORD_BYTES,  # noqa: F401
    FP8_DS_MLA_V32_HEAD_SIZE,
    KVCacheFormat,
    KVQuantMode,
    format_for_storage,
    lookup,
)
from vllm.utils.torch_utils import (
    get_dtype_size,
    is_quantized_kv_cache,  # noqa: F401  (upstream's home of these predicates)
    kv_cache_uses_per_token_head_scales,  # noqa: F401
)
from vllm.v1.kv_cache_spec_base import (
    KVCacheSpec,
    KVCacheSpecMergeError,
    MambaSpec,
    _check_optional_positive,
    _check_positive,
    _check_same_fields,
    _check_torch_dtype,
    _max_model_len,
    _merge_window,
    cdiv,
    round_up,
)

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """Quantization mode of a ``kv_cache_dtype`` string (the registry's ``quant_mode``)."""
    return lookup(kv_cache_dtype).quant_mode


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A paged K/V cache of ``num_kv_heads`` heads.

    ``dtype`` is the storage dtype (``torch.uint8`` for FP8 and NVFP4). ``head_size_v``
    defaults to ``head_size``. ``page_size_padded`` (bytes) overrides the page size when a
    group needs equal pages.
    """

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    head_size_v: int | None = None

    def __post_init__(self) -> None:
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "head_size_v")
        _check_torch_dtype("dtype", self.dtype)
        if not isinstance(self.kv_quant_mode, KVQuantMode):
            raise ValueError(
                f"kv_quant_mode: expected a KVQuantMode, got {self.kv_quant_mode!r} "
                f"({type(self.kv_quant_mode).__name__})"
            )
        if self.kv_quant_mode.is_quantized and get_dtype_size(self.dtype) != 1:
            raise ValueError(
                f"dtype: {self.kv_quant_mode.name} caches are stored as 1-byte elements "
                f"(torch.uint8), got {self.dtype}"
            )
        # The registry's storage-dtype rule, also for latent specs that name their format.
        format_for_storage(self.kv_quant_mode, self.dtype)
        group = self.kv_cache_format.block_scale_group
        if group is not None:
            for name in ("head_size", "head_size_v"):
                size = getattr(self, name)
                if size % group != 0:
                    raise ValueError(
                        f"{name}: {self.kv_quant_mode.name} KV cache needs a multiple of {group} "
                        f"(one FP8 scale per {group} elements), got {size}"
                    )
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded: a padded page must hold the real page of "
                f"{self.real_page_size_bytes} bytes, got {self.page_size_padded}"
            )

    @property
    def kv_cache_format(self) -> KVCacheFormat:
        """The registry's format of this cache, derived from ``(kv_quant_mode, dtype)`` (FP8 →
        ``fp8_e4m3``: the variant is not a page-size fact and a spec does not record it)."""
        return format_for_storage(self.kv_quant_mode, self.dtype)

    @property
    def head_bytes_per_token(self) -> int:
        """K plus V bytes of one token of one head."""
        assert self.head_size_v is not None
        fmt = self.kv_cache_format
        row_elements = fmt.last_dim(self.head_size) + fmt.last_dim(self.head_size_v)
        return row_elements * get_dtype_size(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one page without padding."""
        return self.block_size * self.num_kv_heads * self.head_bytes_per_token

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """Pages for every token: ``cdiv(max_model_len, block_size)``, the length first divided
        among the decode x prefill context-parallel ranks (each keeps its share)."""
        max_model_len = _max_model_len(vllm_config)
        parallel = vllm_config.parallel_config
        ranks = parallel.decode_context_parallel_size * parallel.prefill_context_parallel_size
        if ranks > 1:
            max_model_len = cdiv(max_model_len, ranks)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Every token of the sequence stays in the cache.

    ``sliding_window`` / ``attention_chunk_size`` (tokens) record a layer that computes
    sliding-window or chunked-local attention but is cached as full attention (the single-group
    layout of ``disable_hybrid_kv_cache_manager``); None for a plain full-attention layer.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_optional_positive(self, "sliding_window", "attention_chunk_size")

    @classmethod
    def merge(cls, specs: list[Any]) -> Any:
        """One spec for the group: equal specs apart from the windows; the group takes the one
        window its layers set (``ValueError`` for two), and not both kinds of window. Full and
        sink-full layers merge when their attention fields match (as upstream): the group is of
        the first layer's class (and ``sink_len``). Latent (MLA) specs merge only with their
        own class and all fields equal."""
        if not specs:
            raise KVCacheSpecMergeError("specs: expected at least one spec to merge, got none")
        first = specs[0]
        windows = ("sliding_window", "attention_chunk_size")
        for other in specs[1:]:
            plain = all(
                isinstance(s, FullAttentionSpec) and not isinstance(s, LatentPageSpec)
                for s in (first, other)
            )
            _check_same_fields(first, other, windows, AttentionSpec if plain else None)
        merged = replace(first, **{name: _merge_window(specs, name) for name in windows})
        if merged.sliding_window is not None and merged.attention_chunk_size is not None:
            raise KVCacheSpecMergeError(
                "specs: a group cannot mix sliding-window and chunked-local layers, got "
                f"sliding_window={merged.sliding_window} and "
                f"attention_chunk_size={merged.attention_chunk_size}"
            )
        return merged


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` (tokens) attention-sink entries per sequence."""

    sink_len: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.sink_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"sink_len: expected None or an int >= 0 (tokens), got {n!r}")


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder self-attention: computed in one pass, nothing stays cached (0 bytes)."""

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return 0


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder-to-encoder attention: caches the encoder's K/V, at most
    ``scheduler_config.max_num_encoder_input_tokens`` tokens (e.g. 1500 for Whisper)."""

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        assert vllm_config.scheduler_config is not None
        tokens = vllm_config.scheduler_config.max_num_encoder_input_tokens
        return cdiv(tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Only the last ``sliding_window`` tokens are attended to; older pages can be freed."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "sliding_window")

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Most pages one request holds: the last ``sliding_window - 1`` tokens plus one step's
        ``max_num_batched_tokens`` (at most ``max_model_len``), and one more page because the
        window may start in the middle of a page."""
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        if vllm_config.parallel_config.decode_context_parallel_size != 1:
            raise ValueError(
                "decode_context_parallel_size: sliding-window layers need 1, got "
                f"{vllm_config.parallel_config.decode_context_parallel_size}"
            )
        return _admission_bytes(self, vllm_config)


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Tokens attend within chunks of ``attention_chunk_size`` tokens."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "attention_chunk_size")

    def max_admission_blocks_per_request(
        self, max_num_batched_tokens: int, max_model_len: int
    ) -> int:
        """Most pages one request holds: one chunk plus one step's ``max_num_batched_tokens``
        tokens, at most ``max_model_len``."""
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return _admission_bytes(self, vllm_config)


def _admission_bytes(
    spec: SlidingWindowSpec | ChunkedLocalAttentionSpec, vllm_config: VllmConfig
) -> int:
    """``max_admission_blocks_per_request`` pages, from the scheduler's step size."""
    assert vllm_config.scheduler_config is not None
    blocks = spec.max_admission_blocks_per_request(
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        max_model_len=_max_model_len(vllm_config),
    )
    return blocks * spec.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class LatentPageSpec(AttentionSpec):
    """Page math of latent (MLA-style) caches: one slot of ``head_size`` per stored token,
    shared by all heads, or an ``fp8_ds_mla`` record (bytes from the format registry).

    The record is used for ``cache_dtype_str="fp8_ds_mla"``: DeepSeek-V3.2's 656-byte layout
    (head size 576) by default, DeepSeek-V4's 584-byte one (head size 512) with
    ``model_version="deepseek_v4"``; its bytes do not depend on ``dtype``. ``compress_ratio``
    r > 1 (DeepSeek-V4 compressed layers) keeps one slot per r tokens, so a page of
    ``block_size`` tokens stores ``storage_block_size = block_size // r`` slots.
    ``alignment`` (bytes) pads the page to a multiple of it.
    """

    MODEL_VERSIONS: ClassVar[tuple[str | None, ...]] = (None, "deepseek_v4")
    RECORD_BY_MODEL_VERSION: ClassVar[bool] = False
    """True where ``model_version="deepseek_v4"`` alone selects the record (as upstream's
    sliding-window latent spec does)."""

    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    def __post_init__(self) -> None:
        _check_optional_positive(self, "alignment")
        _check_positive(self, "compress_ratio")
        if self.model_version not in self.MODEL_VERSIONS:
            raise ValueError(
                f"model_version: expected one of {self.MODEL_VERSIONS}, got {self.model_version!r}"
            )
        super().__post_init__()
        if self.kv_quant_mode.is_nvfp4:
            raise ValueError(
                "kv_quant_mode: NVFP4 is not a format for MLA caches (supported: unquantized, "
                "fp8, fp8_ds_mla)"
            )
        if self.block_size % self.compress_ratio != 0:
            raise ValueError(
                f"block_size: must be a multiple of compress_ratio={self.compress_ratio}, "
                f"got {self.block_size}"
            )
        if self.uses_ds_mla_record:
            v4 = self.model_version == "deepseek_v4"
            expected = FP8_DS_MLA_HEAD_SIZE if v4 else FP8_DS_MLA_V32_HEAD_SIZE
            if self.head_size != expected:
                raise ValueError(
                    f"head_size: the fp8_ds_mla record of model_version={self.model_version!r} "
                    f"({'DeepSeek-V4' if v4 else 'DeepSeek-V3.2'}) stores head size {expected}, "
                    f"got {self.head_size}"
                    + ("" if v4 else " (DeepSeek-V4's record needs model_version='deepseek_v4')")
                )
        else:
            self.kv_cache_format.last_dim(self.head_size)

    @property
    def uses_ds_mla_record(self) -> bool:
        """True when a slot is one ``fp8_ds_mla`` record."""
        if self.RECORD_BY_MODEL_VERSION and self.model_version == "deepseek_v4":
            return True
        return (
            self.cache_dtype_str is not None
            and lookup(self.cache_dtype_str, "cache_dtype_str") is FP8_DS_MLA
        )

    @property
    def storage_block_size(self) -> int:
        return self.block_size // self.compress_ratio

    @property
    def kv_cache_format(self) -> KVCacheFormat:
        """``fp8_ds_mla`` for a record, else the format named by ``cache_dtype_str`` when set,
        else the one ``(kv_quant_mode, dtype)`` describe."""
        if self.uses_ds_mla_record:
            return FP8_DS_MLA
        if self.cache_dtype_str is not None:
            return lookup(self.cache_dtype_str, "cache_dtype_str")
        return super().kv_cache_format

    @property
    def slot_size_bytes(self) -> int:
        """Bytes of one stored slot (all heads): one row of the format's last dim per head, in
        ``dtype`` elements (a record's own bytes)."""
        fmt = self.kv_cache_format
        row = fmt.last_dim(self.head_size)
        if self.uses_ds_mla_record:
            assert fmt.storage_dtype is not None
            return self.num_kv_heads * row * get_dtype_size(fmt.storage_dtype)
        return self.num_kv_heads * row * get_dtype_size(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        return self.storage_block_size * self.slot_size_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        if self.alignment is not None:
            return round_up(self.real_page_size_bytes, self.alignment)
        return self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(LatentPageSpec, FullAttentionSpec):
    """Multi-head latent attention: one latent of ``head_size`` per token (or per
    ``compress_ratio`` tokens), shared by all heads; page math of :class:`LatentPageSpec`."""


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """A layer caching hidden states (upstream's marker for extracted hidden states): placed in
    its own group, with the common page size."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(LatentPageSpec, SlidingWindowSpec):
    """Sliding-window attention over one shared latent per token (DeepSeek-V4's SWA cache):
    latent page math, sliding-window memory bound. ``model_version="deepseek_v4"`` alone selects
    the 584-byte record, as upstream."""

    RECORD_BY_MODEL_VERSION: ClassVar[bool] = True


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers that need the same slots (same type and block size) but may differ in page size.

    One "page" of the group is one page of every layer, so its size is the sum.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_memory_usage_pages(self, vllm_config: VllmConfig) -> int:
        """Pages (of every layer) one request needs: the most any layer needs."""
        return max(
            cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)
            for spec in self.kv_cache_specs.values()
        )

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return self.max_memory_usage_pages(vllm_config) * self.page_size_bytes

    def get_page_sizes(self) -> list[int]:
        """The distinct page sizes (bytes) of the layers."""
        return list({spec.page_size_bytes for spec in self.kv_cache_specs.values()})

    def get_num_layer_tuples(self) -> int:
        """Layers of the most common page size (one "tuple" holds one layer of each size)."""
        sizes = Counter(spec.page_size_bytes for spec in self.kv_cache_specs.values())
        return sizes.most_common(1)[0][1]

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """True when all specs need the same token slots (as upstream): one block size, and
        every spec of the first spec's kind: any full attention (MLA of any compress ratio,
        sink-full and recorded windows included), cross attention, sliding window or
        sliding-window MLA of the first spec's window, chunked-local attention of its chunk
        size, or Mamba with its number of speculative pages. False for no specs;
        ``NotImplementedError`` when the first spec is of another kind."""
        specs = list(kv_cache_specs.values())
        if not specs:
            return False
        if len({spec.block_size for spec in specs}) > 1:
            return False
        first = specs[0]
        rule = next((r for r in _UNIFORM_TYPE_RULES if isinstance(first, r[0])), None)
        if rule is None:
            raise NotImplementedError(
                f"kv_cache_specs: no uniform-type rule for {type(first).__name__}"
            )
        kind, attr = rule
        return all(
            isinstance(spec, kind) and (attr is None or getattr(spec, attr) == getattr(first, attr))
            for spec in specs
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The group spec of ``kv_cache_specs``, or None when they are not of uniform type."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size=block_size,
            kv_cache_specs={
                name: spec.copy_with_new_block_size(block_size)
                for name, spec in self.kv_cache_specs.items()
            },
        )


_UNIFORM_TYPE_RULES: tuple[tuple[type[KVCacheSpec], str | None], ...] = (
    # (class every spec must be, field they must share), the most specific class first.
    (SlidingWindowMLASpec, "sliding_window"),
    (FullAttentionSpec, None),
    (CrossAttentionSpec, None),
    (SlidingWindowSpec, "sliding_window"),
    (ChunkedLocalAttentionSpec, "attention_chunk_size"),
    (MambaSpec, "num_speculative_blocks"),
)


class KVCacheSpecKind(str, Enum):
    """The kind of cache a spec describes (subclasses have their own kind)."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"


_SPEC_KINDS: tuple[tuple[type[KVCacheSpec], KVCacheSpecKind], ...] = (
    # The most specific class first.
    (SlidingWindowMLASpec, KVCacheSpecKind.SLIDING_WINDOW_MLA),
    (MLAAttentionSpec, KVCacheSpecKind.MLA_ATTENTION),
    (SinkFullAttentionSpec, KVCacheSpecKind.SINK_FULL_ATTENTION),
    (FullAttentionSpec, KVCacheSpecKind.FULL_ATTENTION),
    (ChunkedLocalAttentionSpec, KVCacheSpecKind.CHUNKED_LOCAL_ATTENTION),
    (SlidingWindowSpec, KVCacheSpecKind.SLIDING_WINDOW),
    (MambaSpec, KVCacheSpecKind.MAMBA),
    (EncoderOnlyAttentionSpec, KVCacheSpecKind.ENCODER_ONLY_ATTENTION),
    (CrossAttentionSpec, KVCacheSpecKind.CROSS_ATTENTION),
)


def get_kv_cache_spec_kind(kv_cache_spec: KVCacheSpec) -> KVCacheSpecKind:
    """The kind of ``kv_cache_spec``; a :class:`UniformTypeKVCacheSpecs` has its layers' kind
    when they share one, else ``UNKNOWN``."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        kinds = {get_kv_cache_spec_kind(s) for s in kv_cache_spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else KVCacheSpecKind.UNKNOWN
    for cls, kind in _SPEC_KINDS:
        if isinstance(kv_cache_spec, cls):
            return kind
    return KVCacheSpecKind.UNKNOWN


def get_kv_cache_spec_sliding_window(kv_cache_spec: KVCacheSpec) -> int | None:
    """The window (tokens) of a sliding-window spec; for a :class:`UniformTypeKVCacheSpecs` the
    window its layers share; None otherwise (a window recorded on a full-attention spec does
    not count: those layers are cached in full)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        windows = {
            get_kv_cache_spec_sliding_window(s) for s in kv_cache_spec.kv_cache_specs.values()
        }
        return windows.pop() if len(windows) == 1 else None
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return kv_cache_spec.sliding_window
    return None


@dataclass
class KVCacheTensor:
    """One raw buffer of ``size`` bytes, shared by the layers in ``shared_by``."""

    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    """Layers that share one block table, and the spec of their pages."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    """True for the group holding EAGLE / MTP draft attention layers."""


@dataclass
class KVCacheConfig:
    """How the KV cache is allocated: ``num_blocks`` pages per tensor, and the groups."""

    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        n = self.num_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_blocks: expected an int >= 0 (pages per tensor), got {n!r}")

    @property
    def has_mamba_layers(self) -> bool:
        """True when a group holds Mamba states."""
        return any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups)

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """True when fresh pages must be zeroed before use (Mamba states are read first)."""
        return self.has_mamba_layers


def iter_layer_specs(config: KVCacheConfig) -> Iterator[tuple[str, KVCacheSpec]]:
    """``(layer name, the layer's own spec)`` for every layer of ``config``, group by group.

    A :class:`UniformTypeKVCacheSpecs` group is split per layer; ``ValueError`` when it has no
    spec for one of its layers.
    """
    for group_idx, group in enumerate(config.kv_cache_groups):
        group_spec = group.kv_cache_spec
        for layer_name in group.layer_names:
            if not isinstance(group_spec, UniformTypeKVCacheSpecs):
                yield layer_name, group_spec
            elif layer_name in group_spec.kv_cache_specs:
                yield layer_name, group_spec.kv_cache_specs[layer_name]
            else:
                raise ValueError(
                    f"kv_cache_config: layer {layer_name!r} of group {group_idx} has no "
                    f"spec in its UniformTypeKVCacheSpecs (has: "
                    f"{', '.join(group_spec.kv_cache_specs)})"
                )
