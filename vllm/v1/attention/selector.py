"""What the attention selector is asked, at upstream vLLM's path (``vllm.v1.attention.selector``).

:class:`AttentionSelectorConfig` gathers one layer's needs: its fields are the arguments of
:meth:`AttentionBackend.validate_configuration
<vllm.v1.attention.backend.AttentionBackend.validate_configuration>` other than the device, so
``backend.validate_configuration(device_capability=..., **config._asdict())`` asks a backend
whether it serves the layer. The selector itself is
:func:`~vllm.v1.attention.backends.registry.get_attn_backend`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm.v1.attention.backend import AttentionType

__all__ = ["AttentionSelectorConfig"]


class AttentionSelectorConfig(NamedTuple):
    """One layer's attention needs (upstream's fields and defaults). Unlike upstream's,
    ``kv_cache_dtype`` and ``block_size`` are required values, never ``None``: validation here
    checks them."""

    head_size: int
    dtype: torch.dtype
    kv_cache_dtype: str
    block_size: int
    use_mla: bool = False
    has_sink: bool = False
    use_sparse: bool = False
    use_mm_prefix: bool = False
    use_per_head_quant_scales: bool = False
    attn_type: str = AttentionType.DECODER
    has_sliding_window: bool = False
    use_non_causal: bool = False
    use_batch_invariant: bool = False
    use_kv_connector: bool = False
    use_pcp: bool = False
    use_adaptive_verification: bool = False
    use_dcp: bool = False
    use_rswa: bool = False
