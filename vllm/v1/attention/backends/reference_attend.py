"""The reference backend's torch pieces: the compiled writer when it is built, gathering a
sequence's pages, and fp32 attention over gathered keys and values."""

from __future__ import annotations

from typing import Any

import torch

from vllm.kv_quant.kv_scale import kv_scale_as_1d

__all__ = ["attend_fp32", "check_codec_write", "compiled_writer", "gather_pages"]

_SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def gather_pages(side: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Copy pages ``pages`` of a cache side ``(B, N, H, F)`` into a new ``(p, N, H, F)`` tensor
    whose pages keep the side's byte order within a page (NHD or HND), so that the NVFP4
    ``[data | scales]`` split still applies."""
    inner = sorted(range(1, 4), key=lambda d: (side.shape[d] != 1, side.stride(d)), reverse=True)
    perm = [0, *inner]
    gathered = side.permute(perm).index_select(0, pages)
    return gathered.permute([perm.index(d) for d in range(4)])


def compiled_writer() -> Any | None:
    """``vllm._custom_ops.reshape_and_cache_flash`` when the extension is built, else None."""
    try:
        from vllm import _custom_ops as ops

        fn = getattr(ops, "reshape_and_cache_flash", None)
        if fn is None:
            return None
        if getattr(ops, "is_available", None) is not None and not ops.is_available():
            return None
        return fn
    except (ImportError, OSError, RuntimeError):
        return None


def check_codec_write(
    key: torch.Tensor,
    value: torch.Tensor,
    head_sizes: tuple[int, int],
    cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """What the reference codecs would find only after writing the keys, checked before any
    byte (the compiled writer checks everything first itself): ``key [T_pad, H, D]`` and
    ``value [T_pad, H, Dv]`` in one float dtype on the cache's device, ``H`` the cache's
    heads; ``scales`` (``k_scale``, ``v_scale``; None where the format reads none) by the
    scale rule."""
    heads = cache.shape[2]
    for name, x, size in (("key", key, head_sizes[0]), ("value", value, head_sizes[1])):
        tokens = "T_pad" if name == "key" else f"T_pad = {key.shape[0]}"
        if list(x.shape[1:]) != [heads, size] or x.shape[0] != key.shape[0]:
            raise ValueError(f"{name}: expected shape [{tokens}, {heads}, {size}], got "
                             f"{list(x.shape)}")  # fmt: skip
        if x.dtype not in _SOURCE_DTYPES or x.dtype != key.dtype:
            raise ValueError(
                f"{name}: expected dtype float32, float16 or bfloat16 (the key's), got {x.dtype}"
            )
        if x.device != cache.device:
            raise ValueError(f"{name}: expected device {cache.device} (the cache's), got "
                             f"{x.device}")  # fmt: skip
    for name, scale in zip(("k_scale", "v_scale"), scales or (), strict=False):
        kv_scale_as_1d(scale, name, heads)


def attend_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_sqrt: bool = False,
    qq_bias: torch.Tensor | None = None,
    rswa: tuple[int, int] | None = None,
) -> torch.Tensor:
    """fp32 attention of ``q [q, Hq, D]`` at positions ``q_pos`` over ``k [k, Hkv, D]``,
    ``v [k, Hkv, Dv]`` at ``key_pos``: GQA (query head ``h`` reads KV head
    ``h // (Hq // Hkv)``), causal and sliding-window masks (the query at ``p`` sees keys in
    ``(p - W, p]``), a logits soft cap, and per-head logit ``sinks`` added to each softmax
    denominator. Returns ``[q, Hq, Dv]`` fp32.

    Score biases after the soft cap, the queries being consecutive from ``c = q_pos[0]``:
    ALiBi ``alibi_slopes [Hq]`` times ``key - c`` (``alibi_sqrt``: ``-sqrt(query - key)`` for
    keys at or before the query, else 0); ``qq_bias [>= q, C]`` adds ``qq_bias[i, key - c]``
    to query ``i``'s score of the keys ``c .. c + C - 1``. ``rswa (prefix_len, window)``:
    keys below ``prefix_len`` stay visible, the others only within ``window`` keys of the
    query, in place of ``sliding_window``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(torch.float32), k) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    delta = q_pos[:, None] - key_pos[None, :]  # query position - key position
    scores = scores + _position_bias(q_pos, key_pos, alibi_slopes, alibi_sqrt, qq_bias)
    allowed = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        allowed &= delta >= 0
    if rswa is not None:
        allowed &= (key_pos[None, :] < rswa[0]) | (delta < rswa[1])
    elif sliding_window is not None:
        allowed &= delta < sliding_window
        if not causal:
            allowed &= delta > -sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(device=scores.device, dtype=torch.float32)
        sink = sink[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def _position_bias(
    q_pos: torch.Tensor,
    key_pos: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    alibi_sqrt: bool,
    qq_bias: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 ``[Hq or 1, q, k]`` bias of :func:`attend_fp32`'s ALiBi and q/q-bias scores."""
    bias = torch.zeros(1, q_pos.shape[0], key_pos.shape[0], device=q_pos.device)
    rel = (key_pos - q_pos[0]).to(q_pos.device)  # key minus the first query's position
    if alibi_slopes is not None:
        if alibi_sqrt:
            back = (q_pos[:, None] - key_pos[None, :]).float()
            offset = torch.where(back >= 0, -back.clamp(min=0).sqrt(), 0.0)
        else:
            offset = rel.float()[None, :].expand(q_pos.shape[0], -1)
        bias = bias + alibi_slopes.float().to(q_pos.device)[:, None, None] * offset
    if qq_bias is not None:
        cols = (rel >= 0) & (rel < qq_bias.shape[1])
        rows = qq_bias[: q_pos.shape[0]].float().to(q_pos.device)
        picked = rows[:, rel.clamp(0, qq_bias.shape[1] - 1)] * cols
        bias = bias + picked[None]
    return bias
