"""Triton paged attention over the packed-slot caches (TurboQuant's presets, ``ultraquant_4bit``,
Octave's formats) for the ``TRITON_ATTN`` backend: the fused packed kernel
(:mod:`~.triton_packed_attention`) decodes each tile of keys and values from the slots in place
(:mod:`~.triton_packed_kv_tiles`), in the formats' frames. The query is rotated into the key frame
and the output back from the value frame once per call, with the codecs' own rotations
(:class:`~vllm.kv_quant.slot_codecs.SlotReader`), so the result is attention over the codecs'
decoded values up to fp32 summation order, as the CPU kernel's
(:func:`vllm._packed_attention_ops.packed_paged_attention`) is.
"""

from __future__ import annotations

import torch

from vllm.kv_quant.formats import KVCacheFormat, format_for_storage
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.octave import HADAMARD_BLOCK, OctaveFormat
from vllm.kv_quant.slot_codecs import SlotCodec, packed_cache_codec, slot_codec
from vllm.kv_quant.turboquant.config import TurboQuantConfig
from vllm.kv_quant.ultraquant import FP4_BITS_TO_VALUE, GROUP_SIZE
from vllm.triton_utils.aot import TritonCompileCase
from vllm.v1.attention.ops.triton_packed_attention import (
    PackedLayout,
    launch_case,
    plan_packed_attention,
)
from vllm.v1.attention.ops.triton_packed_kv_tiles import OCTAVE_FORMAT, ULTRAQUANT_FORMAT

__all__ = ["slot_pages", "triton_compile_cases", "triton_packed_slot_attention"]

_E2M1_LEVELS = torch.tensor(FP4_BITS_TO_VALUE, dtype=torch.float32)
"""The ``ultraquant_4bit`` kernel tiles' level table (code -> E2M1 value), built once."""


def slot_pages(
    fmt: KVCacheFormat, codec: SlotCodec, view: torch.Tensor
) -> tuple[PackedLayout, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(layout, key pages, value pages, level table)`` of the packed kernel for the
    ``(B, N, H, slot_bytes)`` view of a packed-slot cache of ``fmt`` read with ``codec``."""
    d, reader = codec.head_size, codec.reader
    mode = fmt.quant_mode
    if mode.is_turboquant:
        cfg = TurboQuantConfig.from_cache_dtype(fmt.name, d)
        kps = cfg.key_packed_size
        return PackedLayout.turboquant(cfg), view[..., :kps], view[..., kps:], reader.codebook
    if mode.is_ultraquant:
        side = d // 2 + d // GROUP_SIZE
        layout = PackedLayout(ULTRAQUANT_FORMAT)
        return layout, view[..., :side], view[..., side:], _E2M1_LEVELS
    geometry = OctaveFormat.from_cache_dtype(fmt.name, d, reader.rope_dim)
    layout = PackedLayout(
        OCTAVE_FORMAT,
        value_bits=geometry.v_bits,
        rope_dim=geometry.k_wide_dim,
        k_scale_block=geometry.k_rotation_block,
    )
    return layout, view, view, reader.codebook


def triton_packed_slot_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache_dtype: str,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool | torch.Tensor = True,
    num_splits: int | None = None,
    default_rope_dim: int | None = None,
    query_in_key_frame: bool = False,
) -> None:
    """Attention of ``query [T, Hq, D]`` over the packed-slot cache ``kv_cache`` (uint8,
    logical ``(num_blocks, Hkv, block_size, slot_bytes)``, TURBOQUANT's shape, contiguous slots)
    of format ``kv_cache_dtype`` into the first ``query_start_loc[-1]`` rows of ``out [T, Hq,
    D]``; the metadata and options are :func:`~.triton_packed_attention.plan_packed_attention`'s.
    ``default_rope_dim``: Octave's rotary dims when the model registered none for ``D``;
    ``query_in_key_frame``: the caller rotated the query into the key frame itself."""
    fmt, codec = packed_cache_codec(kv_cache_dtype, kv_cache, query.shape[-1], default_rope_dim)
    layout, key_pages, value_pages, table = slot_pages(fmt, codec, kv_cache.transpose(1, 2))
    rows = int(query_start_loc[-1])
    q = query[:rows].float()
    q = (q if query_in_key_frame else codec.reader.key_frame(q)).contiguous()
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    plan_packed_attention(
        o,
        q,
        key_pages,
        value_pages,
        None,
        None,
        table,
        layout,
        block_table,
        seq_lens,
        query_start_loc,
        scale,
        max_query_len,
        max_seq_len,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        causal=causal,
        num_splits=num_splits,
    )()
    out[:rows] = codec.reader.value_out(o).to(out.dtype)


def _case(mode: KVQuantMode, splits: int) -> TritonCompileCase:
    """A launch over a cache of 4 pages of 16 tokens, 2 KV heads of 128, GQA 2, two sequences
    (a 5-token prefill chunk and a decode)."""
    fmt = format_for_storage(mode, torch.uint8)
    codec = slot_codec(fmt, 128, HADAMARD_BLOCK)
    view = torch.zeros(4, 16, 2, codec.slot_bytes, dtype=torch.uint8)
    layout, key_pages, value_pages, table = slot_pages(fmt, codec, view)
    q = torch.zeros(6, 4, 128)
    launch = plan_packed_attention(
        torch.zeros_like(q), q, key_pages, value_pages, None, None, table, layout,
        torch.zeros(2, 2, dtype=torch.int32), torch.tensor([30, 20], dtype=torch.int32),
        torch.tensor([0, 5, 6], dtype=torch.int32), 0.1, 5, 30, num_splits=splits,
    )  # fmt: skip
    return launch_case(f"{fmt.name}/d128/splits{splits}", launch)


def triton_compile_cases() -> list[TritonCompileCase]:
    """The slot formats TurboQuant's reader does not compile: ``ultraquant_4bit`` unsplit,
    Octave block K (64 rotary dims) split-K, compact Octave K unsplit."""
    modes = (KVQuantMode.ULTRAQUANT_4BIT, KVQuantMode.OCTAVE_K3V4, KVQuantMode.OCTAVE_K3V3_COMPACT)
    return [_case(mode, 4 if mode is KVQuantMode.OCTAVE_K3V4 else 1) for mode in modes]
