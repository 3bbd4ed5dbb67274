"""Encoder attention through zentorch's SDPA op on AMD Zen CPUs (upstream's path and names).

Encoder layers attend the step's own keys and values, no cache: with zentorch loaded on a Zen
host, :func:`zentorch_sdpa_attn` hands each batch of sequences to
``torch.ops.zentorch.zentorch_sdpa_attn`` ([batch, heads, tokens, head_size] operands; GQA by
the op's own head mapping; a window of ``w`` tokens each side of the diagonal, the diagonal
excluded; ALiBi slopes per query head).
"""

from __future__ import annotations

from typing import Protocol

import torch

from vllm.model_executor.kernels.linear.zentorch_utils import has_zentorch_op
from vllm.v1.attention.backend import AttentionType

__all__ = ["should_use_zentorch_sdpa", "zentorch_sdpa_attn"]

_OP = "zentorch_sdpa_attn"


class EncoderMetadata(Protocol):
    """What :func:`zentorch_sdpa_attn` reads of the attention metadata."""

    query_start_loc: torch.Tensor
    causal: bool


def should_use_zentorch_sdpa(attn_type: str, dtype: torch.dtype) -> bool:
    """Whether an ``attn_type`` layer computing in ``dtype`` goes to zentorch's SDPA: encoder
    layers only, with the op registered, in a dtype its instruction set serves here (bf16 needs
    AVX-512 BF16, fp32 AVX-512; fp16 is not served)."""
    if attn_type not in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
        return False
    if not has_zentorch_op([_OP]):
        return False
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported()
    if dtype == torch.float32:
        return torch.cpu._is_avx512_supported()
    return False


def _bhsd(t: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    """``[batch * tokens, heads, D]`` packed rows as a ``[batch, heads, tokens, D]`` view."""
    return t.unflatten(0, (batch, tokens)).permute(0, 2, 1, 3)


def zentorch_sdpa_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    attn_metadata: EncoderMetadata,
    scale: float,
    sliding_window: int = -1,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the packed ``query [T, H, D]`` over ``key`` / ``value [T, Hkv, D]``
    within each sequence of ``attn_metadata.query_start_loc``, into ``output`` (returned).
    ``sliding_window`` in tokens counting the diagonal (``-1``: none)."""
    if alibi_slopes is not None and query.dtype == torch.bfloat16:
        # The op builds its bias in the query's dtype; bf16 slopes lose the per-head values
        # of non-power-of-two head counts, so compute in fp32.
        wide = torch.empty_like(query, dtype=torch.float32)
        zentorch_sdpa_attn(
            query.float(),
            key.float(),
            value.float(),
            wide,
            attn_metadata,
            scale,
            sliding_window,
            alibi_slopes,
        )
        output.copy_(wide)
        return output
    window = -1 if sliding_window in (None, -1) else sliding_window - 1
    op = getattr(torch.ops.zentorch, _OP)
    kwargs = dict(
        scale=scale,
        is_causal=attn_metadata.causal,
        alibi_slopes=alibi_slopes,
        left_window_size=window,
        right_window_size=window,
    )
    starts = attn_metadata.query_start_loc.tolist()
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    if lengths and all(n == lengths[0] for n in lengths):
        batch, tokens = len(lengths), lengths[0]
        op(
            _bhsd(query, batch, tokens),
            _bhsd(key, batch, tokens),
            _bhsd(value, batch, tokens),
            _bhsd(output, batch, tokens),
            **kwargs,
        )
        return output
    for begin, end in zip(starts[:-1], starts[1:], strict=True):
        op(
            _bhsd(query[begin:end], 1, end - begin),
            _bhsd(key[begin:end], 1, end - begin),
            _bhsd(value[begin:end], 1, end - begin),
            _bhsd(output[begin:end], 1, end - begin),
            **kwargs,
        )
    return output
