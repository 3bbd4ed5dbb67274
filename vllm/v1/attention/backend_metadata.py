"""Per-batch attention metadata and the builder / impl bases (upstream's ``backend.py`` names,
re-exported there).

``CommonAttentionMetadata`` is what a worker hands every layer's metadata builder for one batch:
query offsets, sequence lengths (tokens), the block table and the slot mapping. A builder turns
it into the metadata its impl's ``forward`` reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import numpy as np
import torch

from vllm.config.compilation import AttentionCGSupport

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "AttentionImplBase",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "CommonAttentionMetadata",
]


class AttentionMetadata:
    """Base of the per-layer metadata a builder produces."""


T = TypeVar("T", bound=AttentionMetadata)
M = TypeVar("M")


def _head(values: Any, count: int) -> Any:
    return None if values is None else values[:count]


@dataclass
class CommonAttentionMetadata:
    """One batch, shared by every layer. Lengths are in tokens; ``*_cpu`` tensors mirror
    device ones on the host. ``query_start_loc`` is ``[num_reqs + 1]`` (exclusive prefix sums
    of the query lengths), ``block_table_tensor`` is ``[num_reqs, max_blocks]`` and
    ``slot_mapping`` is ``[num_actual_tokens]``."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None
    max_logits_per_req: int | None = None
    encoder_seq_lens: torch.Tensor | None = None
    encoder_seq_lens_cpu: np.ndarray | None = None
    dcp_local_seq_lens: torch.Tensor | None = None
    dcp_local_seq_lens_cpu_upper_bound: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    """Host copy of ``seq_lens`` that may overstate them (async scheduling)."""
    req_idx: np.ndarray | None = None
    mm_req_doc_ranges: dict[int, list[tuple[int, int]]] | None = None
    rswa_prefix_lens: torch.Tensor | None = None
    replayssm_decode_base_cpu: torch.Tensor | None = None
    _num_computed_tokens_cache: torch.Tensor | None = None

    def batch_size(self) -> int:
        """Requests in the batch."""
        return self.seq_lens.shape[0]

    def naive_query_lens(self) -> torch.Tensor:
        """Query lengths (tokens), assuming each query ends where the next one starts."""
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def replace(self, **changes: Any) -> CommonAttentionMetadata:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)

    def compute_num_computed_tokens(self) -> torch.Tensor:
        """Tokens already in the cache before this step, per request (cached)."""
        if self._num_computed_tokens_cache is None:
            self._num_computed_tokens_cache = self.seq_lens - self.naive_query_lens()
        return self._num_computed_tokens_cache

    def unpadded(self, num_actual_tokens: int, num_actual_reqs: int) -> CommonAttentionMetadata:
        """The batch without its padding: the first ``num_actual_reqs`` requests and
        ``num_actual_tokens`` tokens."""
        for name, value, bound in (
            ("num_actual_reqs", num_actual_reqs, self.num_reqs),
            ("num_actual_tokens", num_actual_tokens, self.num_actual_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
                raise ValueError(f"{name}: expected an int in [0, {bound}], got {value!r}")
        causal = self.causal
        if isinstance(causal, torch.Tensor):
            causal = causal[:num_actual_reqs]
        per_request = {
            name: _head(getattr(self, name), num_actual_reqs)
            for name in (
                "seq_lens",
                "block_table_tensor",
                "encoder_seq_lens",
                "encoder_seq_lens_cpu",
                "dcp_local_seq_lens",
                "dcp_local_seq_lens_cpu_upper_bound",
                "seq_lens_cpu_upper_bound",
                "is_prefilling",
                "req_idx",
                "rswa_prefix_lens",
                "replayssm_decode_base_cpu",
            )
        }
        return replace(
            self,
            query_start_loc=self.query_start_loc[: num_actual_reqs + 1],
            query_start_loc_cpu=self.query_start_loc_cpu[: num_actual_reqs + 1],
            num_reqs=num_actual_reqs,
            num_actual_tokens=num_actual_tokens,
            slot_mapping=self.slot_mapping[:num_actual_tokens],
            causal=causal,
            positions=None,
            mm_req_doc_ranges=None,
            _num_computed_tokens_cache=None,
            **per_request,
        )


class AttentionMetadataBuilder(ABC, Generic[M]):
    """Builds one KV-cache group's per-layer metadata from ``CommonAttentionMetadata``."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    reorder_batch_threshold: int | None = None
    """Longest query (tokens) reordered to the front of the batch as a decode; None: none."""
    supports_update_block_table: bool = False
    requires_block_table_width: ClassVar[bool] = False

    @abstractmethod
    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device

    @classmethod
    def get_cudagraph_support(
        cls, vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec
    ) -> AttentionCGSupport:
        """How far this builder's metadata can be captured in CUDA graphs."""
        return cls._cudagraph_support

    @abstractmethod
    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> M:
        """The metadata of one batch; ``common_prefix_len``: tokens every request shares."""


class AttentionImplBase(ABC, Generic[T]):
    """Base of every attention implementation (standard and MLA)."""
