"""Metadata of the reference (and ``CPU_ATTN``) attention backend and the validated inputs of
a forward call."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from vllm.kv_quant.index_tensor import check_integer_tensor
from vllm.v1.attention.backends.utils import compute_slot_mapping


def as_int_list(values: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    """``values`` (a 1-D integer tensor or a sequence of ints) as a list; ``ValueError`` naming
    ``name`` for anything else (``int()`` would truncate 6.5 to 6 without a word)."""
    if isinstance(values, torch.Tensor):
        check_integer_tensor(name, values)
        if values.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D tensor, got shape {list(values.shape)}")
        return values.tolist()
    if any(isinstance(v, bool) for v in values):  # bool tensors are refused too
        raise ValueError(f"{name}: expected ints, got {values!r}")
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{name}: expected ints, got {values!r}") from None


@dataclass
class ReferenceAttentionMetadata:
    """Batch metadata in upstream style.

    Sequence ``i`` has ``seq_lens[i]`` tokens in the cache (its new ones included) and
    ``q_len_i = query_start_loc[i+1] - query_start_loc[i]`` query tokens, at positions
    ``seq_lens[i] - q_len_i .. seq_lens[i] - 1``. ``block_table[i, j]`` is the cache page
    (of ``N`` = the cache's page size in tokens) holding positions ``j*N .. j*N + N-1``.
    ``slot_mapping [num_actual_tokens]`` (int64) is where each new token's K/V is written.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool = True
    _token_positions: torch.Tensor | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def build(
        cls,
        seq_lens: Sequence[int] | torch.Tensor,
        query_lens: Sequence[int] | torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        causal: bool = True,
    ) -> ReferenceAttentionMetadata:
        """Metadata for sequences of ``seq_lens`` tokens whose last ``query_lens`` tokens are
        new; ``block_table [num_seqs, max_blocks]`` in pages of ``block_size`` tokens."""
        seqs = as_int_list(seq_lens, "seq_lens")
        queries = as_int_list(query_lens, "query_lens")
        if len(seqs) != len(queries):
            raise ValueError(
                f"query_lens: expected {len(seqs)} entries (one per sequence), got {len(queries)}"
            )
        for i, (s, q) in enumerate(zip(seqs, queries, strict=True)):
            if q < 0 or s < q:
                raise ValueError(
                    f"query_lens: sequence {i} has {s} tokens and {q} query tokens; expected "
                    "0 <= query_len <= seq_len"
                )
        if block_table.dim() != 2 or block_table.shape[0] != len(seqs):
            raise ValueError(
                f"block_table: expected shape [{len(seqs)}, max_blocks], "
                f"got {list(block_table.shape)}"
            )
        device = block_table.device
        qsl = [0]
        for q in queries:
            qsl.append(qsl[-1] + q)
        positions = _positions(seqs, queries).to(device)
        req_indices = torch.repeat_interleave(
            torch.arange(len(seqs), dtype=torch.int64), torch.tensor(queries, dtype=torch.int64)
        ).to(device)
        slot_mapping = compute_slot_mapping(block_table, positions, block_size, req_indices)
        return cls(
            num_actual_tokens=qsl[-1],
            max_query_len=max(queries, default=0),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            max_seq_len=max(seqs, default=0),
            seq_lens=torch.tensor(seqs, dtype=torch.int32, device=device),
            block_table=block_table,
            slot_mapping=slot_mapping,
            causal=causal,
        )

    def checked_batch(self) -> tuple[list[int], list[int]]:
        """``(query_start_loc, seq_lens)`` as int lists, checked against each other,
        ``num_actual_tokens`` and the block table's rows (``ValueError`` naming the field)."""
        qsl = as_int_list(self.query_start_loc, "query_start_loc")
        seq_lens = as_int_list(self.seq_lens, "seq_lens")
        num_tokens = self.num_actual_tokens
        if len(qsl) != len(seq_lens) + 1 or qsl[0] != 0 or qsl[-1] != num_tokens:
            raise ValueError(
                f"query_start_loc: expected {len(seq_lens) + 1} entries from 0 to "
                f"num_actual_tokens={num_tokens}, got {qsl}"
            )
        table = self.block_table
        if table.dim() != 2 or table.shape[0] < len(seq_lens):
            raise ValueError(
                f"block_table: expected shape [{len(seq_lens)}, max_blocks], "
                f"got {list(table.shape)}"
            )
        return qsl, seq_lens

    def token_positions(self) -> torch.Tensor:
        """int64 ``[num_actual_tokens]``: each new token's position in its sequence (computed
        at the first call and kept: every layer of a step asks for it)."""
        if self._token_positions is None:
            qsl = as_int_list(self.query_start_loc, "query_start_loc")
            queries = [b - a for a, b in zip(qsl, qsl[1:], strict=False)]
            seqs = as_int_list(self.seq_lens, "seq_lens")
            self._token_positions = _positions(seqs, queries).to(self.slot_mapping.device)
        return self._token_positions


def _positions(seq_lens: Sequence[int], query_lens: Sequence[int]) -> torch.Tensor:
    """int64 positions of each sequence's last ``query_lens`` tokens, sequence after sequence."""
    spans = zip(seq_lens, query_lens, strict=True)
    pieces = [torch.arange(s - q, s, dtype=torch.int64) for s, q in spans]
    return torch.cat([*pieces, torch.zeros(0, dtype=torch.int64)])


class CheckedForward(NamedTuple):
    """The validated inputs of a forward call: ``query [T, Hq, D]`` (as the reader takes it:
    rotated like the keys), the cache sides, the output ``[T, Hq, Dv]``, fp32 scales (``[1]``
    or ``[Hkv]``), the metadata as int lists and the key sink rows (a NamedTuple: built on
    every forward, ~3x cheaper than a frozen dataclass)."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    output: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    sink_rows: torch.Tensor | None = None
    """The key sink rows of the cache's pages (``[B, S, Hkv, D]`` uint8 view), or None."""
