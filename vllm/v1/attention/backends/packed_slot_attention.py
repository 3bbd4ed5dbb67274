"""Pieces the packed-slot attention backends (TURBOQUANT and ULTRAQUANT, one K+V slot per token
and KV head) share: the prefill requests of a batch, causal attention in fp32 torch over
unquantized keys and values, and scratch tensors from the worker's workspace."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

__all__ = ["PrefillBatch", "causal_attention", "prefill_requests", "scratch", "workspace_or_none"]


class PrefillBatch(Protocol):
    """The metadata fields :func:`prefill_requests` reads (a ``TurboQuantMetadata``)."""

    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor | None
    seq_lens_cpu: torch.Tensor | None


def prefill_requests(metadata: PrefillBatch) -> Iterator[tuple[int, int, int, int]]:
    """``(request, start, stop, seq_len)`` of each request with query tokens: its query rows
    ``[start, stop)`` and its length in tokens, context included. The host copies are read when
    the metadata has them (no device sync)."""
    qsl = metadata.query_start_loc_cpu
    qsl_list = (metadata.query_start_loc if qsl is None else qsl).tolist()
    lens = metadata.seq_lens_cpu
    lens_list = (metadata.seq_lens if lens is None else lens).tolist()
    for i, seq_len in enumerate(lens_list[: len(qsl_list) - 1]):
        start, stop = qsl_list[i], qsl_list[i + 1]
        if stop > start:
            yield i, start, stop, seq_len


def causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp32 ``[T, Hq, D]``: query rows ``[T, Hq, D]`` at the last ``T`` of the ``S`` positions of
    ``keys`` / ``values [S, Hk, D]``, each attending causally (up to its own position); query
    head ``h`` reads KV head ``h // (Hq / Hk)``."""
    group = query.shape[1] // keys.shape[1]
    q = query.float().transpose(0, 1)
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    q_pos = torch.arange(keys.shape[0] - query.shape[0], keys.shape[0], device=query.device)
    k_pos = torch.arange(keys.shape[0], device=query.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def workspace_or_none(
    *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype],
) -> list[torch.Tensor] | None:
    """The tensors from the worker's workspace (scratch shared by all layers, valid until the
    next request of it), or None without a workspace manager."""
    if not is_workspace_manager_initialized():
        return None
    return current_workspace_manager().get_simultaneous(*shapes_and_dtypes)


def scratch(
    device: torch.device, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]
) -> list[torch.Tensor]:
    """:func:`workspace_or_none`'s tensors, or new ones on ``device`` without a manager."""
    found = workspace_or_none(*shapes_and_dtypes)
    if found is not None:
        return found
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes_and_dtypes]
