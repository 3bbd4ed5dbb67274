"""Triton attention backend (``TRITON_ATTN``): paged attention on CUDA GPUs (sm_80+) that reads
every cache format of this library in place.

Same cache shape and layouts as the reference backend
(:class:`~vllm.v1.attention.backends.reference.ReferenceAttentionBackend`: ``(B, 2, N, H, D')``,
NHD or HND, separate K / V regions when ``head_size_v != head_size``), same metadata and impl
constructor, so one cache is read by any of REFERENCE, CPU_ATTN and TRITON_ATTN. The impl runs
:func:`~vllm.v1.attention.ops.triton_unified_attention.plan_paged_attention`: decode, prefill and
chunked prefill in one launch, GQA, sliding window, sinks, logits soft cap, ``head_size_v``,
split-K for long sequences, queries in fp16 / bf16 / fp32, layers that store keys before RoPE
or keep FP8 key sinks (:mod:`~vllm.v1.attention.ops.triton_key_rebuild`). Without a GPU it runs
under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the tests run it
there.

``int4_per_token_head`` pages (upstream v0.33's INT4 format, keys and values rotated before
4-bit quantization) are written by
:func:`~vllm.v1.attention.ops.int4_per_token_head.reshape_and_cache_int4` and read by
:func:`~vllm.v1.attention.ops.int4_per_token_head.int4_paged_attention` (the reader behind
upstream's ``unified_attention_int4``); batches with several queries per sequence run unsplit
(upstream's 2D-only INT4 launcher), decode batches may split.

The packed-slot formats (TurboQuant, ``ultraquant_4bit``, Octave) take the reference backend's
TURBOQUANT-shaped cache and writer (their codecs) and are read by
:func:`~vllm.v1.attention.ops.triton_slot_attention.triton_packed_slot_attention`: the fused
packed kernel over the slots, the query rotated into the key frame, the output back.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm.kv_quant.formats import KVQuantMode
from vllm.kv_quant.int4_per_token_head import int4_scale_words
from vllm.kv_quant.slot_codecs import OCTAVE_CHECK_ROPE_DIM
from vllm.triton_utils import HAS_TRITON, triton_interpreted
from vllm.v1.attention.backends.abstract import AttentionLayer, DeviceCapability
from vllm.v1.attention.backends.reference import (
    ReferenceAttentionBackend,
    ReferenceAttentionImpl,
    ReferenceAttentionMetadata,
)
from vllm.v1.attention.backends.reference_attend import check_codec_write
from vllm.v1.attention.backends.reference_metadata import CheckedForward

MIN_CAPABILITY = (8, 0)
"""Oldest GPU the kernels are built and tested for (Ampere)."""


class TritonAttentionBackend(ReferenceAttentionBackend):
    """Triton paged attention over every cache format, the packed K+V slots included, on
    CUDA sm_80+ (and on the CPU under Triton's interpreter)."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = list(
        ReferenceAttentionBackend.supported_kv_cache_dtypes
    )

    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """CUDA compute capability 8.0 or newer; the CPU (``None``) only under Triton's
        interpreter."""
        if capability is None:
            return triton_interpreted()
        return (capability.major, capability.minor) >= MIN_CAPABILITY

    @classmethod
    def _runtime_reasons(cls) -> list[str]:
        """Triton, when it is not installed."""
        return [] if HAS_TRITON else ["TRITON_ATTN needs Triton (not installed)"]

    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TritonAttentionImpl

    @staticmethod
    def get_metadata_cls() -> type[TritonAttentionMetadata]:
        return TritonAttentionMetadata


class TritonAttentionMetadata(ReferenceAttentionMetadata):
    """The reference backend's metadata (``build(seq_lens, query_lens, block_table,
    block_size)``)."""


