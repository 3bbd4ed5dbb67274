"""The four TurboQuant ``kv_cache_dtype`` formats in the registry (:mod:`vllm.kv_quant.formats`).

Their pages hold one packed K+V slot per (token, KV head), ``slot_size_aligned`` bytes, where
the registry's rows are per side (K and V each): the row is half the slot, so that the two-sided
page math (``2 * block_size * H * row``) gives the packed page's bytes, as upstream's spec does
with ``state_content_bytes = slot_size_aligned``. No compiled or Triton cache writer takes them
yet (``cache_kind=None``): :func:`~vllm.kv_quant.formats.kernel_cache_kind` refuses them.
"""

from __future__ import annotations

from functools import partial

import torch

from vllm.kv_quant.formats import KVCacheFormat, register_format
from vllm.kv_quant.modes import KVQuantMode
from vllm.kv_quant.turboquant.config import TURBOQUANT_MODES, TurboQuantConfig, preset_name

__all__ = ["TURBOQUANT_FORMATS", "turboquant_row_dim"]


def turboquant_row_dim(mode: KVQuantMode, head_size: int) -> int:
    """Bytes per head per side: half the ``slot_size_aligned`` of preset ``mode``."""
    if head_size <= 0:
        raise ValueError(f"head_size: expected a positive head size, got {head_size}")
    return TurboQuantConfig.from_cache_dtype(preset_name(mode), head_size).slot_size_aligned // 2


TURBOQUANT_FORMATS: tuple[KVCacheFormat, ...] = tuple(
    register_format(
        KVCacheFormat(
            name=preset_name(mode),
            accepted_names=(preset_name(mode),),
            storage_dtype=torch.uint8,
            quant_mode=mode,
            label=preset_name(mode).replace("turboquant", "tq"),
            row_dim=partial(turboquant_row_dim, mode),
            cache_kind=None,
            has_kernel=False,
        )
    )
    for mode in TURBOQUANT_MODES
)
"""``turboquant_k8v4``, ``turboquant_4bit_nc``, ``turboquant_k3v4_nc``, ``turboquant_3bit_nc``."""
