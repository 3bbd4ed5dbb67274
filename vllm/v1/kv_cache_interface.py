"""KV-cache specs: what one page of a layer's cache holds, and how many bytes it takes.

The attention specs live in :mod:`vllm.v1.kv_cache_attention_spec` and the base and Mamba specs
in :mod:`vllm.v1.kv_cache_spec_base`; this module (upstream's path) holds the latent (MLA) and
uniform-type specs, the spec kinds and ``KVCacheConfig``, and re-exports the rest.

Units: ``block_size`` is in tokens per page, every ``*_bytes`` quantity is in bytes.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from vllm.kv_quant.ds_mla_nvfp4 import NVFP4_DS_MLA
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import (
    FP8_DS_MLA,
    FP8_DS_MLA_HEAD_SIZE,  # re-exported: its home before the format registry
    FP8_DS_MLA_RECORD_BYTES,  # noqa: F401
    FP8_DS_MLA_V32_HEAD_SIZE,
    KVCacheFormat,
    KVQuantMode,
    lookup,
)
from vllm.utils.torch_utils import (
    get_dtype_size,
    is_quantized_kv_cache,  # noqa: F401  (upstream's home of these predicates)
    kv_cache_uses_per_token_head_scales,  # noqa: F401
)
from vllm.v1.kv_cache_attention_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_config_types import (  # noqa: F401  (re-exported: upstream's home)
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
    iter_layer_specs,
)
from vllm.v1.kv_cache_hisparse_spec import (  # noqa: F401  (re-exported: upstream's home)
    HiSparseHotSpec,
    HiSparseResidentSpec,
    SparseCacheRole,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: F401  (re-exported)
from vllm.v1.kv_cache_spec_base import (
    KVCacheSpec,
    MambaSpec,
    _check_optional_positive,
    _check_positive,
    cdiv,
    get_mamba_prefill_checkpoint_position,  # noqa: F401  (re-exported: upstream's home)
    is_mamba_prefill_checkpoint_valid,  # noqa: F401  (re-exported: upstream's home)
    round_up,
)
from vllm.v1.kv_cache_views import (  # noqa: F401  (re-exported: upstream's home)
    compute_layer_kv_cache_shape_bytes,
    compute_layout_strides,
    create_kv_cache_views,
    group_kernel_blocks,
    replace_as,
)
from vllm.v1.kv_cache_window_specs import (  # noqa: F401  (upstream's home of these specs)
    CircularBufferSpec,
    RSWASpec,
)

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """Quantization mode of a ``kv_cache_dtype`` string (the registry's ``quant_mode``)."""
    return lookup(kv_cache_dtype).quant_mode


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

    LATENT_PAGES: ClassVar[bool] = True
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
                "fp8, fp8_ds_mla, nvfp4_ds_mla)"
            )
        if self.block_size % self.compress_ratio != 0:
            raise ValueError(
                f"block_size: must be a multiple of compress_ratio={self.compress_ratio}, "
                f"got {self.block_size}"
            )
        if self.kv_cache_encoding != KVCacheEncoding(self._default_format()):
            raise ValueError(
                "encoding: a latent (MLA) cache is its format's record, without key options, "
                f"block-scale layouts or per-head scales; expected "
                f"{self._default_format().name!r}, got {self.kv_cache_encoding.id!r}"
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

    def _default_format(self) -> KVCacheFormat:
        """``fp8_ds_mla`` for a record, else the format named by ``cache_dtype_str`` when set,
        else the one ``(kv_quant_mode, dtype)`` describe."""
        if self.uses_ds_mla_record:
            return FP8_DS_MLA
        if self.cache_dtype_str is not None:
            return lookup(self.cache_dtype_str, "cache_dtype_str")
        return super()._default_format()

    @property
    def slot_size_bytes(self) -> int:
        """Bytes of one stored slot (all heads): ``state_content_bytes`` per head when set, else
        one row of the format's last dim per head, in ``dtype`` elements (a record's own
        bytes)."""
        if self.state_content_bytes is not None:
            # A backend's own packing, e.g. 132 bytes: an indexer's 128 FP8 key bytes + scale.
            return self.num_heads * self.state_content_bytes
        fmt = self.kv_cache_format
        row = fmt.last_dim(self.head_size)
        if self.uses_ds_mla_record or fmt is NVFP4_DS_MLA:  # records: their bytes, any dtype
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


_LatentSpecT = TypeVar("_LatentSpecT", bound=type[LatentPageSpec])


def _accepts_tokens_per_state(cls: _LatentSpecT) -> _LatentSpecT:
    """Let ``cls(...)`` take upstream v0.33's ``tokens_per_state=r`` (tokens per stored latent,
    an int) as ``compress_ratio=r``. Not a field: ``dataclasses.replace`` passes only
    ``compress_ratio``, so the two never disagree on a copy."""
    generated = cls.__init__

    @functools.wraps(generated)
    def __init__(self: LatentPageSpec, *args: Any, tokens_per_state: Any = None, **kw: Any) -> None:
        if tokens_per_state is not None:
            if isinstance(tokens_per_state, bool) or not isinstance(tokens_per_state, int):
                raise ValueError(
                    "tokens_per_state: expected a positive int (tokens per stored latent), got "
                    f"{tokens_per_state!r}"
                )
            ratio = kw.setdefault("compress_ratio", tokens_per_state)
            if ratio != tokens_per_state:
                raise ValueError(
                    f"tokens_per_state: expected compress_ratio's value {ratio}, got "
                    f"{tokens_per_state}"
                )
        generated(self, *args, **kw)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_accepts_tokens_per_state
@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(LatentPageSpec, FullAttentionSpec):
    """Multi-head latent attention: one latent of ``head_size`` per token (or per
    ``compress_ratio`` tokens), shared by all heads; page math of :class:`LatentPageSpec`.

    ``cache_role`` says whether a sparse-attention layer's cache holds the latents or its
    indexer's keys; ``is_index_group_leader`` marks the layer whose indexer picks the pages
    (HiSparse keeps that layer's history on host)."""

    cache_role: SparseCacheRole = SparseCacheRole.SPARSE
    is_index_group_leader: bool = False
    topk_buffer_width: int | None = None
    """Rows (tokens) the indexer picks per query for this layer; None: the model's
    ``index_topk``."""


@_accepts_tokens_per_state
@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """A layer caching hidden states (upstream's marker for extracted hidden states): placed in
    its own group, with the common page size."""


@_accepts_tokens_per_state
@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(LatentPageSpec, SlidingWindowSpec):
    """Sliding-window attention over one shared latent per token (DeepSeek-V4's SWA cache):
    latent page math, sliding-window memory bound. ``model_version="deepseek_v4"`` alone selects
    the 584-byte record, as upstream. ``bounded_replay``: the window is recomputed from the
    last ``sliding_window`` tokens of a prefix hit instead of cached, so the group takes no
    part in prefix caching."""

    RECORD_BY_MODEL_VERSION: ClassVar[bool] = True

    bounded_replay: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens (before a prefix hit) this layer recomputes: its window under bounded replay."""
        return self.sliding_window if self.bounded_replay else 0


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """Layers that need the same slots (same type and block size) but may differ in page size.

    One "page" of the group is one page of every layer, so its size is the sum.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_cache_specs:
            # The group is sharded across DCP ranks exactly when its layers are.
            object.__setattr__(self, "dcp_sharded", self.first_spec.dcp_sharded)

    @property
    def first_spec(self) -> KVCacheSpec:
        """The first layer's spec."""
        return next(iter(self.kv_cache_specs.values()))

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for spec in self.kv_cache_specs.values())

    @property
    def prefix_replay_tokens(self) -> int:
        return max(spec.prefix_replay_tokens for spec in self.kv_cache_specs.values())

    @property
    def block_table_token_alignment(self) -> int | None:
        return self.first_spec.block_table_token_alignment

    @property
    def uses_slot_mapping(self) -> bool:
        return self.first_spec.uses_slot_mapping

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        """The block-table width its layers share (metadata builders size from a layer's spec);
        ``ValueError`` when they differ."""
        widths = {
            spec.max_num_blocks_per_req(vllm_config, max_len)
            for spec in self.kv_cache_specs.values()
        }
        if len(widths) != 1:
            raise ValueError(
                f"kv_cache_specs: layers of one group need one block-table width, got "
                f"{sorted(widths)}"
            )
        return widths.pop()

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

    def get_max_layers_per_page_size(self) -> int:
        """Layers of the most common page size (one "tuple" holds one layer of each size)."""
        sizes = Counter(spec.page_size_bytes for spec in self.kv_cache_specs.values())
        return sizes.most_common(1)[0][1]

    get_num_layer_tuples = get_max_layers_per_page_size  # this library's earlier name

    @classmethod
    def is_uniform_type(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        """True when all specs need the same token slots (as upstream): one block size, and
        every spec of the first spec's kind: any full attention (MLA of any compress ratio,
        sink-full and recorded windows included), cross attention, sliding window or
        sliding-window MLA of the first spec's window, chunked-local attention of its chunk
        size, or Mamba with its number of speculative pages. False for no specs;
        :class:`UnsupportedKVCacheSpecError` when the first spec is of another kind."""
        specs = list(kv_cache_specs.values())
        if not specs:
            return False
        if len({spec.block_size for spec in specs}) > 1:
            return False
        if len({spec.dcp_sharded for spec in specs}) > 1:
            return False
        first = specs[0]
        rule = _uniform_type_rule(first)
        if rule is None:
            raise UnsupportedKVCacheSpecError(
                f"kv_cache_specs: Unsupported KV cache spec type {type(first).__name__} (no "
                "uniform-type rule covers it)"
            )
        kind, fields = rule
        return all(
            isinstance(spec, kind)
            and all(getattr(spec, name) == getattr(first, name) for name in fields)
            for spec in specs
        )

    @classmethod
    def from_specs(cls, kv_cache_specs: dict[str, KVCacheSpec]) -> UniformTypeKVCacheSpecs | None:
        """The group spec of ``kv_cache_specs``, or None when they are not of uniform type."""
        if not cls.is_uniform_type(kv_cache_specs):
            return None
        block_size = next(iter(kv_cache_specs.values())).block_size
        return cls(block_size=block_size, kv_cache_specs=dict(kv_cache_specs))

    def layer_specs(self) -> tuple[KVCacheSpec, ...]:
        return tuple(self.kv_cache_specs.values())

    def copy_with_new_block_size(self, block_size: int) -> UniformTypeKVCacheSpecs:
        return UniformTypeKVCacheSpecs(
            block_size=block_size,
            kv_cache_specs={
                name: spec.copy_with_new_block_size(block_size)
                for name, spec in self.kv_cache_specs.items()
            },
        )


_UNIFORM_TYPE_RULES: tuple[tuple[type[KVCacheSpec], tuple[str, ...]], ...] = (
    # (class every spec must be, fields they must share), the most specific class first.
    (SlidingWindowMLASpec, ("sliding_window", "bounded_replay")),
    (FullAttentionSpec, ()),
    (CrossAttentionSpec, ()),
    (SlidingWindowSpec, ("sliding_window",)),
    (ChunkedLocalAttentionSpec, ("attention_chunk_size",)),
    (CircularBufferSpec, ()),
    (
        MambaSpec,
        (
            "num_speculative_blocks",
            "num_prefill_checkpoint_blocks",
            "prefill_checkpoint_alignment",
            "page_size_bytes",
            "tp_replicated",
        ),
    ),
)


class UnsupportedKVCacheSpecError(AssertionError, NotImplementedError):
    """A spec of a type no uniform-type rule covers: an ``AssertionError`` as upstream raises,
    and a ``NotImplementedError`` as this library raised before."""


def _uniform_type_rule(spec: KVCacheSpec) -> tuple[type[KVCacheSpec], tuple[str, ...]] | None:
    """``(base class, shared fields)`` of the uniform-type rule covering ``spec``, or None."""
    return next((rule for rule in _UNIFORM_TYPE_RULES if isinstance(spec, rule[0])), None)


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
    when they share one, ``FULL_ATTENTION`` when they differ in kind but all group as full
    attention (MLA or sink-full layers next to plain ones), else ``UNKNOWN``."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        members = kv_cache_spec.kv_cache_specs.values()
        kinds = {get_kv_cache_spec_kind(s) for s in members}
        if len(kinds) == 1:
            return kinds.pop()
        bases = {(_uniform_type_rule(s) or (None,))[0] for s in members}
        return (
            KVCacheSpecKind.FULL_ATTENTION
            if bases == {FullAttentionSpec}
            else KVCacheSpecKind.UNKNOWN
        )
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


def is_full_attention_spec(kv_cache_spec: KVCacheSpec) -> bool:
    """True when ``kv_cache_spec`` is, or wraps only, full attention (any full-attention
    subclass, MLA included); False for a wrapper without layers. A group holding a
    sliding-window layer recycles its slots, so slot-keyed callers cannot use it."""
    layer_specs = kv_cache_spec.layer_specs()
    return bool(layer_specs) and all(isinstance(s, FullAttentionSpec) for s in layer_specs)