class TritonAttentionImpl(ReferenceAttentionImpl):
    """The reference impl's constructor, checks and cache writer; :meth:`forward` runs the
    Triton kernels. ``num_splits`` (class attribute or per instance) forces the split-K count;
    ``None`` lets :func:`~vllm.v1.attention.ops.triton_unified_attention.choose_num_splits`
    pick."""

    num_splits: int | None = None

    @property
    def _int4(self) -> bool:
        """Whether the cache is ``int4_per_token_head`` (its own writer and reader)."""
        return self.kv_cache_format.quant_mode is KVQuantMode.INT4_PER_TOKEN_HEAD

    def _reads_packed_slots(self) -> bool:
        """This impl's :meth:`forward` reads them (``triton_packed_slot_attention``)."""
        return type(self).forward is TritonAttentionImpl.forward

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
        """INT4 caches that Triton can write (CUDA, or under the interpreter): upstream's
        ``reshape_and_cache_int4`` (the codec's bytes; INT4 encodings have no key transform nor
        sink rows). Everything else: the reference impl's writer."""
        if not self._int4 or not (key_cache.device.type == "cuda" or triton_interpreted()):
            super()._write(
                layer, key, value, key_cache, value_cache, slot_mapping, positions, sink_rows
            )
            return
        from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4

        check_codec_write(key, value, (self.head_size, self.head_size_v), key_cache, None)
        reshape_and_cache_int4(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            k_scale_cache=int4_scale_words(key_cache, self.head_size),
            v_scale_cache=int4_scale_words(value_cache, self.head_size_v),
        )

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
        """The reference impl's checks, plus a CUDA cache (any device under the interpreter)
        and a valid :attr:`num_splits` (checked before anything is written)."""
        from vllm.v1.attention.ops.triton_unified_attention import MAX_SPLITS

        splits = self.num_splits
        if splits is not None and (
            isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS
        ):
            raise ValueError(
                f"num_splits: expected None or an int in 1..{MAX_SPLITS}, got {splits!r}"
            )
        checked = super()._check_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        device = checked.key_cache.device
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"kv_cache: expected a CUDA tensor (or TRITON_INTERPRET=1), got {device}"
            )
        return checked

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
        """Attention of ``query [T, num_heads, D]`` (or ``[T, num_heads*D]``) over the cache,
        as :meth:`ReferenceAttentionImpl.forward` (same arguments, result and errors)."""
        from vllm.v1.attention.ops.triton_unified_attention import plan_paged_attention

        checked = self._begin_forward(layer, query, key, value, kv_cache, attn_metadata, output)
        query, target = self._kernel_io(checked)
        output = checked.output
        rows = attn_metadata.num_actual_tokens
        if self._int4:
            self._int4_forward(target[:rows], query[:rows], checked, attn_metadata)
        elif self._packed is not None:
            self._packed_forward(target[:rows], query[:rows], checked, attn_metadata)
        else:
            k_layout, v_layout = self._fitting_scale_layouts(checked.key_cache.shape[1])
            rebuild = self._key_rebuild(checked, attn_metadata.block_table)
            plan_paged_attention(
                target[:rows],
                query[:rows],
                checked.key_cache,
                checked.value_cache,
                attn_metadata.block_table,
                attn_metadata.seq_lens,
                attn_metadata.query_start_loc,
                self.kv_cache_dtype,
                checked.k_scale,
                checked.v_scale,
                self.scale,
                attn_metadata.max_query_len,
                attn_metadata.max_seq_len,
                sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap,
                sinks=self.sinks,
                causal=attn_metadata.causal,
                k_scale_layout=k_layout,
                v_scale_layout=v_layout,
                num_splits=self.num_splits,
                **({} if rebuild is None else _on_device(rebuild.kernel_args(), query.device)),
            )()
        if target is not output:
            output[:rows] = target[:rows]
        return output

    def _packed_forward(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        checked: CheckedForward,
        attn_metadata: ReferenceAttentionMetadata,
    ) -> None:
        """Attention over a packed-slot cache (``checked.key_cache`` its ``(B, N, H, slot)``
        view) into ``out``."""
        from vllm.v1.attention.ops.triton_slot_attention import triton_packed_slot_attention

        triton_packed_slot_attention(
            out,
            query,
            checked.key_cache.transpose(1, 2),  # the logical (B, H, N, slot) cache
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            self.kv_cache_dtype,
            self.scale,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
            causal=attn_metadata.causal,
            num_splits=self.num_splits,
            default_rope_dim=OCTAVE_CHECK_ROPE_DIM,
        )

    def _int4_forward(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        checked: CheckedForward,
        attn_metadata: ReferenceAttentionMetadata,
    ) -> None:
        """Attention over an INT4 cache into ``out``: split-K only for single-query batches."""
        from vllm.v1.attention.ops.int4_per_token_head import int4_paged_attention

        key_cache, value_cache = checked.key_cache, checked.value_cache
        int4_paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            int4_scale_words(key_cache, self.head_size),
            int4_scale_words(value_cache, self.head_size_v),
            block_table=attn_metadata.block_table,
            seq_lens=attn_metadata.seq_lens,
            query_start_loc=attn_metadata.query_start_loc,
            softmax_scale=self.scale,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
            causal=attn_metadata.causal,
            num_splits=1 if attn_metadata.max_query_len > 1 else self.num_splits,
        )


def _on_device(args: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The rebuild's kernel arguments with its tensors on the query's device (a layer's RoPE
    table may live on the CPU)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
