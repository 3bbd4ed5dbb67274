"""UltraQuant's FlyDSL decode at upstream's path: the routing rule between upstream's FlyDSL
D=256 decode (a ROCm gfx950 kernel) and the unified Triton path, and the launcher's name.

This library ships no FlyDSL kernel, so :func:`is_ultraquant_flydsl_available` is False and the
UltraQuant backend's decode always takes the unified path
(:func:`~vllm.v1.attention.ops.ultraquant.triton_unified_attention.ultraquant_unified_attention`);
:func:`ultraquant_flydsl_decode_eligible` is upstream's rule, which the backend applies as
upstream does.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "flydsl_ultraquant_decode_attention",
    "is_ultraquant_flydsl_available",
    "ultraquant_flydsl_decode_eligible",
]

ULTRAQUANT_FLYDSL_GQA = (6, 8, 16)
"""Query heads per KV head the FlyDSL kernel serves."""

ULTRAQUANT_FLYDSL_HEAD_SIZE = 256
"""The one head size the FlyDSL kernel serves."""


def is_ultraquant_flydsl_available() -> bool:
    """Whether the FlyDSL UltraQuant decode kernel can run in this process: never here (the
    library ships no FlyDSL kernel; FlyDSL itself is ROCm-only)."""
    return False


def ultraquant_flydsl_decode_eligible(
    *,
    head_size: int,
    num_kv_groups: int,
    has_sinks: bool,
    sliding_window: int | None,
    flydsl_loaded: bool,
) -> bool:
    """Whether a layer's decode goes to the FlyDSL kernel (upstream's rule): FlyDSL loaded,
    head size 256, 6, 8 or 16 query heads per KV head, no sinks and no sliding window (a
    window of 0 or less counts as none). Everything else takes the unified Triton path."""
    return (
        flydsl_loaded
        and head_size == ULTRAQUANT_FLYDSL_HEAD_SIZE
        and num_kv_groups in ULTRAQUANT_FLYDSL_GQA
        and not has_sinks
        and not (sliding_window is not None and sliding_window > 0)
    )


def flydsl_ultraquant_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    PiT: torch.Tensor | None = None,  # noqa: N803  (upstream's name)
    max_seq_len: int = 0,
    output_buf: torch.Tensor | None = None,
    buf_holder: Any = None,
    max_num_kv_splits: int = 32,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upstream's FlyDSL decode launcher (signature kept for its callers). ``RuntimeError``
    whenever :func:`is_ultraquant_flydsl_available` is False, i.e. always in this library:
    route decodes with :func:`ultraquant_flydsl_decode_eligible` instead."""
    raise RuntimeError(
        "flydsl_ultraquant_decode_attention: the FlyDSL UltraQuant decode is not available "
        "(this library ships no FlyDSL kernel); use ultraquant_unified_attention"
    )
