"""TurboQuant attention backend (upstream v0.33.0's ``TURBOQUANT``, at upstream's path and under
its class names), written for this library over its TurboQuant kernels: the Triton store
(:func:`~vllm.v1.attention.ops.triton_turboquant_store.triton_turboquant_store`) and decode
(:func:`~vllm.v1.attention.ops.triton_turboquant_decode.triton_turboquant_decode_attention`).

Cache: one uint8 slot of ``slot_size_aligned`` bytes per (token, KV head) holding both K and V,
logical shape ``(num_blocks, num_kv_heads, block_size, slot)`` (upstream's order), stored
block, token, head, slot (``LBNHC``). Keys are rotated by the normalized Sylvester Hadamard
matrix of the head size (a power of two), as upstream's serving path.

Attention, as upstream's paths define it: decode requests (one query token, first in the
batch) read the cache through the decode kernel; a first-chunk prefill attends causally over
its own unquantized keys and values; a continuation chunk of at most
:data:`CONTINUATION_DECODE_THRESHOLD` tokens runs the decode kernel once per query token
(the cache already holds the chunk), a longer one attends over the cached prefix, decoded by
the reference codec into fp16 buffers, followed by its own unquantized keys and values.
Prefill attention is computed in fp32 torch. Decoder self-attention only, no window, sinks,
ALiBi or soft cap.

Structure, as upstream's: :meth:`TurboQuantAttentionImpl.forward` splits the batch and calls the
seams ``_ensure_on_device`` / ``_store_kv`` / ``_decode_attention`` / ``_prefill_attention``,
which a packed-slot format's impl overrides (:mod:`.ultraquant_attn`). The per-layer tables live
on the layer (``layer._tq_*``). Scratch (decode buffers, a long continuation's decoded prefix)
comes from the worker's workspace (:mod:`vllm.v1.worker.workspace`) when it exists, reserved
up front by the metadata builder.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from vllm.config.compilation import AttentionCGSupport
from vllm.kv_quant.turboquant import (
    TQ_PRESETS,
    TurboQuantConfig,
    turboquant_decode_slots,
)
from vllm.kv_quant.turboquant.centroids import turboquant_tables
from vllm.triton_utils import HAS_TRITON, triton_interpreted
from vllm.utils.math_utils import round_up
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.abstract import DeviceCapability, check_kv_cache_shape_args
from vllm.v1.attention.backends.packed_slot_attention import (
    causal_attention,
    prefill_requests,
    scratch,
    workspace_or_none,
)
from vllm.v1.attention.backends.triton_attn import MIN_CAPABILITY
from vllm.v1.attention.backends.turboquant_metadata import (
    TurboQuantMetadata,
    decode_buffer_specs,
    split_batch,
)
from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

__all__ = [
    "CONTINUATION_DECODE_THRESHOLD",
    "TurboQuantAttentionBackend",
    "TurboQuantAttentionImpl",
    "TurboQuantMetadata",
    "TurboQuantMetadataBuilder",
]

CONTINUATION_DECODE_THRESHOLD = 128
"""Longest continuation chunk (tokens) read through the decode kernel (upstream's value)."""


class TurboQuantAttentionBackend(AttentionBackend):
    """Attention over TurboQuant KV caches (the four ``turboquant_*`` presets)."""

    accept_output_buffer: ClassVar[bool] = True
    forward_includes_kv_cache_update: ClassVar[bool] = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(TQ_PRESETS)
    supported_kernel_block_sizes: ClassVar[list[Any]] = [16, 32, 64, 128]

    @staticmethod
    def get_name() -> str:
        return "TURBOQUANT"

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """The Triton kernels' devices: CUDA sm_80+, the CPU only under Triton's interpreter."""
        if capability is None:
            return triton_interpreted()
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @classmethod
    def _runtime_reasons(cls) -> list[str]:
        return [] if HAS_TRITON else [f"{cls.get_name()} needs Triton (not installed)"]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Upstream v0.33's hook: a TurboQuant spec gets ``state_content_bytes`` = the preset's
        ``slot_size_aligned`` at the spec's head size (K and V share one slot); other specs,
        and one already set, are returned as given."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_turboquant:
            return spec
        cfg = TurboQuantConfig.from_cache_dtype(spec.kv_quant_mode.name.lower(), spec.head_size)
        return replace(spec, state_content_bytes=cfg.slot_size_aligned)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, num_kv_heads, block_size, slot_size_aligned)`` uint8 (upstream's
        logical order; the slot's bytes for ``head_size`` under preset ``cache_dtype_str``)."""
        check_kv_cache_shape_args(
            "TurboQuantAttentionBackend", num_blocks, block_size, num_kv_heads, head_size
        )
        if cache_dtype_str not in TQ_PRESETS:
            raise ValueError(
                f"cache_dtype_str: expected one of {', '.join(TQ_PRESETS)}, got {cache_dtype_str!r}"
            )
        slot = TurboQuantConfig.from_cache_dtype(cache_dtype_str, head_size).slot_size_aligned
        return (num_blocks, num_kv_heads, block_size, slot)

    @classmethod
    def get_kv_cache_stride_order(cls) -> tuple[int, ...]:
        """Block, token, head, slot in memory (``LBNHC``) for the logical ``(B, H, N, C)``."""
        return (0, 2, 1, 3)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return False

    @staticmethod
    def get_impl_cls() -> type[TurboQuantAttentionImpl]:
        return TurboQuantAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TurboQuantMetadataBuilder]:
        return TurboQuantMetadataBuilder

    @staticmethod
    def get_metadata_cls() -> type[TurboQuantMetadata]:
        return TurboQuantMetadata


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    """Metadata from ``CommonAttentionMetadata``; the engine puts requests of one query token
    first (``reorder_batch_threshold = 1``). Built with a ``vllm_config`` while the worker's
    workspace manager exists, it reserves the workspace the impl's decode and long
    continuations take (:meth:`_reserve_workspace`), so that a locked workspace never grows."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int | None = 1

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._reserve_workspace()

    def _reserve_workspace(self) -> None:
        """Grow the workspace to the largest requests of :class:`TurboQuantAttentionImpl`: the
        decode's buffers at ``max_num_seqs`` sequences (``(B, Hq, splits, D + 1)`` fp32,
        ``(B, Hq, D)`` in the model dtype, ``(B, Hq)`` fp32), and, where chunked prefill can
        schedule a continuation longer than :data:`CONTINUATION_DECODE_THRESHOLD` tokens, the
        fp16 ``(1, Hk, S, D)`` key and value buffers of a cached prefix of up to
        ``max_model_len - 1`` tokens rounded up to whole blocks (``S``)."""
        config = self.vllm_config
        if config is None or not is_workspace_manager_initialized():
            return
        scheduler, model = config.scheduler_config, config.model_config
        batch = scheduler.max_num_seqs
        num_heads = model.get_num_attention_heads(config.parallel_config)
        head_size = self.kv_cache_spec.head_size
        splits = config.attention_config.tq_max_kv_splits_for_cuda_graph
        current_workspace_manager().get_simultaneous(
            *decode_buffer_specs(batch, num_heads, head_size, splits, model.dtype)
        )
        if not (
            scheduler.enable_chunked_prefill
            and scheduler.max_num_batched_tokens > CONTINUATION_DECODE_THRESHOLD
        ):
            return
        prefix = round_up(max(0, model.max_model_len - 1), self.kv_cache_spec.block_size)
        shape = (1, self.kv_cache_spec.num_kv_heads, prefix, head_size)
        current_workspace_manager().get_simultaneous((shape, torch.float16), (shape, torch.float16))

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TurboQuantMetadata:
        cam = common_attn_metadata
        qsl = cam.query_start_loc_cpu.to(torch.int64)
        query_lens = (qsl[1 : cam.num_reqs + 1] - qsl[: cam.num_reqs]).tolist()
        num_decodes = next(
            (i for i, n in enumerate(query_lens) if n > 1), len(query_lens)
        )  # fmt: skip
        return TurboQuantMetadata(
            seq_lens=cam.seq_lens,
            slot_mapping=cam.slot_mapping,
            block_table=cam.block_table_tensor,
            query_start_loc=cam.query_start_loc,
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            is_prefill=cam.max_query_len > 1,
            num_decodes=num_decodes,
            num_decode_tokens=int(sum(query_lens[:num_decodes])),
            query_start_loc_cpu=cam.query_start_loc_cpu,
            seq_lens_cpu=cam.seq_lens_cpu_upper_bound,
        )

    def build_for_cudagraph_capture(
        self, common_attn_metadata: CommonAttentionMetadata
    ) -> TurboQuantMetadata:
        """:meth:`build` with every length 1 (a capture needs no real lengths)."""
        metadata = self.build(0, common_attn_metadata)
        metadata.seq_lens.fill_(1)
        return metadata


class TurboQuantAttentionImpl(AttentionImpl):
    """Store and attention of one layer over a TurboQuant cache (module docstring).

    :meth:`forward` and :meth:`do_kv_cache_update` orchestrate four seams a packed-slot format
    overrides (ULTRAQUANT does): :meth:`_ensure_on_device` (the layer's ``_tq_*`` tables, read
    by ``forward``), :meth:`_store_kv`, :meth:`_decode_attention`, :meth:`_prefill_attention`.
    ``max_num_kv_splits`` (class attribute or per instance): the decode's key segments; the
    builder reserves the decode's workspace for ``AttentionConfig.tq_max_kv_splits_for_cuda_graph``
    of them, which it should equal (both 32 by default)."""

    max_num_kv_splits: int = 32
    backend_name: ClassVar[str] = "TURBOQUANT"

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        self._init_layer(
            num_heads, head_size, scale, num_kv_heads, kv_cache_dtype, list(TQ_PRESETS),
            attn_type=attn_type, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sinks=kwargs.get("sinks"),
        )  # fmt: skip
        self.tq_config = TurboQuantConfig.from_cache_dtype(kv_cache_dtype, head_size)
        self.slot_bytes = self.tq_config.slot_size

    def _init_layer(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None,
        kv_cache_dtype: str,
        presets: list[str],
        attn_type: str,
        **unserved: Any,
    ) -> None:
        """Check and keep what every packed-slot layer has: ``kv_cache_dtype`` one of
        ``presets``, a decoder ``attn_type``; ``unserved``: the features the backend refuses
        (each must be None)."""
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}"
            )
        if kv_cache_dtype not in presets:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(presets)}, got {kv_cache_dtype!r}"
            )
        if head_size <= 0 or head_size & (head_size - 1):
            raise ValueError(
                f"head_size: expected a power of two (the Hadamard rotation), got {head_size}"
            )
        if attn_type != AttentionType.DECODER:
            raise ValueError(
                f"attn_type: {self.backend_name} serves decoder self-attention only, got "
                f"{attn_type}"
            )
        for name, given in unserved.items():
            if given is not None:
                raise ValueError(
                    f"{name}: {self.backend_name} serves decoder self-attention without it, got "
                    "a value"
                )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def _cache_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The ``(B, N, H, slot)`` view the kernels take of a ``(B, H, N, slot)`` cache."""
        if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or (
            kv_cache.shape[1] != self.num_kv_heads or kv_cache.shape[3] < self.slot_bytes
        ):  # fmt: skip
            raise ValueError(
                f"kv_cache: expected uint8 (num_blocks, {self.num_kv_heads}, block_size, "
                f">= {self.slot_bytes}), got {kv_cache.dtype} of shape {list(kv_cache.shape)}"
            )
        return kv_cache.transpose(1, 2)

    def _layer_state(self, layer: AttentionLayer | None) -> Any:
        """``layer``, which holds the ``_tq_*`` tables (``ValueError`` for None)."""
        if layer is None:
            raise ValueError(
                f"layer: expected the attention layer ({self.backend_name} keeps its tables "
                "on it), got None"
            )
        return layer

    def _ensure_on_device(self, layer: Any, device: torch.device) -> None:
        """Put the layer's tables on ``device`` (once per device): ``_tq_Pi`` / ``_tq_PiT``
        (the normalized Hadamard rotation, its own inverse), the Lloyd-Max ``_tq_centroids``
        and ``_tq_midpoints`` (fp32); ``_tq_cached`` records the device."""
        if getattr(layer, "_tq_cached", None) == device:
            return
        tables = turboquant_tables(self.head_size, self.tq_config.centroid_bits)
        rotation = tables.rotation.to(device)
        layer._tq_Pi = rotation
        layer._tq_PiT = rotation
        layer._tq_centroids = tables.centroids.to(device)
        layer._tq_midpoints = tables.midpoints.to(device)
        layer._tq_cached = device

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the first ``len(slot_mapping)`` tokens of ``key`` / ``value`` (``[T, Hk, D]``
        or ``[T, Hk*D]``) at their slots (negative: skipped)."""
        n = slot_mapping.shape[0]
        if n <= 0:
            return
        cache = self._cache_view(kv_cache)
        state = self._layer_state(layer)
        self._ensure_on_device(state, key.device)
        shape = (n, self.num_kv_heads, self.head_size)
        self._store_kv(key[:n].reshape(shape), value[:n].reshape(shape), cache, slot_mapping, state)

    def _store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        layer: Any,
    ) -> None:
        """Encode ``key`` / ``value [N, Hk, D]`` into ``kv_cache [B, N, H, slot]``."""
        cfg = self.tq_config
        triton_turboquant_store(
            key, value, kv_cache, slot_mapping, layer._tq_PiT, layer._tq_midpoints,
            mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        )  # fmt: skip

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: TurboQuantMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``query [T, Hq, D]`` (or ``[T, Hq*D]``) over the cache that
        :meth:`do_kv_cache_update` filled for this batch; ``key`` / ``value`` (the batch's own,
        unquantized) serve prefills. Written into ``output`` (``[T, Hq, D]`` or ``[T, Hq*D]``;
        allocated when None, zeros for a profiling run without metadata) and returned."""
        if output_scale is not None or output_block_scale is not None:
            raise ValueError(
                f"output_scale: expected None ({self.backend_name} has no quantized output)"
            )
        if output is None:
            output = torch.zeros(query.shape[0], self.num_heads * self.head_size,
                                 dtype=query.dtype, device=query.device)  # fmt: skip
        if attn_metadata is None or attn_metadata.num_actual_tokens <= 0:
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        q = query[:n].reshape(n, self.num_heads, self.head_size)
        cache = self._cache_view(kv_cache)
        decode_meta, prefill_meta = split_batch(attn_metadata)
        t = 0 if decode_meta is None else decode_meta.num_actual_tokens
        own_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # a prefill's keys, values
        if prefill_meta is not None:
            if key is None or value is None:
                raise ValueError("key, value: expected the batch's keys and values for prefills")
            shape = (n, self.num_kv_heads, self.head_size)
            own_kv = key[:n].reshape(shape)[t:], value[:n].reshape(shape)[t:]
        tq_layer = self._layer_state(layer)
        self._ensure_on_device(tq_layer, q.device)
        pi, pit, centroids = tq_layer._tq_Pi, tq_layer._tq_PiT, tq_layer._tq_centroids
        result = torch.empty(n, self.num_heads, self.head_size, dtype=q.dtype, device=q.device)
        if decode_meta is not None:
            result[:t] = self._decode_attention(
                q[:t], cache, decode_meta, pi, centroids, pit, tq_layer
            )
        if prefill_meta is not None and own_kv is not None:  # both or neither
            result[t:] = self._prefill_attention(
                q[t:], *own_kv, cache, prefill_meta, pi, centroids, pit, layer=tq_layer
            )
        output[:n] = result.reshape(output[:n].shape)
        return output

    def _decode_attention(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TurboQuantMetadata,
        Pi: torch.Tensor,  # noqa: N803  (upstream's names)
        centroids: torch.Tensor,
        PiT: torch.Tensor | None = None,  # noqa: N803
        layer: Any = None,
    ) -> torch.Tensor:
        """Decode attention of ``query [B, Hq, D]`` (one token per request) in its dtype; the
        kernel's buffers come from the workspace when there is one."""
        buffers = self._decode_buffers(query)
        mid_o, out, lse = (None, None, None) if buffers is None else buffers
        return self._tq_decode(
            query, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens, Pi, centroids,
            PiT, mid_o_buf=mid_o, output_buf=out, lse_buf=lse, buf_holder=layer,
        )  # fmt: skip

    def _decode_buffers(self, query: torch.Tensor) -> list[torch.Tensor] | None:
        """The decode's workspace buffers (:func:`decode_buffer_specs`) for ``query [B, Hq, D]``,
        None without a workspace."""
        batch, dtype = query.shape[0], query.dtype
        specs = decode_buffer_specs(
            batch, self.num_heads, self.head_size, self.max_num_kv_splits, dtype
        )
        return workspace_or_none(*specs)

    def _tq_decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        Pi: torch.Tensor,  # noqa: N803
        centroids: torch.Tensor,
        PiT: torch.Tensor | None,  # noqa: N803
        **buffers: Any,
    ) -> torch.Tensor:
        """The decode kernel with this layer's configuration."""
        cfg = self.tq_config
        return triton_turboquant_decode_attention(
            query, kv_cache, block_table, seq_lens, Pi, centroids, self.scale, cfg.key_mse_bits,
            cfg.key_packed_size, cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction, PiT=PiT,
            max_num_kv_splits=self.max_num_kv_splits, **buffers,
        )  # fmt: skip

    def _prefill_attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TurboQuantMetadata,
        Pi: torch.Tensor,  # noqa: N803
        centroids: torch.Tensor,
        PiT: torch.Tensor | None = None,  # noqa: N803
        layer: Any = None,
    ) -> torch.Tensor:
        """Prefill requests (query, key, value rows ``[N, H, D]`` from 0; module docstring),
        in the query's dtype."""
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        for i, start, stop, seq_len in prefill_requests(attn_metadata):
            q_len = stop - start
            cached = seq_len - q_len
            if cached <= 0:
                out[start:stop] = causal_attention(
                    query[start:stop], key[start:stop], value[start:stop], self.scale
                )
            elif q_len <= CONTINUATION_DECODE_THRESHOLD:
                # One decode per query token over the cache up to and including it.
                lens = torch.arange(cached + 1, seq_len + 1, device=query.device)
                table = attn_metadata.block_table[i : i + 1].expand(q_len, -1)
                out[start:stop] = self._tq_decode(
                    query[start:stop], kv_cache, table, lens, Pi, centroids, PiT
                ).float()
            else:
                out[start:stop] = self._continuation_prefill(
                    layer, query[start:stop], key[start:stop], value[start:stop], kv_cache,
                    attn_metadata.block_table[i : i + 1], cached, seq_len, Pi, centroids,
                )  # fmt: skip
        return out.to(query.dtype)

    def _continuation_prefill(
        self,
        layer: Any,
        query: torch.Tensor,
        key_chunk: torch.Tensor,
        val_chunk: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cached_len: int,
        seq_len: int,
        Pi: torch.Tensor,  # noqa: N803
        centroids: torch.Tensor,
    ) -> torch.Tensor:
        """fp32 attention of a long chunk over its ``cached_len`` cached tokens, read back by
        the reference codec into fp16 workspace buffers (keys rotated back), then its own
        unquantized keys and values (``seq_len`` tokens in all)."""
        hk, d = key_chunk.shape[1:]
        block_size = kv_cache.shape[1]
        shape = (1, hk, round_up(cached_len, block_size), d)
        k_buf, v_buf = scratch(query.device, (shape, torch.float16), (shape, torch.float16))
        pos = torch.arange(cached_len, device=kv_cache.device)
        pages = block_table[0].to(device=kv_cache.device, dtype=torch.int64)[pos // block_size]
        old_k, old_v = turboquant_decode_slots(
            kv_cache[pages, pos % block_size], self.tq_config, centroids, Pi
        )
        k_buf[0, :, :cached_len] = old_k.transpose(0, 1)
        v_buf[0, :, :cached_len] = old_v.transpose(0, 1)
        keys = torch.cat([k_buf[0, :, :cached_len].transpose(0, 1).float(), key_chunk.float()])
        values = torch.cat([v_buf[0, :, :cached_len].transpose(0, 1).float(), val_chunk.float()])
        return causal_attention(query, keys, values, self.scale)
