"""``ultraquant_unified_attention``: varlen paged attention over an ``ultraquant_4bit`` cache
(upstream's ``vllm.v1.attention.ops.ultraquant.triton_unified_attention`` entry point).

Semantics follow upstream's launcher: Q is rotated (``q @ PiT``, the normalised Hadamard) and
rounded through FP8 E4M3 at unit scale; K is read in the rotated basis it is stored in and V as
stored, both decoded exactly to fp32. Each request's queries are its last ``q_len`` positions,
causal, optionally limited to a sliding window and with one sink logit per head.

The attention runs in the library's packed-slot readers, given the rotated, FP8-rounded query as
already in the key frame: the compiled ``packed_paged_attention`` on the CPU, the fused Triton
packed kernel (``triton_packed_slot_attention``) on a GPU. :func:`reference_unified_attention`
(fp32 torch per request, over the decoded cache) is the definition they are tested against, and
the path where neither runs or the cache's slots are padded (the readers take dense pages).
"""

from __future__ import annotations

import torch

from vllm._extension import compiled_kernel
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.ultraquant.format import slot_size
from vllm.v1.attention.ops.ultraquant.reference import hadamard_matrix
from vllm.v1.attention.ops.ultraquant.triton_dequant import ultraquant_full_dequant_kv

__all__ = ["reference_unified_attention", "ultraquant_unified_attention"]

_DTYPE = "ultraquant_4bit"


def ultraquant_unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    PiT: torch.Tensor | None = None,  # noqa: N803  (upstream's name)
    output: torch.Tensor | None = None,
    tile_size: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    force_2d: bool = False,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention output ``[num_tokens, Hq, D]`` in ``query.dtype`` (written into ``output`` when
    given). ``query`` ``[num_tokens, Hq, D]`` is unrotated; ``query_start_loc`` ``[S + 1]``
    splits it into ``S`` requests of ``seq_lens`` tokens (context included) reading
    ``block_table`` rows. ``tile_size``, ``max_query_len``, ``max_seq_len``, ``num_kv_splits``
    and ``force_2d`` tune upstream's kernel launch only and do not change the result."""
    if query.dim() != 3:
        raise ValueError(f"query: expected [num_tokens, Hq, D], got {tuple(query.shape)}")
    num_tokens, hq, d = query.shape
    hk = kv_cache.shape[2] if kv_cache.dim() == 4 else 0
    if hk == 0 or hq % hk != 0:
        raise ValueError(
            f"query: expected a head count that is a multiple of the cache's KV heads {hk}, "
            f"got {hq}"
        )
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start_loc: expected {len(lens) + 1} offsets from 0 to {num_tokens}, got "
            f"{starts}"
        )
    rot = hadamard_matrix(d, query.device) if PiT is None else PiT.to(torch.float32)
    q = (query.float() @ rot).to(torch.float8_e4m3fn).float()
    out = torch.empty_like(query) if output is None else output
    pages = kv_cache.transpose(1, 2)  # the readers' logical (num_blocks, Hk, block_size, slot)
    metadata = [t.to(kv_cache.device, torch.int32).contiguous()
                for t in (block_table, seq_lens, query_start_loc)]  # fmt: skip
    sinks = None if sinks is None else sinks.float()
    options = dict(sliding_window=sliding_window or None, sinks=sinks, query_in_key_frame=True)
    if kv_cache.shape[-1] != slot_size(d):  # padded slots: pages the readers do not take
        return reference_unified_attention(q, kv_cache, block_table, lens, starts, scale, out,
                                           sinks, sliding_window)  # fmt: skip
    if compiled_kernel("packed_paged_attention", kv_cache.device) is not None:
        from vllm._packed_attention_ops import packed_paged_attention

        packed_paged_attention(out, q, pages, *metadata, _DTYPE, scale, **options)
        return out
    if kv_cache.is_cuda and HAS_TRITON:
        from vllm.v1.attention.ops.triton_slot_attention import triton_packed_slot_attention

        longest_query = max(hi - lo for lo, hi in zip(starts, starts[1:], strict=False))
        longest_seq = max(lens, default=0)
        triton_packed_slot_attention(
            out, q, pages, *metadata, _DTYPE, scale, max_query_len or longest_query,
            max_seq_len or longest_seq, **options,
        )  # fmt: skip
        return out
    return reference_unified_attention(q, kv_cache, block_table, lens, starts, scale, out,
                                       sinks, sliding_window)  # fmt: skip


def reference_unified_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    lens: list[int],
    starts: list[int],
    scale: float,
    out: torch.Tensor,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """:func:`ultraquant_unified_attention` in fp32 torch, request by request, from the rotated
    FP8-rounded query ``q [T, Hq, D]`` (fp32) over the decoded cache, into ``out``."""
    hq, d = q.shape[1], q.shape[2]
    hk = kv_cache.shape[2]
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"seq_lens: expected >= {q_len} for request {i}, got {seq_len}")
        k = torch.empty(1, hk, seq_len, d, dtype=torch.float32, device=q.device)
        v = torch.empty_like(k)
        ultraquant_full_dequant_kv(kv_cache, block_table[i : i + 1], k, v, alloc_len=seq_len)
        group = hq // hk
        k = k[0].repeat_interleave(group, dim=0)  # [Hq, seq_len, D]
        v = v[0].repeat_interleave(group, dim=0)
        logits = torch.einsum("thd,hnd->htn", q[lo:hi], k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window:
            allowed &= (q_pos - k_pos) < sliding_window
        logits = logits.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().reshape(hq, 1, 1).expand(hq, q_len, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :seq_len]
        else:
            probs = torch.softmax(logits, dim=-1)
        out[lo:hi] = torch.einsum("htn,hnd->thd", probs, v).to(out.dtype)
    return out
