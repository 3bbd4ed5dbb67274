"""Where each prefill row of a Mamba layer saves its mid-chunk state checkpoint (upstream's
home of :func:`compute_mamba_prefill_checkpoints`). The rules themselves live with the spec
(:mod:`vllm.v1.kv_cache_spec_base`) so that the block manager, which allocates the checkpoint
page, and the attention backends, which write it, decide the same way."""

from __future__ import annotations

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)


def compute_mamba_prefill_checkpoints(
    seq_lens: list[int],
    query_lens: list[int],
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
    drop_eagle_block: bool,
    cache_hit_alignment_tokens: int,
    num_hash_lookahead_tokens: int = 0,
) -> tuple[list[int], list[int]]:
    """Per row (a request of the batch, lengths in tokens, the query being the row's last
    ``query_len`` tokens of ``seq_len``): ``(offsets, cols)``, the checkpoint's offset into the
    row's query and the block-table column of its page; ``0`` and ``-1`` for a row without one.
    """
    if len(seq_lens) != len(query_lens):
        raise ValueError(
            f"query_lens: expected {len(seq_lens)} lengths (one per seq_lens row), "
            f"got {len(query_lens)}"
        )
    offsets: list[int] = []
    cols: list[int] = []
    for seq_len, query_len in zip(seq_lens, query_lens, strict=True):
        query_start = seq_len - query_len
        position = get_mamba_prefill_checkpoint_position(
            seq_len, cache_hit_alignment_tokens, drop_eagle_block, num_hash_lookahead_tokens
        )
        if is_mamba_prefill_checkpoint_valid(
            query_start, seq_len, position, hash_block_size, mamba_block_size, checkpoint_alignment
        ):
            offsets.append(position - query_start)
            # The running state takes the row's last page; the checkpoint the one before.
            cols.append(cdiv(seq_len, mamba_block_size) - 2)
        else:
            offsets.append(0)
            cols.append(-1)
    return offsets, cols
