"""Reference attention backend: pure torch, any device, every cache format and encoding.

Same cache layout and shapes as :class:`~vllm.v1.attention.backends.flashinfer.FlashInferBackend`
(``(B, 2, N, H, D')``, NHD or HND, ``D' = F(D)`` for NVFP4), plus separate K / V regions when
``head_size_v != head_size``, and the key sink rows of an encoding that keeps them after each
page's K and V rows. The impl computes paged attention straight from the cache: per sequence it
gathers the pages it needs, dequantizes them with the encoding's reference codec
(:mod:`vllm.kv_quant.codecs`: unquantized, FP8 e4m3 / e5m2 with per-tensor or ``[H]`` scales,
NVFP4 with linear or interleave4 block scales, K and V layouts independent, per-token-head
rows), rebuilds keys as the encoding's key transform says, then attends in fp32.

The packed-slot formats (TurboQuant, UltraQuant, Octave: K and V of a token and KV head in one
slot) use TURBOQUANT's cache instead, ``(B, H, N, slot_bytes)`` uint8 stored block, token, head,
slot, written and decoded by their reference codecs (:mod:`.reference_packed`).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vllm.kv_quant import KeyRope, KeyTransform, ScaleLayout, interleave4_index
from vllm.kv_quant.codecs import codec_dtype_names
from vllm.kv_quant.encoding import KVCacheEncoding, ScaleGranularity
from vllm.kv_quant.formats import find_format, formats
from vllm.kv_quant.key_sinks import key_sink_scale, write_key_sinks
from vllm.kv_quant.slot_codecs import is_packed
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    KVCacheScaleLayouts,
    check_kv_cache_shape_args,
    paged_kv_cache_shape,
    softmax_scale,
)
from vllm.v1.attention.backends.key_rebuild import KeyRebuild, key_positions, key_sink_rows
from vllm.v1.attention.backends.reference_args import (
    check_impl_args,
    check_output,
    check_scale,
    check_side,
    one_layout,
)
from vllm.v1.attention.backends.reference_attend import (
    attend_fp32,
    check_codec_write,
    compiled_writer,
    gather_pages,
)
from vllm.v1.attention.backends.reference_metadata import (
    CheckedForward,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.reference_packed import PackedSlots, packed_kv_cache_shape
from vllm.v1.attention.backends.utils import check_sequences, key_window, split_kv_cache


class ReferenceAttentionBackend(AttentionBackend):
    """Pure-torch paged attention over every cache format, on CPU and any CUDA GPU."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        *codec_dtype_names(),
        *(f.name for f in formats() if is_packed(f)),
    ]
    supports_head_size_v: ClassVar[bool] = True
    supported_features: ClassVar[frozenset[str]] = AttentionBackend.supported_features.union(
        ("has_sink", "has_sliding_window", "use_non_causal", "use_per_head_quant_scales")
    )

    @staticmethod
    def get_name() -> str:
        return "REFERENCE"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, 2, block_size, num_kv_heads, F(head_size) if nvfp4 else head_size)``,
        the same as FlashInfer's; a packed-slot format's is TURBOQUANT's ``(num_blocks,
        num_kv_heads, block_size, slot_bytes)`` uint8, stored block, token, head, slot
        (:data:`~vllm.v1.attention.backends.reference_packed.PACKED_STRIDE_ORDER`)."""
        fmt = find_format(cache_dtype_str)
        if fmt is not None and is_packed(fmt):
            check_kv_cache_shape_args(
                "ReferenceAttentionBackend", num_blocks, block_size, num_kv_heads, head_size
            )
            return packed_kv_cache_shape(fmt, num_blocks, block_size, num_kv_heads, head_size)
        return paged_kv_cache_shape(
            "ReferenceAttentionBackend",
            num_blocks,
            block_size,
            num_kv_heads,
            head_size,
            cache_dtype_str,
        )

    @staticmethod
    def get_impl_cls() -> type[ReferenceAttentionImpl]:
        return ReferenceAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[ReferenceAttentionMetadata]:
        return ReferenceAttentionMetadata


_UNIT_SCALE = torch.ones(1, dtype=torch.float32)
"""The scale that an unquantized cache's reads and writes ignore (never written to)."""


