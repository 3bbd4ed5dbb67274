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
the reference codec, followed by its own unquantized keys and values. Prefill attention is
computed in fp32 torch. Decoder self-attention only, no window, sinks, ALiBi or soft cap.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from vllm.config.compilation import AttentionCGSupport
from vllm.kv_quant.turboquant import (
    TQ_PRESETS,
    TurboQuantConfig,
    get_centroids,
    turboquant_decode_slots,
)
from vllm.triton_utils import HAS_TRITON, triton_interpreted
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.abstract import DeviceCapability, check_kv_cache_shape_args
from vllm.v1.attention.backends.triton_attn import MIN_CAPABILITY
from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

__all__ = [
    "CONTINUATION_DECODE_THRESHOLD",
    "TurboQuantAttentionBackend",
    "TurboQuantAttentionImpl",
    "TurboQuantMetadata",
    "TurboQuantMetadataBuilder",
]

CONTINUATION_DECODE_THRESHOLD = 128
"""Longest continuation chunk (tokens) read through the decode kernel (upstream's value)."""


@functools.cache
def _hadamard(d: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix ``H / sqrt(d)`` (symmetric, orthonormal), fp32."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


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
        return [] if HAS_TRITON else ["TURBOQUANT needs Triton (not installed)"]

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


@dataclass
class TurboQuantMetadata(AttentionMetadata):
    """One batch: decode requests first (``num_decodes`` of them, ``num_decode_tokens``
    tokens), then prefills. Lengths in tokens; ``query_start_loc_cpu`` / ``seq_lens_cpu``
    (optional host copies) spare the prefill loop device syncs."""

    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    num_actual_tokens: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    is_prefill: bool = False
    num_decodes: int = 0
    num_decode_tokens: int = 0
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None


class TurboQuantMetadataBuilder(AttentionMetadataBuilder[TurboQuantMetadata]):
    """Metadata from ``CommonAttentionMetadata``; the engine puts requests of one query token
    first (``reorder_batch_threshold = 1``)."""

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
    ``max_num_kv_splits`` (class attribute or per instance): the decode's key segments."""

    max_num_kv_splits: int = 32

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
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}"
            )
        if kv_cache_dtype not in TQ_PRESETS:
            raise ValueError(
                f"kv_cache_dtype: expected one of {', '.join(TQ_PRESETS)}, got {kv_cache_dtype!r}"
            )
        if head_size <= 0 or head_size & (head_size - 1):
            raise ValueError(
                f"head_size: expected a power of two (the Hadamard rotation), got {head_size}"
            )
        unserved = {
            "attn_type": attn_type != AttentionType.DECODER,
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": logits_soft_cap is not None,
            "sinks": kwargs.get("sinks") is not None,
        }
        for name, bad in unserved.items():
            if bad:
                raise ValueError(
                    f"{name}: TURBOQUANT serves decoder self-attention without it, got "
                    f"{attn_type if name == 'attn_type' else 'a value'}"
                )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.num_kv_groups = num_heads // num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.tq_config = TurboQuantConfig.from_cache_dtype(kv_cache_dtype, head_size)
        # The rotation and the Lloyd-Max tables, per device (copied on first use).
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _tables_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(Pi, centroids, midpoints)`` fp32 on ``device``."""
        tables = self._tables.get(device)
        if tables is None:
            centroids = get_centroids(self.head_size, self.tq_config.centroid_bits).float()
            ordered = centroids.sort().values
            midpoints = (ordered[:-1] + ordered[1:]) / 2
            tables = tuple(t.to(device) for t in (_hadamard(self.head_size), centroids, midpoints))
            self._tables[device] = tables  # type: ignore[assignment]
        return tables  # type: ignore[return-value]

    def _slots(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The ``(B, N, H, slot)`` view the kernels take of a ``(B, H, N, slot)`` cache."""
        cfg = self.tq_config
        if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or (
            kv_cache.shape[1] != self.num_kv_heads or kv_cache.shape[3] < cfg.slot_size
        ):  # fmt: skip
            raise ValueError(
                f"kv_cache: expected uint8 (num_blocks, {self.num_kv_heads}, block_size, "
                f">= {cfg.slot_size}), got {kv_cache.dtype} of shape {list(kv_cache.shape)}"
            )
        return kv_cache.transpose(1, 2)

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
        slots = self._slots(kv_cache)
        pi, _, midpoints = self._tables_on(key.device)
        cfg = self.tq_config
        shape = (n, self.num_kv_heads, self.head_size)
        triton_turboquant_store(
            key[:n].reshape(shape), value[:n].reshape(shape), slots, slot_mapping, pi,
            midpoints, mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
            value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        )  # fmt: skip

    def _decode(
        self, query: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        pi, centroids, _ = self._tables_on(query.device)
        cfg = self.tq_config
        return triton_turboquant_decode_attention(
            query, slots, block_table, seq_lens, pi, centroids, self.scale, cfg.key_mse_bits,
            cfg.key_packed_size, cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
            norm_correction=cfg.norm_correction, PiT=pi,
            max_num_kv_splits=self.max_num_kv_splits,
        )  # fmt: skip

    def _attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Causal fp32 attention of the last ``len(query)`` positions over ``keys`` /
        ``values [S, Hk, D]``."""
        q = query.float().transpose(0, 1)
        k = keys.float().repeat_interleave(self.num_kv_groups, dim=1).transpose(0, 1)
        v = values.float().repeat_interleave(self.num_kv_groups, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * self.scale
        first = keys.shape[0] - query.shape[0]
        q_pos = torch.arange(first, keys.shape[0], device=query.device)
        k_pos = torch.arange(keys.shape[0], device=query.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)

    def _cached_prefix(
        self, slots: torch.Tensor, block_row: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The codec's keys (rotated back) and values ``[length, Hk, D]`` fp32 of a sequence's
        first ``length`` cached tokens."""
        pi, centroids, _ = self._tables_on(slots.device)
        block_size = slots.shape[1]
        pos = torch.arange(length, device=slots.device)
        pages = block_row.to(device=slots.device, dtype=torch.int64)[pos // block_size]
        rows = slots[pages, pos % block_size]
        return turboquant_decode_slots(rows, self.tq_config, centroids, pi)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Prefill requests (query tokens ``[N, Hq, D]`` from 0, module docstring)."""
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        for i, seq_len in enumerate(seq_lens):
            start, stop = query_start_loc[i], query_start_loc[i + 1]
            q_len = stop - start
            if q_len <= 0:
                continue
            cached = seq_len - q_len
            if cached > 0 and q_len <= CONTINUATION_DECODE_THRESHOLD:
                # One decode per query token over the cache up to and including it.
                lens = torch.arange(cached + 1, seq_len + 1, device=query.device)
                table = block_table[i : i + 1].expand(q_len, -1)
                out[start:stop] = self._decode(query[start:stop], slots, table, lens).float()
                continue
            keys, values = key[start:stop], value[start:stop]
            if cached > 0:
                old_k, old_v = self._cached_prefix(slots, block_table[i], cached)
                keys = torch.cat([old_k, keys.float()])
                values = torch.cat([old_v, values.float()])
            out[start:stop] = self._attend(query[start:stop], keys, values)
        return out

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
            raise ValueError("output_scale: expected None (TURBOQUANT has no quantized output)")
        if output is None:
            output = torch.zeros(query.shape[0], self.num_heads * self.head_size,
                                 dtype=query.dtype, device=query.device)  # fmt: skip
        if attn_metadata is None or attn_metadata.num_actual_tokens <= 0:
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        q = query[:n].reshape(n, self.num_heads, self.head_size)
        slots = self._slots(kv_cache)
        result = torch.empty(n, self.num_heads, self.head_size, dtype=q.dtype, device=q.device)
        decodes, decode_tokens = attn_metadata.num_decodes, attn_metadata.num_decode_tokens
        if not attn_metadata.is_prefill:
            decodes, decode_tokens = attn_metadata.seq_lens.shape[0], n
        if decode_tokens:
            result[:decode_tokens] = self._decode(
                q[:decode_tokens], slots, attn_metadata.block_table[:decodes],
                attn_metadata.seq_lens[:decodes],
            )  # fmt: skip
        if decode_tokens < n:
            if key is None or value is None:
                raise ValueError("key, value: expected the batch's keys and values for prefills")
            shape = (n, self.num_kv_heads, self.head_size)
            qsl = attn_metadata.query_start_loc_cpu
            qsl = (attn_metadata.query_start_loc if qsl is None else qsl).tolist()
            lens = attn_metadata.seq_lens_cpu
            lens = (attn_metadata.seq_lens if lens is None else lens).tolist()
            result[decode_tokens:] = self._prefill(
                q[decode_tokens:], key[:n].reshape(shape)[decode_tokens:],
                value[:n].reshape(shape)[decode_tokens:], slots,
                attn_metadata.block_table[decodes:],
                [s - decode_tokens for s in qsl[decodes:]], lens[decodes:],
            ).to(q.dtype)  # fmt: skip
        output[:n] = result.reshape(output[:n].shape)
        return output
