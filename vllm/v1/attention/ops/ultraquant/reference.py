"""Upstream's ``vllm.v1.attention.ops.ultraquant.reference``: the ``ultraquant_4bit`` reference
codec (:mod:`vllm.kv_quant.ultraquant_codec`, re-exported) and the reference decode attention
the kernels are checked against."""

from __future__ import annotations

import torch

from vllm.kv_quant.ultraquant_codec import (
    UltraQuantEncoded,
    hadamard_matrix,
    ultraquant_dequant,
    ultraquant_encode,
    ultraquant_encode_decode,
)

__all__ = [
    "UltraQuantEncoded",
    "hadamard_matrix",
    "reference_ultraquant_attention",
    "ultraquant_dequant",
    "ultraquant_encode",
    "ultraquant_encode_decode",
]


def reference_ultraquant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    constant_c: float | None = None,
) -> torch.Tensor:
    """Single-query attention over an ultraquant-encoded K/V, in ``query.dtype``.

    ``query`` ``[B, Hq, D]`` (unrotated), ``key``/``value`` ``[B, N, Hk, D]``, ``Hq`` a multiple
    of ``Hk``. Q is rotated and rounded through FP8 E4M3 (unit scale) as the decode launcher does;
    K is compared in the rotated basis; ``sinks`` ``[Hq]`` adds one logit per head to the softmax
    denominator. Returns ``[B, Hq, D]``.
    """
    b, hq, d = query.shape
    if key.dim() != 4 or key.shape[0] != b or key.shape[3] != d or value.shape != key.shape:
        raise ValueError(
            f"key: expected [B={b}, N, Hk, D={d}] matching value, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    n, hk = key.shape[1], key.shape[2]
    if hq % hk != 0:
        raise ValueError(f"query: expected a head count that is a multiple of {hk}, got {hq}")
    q = query.to(torch.float32) @ hadamard_matrix(d, query.device).T
    q = q.to(torch.float8_e4m3fn).to(torch.float32)

    def expand(t: torch.Tensor) -> torch.Tensor:
        # [B, Hk, N, D] → [B, Hq, N, D], each KV head serving its query-head group.
        return t.unsqueeze(2).expand(b, hk, hq // hk, n, d).reshape(b, hq, n, d)

    k = expand(
        ultraquant_encode_decode(
            key.transpose(1, 2).contiguous(), rotate=True, constant_c=constant_c
        )
    )
    v = expand(
        ultraquant_encode_decode(
            value.transpose(1, 2).contiguous(), rotate=False, constant_c=constant_c
        )
    )
    logits = torch.einsum("bhd,bhnd->bhn", q, k) * scale
    if sinks is not None:
        sink = sinks.to(torch.float32).reshape(1, hq, 1).expand(b, hq, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :n]
    else:
        probs = torch.softmax(logits, dim=-1)
    return torch.einsum("bhn,bhnd->bhd", probs, v).to(query.dtype)
