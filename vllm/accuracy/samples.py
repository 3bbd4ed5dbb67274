"""The unit of data that the accuracy check runs on: queries, keys and values of one layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSample:
    """Queries, keys and values of one attention layer over one or more sequences.

    Sequences are concatenated along the token dim. Every query of a sequence attends to all
    keys of that sequence (decode-style, or a bidirectional encoder), with GQA: query head
    ``i`` reads KV head ``i // (Hq // H)``; softmax scale ``1/sqrt(D)``.

    Attributes:
        name: label in tables, e.g. ``synthetic`` or ``minilm/layer3``.
        query: fp32 ``[sum(query_lens), Hq, D]``.
        key: bf16 ``[sum(seq_lens), H, D]``: the reference keys (what a bf16 cache holds).
        value: bf16 ``[sum(seq_lens), H, Dv]``.
        seq_lens: KV tokens of each sequence.
        query_lens: queries of each sequence.
    """

    name: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        q, k, v = self.query, self.key, self.value
        if k.dim() != 3 or v.dim() != 3 or q.dim() != 3:
            raise ValueError(
                f"{self.name}: expected query [Tq, Hq, D], key [T, H, D], value [T, H, Dv], "
                f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
            )
        if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
            raise ValueError(
                f"{self.name}: key and value must be bfloat16, got {k.dtype}, {v.dtype}"
            )
        if q.dtype != torch.float32:
            raise ValueError(f"{self.name}: query must be float32, got {q.dtype}")
        if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
            raise ValueError(f"{self.name}: query/key/value shapes disagree")
        if q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"{self.name}: query heads {q.shape[1]} not a multiple of KV heads {k.shape[1]}"
            )
        if sum(self.seq_lens) != k.shape[0] or sum(self.query_lens) != q.shape[0]:
            raise ValueError(f"{self.name}: seq_lens/query_lens do not add up to the token counts")
        if len(self.seq_lens) != len(self.query_lens) or min(self.seq_lens, default=0) <= 0:
            raise ValueError(f"{self.name}: need one positive seq_len and a query_len per sequence")

    @property
    def num_kv_heads(self) -> int:
        return self.key.shape[1]

    @property
    def head_size(self) -> int:
        return self.key.shape[2]

    @property
    def head_size_v(self) -> int:
        return self.value.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.key.shape[0]

    def to(self, device: torch.device | str) -> KVSample:
        """The same sample with every tensor on ``device``."""
        return KVSample(
            self.name,
            self.query.to(device),
            self.key.to(device),
            self.value.to(device),
            self.seq_lens,
            self.query_lens,
        )
