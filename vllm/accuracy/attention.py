"""Plain fp32 attention over contiguous K/V, used as the reference math of the check.

Every query of a sequence attends to all keys of that sequence (no causal mask), softmax scale
``1/sqrt(D)``, GQA: query head ``i`` reads KV head ``i // (Hq // H)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch


def _split(x: torch.Tensor, lens: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    return torch.split(x, list(lens), dim=0)


def _expand_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[T, H, D]`` -> ``[Hq, T, D]`` (each KV head repeated for its query heads)."""
    group = num_q_heads // x.shape[1]
    return x.to(torch.float32).repeat_interleave(group, dim=1).transpose(0, 1)


def attention_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    seq_lens: tuple[int, ...],
    query_lens: tuple[int, ...],
) -> Iterator[torch.Tensor]:
    """Scaled scores ``q·k / sqrt(D)`` in fp32, one ``[Hq, Tq_i, T_i]`` tensor per sequence."""
    scale = 1.0 / math.sqrt(query.shape[-1])
    hq, h = query.shape[1], key.shape[1]
    for q, k in zip(_split(query, query_lens), _split(key, seq_lens), strict=True):
        tq = q.shape[0]
        # Query heads h*G .. h*G+G-1 share KV head h: one [G*Tq, D] x [D, T] product per head.
        qf = q.to(torch.float32).transpose(0, 1).reshape(h, (hq // h) * tq, -1)
        kf = k.to(torch.float32).permute(1, 2, 0)  # [H, D, T]
        yield (torch.matmul(qf, kf) * scale).view(hq, tq, -1)


def attention_output(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: tuple[int, ...],
    query_lens: tuple[int, ...],
) -> torch.Tensor:
    """Attention output ``[sum(query_lens), Hq, Dv]`` in fp32 from contiguous ``key [T, H, D]``
    and ``value [T, H, Dv]`` (any float dtype; widened to fp32)."""
    hq = query.shape[1]
    outs = []
    logits = attention_logits(query, key, seq_lens, query_lens)
    for s, v in zip(logits, _split(value, seq_lens), strict=True):
        p = torch.softmax(s, dim=-1)
        outs.append(torch.matmul(p, _expand_kv(v, hq)).transpose(0, 1))  # [Tq, Hq, Dv]
    return torch.cat(outs, dim=0)
