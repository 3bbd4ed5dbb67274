"""UltraQuant attention backend (upstream v0.33.0's ``ULTRAQUANT``, at upstream's path and under
its class names): the ``ultraquant_4bit`` cache (FP4 E2M1 codes, one UE8M0 scale per 32 values,
keys Hadamard-rotated; :mod:`vllm.kv_quant.ultraquant_codec`), written for this library over
its UltraQuant ops (:mod:`vllm.v1.attention.ops.ultraquant`).

Built on the TurboQuant backend as upstream's is: the backend, metadata, builder (and so its
workspace reservation), ``forward`` and ``do_kv_cache_update`` are TurboQuant's; the impl
overrides the four seams ``_ensure_on_device`` (the rotation on the layer as ``_tq_Pi`` /
``_tq_PiT``, no centroids), ``_store_kv`` (``ultraquant_store``), ``_decode_attention`` and
``_prefill_attention``.

Attention, as upstream's paths define it: decodes go to upstream's FlyDSL kernel where
:func:`~vllm.v1.attention.ops.flydsl_ultraquant_decode.ultraquant_flydsl_decode_eligible` says
so (never here: the library ships no FlyDSL kernel), else to the unified path
(``ultraquant_unified_attention``: the query rotated and rounded through FP8 E4M3, the cache
decoded exactly). A first-chunk prefill attends causally over its own unquantized keys and
values; a continuation chunk of at most ``CONTINUATION_DECODE_THRESHOLD`` tokens reads the whole
sequence from the cache through the unified path; a longer one attends over the cached prefix
decoded into workspace buffers of the query's dtype, then its own unquantized keys and values,
in the rotated basis (queries and the chunk's keys rotated, fp32). Prefill attention is fp32
torch. Queries in bf16 (upstream's FlyDSL kernel reads bf16); decoder self-attention only, no
window, sinks, ALiBi or soft cap; head sizes are powers of two from 32.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from vllm.utils.math_utils import round_up
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.abstract import check_kv_cache_shape_args
from vllm.v1.attention.backends.packed_slot_attention import (
    causal_attention,
    prefill_requests,
    scratch,
)
from vllm.v1.attention.backends.turboquant_attn import (
    CONTINUATION_DECODE_THRESHOLD,
    TurboQuantAttentionBackend,
    TurboQuantAttentionImpl,
)
from vllm.v1.attention.backends.turboquant_metadata import TurboQuantMetadata
from vllm.v1.attention.ops.flydsl_ultraquant_decode import (
    flydsl_ultraquant_decode_attention,
    is_ultraquant_flydsl_available,
    ultraquant_flydsl_decode_eligible,
)
from vllm.v1.attention.ops.ultraquant.format import GROUP_SIZE, slot_size
from vllm.v1.attention.ops.ultraquant.reference import hadamard_matrix
from vllm.v1.attention.ops.ultraquant.triton_dequant import ultraquant_full_dequant_kv
from vllm.v1.attention.ops.ultraquant.triton_store import ultraquant_store
from vllm.v1.attention.ops.ultraquant.triton_unified_attention import (
    ultraquant_unified_attention,
)
from vllm.v1.kv_cache_interface import AttentionSpec

__all__ = ["ULTRAQUANT_BLOCK_SIZE", "UltraQuantAttentionBackend", "UltraQuantAttentionImpl"]

ULTRAQUANT_DTYPES = ["ultraquant_4bit"]
ULTRAQUANT_BLOCK_SIZE = 64
"""Tokens per block the backend asks for (upstream's FlyDSL decode geometry)."""


class UltraQuantAttentionBackend(TurboQuantAttentionBackend):
    """Attention over ``ultraquant_4bit`` KV caches (TurboQuant's backend otherwise)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ULTRAQUANT_DTYPES
    # The impl's rule: a power of two (the rotation) of whole 32-value scale groups.
    supported_head_sizes: ClassVar[list[int]] = [32, 64, 128, 256, 512]

    @staticmethod
    def get_name() -> str:
        return "ULTRAQUANT"

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """:data:`ULTRAQUANT_BLOCK_SIZE` tokens, whatever the default."""
        return ULTRAQUANT_BLOCK_SIZE

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """An UltraQuant spec gets ``state_content_bytes`` = the packed K+V slot at its head
        size (``D + D / 16`` bytes); other specs, and one already set, are returned as given."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_ultraquant:
            return spec
        return replace(spec, state_content_bytes=slot_size(spec.head_size))

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """``(num_blocks, num_kv_heads, block_size, slot)`` uint8, ``slot`` the packed K+V bytes
        of one token and KV head (``D + D / 16``)."""
        check_kv_cache_shape_args(
            "UltraQuantAttentionBackend", num_blocks, block_size, num_kv_heads, head_size
        )
        if cache_dtype_str not in ULTRAQUANT_DTYPES:
            raise ValueError(
                f"cache_dtype_str: expected one of {', '.join(ULTRAQUANT_DTYPES)}, got "
                f"{cache_dtype_str!r}"
            )
        return (num_blocks, num_kv_heads, block_size, slot_size(head_size))

    @staticmethod
    def get_impl_cls() -> type[UltraQuantAttentionImpl]:
        return UltraQuantAttentionImpl


class UltraQuantAttentionImpl(TurboQuantAttentionImpl):
    """Store and attention of one layer over an ``ultraquant_4bit`` cache (module docstring)."""

    backend_name: ClassVar[str] = "ULTRAQUANT"

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
            num_heads, head_size, scale, num_kv_heads, kv_cache_dtype, ULTRAQUANT_DTYPES,
            attn_type=attn_type, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sinks=kwargs.get("sinks"),
        )  # fmt: skip
        if head_size < GROUP_SIZE:
            raise ValueError(
                f"head_size: expected a power of two of at least {GROUP_SIZE} (one scale "
                f"group), got {head_size}"
            )
        self.slot_bytes = slot_size(head_size)
        self._flydsl_decode_eligible = ultraquant_flydsl_decode_eligible(
            head_size=head_size,
            num_kv_groups=self.num_kv_groups,
            has_sinks=False,
            sliding_window=None,
            flydsl_loaded=is_ultraquant_flydsl_available(),
        )

    def _ensure_on_device(self, layer: Any, device: torch.device) -> None:
        """Put the codec's normalized Hadamard rotation on the layer as ``_tq_Pi`` /
        ``_tq_PiT`` (once per device); ``_tq_centroids`` is empty (FP4 has no Lloyd-Max
        table) but set, as ``forward`` reads it."""
        if getattr(layer, "_tq_cached", None) == device:
            return
        rotation = hadamard_matrix(self.head_size, device)
        layer._tq_Pi = rotation
        layer._tq_PiT = rotation
        layer._tq_centroids = torch.empty(0, dtype=torch.float32, device=device)
        layer._tq_cached = device

    def _store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        layer: Any,
    ) -> None:
        """Encode ``key`` (rotated) and ``value`` ``[N, Hk, D]`` into ``kv_cache``'s slots."""
        ultraquant_store(key, value, kv_cache, slot_mapping, PiT=layer._tq_PiT)

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
        """Decode attention of ``query [B, Hq, D]`` in its dtype, written into the workspace's
        output buffer when there is a workspace (the one TurboQuant's builder reserves)."""
        buffers = self._decode_buffers(query)
        output = None if buffers is None else buffers[1]
        if self._flydsl_decode_eligible:
            return flydsl_ultraquant_decode_attention(
                query, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens, self.scale,
                PiT=PiT, max_seq_len=attn_metadata.max_seq_len, output_buf=output,
                buf_holder=layer, max_num_kv_splits=self.max_num_kv_splits,
            )  # fmt: skip
        return ultraquant_unified_attention(
            query, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, self.scale, PiT=PiT, output=output, max_query_len=1,
            max_seq_len=attn_metadata.max_seq_len,
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
        rotation = Pi if PiT is None else PiT
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        for i, start, stop, seq_len in prefill_requests(attn_metadata):
            q, k, v = query[start:stop], key[start:stop], value[start:stop]
            cached = seq_len - (stop - start)
            table = attn_metadata.block_table[i : i + 1]
            if cached <= 0:
                out[start:stop] = causal_attention(q, k, v, self.scale)
            elif stop - start <= CONTINUATION_DECODE_THRESHOLD:
                # The cache already holds the chunk: one request over all of it.
                bounds = torch.tensor([0, stop - start], dtype=torch.int32, device=q.device)
                lens = torch.tensor([seq_len], dtype=torch.int32, device=q.device)
                out[start:stop] = ultraquant_unified_attention(
                    q, kv_cache, table, lens, bounds, self.scale, PiT=rotation,
                    max_query_len=stop - start, max_seq_len=seq_len,
                ).float()  # fmt: skip
            else:
                out[start:stop] = self._ultraquant_continuation_prefill(
                    query=q, key_chunk=k, val_chunk=v, kv_cache=kv_cache,
                    block_table=table, cached_len=cached, seq_len=seq_len, PiT=rotation,
                )  # fmt: skip
        return out.to(query.dtype)

    def _ultraquant_continuation_prefill(
        self,
        *,
        query: torch.Tensor,
        key_chunk: torch.Tensor,
        val_chunk: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        cached_len: int,
        seq_len: int,
        PiT: torch.Tensor,  # noqa: N803
    ) -> torch.Tensor:
        """fp32 attention of a long chunk over its ``cached_len`` cached tokens (decoded into
        workspace buffers of the query's dtype, keys in the rotated basis they are stored in),
        then its own unquantized ones (``seq_len`` tokens in all). The chunk's keys and the
        queries are rotated too: the rotation is orthonormal, so the scores are unchanged."""
        hk, d = key_chunk.shape[1:]
        block_size = kv_cache.shape[1]
        alloc_len = round_up(cached_len, block_size)
        shape = (1, hk, alloc_len, d)
        k_buf, v_buf = scratch(query.device, (shape, query.dtype), (shape, query.dtype))
        ultraquant_full_dequant_kv(kv_cache, block_table, k_buf, v_buf, alloc_len)
        rotation = PiT.to(device=query.device, dtype=torch.float32)
        keys = torch.cat([k_buf[0, :, :cached_len].transpose(0, 1).float(),
                          key_chunk.float() @ rotation])  # fmt: skip
        values = torch.cat([v_buf[0, :, :cached_len].transpose(0, 1).float(), val_chunk.float()])
        return causal_attention(query.float() @ rotation, keys, values, self.scale)
