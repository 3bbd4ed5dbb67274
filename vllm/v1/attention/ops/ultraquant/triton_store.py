"""``ultraquant_store``: writes K/V rows into an ``ultraquant_4bit`` paged cache (upstream's
``vllm.v1.attention.ops.ultraquant.triton_store`` entry point and signature).

The bytes are the reference codec's (:mod:`.reference`), written from keys rotated by the
codec's own matmul by the extension's compiled store (``_C_cache_ops::ultraquant_store``, CPU
and CUDA) where it has a kernel for the cache's device, else on a GPU by the Triton store
(:mod:`.triton_slot_store`), else by the codec, its bytes scattered.
"""

from __future__ import annotations

import torch

from vllm._packed_cache_ops import ultraquant_kernel_store
from vllm.kv_quant.ultraquant import DEFAULT_CONSTANT_C
from vllm.kv_quant.ultraquant_codec import rotate_keys
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.ops.ultraquant.format import check_paged_cache
from vllm.v1.attention.ops.ultraquant.reference import ultraquant_encode
from vllm.v1.attention.ops.ultraquant.triton_slot_store import triton_ultraquant_store

__all__ = ["ultraquant_store"]

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def ultraquant_store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    PiT: torch.Tensor | None = None,  # noqa: N803  (upstream's name; unused, as upstream's)
    constant_c: float | None = None,
) -> None:
    """Encode ``key``/``value`` ``[N, Hk, D]`` and write token ``i``'s slot bytes (K codes, K
    scales, V codes, V scales; ``slot_size(D)`` bytes per head) at cache slot
    ``slot_mapping[i]`` (``block * block_size + offset``); negative slots are skipped. Bytes of a
    slot past ``slot_size(D)`` (alignment padding) are left alone."""
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key: expected [N, Hk, D] with value the same shape, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if key.dtype not in _INPUT_DTYPES or value.dtype != key.dtype:
        raise TypeError(
            f"key: expected float16, bfloat16 or float32 (value alike), got {key.dtype} and "
            f"{value.dtype}"
        )
    n, hk, d = key.shape
    check_paged_cache(kv_cache, hk, d)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != n or slot_mapping.is_floating_point():
        raise ValueError(
            f"slot_mapping: expected {n} integer slots, got {tuple(slot_mapping.shape)} "
            f"{slot_mapping.dtype}"
        )
    num_blocks, block_size = kv_cache.shape[:2]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.int64)
    keep = slots >= 0
    if bool((slots[keep] >= num_blocks * block_size).any()):
        raise ValueError(
            f"slot_mapping: expected slots below {num_blocks * block_size}, got {int(slots.max())}"
        )
    c = DEFAULT_CONSTANT_C if constant_c is None else constant_c
    if ultraquant_kernel_store(key, value, kv_cache, slots, c):
        return
    if kv_cache.is_cuda and HAS_TRITON and kv_cache.stride(3) == 1:
        triton_ultraquant_store(rotate_keys(key), value, kv_cache, slots, c)
        return
    k = ultraquant_encode(key, rotate=True, constant_c=constant_c)
    v = ultraquant_encode(value, rotate=False, constant_c=constant_c)
    rows = torch.cat([k.codes_packed, k.scale_bytes, v.codes_packed, v.scale_bytes], dim=-1)
    slots = slots[keep]
    kv_cache[slots // block_size, slots % block_size, :, : rows.shape[-1]] = rows[keep].to(
        kv_cache.device
    )
