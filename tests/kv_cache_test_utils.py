"""Helpers shared by the KV-cache tests (importable from any test: ``tests/`` is on
``sys.path`` through ``tests/conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVQuantMode,
    MLAAttentionSpec,
)

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
        model_version="deepseek_v4",
        compress_ratio=ratio,
        alignment=576,
    )


def attn_spec(**overrides: Any) -> FullAttentionSpec:
    """A bf16 ``FullAttentionSpec`` (16-token pages, 8 KV heads of 128) with ``overrides``."""
    kwargs: dict[str, Any] = dict(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    kwargs.update(overrides)
    return FullAttentionSpec(**kwargs)


def one_group(spec: KVCacheSpec, size: int, layers: tuple[str, ...] = ("l0",)) -> KVCacheConfig:
    """One KV-cache group of ``layers`` with ``spec``, one ``size``-byte tensor per layer."""
    return KVCacheConfig(
        num_blocks=0,
        kv_cache_tensors=[KVCacheTensor(size=size, shared_by=[name]) for name in layers],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )
