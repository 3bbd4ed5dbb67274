"""One attention layer's paged K/V cache for an engine: allocate, write, read, one object.

:class:`AttentionKVCache` is a thin layer over the worker and backend code: the layer's
encoding (:class:`~vllm.kv_quant.encoding.KVCacheEncoding`) is the spec's, the impl applies it
(key transform on write and read, sink rows in the pages), and the cache allocates through
:func:`~vllm.v1.worker.gpu.init_layer_kv_caches.init_layer_kv_caches` (the backend's shape
and stride order), takes the NVFP4 scale layouts from
:func:`~vllm.v1.worker.gpu.init_layer_kv_caches.get_kv_cache_scale_layouts`
(``ScaleLayout.default_for`` unless the backend or the caller says otherwise), and builds the
backend's attention impl with those layouts; the impl's writer (``reshape_and_cache_flash``
on ``kv_cache[:, 0]`` / ``kv_cache[:, 1]``) and its reader then share the layouts and the
scales, so they cannot disagree. On the CPU the backend is ``CPU_ATTN``; a backend without an
impl in this library (FlashInfer: shapes and layouts only) shapes the cache and the reference
impl reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from vllm.kv_quant.calibrated import KVCacheCalibration
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.key_rope import KeyRope
from vllm.kv_quant.key_transform import KeyTransform
from vllm.kv_quant.kv_scale import kv_scale_as_1d
from vllm.kv_quant.scale_layout import ScaleLayout
from vllm.utils import check_device, check_positive_int
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionLayerScales,
    KVCacheScaleLayouts,
    get_device_capability,
)
from vllm.v1.attention.backends.key_rebuild import key_sink_rows
from vllm.v1.attention.backends.reference import (
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, get_attn_backend
from vllm.v1.attention.backends.utils import kv_cache_layout, split_kv_cache
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    LatentPageSpec,
)
from vllm.v1.worker.gpu.init_layer_kv_caches import (
    get_kv_cache_scale_layouts,
    init_layer_kv_caches,
)
from vllm.v1.worker.gpu.paged_views import spec_cache_dtype_str

__all__ = ["AttentionKVCache"]

_LAYER = "layer"
"""The name of the one layer of the config the cache is allocated from."""


def _reader_backend(backend: type[AttentionBackend]) -> type[ReferenceAttentionBackend]:
    """The backend whose impl reads the cache: ``backend`` when it has one, else REFERENCE."""
    if isinstance(backend, type) and issubclass(backend, ReferenceAttentionBackend):
        return backend
    return ReferenceAttentionBackend


def _select_backend(
    spec: AttentionSpec,
    cache_dtype: str,
    model_dtype: torch.dtype,
    device: torch.device,
    backend: str | AttentionBackendEnum | type[AttentionBackend] | None,
) -> type[AttentionBackend]:
    """``backend`` when it is a class (checked later by ``init_layer_kv_caches``), else the
    selector's choice for the spec on ``device`` (``get_attn_backend``: CPU_ATTN first on the
    CPU)."""
    if isinstance(backend, type):
        return backend
    return get_attn_backend(
        spec.head_size,
        model_dtype,
        cache_dtype,
        spec.block_size,
        get_device_capability(device),
        backend=backend,
        head_size_v=spec.head_size_v,
    )


def _encoding(
    spec: AttentionSpec,
    kv_cache_dtype: str | None,
    scale_layouts: tuple[ScaleLayout | str, ScaleLayout | str] | None,
    key_rotation: str | None,
    key_rope: KeyRope | None,
    key_sink_tokens: int,
) -> KVCacheEncoding:
    """The cache's encoding: the spec's, refined by ``kv_cache_dtype`` (a dtype string or an
    encoding id of the spec's quantization, e.g. ``fp8_e5m2`` or ``nvfp4_mse+offset+sink``;
    only where the spec's encoding has defaults), the named scale layouts and the key
    options of :meth:`AttentionKVCache.from_spec`. ``ValueError`` naming the argument that
    does not fit (the rules themselves are the encoding's)."""
    encoding = spec.kv_cache_encoding
    if kv_cache_dtype is not None:
        named = KVCacheEncoding.parse(kv_cache_dtype, include_mla_only=False)
        defaults = KVCacheEncoding(encoding.format)
        if named.format.quant_mode != encoding.format.quant_mode or (
            encoding != defaults and named != encoding
        ):
            raise ValueError(
                f"kv_cache_dtype: expected a name of the spec's encoding {encoding.id!r}, "
                f"got {kv_cache_dtype!r}"
            )
        encoding = named
    geometry = (spec.block_size, spec.num_kv_heads, spec.head_size, spec.head_size_v)
    if scale_layouts is not None:
        k_layout, v_layout = (ScaleLayout.parse(x) for x in scale_layouts)
        if encoding.format.block_scale_group is not None:
            encoding = dataclasses.replace(
                encoding, k_scale_layout=k_layout, v_scale_layout=v_layout
            )
            try:
                encoding.check_geometry(*geometry)
            except ValueError as e:
                raise ValueError(f"scale_layouts: {e}") from None
    if key_rope is not None and not isinstance(key_rope, KeyRope):
        raise ValueError(f"key_rope: expected None or a KeyRope, got {type(key_rope).__name__}")
    key = encoding.key
    for name, given, current, default in (
        ("key_rotation", key_rotation, key.rotation, None),
        ("key_sink_tokens", key_sink_tokens, key.sink_tokens, 0),
    ):
        if given != default and current != default and given != current:
            raise ValueError(f"{name}: expected the encoding's {current!r}, got {given!r}")
    if key_rotation is not None:
        encoding = encoding.with_key(rotation=key_rotation)
    if key_sink_tokens:
        encoding = encoding.with_key(sink_tokens=key_sink_tokens)
    if key_rope is not None:
        KeyTransform.bind(dataclasses.replace(encoding.key, prerope=True), key_rope)
        if encoding.key.rope is None:
            encoding = encoding.with_rope(key_rope)
    encoding.check_geometry(*geometry)
    return encoding


class AttentionKVCache:
    """A layer's paged cache ``kv_cache`` (``(B, 2, N, H, D')``, or the ``(key_cache,
    value_cache)`` pair when ``head_size_v != head_size``; key sink rows after each page's K
    and V rows), its scales (:attr:`k_scale`, :attr:`v_scale`, set with
    :meth:`set_kv_scales`), its NVFP4 :attr:`scale_layouts`, the :attr:`backend` that shaped
    it and the :attr:`impl` that writes and reads it with the layer's encoding
    (:attr:`spec`'s).

    Build it with :meth:`create` or :meth:`from_spec`. Block tables and slots count pages of
    :attr:`block_size` tokens (the spec's, unless the backend splits pages into kernel blocks).
    ``num_blocks * spec.page_size_bytes`` is what the cache allocates.
    """

    def __init__(
        self,
        backend: type[AttentionBackend],
        kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        impl: ReferenceAttentionImpl,
        scale_layouts: KVCacheScaleLayouts,
        spec: AttentionSpec,
    ) -> None:
        key_cache, _ = split_kv_cache(kv_cache)
        self.backend = backend
        self.kv_cache = kv_cache
        self.impl = impl
        self.scale_layouts = scale_layouts
        self._spec = spec
        self.layer = AttentionLayerScales(
            torch.ones((), dtype=torch.float32, device=key_cache.device),
            torch.ones((), dtype=torch.float32, device=key_cache.device),
        )
        """What the impl reads the scales from (upstream's ``_k_scale`` / ``_v_scale``)."""

    @classmethod
    def create(
        cls,
        kv_cache_dtype: str | KVCacheEncoding,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        head_size_v: int | None = None,
        model_dtype: torch.dtype = torch.bfloat16,
        **options: Any,
    ) -> AttentionKVCache:
        """A full-attention cache of ``num_blocks`` pages of ``block_size`` tokens for
        ``num_kv_heads`` heads of ``head_size`` (``head_size_v``) in ``kv_cache_dtype`` (any
        name or alias of the format registry, or an encoding id such as
        ``nvfp4_mse+offset+prerope+sink``); ``options`` as for :meth:`from_spec`."""
        fmt = KVCacheEncoding.parse(kv_cache_dtype, include_mla_only=False).format
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size if head_size_v is None else head_size_v,
            dtype=fmt.resolve_storage_dtype(model_dtype),
            kv_quant_mode=fmt.quant_mode,
        )
        return cls.from_spec(
            spec, num_blocks, kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype, **options
        )

    @classmethod
    def from_spec(
        cls,
        spec: AttentionSpec,
        num_blocks: int,
        *,
        kv_cache_dtype: str | None = None,
        num_heads: int | None = None,
        model_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        backend: str | AttentionBackendEnum | type[AttentionBackend] | None = None,
        layout: str | None = None,
        scale_layouts: tuple[ScaleLayout | str, ScaleLayout | str] | None = None,
        key_rotation: str | None = None,
        key_rope: KeyRope | None = None,
        key_sink_tokens: int = 0,
        **impl_options: Any,
    ) -> AttentionKVCache:
        """Validate, allocate and wire the cache of a (non-MLA) attention ``spec``.

        The cache's encoding is the spec's (:attr:`AttentionSpec.encoding`), which these
        arguments may refine (``ValueError`` where they contradict it): ``kv_cache_dtype`` a
        dtype string or encoding id of the spec's quantization (``fp8_e5m2``,
        ``nvfp4_mse+offset+prerope+sink``); ``scale_layouts`` ``(K, V)`` NVFP4 layouts
        (default: the encoding's, else the backend's); ``key_rotation`` ``"hadamard"`` stores
        keys rotated by the fixed Hadamard rotation (quantized formats, power-of-two head
        sizes; the scores are unchanged, the quantization error of keys spread over all
        channels; calibrate :attr:`k_scale` on :meth:`stored_key`); ``key_rope`` (the model's
        RoPE) stores keys before RoPE, the reader rebuilding them at their positions (the
        encoding's ``+prerope`` needs it); ``key_sink_tokens`` S keeps the first S keys of each
        page again in FP8 inside the page (FP8 / NVFP4 formats; :mod:`vllm.kv_quant.key_sinks`),
        read by every backend's reader (docs/design.md §5.6). ``num_heads`` query heads
        (default ``num_kv_heads``); ``backend`` a class, a registry name or ``None``
        (:func:`get_attn_backend` for ``device``); ``layout`` ``NHD`` / ``HND`` (default: the
        current setting); ``impl_options`` go to the impl (``scale``, ``sliding_window``,
        ``logits_soft_cap``, ``sinks``). The backend, the impl's arguments and the cache views
        are checked before memory is allocated, the scale layouts against the pages (an empty
        write) before the cache is returned.
        """
        if not isinstance(spec, AttentionSpec) or isinstance(spec, LatentPageSpec):
            raise ValueError(f"spec: expected a non-MLA attention spec, got {type(spec).__name__}")
        check_positive_int("num_blocks", num_blocks)
        encoding = _encoding(
            spec, kv_cache_dtype, scale_layouts, key_rotation, key_rope, key_sink_tokens
        )
        spec = dataclasses.replace(spec, encoding=encoding)
        cache_dtype = spec_cache_dtype_str(spec, kv_cache_dtype)
        device = check_device("device", device)
        if key_rope is not None:  # once here, not a table copy per write and read
            key_rope = key_rope.to(device)
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(num_blocks * spec.page_size_bytes, [_LAYER])],
            kv_cache_groups=[KVCacheGroupSpec([_LAYER], spec)],
        )
        context = contextlib.nullcontext() if layout is None else kv_cache_layout(layout)
        with context:
            chosen = _select_backend(spec, cache_dtype, model_dtype, device, backend)
            layouts = get_kv_cache_scale_layouts(config, [chosen])[_LAYER]
            if encoding.k_scale_layout is not None:
                layouts = KVCacheScaleLayouts(encoding.k_scale_layout, encoding.v_scale_layout)
            impl = _reader_backend(chosen).get_impl_cls()(
                spec.num_kv_heads if num_heads is None else num_heads,
                spec.head_size,
                num_kv_heads=spec.num_kv_heads,
                kv_cache_dtype=encoding,
                head_size_v=spec.head_size_v,
                k_scale_layout=layouts.k_scale_layout,
                v_scale_layout=layouts.v_scale_layout,
                key_rope=key_rope,
                **impl_options,
            )
            kv_cache = init_layer_kv_caches(
                config, [chosen], device, model_dtype=model_dtype, cache_dtype=cache_dtype
            )[_LAYER]
        cache = cls(chosen, kv_cache, impl, layouts, spec)
        cache.write(*cache._empty_batch(model_dtype))  # the impl's checks (layouts fit), no-op
        return cache

    def _empty_batch(
        self, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """No tokens: K, V in ``dtype``, their slots and positions."""
        heads, device = self.impl.num_kv_heads, self.device
        no_tokens = torch.empty(0, dtype=torch.int64, device=device)
        return (
            torch.empty(0, heads, self.impl.head_size, dtype=dtype, device=device),
            torch.empty(0, heads, self.impl.head_size_v, dtype=dtype, device=device),
            no_tokens,
            no_tokens,
        )

    # ------------------------------------------------------------------------- properties

    @property
    def key_cache(self) -> torch.Tensor:
        """K side ``(B, N, H, D')``."""
        return split_kv_cache(self.kv_cache)[0]

    @property
    def value_cache(self) -> torch.Tensor:
        """V side ``(B, N, H, Dv')``."""
        return split_kv_cache(self.kv_cache)[1]

    @property
    def device(self) -> torch.device:
        return self.key_cache.device

    @property
    def num_blocks(self) -> int:
        """Pages of the cache."""
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        """Tokens per page (what block tables and slot mappings count in)."""
        return self.key_cache.shape[1]

    @property
    def kv_cache_dtype(self) -> str:
        return self.impl.kv_cache_dtype

    @property
    def k_scale(self) -> torch.Tensor:
        """fp32 K dequantization scale (0-d or ``[H]``) that the writer and reader use."""
        return self.layer.k_scale

    @property
    def v_scale(self) -> torch.Tensor:
        """fp32 V dequantization scale, like :attr:`k_scale`."""
        return self.layer.v_scale

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Use these fp32 scales (one value or ``[num_kv_heads]``, finite, > 0; e.g.
        :meth:`vllm.kv_quant.KVScaleObserver.scales`) from now on, copied to the cache's
        device. Both are checked before either changes. Write and read with the same scales:
        pages written before the change are read with the new ones."""
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            kv_scale_as_1d(scale, name, self.impl.num_kv_heads)
        self.layer.set_kv_scales(k_scale.to(self.device), v_scale.to(self.device))

    # ------------------------------------------------------------------------ write, read

    def metadata(
        self,
        seq_lens: Sequence[int] | torch.Tensor,
        query_lens: Sequence[int] | torch.Tensor,
        block_table: torch.Tensor,
        causal: bool = True,
    ) -> ReferenceAttentionMetadata:
        """The impl's metadata for sequences of ``seq_lens`` tokens whose last ``query_lens``
        are new, ``block_table [num_seqs, max_pages]`` in this cache's pages; its
        ``slot_mapping`` is where the new tokens go."""
        return (
            _reader_backend(self.backend)
            .get_metadata_cls()
            .build(
                seq_lens, query_lens, block_table.to(self.device), self.block_size, causal=causal
            )
        )

    @property
    def spec(self) -> AttentionSpec:
        """The spec the cache was built from, with the encoding it holds now (a key offset
        set or dropped changes its ``+offset``): ``num_blocks * spec.page_size_bytes`` bytes
        are allocated."""
        return dataclasses.replace(self._spec, encoding=self.impl.kv_cache_encoding)

    @property
    def encoding(self) -> KVCacheEncoding:
        """The layer's encoding (:class:`~vllm.kv_quant.encoding.KVCacheEncoding`)."""
        return self.impl.kv_cache_encoding

    @property
    def key_sinks(self) -> torch.Tensor | None:
        """uint8 ``[num_blocks, S, H, D]`` view of the key sink rows inside the pages (FP8 e4m3
        copies of each page's first S stored keys, :mod:`vllm.kv_quant.key_sinks`), or None
        when the encoding keeps none."""
        sink_tokens = self.encoding.key.sink_tokens
        if not sink_tokens:
            return None
        return key_sink_rows(
            self.kv_cache, sink_tokens, self.impl.num_kv_heads, self.impl.head_size
        )

    @property
    def key_transform(self) -> KeyTransform:
        """What the impl does to keys (:class:`~vllm.kv_quant.KeyTransform`): offset
        (:meth:`set_key_offset`), rotation, RoPE undone and sink rows."""
        return self.impl.key_transform

    @property
    def key_rotation(self) -> str | None:
        """``"hadamard"`` when keys are stored rotated (queries rotated alike), else None."""
        return self.key_transform.rotation

    @property
    def key_offset(self) -> torch.Tensor | None:
        """fp32 ``[H, D]`` subtracted from every key before it is written, or None."""
        return self.key_transform.offset

    def set_key_offset(self, offset: torch.Tensor | None) -> None:
        """Subtract ``offset`` (``[num_kv_heads, head_size]``, finite; e.g.
        :meth:`vllm.kv_quant.KVScaleObserver.key_mean`) from every key before it is written, or
        stop (``None``): :meth:`ReferenceAttentionImpl.set_key_offset` on the cache's device.
        Every score of a query then moves by the same ``q . offset``, which softmax ignores:
        the attention is unchanged while the keys' common part no longer takes the format's
        range. Refused for an impl with ``sinks`` or ``logits_soft_cap`` (their scores are not
        shift-free) unless keys are stored before RoPE (the reader then adds the offset back).
        With RoPE it is the mean of the pre-RoPE keys. Set it before the first write and
        calibrate :attr:`k_scale` on :meth:`stored_key` afterwards."""
        if isinstance(offset, torch.Tensor):
            offset = offset.to(device=self.device)
        self.impl.set_key_offset(offset)

    def load_calibration(self, calibration: KVCacheCalibration, layer: str) -> None:
        """Use layer ``layer``'s calibrated values of ``calibration`` (scales, and the key
        offset of a ``+offset`` encoding): ``ValueError`` unless the calibration's encoding is
        this cache's (the same fingerprint) and names the layer. Both checked before anything
        changes."""
        encoding = self.encoding
        if calibration.encoding.key.offset and not encoding.key.offset:
            encoding = encoding.with_key(offset=True)
        if calibration.encoding.fingerprint != encoding.fingerprint:
            raise ValueError(
                f"calibration: expected one of encoding {encoding.id!r} (fingerprint "
                f"{encoding.fingerprint}), got {calibration.encoding.id!r} (fingerprint "
                f"{calibration.encoding.fingerprint})"
            )
        if layer not in calibration.layers:
            raise ValueError(
                f"layer: expected one of {', '.join(calibration.layers)}, got {layer!r}"
            )
        values = calibration.layers[layer]
        for name, scale in (("k_scale", values.k_scale), ("v_scale", values.v_scale)):
            kv_scale_as_1d(scale, name, self.impl.num_kv_heads)
        self.set_key_offset(values.key_offset)
        self.set_kv_scales(values.k_scale, values.v_scale)

    def stored_key(self, key: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The keys as the writer receives them (:meth:`KeyTransform.stored_key
        <vllm.kv_quant.KeyTransform.stored_key>`; ``positions [T]`` needed with RoPE).
        Observe these to calibrate :attr:`k_scale`."""
        return self.key_transform.stored_key(key, positions)

    def write(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Write ``key [T, H, D]`` / ``value [T, H, Dv]`` at ``slot_mapping [T]`` (int64;
        negative slots skipped) with the cache's scales and scale layouts; ``positions [T]``
        (each token's position in its sequence) are needed when keys are stored before RoPE
        (the impl's :meth:`~ReferenceAttentionImpl.do_kv_cache_update`)."""
        self.impl.do_kv_cache_update(
            self.layer, key, value, self.kv_cache, slot_mapping, positions=positions
        )

    def attend(
        self,
        query: torch.Tensor,
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Paged attention of ``query [T, num_heads, D]`` over the cache:
        ``[T, num_heads, Dv]`` in the query's dtype."""
        return self.impl.forward(
            self.layer, query, None, None, self.kv_cache, attn_metadata, output
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: ReferenceAttentionMetadata,
        output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the new ``key`` / ``value`` at ``attn_metadata.slot_mapping``, then attend
        (every argument is checked before anything is written): the impl's ``forward``."""
        return self.impl.forward(
            self.layer, query, key, value, self.kv_cache, attn_metadata, output
        )
