"""Key sinks: the first keys of each page kept again in FP8, inside the page.

Most heads put much of their attention on the first token of a sequence (the attention sink), so
its score is the largest and an error in its key moves every other weight. 4-bit codes give it
the same relative error as any key; FP8 (3 mantissa bits instead of 1) takes that error out
(measured with pre-RoPE NVFP4 keys, :mod:`vllm.kv_quant.key_rope`, in docs/accuracy.md; a
simulation found FP8 as good as an exact key).

The rows are ``[num_blocks, S, H, D]`` FP8 E4M3 bytes: page ``b``'s first ``S`` keys, in the
form the page holds them (offset, pre-RoPE), at the FP8 scale of the page's own K scale
(:func:`key_sink_scale`). They sit in the page after its K and V rows (docs/formats.md §5), so a
sequence's first page carries its sinks wherever the page goes (prefix caching, ``swap_blocks``,
offload tiers, transfers); the reader uses them only for positions ``< S`` of a sequence, i.e.
from the sequence's first page. Cost: ``S * H * D`` bytes per page, ``S / block_size`` FP8 bytes
per key value (0.5 bit per K value at 16-token pages and ``S = 1``). The functions here take the
rows as a ``[num_blocks, S, H, D]`` tensor (in a cache, a strided view into its pages).
"""

from __future__ import annotations

import torch

from vllm.kv_quant.fp8 import Fp8Format, dequantize_fp8, quantize_fp8
from vllm.kv_quant.nvfp4_cache import check_slot_mapping

__all__ = ["key_sink_scale", "read_key_sinks", "write_key_sinks"]

_E4M3 = Fp8Format("e4m3")


def key_sink_scale(k_scale: torch.Tensor, multiplier: float) -> torch.Tensor:
    """The FP8 e4m3 scale of the sink rows of a cache whose K scale is ``k_scale``:
    ``k_scale * multiplier`` in fp32, the multiplier being the format's scale maximum over
    448 (:attr:`~vllm.kv_quant.encoding.KVCacheEncoding.sink_scale_multiplier`: 1 for FP8 e4m3,
    6 for NVFP4, whose global scale is ``amax / (448 * 6)``), so that the rows span the amax
    the K scale was calibrated on."""
    return k_scale.to(torch.float32) * multiplier


def _check_rows(sinks: torch.Tensor) -> None:
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 4 or sinks.dtype != torch.uint8:
        got = f"{sinks.dtype} {list(sinks.shape)}" if isinstance(sinks, torch.Tensor) else sinks
        raise ValueError(f"key_sinks: expected a uint8 [num_blocks, S, H, D] tensor, got {got}")


def write_key_sinks(
    sinks: torch.Tensor,
    key: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
    scale: torch.Tensor,
) -> None:
    """Store the keys ``key [T_pad, H, D]`` (as written to the pages) of the slots of
    ``slot_mapping [T]`` that are among the first ``S`` of their page into ``sinks``, FP8 E4M3
    at ``scale`` (:func:`key_sink_scale`). Negative slots are skipped."""
    _check_rows(sinks)
    num_blocks, rows, heads, head_size = sinks.shape
    if key.dim() != 3 or tuple(key.shape[1:]) != (heads, head_size):
        raise ValueError(
            f"key: expected [T, {heads}, {head_size}] like the key sinks, got {list(key.shape)}"
        )
    check_slot_mapping(slot_mapping, key.shape[0], num_blocks * block_size, sinks.device)
    offset = slot_mapping % block_size
    keep = (slot_mapping >= 0) & (offset < rows)
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep]
    codes = quantize_fp8(key[: slot_mapping.shape[0]][keep].to(torch.float32), scale, _E4M3)
    sinks[slots // block_size, slots % block_size] = codes


def read_key_sinks(
    sinks: torch.Tensor, first_pages: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """fp32 ``[num_seqs, S, H, D]``: the sink rows of the pages ``first_pages [num_seqs]`` (each
    sequence's first page), dequantized at ``scale``."""
    _check_rows(sinks)
    pages = first_pages.to(device=sinks.device, dtype=torch.int64)
    return dequantize_fp8(sinks[pages], scale, _E4M3, torch.float32)
