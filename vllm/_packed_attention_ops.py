"""The extension's paged attention over packed-slot caches (TurboQuant, ``ultraquant_4bit``,
Octave: K and V of a (token, KV head) in one slot).

:func:`packed_paged_attention` rotates the query into the format's key frame and the output back
from its value frame (the codec's own rotations, :class:`~vllm.kv_quant.slot_codecs.SlotReader`)
around ``_C_cache_ops::packed_paged_attention``, which decodes each page's slots into fp32 tiles
(``csrc/packed_slot_read.h``: the reference codecs' decode, no rotation undone) and attends with an
online softmax, as ``paged_attention`` does for the per-side formats. Everything is checked before
the kernel runs (``ValueError``, ``<arg>: expected X, got Y``; the op's own checks name the
argument too).
"""

from __future__ import annotations

import torch

from vllm._extension import compiled_kernel  # loads the extension: its ops before their fakes
from vllm.kv_quant.slot_codecs import packed_cache_codec

__all__ = ["packed_paged_attention"]


def packed_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache_dtype: str,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    simd: str = "auto",
    alibi_slopes: torch.Tensor | None = None,
    seq_causal: torch.Tensor | None = None,
    key_split: bool = True,
    default_rope_dim: int | None = None,
    *,
    query_in_key_frame: bool = False,
) -> None:
    """Paged attention of ``query [T, Hq, D]`` over the packed-slot cache ``kv_cache`` (uint8,
    logical ``(num_blocks, Hkv, block_size, slot_bytes)``, TURBOQUANT's shape, any strides whose
    slots are contiguous) of format ``kv_cache_dtype``, into ``out [T, Hq, D]`` (query's dtype).
    The metadata and options are :func:`vllm._custom_ops.paged_attention`'s (no key transforms:
    these formats store keys as given). ``default_rope_dim``: Octave's rotary dims when the model
    registered none for ``D``. ``query_in_key_frame``: the caller rotated the query into the key
    frame itself (UltraQuant's unified attention rounds the rotated query through FP8)."""
    for name, t in (("out", out), ("query", query)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 3-D tensor [T, num_heads, head_size], got {got}")
    fmt, codec = packed_cache_codec(kv_cache_dtype, kv_cache, query.shape[-1], default_rope_dim)
    reader = codec.reader
    if compiled_kernel("packed_paged_attention", kv_cache.device) is None:
        raise ValueError(
            f"kv_cache: expected a tensor on a device the compiled packed_paged_attention runs "
            f"on (CPU), got {kv_cache.device}"
        )
    codebook = None if reader.codebook is None else reader.codebook.to(kv_cache.device)
    query_in_frame = query.float() if query_in_key_frame else reader.key_frame(query.float())
    query_in_frame = query_in_frame.contiguous()
    out_in_frame = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    torch.ops._C_cache_ops.packed_paged_attention(
        out_in_frame,
        query_in_frame,
        kv_cache.transpose(1, 2),
        block_table,
        seq_lens,
        query_start_loc,
        fmt.name,
        reader.key_bits,
        reader.value_bits,
        reader.norm_correction,
        reader.rope_dim,
        codebook,
        float(scale),
        0 if sliding_window is None else int(sliding_window),
        0.0 if logits_soft_cap is None else float(logits_soft_cap),
        sinks,
        causal,
        simd,
        alibi_slopes,
        seq_causal,
        key_split,
    )
    rows = int(query_start_loc[-1])
    out[:rows] = reader.value_out(out_in_frame[:rows]).to(out.dtype)


@torch.library.register_fake("_C_cache_ops::packed_paged_attention")
def _packed_paged_attention_fake(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    kv_cache_dtype: str,
    key_bits: int,
    value_bits: int,
    norm_correction: bool,
    rope_dim: int,
    codebook: torch.Tensor | None,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    sinks: torch.Tensor | None,
    causal: bool,
    simd: str = "auto",
    alibi_slopes: torch.Tensor | None = None,
    seq_causal: torch.Tensor | None = None,
    key_split: bool = True,
) -> None:
    # Tracing rejects what the kernel would (shapes, dtypes); the pages are the kernel's own.
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4:
        raise ValueError(
            f"kv_cache: expected a uint8 [num_blocks, block_size, num_kv_heads, slot_bytes] "
            f"tensor, got {kv_cache.dtype} {list(kv_cache.shape)}"
        )
    if query.dim() != 3 or out.shape != query.shape:
        raise ValueError(
            f"out: expected query's shape {list(query.shape)} (3-D), got {list(out.shape)}"
        )
