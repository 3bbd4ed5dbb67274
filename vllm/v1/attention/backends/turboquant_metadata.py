"""Batch metadata of the packed-slot attention backends (TURBOQUANT, ULTRAQUANT): one batch's
:class:`TurboQuantMetadata`, its decode / prefill split, and the decode's workspace buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.v1.attention.backend import AttentionMetadata

__all__ = ["TurboQuantMetadata", "decode_buffer_specs", "split_batch"]


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


def decode_buffer_specs(
    batch: int, num_heads: int, head_size: int, splits: int, dtype: torch.dtype
) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The decode's workspace buffers for ``batch`` sequences: the per-split partial outputs
    and their log-sum-exp (fp32), the output (``dtype``), the final log-sum-exp (fp32)."""
    return (
        ((batch, num_heads, splits, head_size + 1), torch.float32),
        ((batch, num_heads, head_size), dtype),
        ((batch, num_heads), torch.float32),
    )


def split_batch(
    metadata: TurboQuantMetadata,
) -> tuple[TurboQuantMetadata | None, TurboQuantMetadata | None]:
    """The decode part (the first ``num_decodes`` requests; the whole batch when it has no
    prefill) and the prefill part (query rows renumbered from 0) of a batch, None where
    empty."""
    if not metadata.is_prefill:
        return metadata, None
    d, t, n = metadata.num_decodes, metadata.num_decode_tokens, metadata.num_actual_tokens
    decode = None
    if d > 0:
        decode = TurboQuantMetadata(
            seq_lens=metadata.seq_lens[:d],
            slot_mapping=metadata.slot_mapping[:t],
            block_table=metadata.block_table[:d],
            query_start_loc=metadata.query_start_loc[: d + 1],
            num_actual_tokens=t,
            max_query_len=1,
            max_seq_len=metadata.max_seq_len,
            num_decodes=d,
            num_decode_tokens=t,
        )
    if t >= n:
        return decode, None
    qsl_cpu, lens_cpu = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    prefill = TurboQuantMetadata(
        seq_lens=metadata.seq_lens[d:],
        slot_mapping=metadata.slot_mapping[t:n],
        block_table=metadata.block_table[d:],
        query_start_loc=metadata.query_start_loc[d:] - t,
        num_actual_tokens=n - t,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len if lens_cpu is None else int(lens_cpu[d:].max()),
        is_prefill=True,
        query_start_loc_cpu=None if qsl_cpu is None else qsl_cpu[d:] - t,
        seq_lens_cpu=None if lens_cpu is None else lens_cpu[d:],
    )
    return decode, prefill
