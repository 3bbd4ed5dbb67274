"""Helpers shared by the KV-cache tests (importable from any test: ``tests/`` is on
``sys.path`` through ``tests/conftest.py``)."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ),
]
"""``device`` parameters: CPU, and CUDA (skipped without a GPU)."""


def dsv4_spec(ratio: int) -> MLAAttentionSpec:
    """A DeepSeek-V4 compressed latent spec (docs/design.md §4/§7 worked example): 256-token
    pages of ``fp8_ds_mla`` records compressed ``ratio``x, 576-byte page alignment."""
    return MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.uint8,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        cache_dtype_str="fp8_ds_mla",
        compress_ratio=ratio,
        alignment=576,
    )
