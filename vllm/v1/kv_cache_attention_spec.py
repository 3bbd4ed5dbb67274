"""The attention specs' page math (:mod:`vllm.v1.kv_cache_interface` re-exports every name):
``AttentionSpec`` with its encoding, and the full, sink, encoder-only, cross-attention,
sliding-window and chunked-local specs.

Units: ``block_size`` is in tokens per page, every ``*_bytes`` quantity is in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.formats import KVCacheFormat, KVQuantMode, format_for_storage
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.kv_cache_spec_base import (
    KVCacheSpec,
    KVCacheSpecMergeError,
    _as_torch_dtype,
    _check_optional_positive,
    _check_positive,
    _check_same_fields,
    _max_model_len,
    _merge_window,
    cdiv,
)

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = [
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "SinkFullAttentionSpec",
    "SlidingWindowSpec",
]


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """A paged K/V cache of ``num_kv_heads`` heads.

    ``dtype`` is the storage dtype (``torch.uint8`` for FP8 and NVFP4). ``head_size_v``
    defaults to ``head_size``. ``page_size_padded`` (bytes) overrides the page size when a
    group needs equal pages. ``encoding`` (beyond upstream) is the layer's whole encoding
    (:class:`~vllm.kv_quant.encoding.KVCacheEncoding`: FP8 variant, scale granularity and
    layouts, key transform, key sink rows); left ``None`` it becomes the encoding with defaults
    of the format ``(kv_quant_mode, dtype)`` describe, so after construction it is never None.
    Its format must have the spec's ``kv_quant_mode``; its key sink rows are part of the page.
    """

    LATENT_PAGES: ClassVar[bool] = False
    """True for the latent (MLA-style) page math of ``LatentPageSpec``."""

    dcp_sharded: bool = True
    max_tp_shards: int | None = None
    """Distinct shards this cache splits into across tensor parallelism (ranks beyond hold
    replicas); None: unknown, taken as not replicated."""
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    head_size_v: int | None = None
    encoding: KVCacheEncoding | None = None
    num_head_slots: int | None = None
    """H of the page's ``[B, H, N, C]`` grid when a backend packs heads its own way (upstream
    v0.33's field); None: one slot per KV head."""
    state_content_bytes: int | None = None
    """C of the grid, bytes per (head slot, stored state), when a backend packs its own rows
    (upstream v0.33's field); None: the encoding's rows. Set, the unpadded page is H x N x C."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _check_positive(self, "block_size", "num_kv_heads", "head_size")
        _check_optional_positive(self, "num_head_slots")
        _check_optional_positive(self, "state_content_bytes")
        v = self.head_size_v
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            # 0: a key-only cache (upstream's latent and circular-buffer key pools).
            raise ValueError(f"head_size_v: expected an int >= 0, got {v!r}")
        _check_optional_positive(self, "max_tp_shards")
        object.__setattr__(self, "dtype", _as_torch_dtype("dtype", self.dtype))
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
        self._resolve_encoding()
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

    def _resolve_encoding(self) -> None:
        """Fill in the default encoding, or check a given one against the spec: the same quant
        mode, storage elements of the spec's size, and a geometry that holds it."""
        encoding = self.encoding
        default = KVCacheEncoding(self._default_format())
        if encoding is None or encoding == default:
            object.__setattr__(self, "encoding", default)
            return
        if not isinstance(encoding, KVCacheEncoding):
            raise ValueError(
                f"encoding: expected a KVCacheEncoding or None, got {type(encoding).__name__}"
            )
        fmt = encoding.format
        itemsize = get_dtype_size(fmt.resolve_storage_dtype(self.dtype))
        if fmt.quant_mode != self.kv_quant_mode or itemsize != get_dtype_size(self.dtype):
            raise ValueError(
                f"encoding: expected an encoding of a {self.kv_quant_mode.name} format stored "
                f"as {self.dtype}, got {encoding.id!r}"
            )
        encoding.check_geometry(
            self.block_size, self.num_kv_heads, self.head_size, self.head_size_v
        )

    def _default_format(self) -> KVCacheFormat:
        """The format upstream's fields describe: ``(kv_quant_mode, dtype)`` (FP8 →
        ``fp8_e4m3``: upstream's spec does not record the variant; an encoding does)."""
        return format_for_storage(self.kv_quant_mode, self.dtype)

    @property
    def kv_cache_format(self) -> KVCacheFormat:
        """The registry's format of this cache: its encoding's."""
        return self.kv_cache_encoding.format

    @property
    def kv_cache_encoding(self) -> KVCacheEncoding:
        """:attr:`encoding`, typed as never None."""
        assert self.encoding is not None
        return self.encoding

    @property
    def head_bytes_per_token(self) -> int:
        """K plus V bytes of one token of one head."""
        return self.kv_cache_encoding.kv_bytes_per_page(
            1, 1, self.head_size, self.head_size_v, get_dtype_size(self.dtype)
        )

    @property
    def sink_bytes_per_page(self) -> int:
        """Bytes of the page's key sink rows (after its K and V rows; 0 without sinks)."""
        return self.kv_cache_encoding.sink_bytes_per_page(self.num_kv_heads, self.head_size)

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads if self.num_head_slots is None else self.num_head_slots

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one page without padding: K and V rows, then the key sink rows (H x N x
        ``state_content_bytes`` when a backend packs the page)."""
        if self.state_content_bytes is not None:
            return self.num_heads * self.num_states * self.state_content_bytes
        return self.kv_cache_encoding.page_bytes(
            self.block_size,
            self.num_kv_heads,
            self.head_size,
            self.head_size_v,
            get_dtype_size(self.dtype),
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        """Pages for every token: ``cdiv(max_model_len, block_size)``, the length first divided
        among the decode context-parallel ranks (each keeps its share) unless the cache is
        replicated on them (``dcp_sharded=False``, a draft's), as upstream v0.33."""
        max_model_len = _max_model_len(vllm_config)
        ranks = vllm_config.parallel_config.decode_context_parallel_size
        if ranks > 1 and self.dcp_sharded:
            max_model_len = cdiv(max_model_len, ranks)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        """Block-table entries for ``max_len`` tokens; a DCP-sharded cache's page covers
        ``block_size`` tokens on each of the decode context-parallel ranks."""
        shards = vllm_config.parallel_config.decode_context_parallel_size if self.dcp_sharded else 1
        return cdiv(max_len, self.block_size * shards)


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
                isinstance(s, FullAttentionSpec) and not s.LATENT_PAGES for s in (first, other)
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
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most pages one request holds: the last ``sliding_window - 1`` tokens plus the
        ``max_in_flight_tokens`` scheduled but not yet freed (at most ``max_model_len``), and
        one more page because the window may start in the middle of a page."""
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        # A replicated window (a draft's) holds every position on each rank: DCP is no
        # concern of its sizing; a sharded window is not supported.
        if self.dcp_sharded and vllm_config.parallel_config.decode_context_parallel_size != 1:
            raise ValueError(
                "decode_context_parallel_size: sliding-window layers need 1 when DCP-sharded, got "
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
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Most pages one request holds: one chunk plus the ``max_in_flight_tokens`` scheduled
        but not yet freed, at most ``max_model_len``."""
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return _admission_bytes(self, vllm_config)


def _admission_bytes(
    spec: SlidingWindowSpec | ChunkedLocalAttentionSpec, vllm_config: VllmConfig
) -> int:
    """``max_admission_blocks_per_request`` pages, from the tokens in flight."""
    blocks = spec.max_admission_blocks_per_request(
        max_in_flight_tokens=vllm_config.max_in_flight_tokens,
        max_model_len=_max_model_len(vllm_config),
    )
    return blocks * spec.page_size_bytes
