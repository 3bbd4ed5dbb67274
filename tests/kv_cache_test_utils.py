"""Helpers shared by the KV-cache tests (importable from any test: ``tests/`` is on
``sys.path`` through ``tests/conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm.kv_quant.codecs import codec_for
from vllm.kv_quant.formats import CacheKind, formats
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

PER_TOKEN_HEAD_DTYPES: list[str] = [
    f.name
    for f in formats()
    if f.cache_kind in (CacheKind.INT8_PER_TOKEN_HEAD, CacheKind.FP8_PER_TOKEN_HEAD)
    and f.has_kernel
]
"""The registry's per-token-head formats of one byte per value that the kernels write
(``int8_per_token_head``, ``fp8_per_token_head``; INT4 rows, rotated and packed, have their own
tests)."""

SCALED_DTYPES: list[str] = [
    name
    for f in formats()
    if f.has_kernel and f.cache_kind is not None and codec_for(f).reads_kv_scale
    for name in f.accepted_names
]
"""Every accepted name of the formats whose bytes depend on ``k_scale`` / ``v_scale`` (FP8 and
NVFP4: ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ``nvfp4``, ``nvfp4_mse``), aliases included."""

LLAMA_LIKE: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 4096,
}
"""A two-layer Llama config (8 KV heads of 128) for the planner's spec builder."""


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