class ReferenceAttentionImpl(AttentionImpl):
    """Paged attention read straight from the cache (decode, prefill, chunked prefill).

    ``scale`` defaults to ``1/sqrt(head_size)``. ``sliding_window`` W: the query at position
    ``p`` sees keys in ``(p - W, p]``. ``num_heads`` must be a multiple of ``num_kv_heads``
    (query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``). ``sinks`` (fp32
    ``[num_heads]``) are per-head logits added to each softmax denominator (GPT-OSS).
    ``k_scale_layout`` / ``v_scale_layout`` name the NVFP4 block-scale layout of each side, for
    the write (:meth:`do_kv_cache_update`) and the read (:meth:`forward`): pass the layouts
    recorded with the cache (``get_kv_cache_scale_layouts``). Defaults (:meth:`scale_layouts`):
    the encoding's, else the op's default for the cache's geometry; ``v_scale_layout=None``
    means K's when ``k_scale_layout`` is given.

    ``kv_cache_dtype`` is a dtype string or, beyond upstream, an encoding id or
    :class:`~vllm.kv_quant.encoding.KVCacheEncoding` (``"nvfp4_mse+offset+prerope+sink"``):
    the impl applies its key transform itself, the write half (RoPE undone, offset, rotation,
    sink rows) in :meth:`do_kv_cache_update` and the read half in :meth:`forward`, so an
    engine driving the impl directly stores and reads what the encoding says. ``key_rope``
    is the model's RoPE for an encoding that stores keys before it; the key offset is
    calibrated state (:meth:`set_key_offset`), the scales are the layer's.
    """

    cache_device_type: ClassVar[str | None] = None
    """The device type that the cache must be on (``None``: any device)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float | None = None,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str | KVCacheEncoding = "auto",
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
        *,
        head_size_v: int | None = None,
        k_scale_layout: ScaleLayout | str | None = None,
        v_scale_layout: ScaleLayout | str | None = None,
        key_rope: KeyRope | None = None,
    ) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_size_v = head_size if head_size_v is None else head_size_v
        check_impl_args(
            num_heads, num_kv_heads, head_size, head_size_v, sliding_window, logits_soft_cap, sinks
        )
        encoding = KVCacheEncoding.of(kv_cache_dtype, include_mla_only=False)
        fmt = encoding.format
        self._packed = self._packed_slots(encoding, num_kv_heads, head_size, head_size_v, key_rope)
        group = fmt.block_scale_group
        if group is not None:
            for name, value in (("head_size", head_size), ("head_size_v", head_size_v)):
                if value % group != 0:
                    raise ValueError(
                        f"{name}: {fmt.label.upper()} KV cache needs a multiple of {group}, "
                        f"got {value}"
                    )
        if self._packed is None:
            encoding.check_geometry(None, num_kv_heads, head_size, head_size_v)
        transform = KeyTransform.bind(encoding.key, key_rope)
        if key_rope is not None and encoding.key.rope is None:
            encoding = encoding.with_rope(key_rope)
        encoding.check_attention(logits_soft_cap, sinks is not None)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.head_size = head_size
        self.head_size_v = head_size_v
        self.scale = softmax_scale(scale, head_size)
        self.sliding_window = sliding_window
        # The dtype string kernels and backends take: the one given, else the format's.
        named = isinstance(kv_cache_dtype, str) and find_format(kv_cache_dtype) is not None
        self.kv_cache_dtype = kv_cache_dtype if named else fmt.name
        self.kv_cache_encoding = encoding
        self.kv_cache_format = fmt
        self.key_transform = transform
        """The encoding's key transform with the model's RoPE and the calibrated offset."""
        # D -> D' of the per-side rows (a packed-slot cache has none).
        sizes = () if self._packed else (head_size, head_size_v)
        self._cache_dims = {h: fmt.last_dim(h) for h in sizes}
        self.logits_soft_cap = logits_soft_cap
        self.sinks = sinks
        # None: the backend's default for the cache's geometry, known at the first cache.
        self.k_scale_layout = one_layout("k_scale_layout", k_scale_layout, encoding.k_scale_layout)
        v_given = v_scale_layout
        if v_given is None and k_scale_layout is not None:
            v_given = self.k_scale_layout
        self.v_scale_layout = one_layout("v_scale_layout", v_given, encoding.v_scale_layout)
        # Block size -> scale_layouts() checked to fit its pages; the layouts and head sizes
        # are fixed here, so an entry never goes stale.
        self._fitting_layouts: dict[int, KVCacheScaleLayouts] = {}

    def _packed_slots(
        self,
        encoding: KVCacheEncoding,
        num_kv_heads: int,
        head_size: int,
        head_size_v: int,
        key_rope: KeyRope | None,
    ) -> PackedSlots | None:
        """The packed-slot codec of ``encoding``'s format (None for a per-side format), after
        the checks such a format needs: read by this impl's :meth:`forward`
        (:meth:`_reads_packed_slots`), no per-head scales or key
        RoPE (the slot keeps its own scales and stores keys as given), K and V of one size."""
        fmt = encoding.format
        if not is_packed(fmt):
            return None
        if not self._reads_packed_slots():
            raise ValueError(
                f"kv_cache_dtype: expected a format {type(self).__name__} reads (the packed-slot "
                f"formats are read by REFERENCE or their own backend), got {fmt.name!r}"
            )
        if encoding.granularity is ScaleGranularity.HEAD:
            raise ValueError(
                f"kv_cache_dtype: expected {fmt.name} without /head (a packed-slot format keeps "
                f"its scales inside each slot), got {encoding.id!r}"
            )
        if key_rope is not None:
            raise ValueError(
                f"key_rope: expected None for {fmt.name} (a packed-slot format stores keys as "
                "given), got a KeyRope"
            )
        if head_size_v != head_size:
            raise ValueError(
                f"head_size_v: expected head_size={head_size} (a {fmt.name} slot holds K and V "
                f"of one size), got {head_size_v}"
            )
        return PackedSlots(fmt, num_kv_heads, head_size)

    def _reads_packed_slots(self) -> bool:
        """Whether this impl's :meth:`forward` reads packed-slot caches: the reference one does;
        an impl that replaces it with kernels says so by overriding this."""
        return type(self).forward is ReferenceAttentionImpl.forward

    def set_key_offset(self, offset: torch.Tensor | None) -> None:
        """Subtract ``offset`` (``[num_kv_heads, head_size]``, finite; calibrated state, e.g.
        :meth:`vllm.kv_quant.KVScaleObserver.key_mean`) from every key before it is written,
        or stop (``None``); the encoding then says ``+offset`` or not. Refused where the shift
        would change the attention (:meth:`KVCacheEncoding.check_attention`). Pages written
        before are read with the new offset."""
        if offset is not None:
            shape = [self.num_kv_heads, self.head_size]
            if not isinstance(offset, torch.Tensor) or list(offset.shape) != shape:
                got = list(offset.shape) if isinstance(offset, torch.Tensor) else offset
                raise ValueError(f"offset: expected a tensor of shape {shape}, got {got}")
        encoding = self.kv_cache_encoding.with_key(offset=offset is not None)
        encoding.check_attention(self.logits_soft_cap, self.sinks is not None, "offset")
        transform = KeyTransform.bind(encoding.key, self.key_transform.rope, offset)
        self.kv_cache_encoding, self.key_transform = encoding, transform

    def scale_layouts(self, block_size: int) -> KVCacheScaleLayouts:
        """NVFP4 scale layouts (K, V) of this impl's caches with pages of ``block_size``
        tokens: the named ones, else :class:`ReferenceAttentionBackend`'s default for the
        geometry (upstream's interleave4 where it fits, else linear)."""
        default = ReferenceAttentionBackend.get_kv_cache_scale_layouts(
            block_size, self.head_size, self.head_size_v
        )
        return KVCacheScaleLayouts(
            default.k_scale_layout if self.k_scale_layout is None else self.k_scale_layout,
            default.v_scale_layout if self.v_scale_layout is None else self.v_scale_layout,
        )

    # ----------------------------------------------------------------------------- checks

    def _cache_views(
        self, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The checked cache sides and the key sink rows of their pages (None without sinks);
        the layouts and the encoding checked against the pages. A packed-slot cache: its
        ``(B, N, H, slot)`` view as both sides."""
        if self._packed is not None:
            view = self._packed.cache_view(kv_cache)
            return view, view, None
        key_cache, value_cache = split_kv_cache(kv_cache)
        for name, side, size in (
            ("key_cache", key_cache, self.head_size),
            ("value_cache", value_cache, self.head_size_v),
        ):
            dim = self._cache_dims[size]
            fmt, dtype = self.kv_cache_format, self.kv_cache_dtype
            check_side(side, name, self.num_kv_heads, dim, size, fmt, dtype)
        self._fitting_scale_layouts(key_cache.shape[1])
        sink_tokens = self.kv_cache_encoding.key.sink_tokens
        if not sink_tokens:
            return key_cache, value_cache, None
        rows = key_sink_rows(kv_cache, sink_tokens, self.num_kv_heads, self.head_size)
        return key_cache, value_cache, rows

    def _sink_scale(self, k_scale: torch.Tensor) -> torch.Tensor:
        """The sink rows' FP8 scale for the layer's K scale."""
        return key_sink_scale(k_scale, self.kv_cache_encoding.sink_scale_multiplier)

    # ------------------------------------------------------------------------------ write

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Write ``key [T_pad, H, D]`` / ``value [T_pad, H, Dv]`` into the cache at
        ``slot_mapping [T]`` (negative slots skipped), as the encoding stores them: keys
        through its key transform (RoPE undone at ``positions [T]``, each token's position in
        its sequence, needed when keys are stored before RoPE; offset; rotation), quantized,
        and the key sink rows of the pages written in the same pass.

        Uses the compiled ``reshape_and_cache_flash`` when the extension is built, else the
        reference codecs of :mod:`vllm.kv_quant` (the same bytes by contract).
        """
        key_cache, value_cache, rows = self._cache_views(kv_cache)
        self._write(layer, key, value, key_cache, value_cache, slot_mapping, positions, rows)

    def _write(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor | None,
        sink_rows: torch.Tensor | None,
    ) -> None:
        """:meth:`do_kv_cache_update` on checked cache views."""
        if self._packed is not None:
            self._packed.write(key, value, key_cache, slot_mapping)
            return
        transform = self.key_transform
        if transform.rebuilds_keys:
            positions = key_positions(key, positions, self.kv_cache_encoding.id)
        key = transform.stored_key(key, positions)
        k_layout, v_layout = self._fitting_scale_layouts(key_cache.shape[1])
        sink_scale = None
        if sink_rows is not None:
            sink_scale = self._sink_scale(layer._k_scale).to(sink_rows.device)
        op = compiled_writer() if self.kv_cache_encoding.format.has_kernel else None
        if op is not None:  # pages and sink rows in one pass
            op(
                key,
                value,
                key_cache,
                value_cache,
                slot_mapping,
                self.kv_cache_dtype,
                layer._k_scale,
                layer._v_scale,
                k_scale_layout=k_layout.value,
                v_scale_layout=v_layout.value,
                key_sinks=sink_rows,
                key_sink_scale=sink_scale,
            )
            return
        # The codecs (no extension, or no compiled writer of the format), sides checked first.
        codec = self.kv_cache_encoding.codec
        sizes, scales = (self.head_size, self.head_size_v), (layer._k_scale, layer._v_scale)
        check_codec_write(key, value, sizes, key_cache, scales if codec.reads_kv_scale else None)
        codec.write(key, key_cache, slot_mapping, layer._k_scale, k_layout)
        codec.write(value, value_cache, slot_mapping, layer._v_scale, v_layout)
        if sink_rows is not None:
            assert sink_scale is not None
            write_key_sinks(sink_rows, key, slot_mapping, key_cache.shape[1], sink_scale)

    # ------------------------------------------------------------------------------- read

    def _check_forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None,
    ) -> CheckedForward:
        """Validate every argument of :meth:`forward` (nothing is written here) and return the
        normalised inputs (``output`` allocated when ``None``; the query as the reader takes
        it). ``key`` / ``value`` themselves are checked by the writer, before it writes
        anything."""
        if (key is None) != (value is None):
            raise ValueError("key, value: pass both (to write them first) or neither")
        if query.dim() == 2:
            query = query.reshape(query.shape[0], self.num_heads, self.head_size)
        if query.dim() != 3 or tuple(query.shape[1:]) != (self.num_heads, self.head_size):
            raise ValueError(
                f"query: expected shape [T, {self.num_heads}, {self.head_size}], "
                f"got {list(query.shape)}"
            )
        supported = ReferenceAttentionBackend.supported_dtypes
        if query.dtype not in supported:
            raise ValueError(
                f"query: expected one of {', '.join(map(str, supported))}, got {query.dtype}"
            )
        key_cache, value_cache, sink_rows = self._cache_views(kv_cache)
        if key_cache.shape[:2] != value_cache.shape[:2]:
            raise ValueError(
                f"value_cache: expected {list(key_cache.shape[:2])} pages x tokens like "
                f"key_cache, got {list(value_cache.shape[:2])}"
            )
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        device = key_cache.device
        wanted = self.cache_device_type
        if wanted is not None and device.type != wanted:
            raise ValueError(f"kv_cache: expected a tensor on {wanted}, got {device}")
        if query.device != device:
            raise ValueError(f"query: expected device {device} (the cache's), got {query.device}")
        k_scale = v_scale = _UNIT_SCALE
        # Per-token-head rows and packed slots keep their own scales.
        if self._packed is None and self.kv_cache_encoding.codec.reads_kv_scale:
            k_scale = check_scale(layer._k_scale, "k_scale", self.num_kv_heads).to(device)
            v_scale = check_scale(layer._v_scale, "v_scale", self.num_kv_heads).to(device)

        num_tokens = attn_metadata.num_actual_tokens
        if num_tokens > query.shape[0]:
            raise ValueError(
                f"query: expected at least num_actual_tokens={num_tokens} rows, "
                f"got {query.shape[0]}"
            )
        if output is None:
            output = torch.zeros(
                query.shape[0], self.num_heads, self.head_size_v, dtype=query.dtype, device=device
            )
        else:
            check_output(output, query, num_tokens, self.num_heads, self.head_size_v)
        qsl, seq_lens = attn_metadata.checked_batch()
        block_table = attn_metadata.block_table
        check_sequences(qsl, seq_lens, block_table, block_size, num_blocks, self.sliding_window)
        rope = self.key_transform.rope
        longest = max(seq_lens, default=0)
        if rope is not None and longest > rope.max_positions:
            raise ValueError(
                f"seq_lens: expected at most {rope.max_positions} tokens (the rows of the "
                f"encoding's RoPE table), got {longest}"
            )
        query = self.key_transform.reader_query(query)
        return CheckedForward(
            query, key_cache, value_cache, output, k_scale, v_scale, qsl, seq_lens, sink_rows
        )

    def _fitting_scale_layouts(self, block_size: int) -> KVCacheScaleLayouts:
        """:meth:`scale_layouts`, checked (NVFP4) to fit pages of ``block_size`` tokens
        (interleave4's needs: ``ValueError``) with the encoding's page rules (key sinks within
        a page); computed once per block size."""
        layouts = self._fitting_layouts.get(block_size)
        if layouts is None and self._packed is not None:  # no per-side rows to check
            layouts = self._fitting_layouts[block_size] = self.scale_layouts(block_size)
        if layouts is None:
            self.kv_cache_encoding.check_geometry(
                block_size, self.num_kv_heads, self.head_size, self.head_size_v
            )
            layouts = self.scale_layouts(block_size)
            group = self.kv_cache_format.block_scale_group
            for layout, head_size in zip(layouts, (self.head_size, self.head_size_v), strict=True):
                if group is not None and layout is ScaleLayout.INTERLEAVE4:
                    interleave4_index(block_size, head_size // group, "meta")
            self._fitting_layouts[block_size] = layouts
        return layouts

    def _begin_forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None,
    ) -> CheckedForward:
        """:meth:`_check_forward`, then (only once every argument has passed) the write of
        ``key`` / ``value`` at ``attn_metadata.slot_mapping`` when given, at the metadata's
        token positions."""
        checked = self._check_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        if key is not None and value is not None:
            positions = None
            if self.key_transform.rebuilds_keys:
                positions = attn_metadata.token_positions()
            self._write(
                layer,
                key,
                value,
                checked.key_cache,
                checked.value_cache,
                attn_metadata.slot_mapping,
                positions,
                checked.sink_rows,
            )
        return checked

    def _key_rebuild(self, checked: CheckedForward, block_table: torch.Tensor) -> KeyRebuild | None:
        """What the reader needs to rebuild this call's keys (None: keys read as stored)."""
        rows = checked.sink_rows
        scale = None if rows is None else self._sink_scale(checked.k_scale)
        return KeyRebuild.of(self.key_transform, rows, block_table, len(checked.seq_lens), scale)

    @staticmethod
    def _kernel_io(checked: CheckedForward) -> tuple[torch.Tensor, torch.Tensor]:
        """For the compiled impls' kernels, which need unit last strides: the query (a
        contiguous copy when its last stride is not 1) and the tensor to write the output into
        (``checked.output``, or a new one whose first ``num_actual_tokens`` rows the caller
        copies back)."""
        query = checked.query if checked.query.stride(-1) == 1 else checked.query.contiguous()
        output = checked.output
        if output.stride(-1) == 1:
            return query, output
        return query, torch.empty(output.shape, dtype=output.dtype, device=output.device)

    def _read_pages(
        self, checked: CheckedForward, pages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 keys ``[len(pages) * N, Hkv, D]`` and values ``[..., Dv]`` of cache pages
        ``pages``, token after token, as stored (the key transform's read half not applied)."""
        if self._packed is not None:
            return self._packed.read(checked.key_cache, pages)
        k_layout, v_layout = self._fitting_scale_layouts(checked.key_cache.shape[1])
        codec = self.kv_cache_encoding.codec
        k_pages = gather_pages(checked.key_cache, pages)
        v_pages = gather_pages(checked.value_cache, pages)
        k = codec.read(k_pages, checked.k_scale, self.head_size, k_layout, torch.float32)
        v = codec.read(v_pages, checked.v_scale, self.head_size_v, v_layout, torch.float32)
        return (
            k.reshape(-1, self.num_kv_heads, self.head_size),
            v.reshape(-1, self.num_kv_heads, self.head_size_v),
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query [T, num_heads, D]`` (or ``[T, num_heads*D]``) over the cache.

        When ``key`` / ``value`` are given they are first written at
        ``attn_metadata.slot_mapping`` (:meth:`do_kv_cache_update` at the metadata's token
        positions). Returns ``[T, num_heads, head_size_v]`` in the query dtype (written into
        ``output`` when given; rows past ``num_actual_tokens`` untouched).
        """
        checked = self._begin_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        query, output = checked.query, checked.output
        key_cache = checked.key_cache
        qsl, seq_lens = checked.query_start_loc, checked.seq_lens
        device = key_cache.device
        block_size = key_cache.shape[1]
        block_table = attn_metadata.block_table.to(device=device, dtype=torch.int64)
        rebuild = self._key_rebuild(checked, block_table)

        for i, seq_len in enumerate(seq_lens):
            q_start, q_end = qsl[i], qsl[i + 1]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            first_q = seq_len - q_len
            first_key, last_key = key_window(seq_len, q_len, self.sliding_window)
            p0, p1 = first_key // block_size, last_key // block_size
            pages = block_table[i, p0 : p1 + 1]
            start = first_key - p0 * block_size
            stop = last_key + 1 - p0 * block_size
            k, v = self._read_pages(checked, pages)
            k, v = k[start:stop], v[start:stop]
            key_pos = torch.arange(first_key, last_key + 1, device=device)
            if rebuild is not None:
                k = rebuild.keys(k, i, key_pos)
            q_pos = torch.arange(first_q, seq_len, device=device)
            out = attend_fp32(
                query[q_start:q_end],
                k,
                v,
                q_pos,
                key_pos,
                scale=self.scale,
                causal=attn_metadata.causal,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                sinks=self.sinks,
            )
            output[q_start:q_end] = out.to(output.dtype)
        return output
