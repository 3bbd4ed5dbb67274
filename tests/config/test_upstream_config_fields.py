"""The config fields and hooks the v0.33 backends read: TurboQuant's split count, the query heads
per tensor-parallel rank, and a backend's preferred page size."""

from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

from vllm.config.attention import AttentionConfig
from vllm.config.model import ModelConfig
from vllm.config.parallel import ParallelConfig
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.reference import ReferenceAttentionBackend


def test_turboquant_split_count_defaults_to_upstreams() -> None:
    assert AttentionConfig().tq_max_kv_splits_for_cuda_graph == 32


def test_query_heads_per_rank() -> None:
    model = ModelConfig(hf_config=SimpleNamespace(num_attention_heads=32))
    assert model.get_num_attention_heads(ParallelConfig(tensor_parallel_size=4)) == 8
    assert model.get_num_attention_heads(ParallelConfig()) == 32
    layer = SimpleNamespace(num_attention_heads=2)
    assert model.get_num_attention_heads(ParallelConfig(tensor_parallel_size=4), layer) == 1


class _Pages64(ReferenceAttentionBackend):
    supported_kernel_block_sizes: ClassVar[list[int | MultipleOf]] = [64, MultipleOf(128)]


def test_preferred_block_size_keeps_a_size_the_kernels_take() -> None:
    assert ReferenceAttentionBackend.get_preferred_block_size(16) == 16
    assert _Pages64.get_preferred_block_size(128) == 128
    assert _Pages64.get_preferred_block_size(16) == 64
