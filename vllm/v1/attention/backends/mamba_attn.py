"""Metadata shared by the Mamba (state-space) layers' backends, in upstream's names.

A Mamba layer's "KV cache" is one state row per request (``MambaSpec``); its metadata says which
requests are decodes (one new token, the state is advanced in place) and which are prefills
(a chunk of tokens, possibly starting from a saved state), and which state rows they use. The
kernels that read it belong to the model's backends, not to this library; the builder base
keeps what every such backend derives from the configs.
"""

from __future__ import annotations

from abc import ABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch

from vllm.config.compilation import AttentionCGSupport
from vllm.v1.attention.backend_metadata import AttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MambaSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = ["BaseMambaAttentionMetadata", "BaseMambaAttentionMetadataBuilder"]

M = TypeVar("M")


@dataclass
class BaseMambaAttentionMetadata:
    """One batch of a Mamba group, decodes first. Counts are requests or tokens as named;
    ``*_p`` tensors cover the prefills, ``*_d`` the decodes; ``state_indices_tensor_*`` hold
    each request's state-row index (decodes: one per speculative position)."""

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_reqs: int
    has_initial_states_p: torch.Tensor | None
    query_start_loc_p: torch.Tensor | None
    state_indices_tensor_p: torch.Tensor | None
    state_indices_tensor_d: torch.Tensor | None
    query_start_loc_d: torch.Tensor | None
    num_accepted_tokens: torch.Tensor | None
    seq_lens: torch.Tensor
    cu_chunk_seqlen_p: torch.Tensor | None = None
    last_chunk_indices_p: torch.Tensor | None = None
    nums_dict: dict | None = None
    batch_ptr: torch.Tensor | None = None
    token_chunk_offset_ptr: torch.Tensor | None = None


class BaseMambaAttentionMetadataBuilder(AttentionMetadataBuilder[M], ABC):
    """Base of Mamba metadata builders: one-token queries are decodes (the speculative
    tokens' queries too, when drafting), decode batches up to ``decode_cudagraph_max_bs``
    requests replay a CUDA graph."""

    kv_cache_spec: MambaSpec
    metadata_cls: type[M]
    reorder_batch_threshold: int = 1
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    supports_update_block_table: bool = True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError(
                f"kv_cache_spec: expected a MambaSpec, got {type(kv_cache_spec).__name__}"
            )
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.num_spec_tokens = vllm_config.num_speculative_tokens
        self.use_spec_decode = self.num_spec_tokens > 0
        if self.use_spec_decode:
            # A request's draft tokens are one decode query.
            self.reorder_batch_threshold = 1 + self.num_spec_tokens
            # Accepted-token counts change the rows each step: rebuild, never patch tables.
            self.supports_update_block_table = False
        assert vllm_config.scheduler_config is not None  # set by VllmConfig
        self.decode_cudagraph_max_bs = vllm_config.scheduler_config.max_num_seqs
