"""HiSparse's device-side caches (:mod:`vllm.v1.kv_cache_interface` re-exports every name).

HiSparse keeps a sparse-MLA layer's full history in a host pool and on the device only the
newest pages ("resident") plus a bounded set of pages the indexer picked ("hot"). Both are
raw per-request byte pools laid out by HiSparse itself, so they have no per-layer views, no
slot mapping and no prefix cache. ``SparseCacheRole`` marks an MLA layer as the sparse
attention cache or its indexer's key cache.

Units: ``block_size`` is in tokens per page, ``page_size`` and every ``*_bytes`` in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_spec_base import KVCacheSpec, _check_positive, _max_model_len, cdiv

if TYPE_CHECKING:
    from vllm.config.vllm import VllmConfig

__all__ = ["HiSparseHotSpec", "HiSparseResidentSpec", "SparseCacheRole"]


class SparseCacheRole(str, Enum):
    """What a sparse-attention MLA layer's cache holds."""

    SPARSE = "sparse"
    INDEXER = "indexer"


@dataclass(frozen=True, kw_only=True)
class _RawPageSpec(KVCacheSpec):
    """Pages of ``page_size`` bytes that HiSparse lays out itself."""

    page_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "block_size", "page_size")

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    @property
    def has_layer_views(self) -> bool:
        return False

    @property
    def tokens_per_state(self) -> int:
        """The page is one opaque state."""
        return self.block_size


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(_RawPageSpec):
    """A request's hot buffer: ``blocks_per_request`` pages, held only while it runs."""

    blocks_per_request: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "blocks_per_request")

    @property
    def block_table_token_alignment(self) -> int | None:
        return None

    @property
    def uses_slot_mapping(self) -> bool:
        return False

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        return self.blocks_per_request * self.page_size

    def max_num_blocks_per_req(self, vllm_config: VllmConfig, max_len: int) -> int:
        return self.blocks_per_request


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(_RawPageSpec):
    """The newest pages of a request on the device; older ones may be spilled to host."""

    def max_admission_blocks_per_request(
        self, max_in_flight_tokens: int, max_model_len: int
    ) -> int:
        """Pages admitting one request takes: its in-flight tokens, at most the model length."""
        return cdiv(min(max_in_flight_tokens, max_model_len), self.block_size)

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        pages = self.max_admission_blocks_per_request(
            vllm_config.max_in_flight_tokens, _max_model_len(vllm_config)
        )
        return pages * self.page_size
