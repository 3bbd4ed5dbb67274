"""Decode attention over TurboQuant KV-cache slots (upstream v0.33.0's
``triton_turboquant_decode_attention`` at upstream's path and signature), written for this
library: attention over the values :func:`~vllm.kv_quant.turboquant.codec.turboquant_decode_slots`
decodes, up to fp32 summation order.

One fused kernel (:func:`~.triton_packed_attention.packed_attention_kernel`) reads the slots in
place, tile by tile: FP8 keys through the exact e4m3 decoder, Lloyd-Max keys as centroids in
the rotated frame with their norm (over the centroids' length under norm correction) applied
to the scores, values ``code * scale + lo`` with the codec's roundings (no FMA contraction).
Lloyd-Max keys meet the query rotated once, ``q @ PiT`` (``PiT`` is ``Pi``'s inverse, so the
scores are those of the rotated-back keys); FP8 keys meet the query as it is. Values are stored
unrotated, so the output needs no inverse rotation. Scores and outputs are fp32 (IEEE dots).

Bytes per decoded (token, KV head): the slot's ``slot_size`` (e.g. 134 for
``turboquant_4bit_nc`` at D = 128, 196 for ``turboquant_k8v4``); the previous reader decoded
every referenced page to fp32 first, ``slot_size + 4 * 4 * D`` bytes (2182 / 2244 at D = 128).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.kv_quant.turboquant.config import TQ_PRESETS, TurboQuantConfig, kernel_config
from vllm.triton_utils.aot import TritonCompileCase
from vllm.v1.attention.ops.triton_attention_plan import MAX_SPLITS, PagedAttentionLaunch
from vllm.v1.attention.ops.triton_packed_attention import (
    PackedLayout,
    launch_case,
    plan_packed_attention,
)

__all__ = ["triton_compile_cases", "triton_turboquant_decode_attention"]

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_float_table(x: torch.Tensor | None, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or tuple(x.shape) != shape:
        got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
        raise ValueError(f"{name}: expected float32 {list(shape)}, got {got}")
    return x


def _check_batch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cfg: TurboQuantConfig,
) -> None:
    """The checks of the batch's tensors, the pages its sequences read included (the kernel
    reads them in place)."""
    if query.dim() != 3 or query.dtype not in _QUERY_DTYPES:
        raise ValueError(
            f"query: expected a float16 / bfloat16 / float32 [B, Hq, D] tensor, got "
            f"{query.dtype} of shape {list(query.shape)}"
        )
    batch, num_heads, _ = query.shape
    if (
        kv_cache.dtype != torch.uint8
        or kv_cache.dim() != 4
        or kv_cache.shape[3] < cfg.slot_size
        or kv_cache.stride(3) != 1
    ):
        raise ValueError(
            f"kv_cache: expected uint8 [num_blocks, block_size, Hk, >= {cfg.slot_size}] with "
            f"contiguous slots, got {kv_cache.dtype} of shape {list(kv_cache.shape)}"
        )
    if num_heads % kv_cache.shape[2] != 0:
        raise ValueError(
            f"query: expected a multiple of the cache's {kv_cache.shape[2]} KV heads, got "
            f"{num_heads} heads"
        )
    check_integer_tensor("block_table", block_table)
    check_integer_tensor("seq_lens", seq_lens)
    if block_table.dim() != 2 or block_table.shape[0] < batch:
        raise ValueError(
            f"block_table: expected [{batch}, max_blocks], got {list(block_table.shape)}"
        )
    block_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * block_size
    lens = seq_lens.to(torch.int64)
    if seq_lens.shape != (batch,) or bool(((lens < 0) | (lens > capacity)).any()):
        raise ValueError(
            f"seq_lens: expected [{batch}] lengths in 0..{capacity} (the block table's tokens), "
            f"got {seq_lens.tolist() if seq_lens.numel() <= 16 else list(seq_lens.shape)}"
        )
    table = block_table[:batch].to(torch.int64)
    column = torch.arange(table.shape[1], device=table.device)
    read = column[None, :] * block_size < lens.to(table.device)[:, None]
    pages = table[read]
    if pages.numel() and bool(((pages < 0) | (pages >= kv_cache.shape[0])).any()):
        raise ValueError(
            f"block_table: expected the pages the sequences read in 0..{kv_cache.shape[0] - 1}, "
            f"got {pages.min().item()}..{pages.max().item()}"
        )


def triton_turboquant_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    mse_bits: int,
    key_packed_size: int,
    value_quant_bits: int,
    key_fp8: bool = False,
    norm_correction: bool = False,
    PiT: torch.Tensor | None = None,
    mid_o_buf: torch.Tensor | None = None,
    output_buf: torch.Tensor | None = None,
    lse_buf: torch.Tensor | None = None,
    buf_holder: Any = None,
    max_num_kv_splits: int = 32,
) -> torch.Tensor:
    """Decode attention: query ``b`` (``query [B, Hq, D]``, fp16 / bf16 / fp32, one token per
    sequence, at its last position) over the ``seq_lens[b]`` tokens of ``kv_cache
    [num_blocks, block_size, Hk, >= slot bytes]`` (uint8, TurboQuant slots) that
    ``block_table [B, max_blocks]`` maps, GQA (query head ``h`` reads KV head ``h // (Hq /
    Hk)``), softmax scale ``scale``. Returns ``[B, Hq, D]`` in the query's dtype: a view of
    ``output_buf`` when it has ``B`` rows or more and the query's dtype, else a new tensor
    (kept on ``buf_holder._tq_output_buf`` when ``buf_holder`` is given).

    The bit widths, ``key_packed_size`` (bytes), ``key_fp8`` and ``norm_correction`` are a
    :class:`TurboQuantConfig`'s (``effective_value_quant_bits``). Lloyd-Max keys need
    ``centroids`` (fp32 ``[2**mse_bits]``) and ``Pi`` / ``PiT`` (fp32 ``[D, D]``, ``PiT``
    defaulting to ``Pi.T``); FP8 keys read neither. ``max_num_kv_splits``: key segments per
    sequence (at most 32; the result is the same function of the cache for any count).
    ``mid_o_buf`` / ``lse_buf`` are upstream's stage buffers, accepted from its callers and not
    read: the partials live in the attention kernel's own scratch. A sequence of length 0
    gives zeros. Bad arguments raise ``ValueError``.
    """
    if query.dim() != 3:
        raise ValueError(f"query: expected a [B, Hq, D] tensor, got shape {list(query.shape)}")
    head_dim = query.shape[2]
    cfg = kernel_config(
        head_dim, mse_bits, key_packed_size, value_quant_bits, key_fp8, norm_correction
    )
    if head_dim % 8 != 0:
        raise ValueError(f"query: expected head dim D (a multiple of 8), got {head_dim}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float (the softmax scale), got {scale!r}")
    splits = max_num_kv_splits
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"max_num_kv_splits: expected a positive int, got {max_num_kv_splits!r}")
    launch, result = _plan(
        query, kv_cache, block_table, seq_lens, Pi, centroids, scale, cfg, PiT,
        min(splits, MAX_SPLITS),
    )  # fmt: skip
    launch()
    batch, num_heads, _ = query.shape
    device = query.device
    usable = (
        output_buf is not None and output_buf.shape[0] >= batch and output_buf.dtype == query.dtype
    )
    if usable:
        output = output_buf[:batch, :num_heads, :head_dim]
    else:
        output = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=device)
        if buf_holder is not None:
            buf_holder._tq_output_buf = output
    output.copy_(result)
    return output


def _plan(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    Pi: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    cfg: TurboQuantConfig,
    PiT: torch.Tensor | None,
    num_splits: int,
) -> tuple[PagedAttentionLaunch, torch.Tensor]:
    """The checked batch's fused launch and the fp32 ``[B, Hq, D]`` result it writes (zeros
    for sequences without keys)."""
    _check_batch(query, kv_cache, block_table, seq_lens, cfg)
    device = query.device
    head_dim = cfg.head_dim
    table = None
    if cfg.key_fp8:
        rotated_q = query.float()
    else:
        given = PiT if PiT is not None else Pi.T if isinstance(Pi, torch.Tensor) else Pi
        rotation = _check_float_table(given, "PiT", (head_dim, head_dim))
        table = _check_float_table(centroids, "centroids", (cfg.n_centroids,)).to(device)
        rotated_q = query.float() @ rotation.to(device)
    batch = query.shape[0]
    result = torch.zeros(query.shape, dtype=torch.float32, device=device)
    kps = cfg.key_packed_size
    launch = plan_packed_attention(
        result, rotated_q.contiguous(), kv_cache[..., :kps], kv_cache[..., kps:], None, None,
        table, PackedLayout.turboquant(cfg), block_table, seq_lens,
        torch.arange(batch + 1, dtype=torch.int32, device=device), float(scale), 1,
        block_table.shape[1] * kv_cache.shape[1], num_splits=num_splits,
    )  # fmt: skip
    return launch, result


def triton_compile_cases() -> list[TritonCompileCase]:
    """The fused decode for each preset at head dims 128 and 96 (a row shorter than its
    block): pages of 16 tokens, GQA 4, 4 key splits."""
    cases = []
    for name in TQ_PRESETS:
        for d in (128, 96):
            cfg = TurboQuantConfig.from_cache_dtype(name, d)
            cache = torch.zeros(2, 16, 2, cfg.slot_size_aligned, dtype=torch.uint8)
            table = torch.zeros(cfg.n_centroids)
            launch, _ = _plan(
                torch.zeros(2, 8, d), cache, torch.zeros(2, 4, dtype=torch.int32),
                torch.full((2,), 64, dtype=torch.int32), torch.eye(d), table, d**-0.5, cfg,
                None, 4,
            )  # fmt: skip
            cases.append(launch_case(f"decode/{name}/d{d}", launch))
    return cases
