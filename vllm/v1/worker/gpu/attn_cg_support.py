"""What the attention groups allow of CUDA graphs, and the KV-sharing fast-prefill inputs (split
out of :mod:`vllm.v1.worker.gpu.attn_utils`, which re-exports every name).

``checked_layer_names`` limits a check to the groups holding one of those layers (adaptive
speculative verification checks only the target model's layers); a group shared by target and
draft layers is checked. Units: lengths and counts in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm.config.compilation import AttentionCGSupport, CUDAGraphMode
from vllm.v1.worker.gpu.attn_groups import AttentionGroup
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

__all__ = [
    "AttentionCGSupportInfo",
    "FastPrefillBatchMetadata",
    "FastPrefillHelper",
    "get_attn_cg_support",
    "get_query_lens_mismatch_unsupported_backend",
    "get_varlen_cudagraph_unsupported_backend",
]


@dataclass(frozen=True)
class AttentionCGSupportInfo:
    """The weakest support among the checked groups and the backend that has it (None when
    every group supports ``ALWAYS``)."""

    min_cg_support: AttentionCGSupport = AttentionCGSupport.ALWAYS
    min_cg_attn_backend: str | None = None

    def narrow(self, support: AttentionCGSupport, backend: str | None) -> AttentionCGSupportInfo:
        """This info, or ``(support, backend)`` when ``support`` is weaker: lets groups built
        outside the runner's group discovery (encoder-only layers) weigh in."""
        if support.value < self.min_cg_support.value:
            return AttentionCGSupportInfo(support, backend)
        return self


def _checked_groups(
    attn_groups: Sequence[Sequence[AttentionGroup]], checked_layer_names: set[str] | None
) -> list[AttentionGroup]:
    return [
        group
        for groups in attn_groups
        for group in groups
        if checked_layer_names is None or not checked_layer_names.isdisjoint(group.layer_names)
    ]


def get_attn_cg_support(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    vllm_config: Any,
    checked_layer_names: set[str] | None = None,
) -> AttentionCGSupportInfo:
    """The weakest CUDA-graph support of the checked groups' first metadata builders."""
    info = AttentionCGSupportInfo()
    for group in _checked_groups(attn_groups, checked_layer_names):
        support = group.get_metadata_builder(0).get_cudagraph_support(
            vllm_config, group.kv_cache_spec
        )
        info = info.narrow(support, group.backend.__name__)
    return info


def get_query_lens_mismatch_unsupported_backend(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    checked_layer_names: set[str] | None = None,
) -> str | None:
    """The first checked backend that needs the host's query lengths to match the device's
    exactly (so cannot run adaptive verification), or None."""
    for group in _checked_groups(attn_groups, checked_layer_names):
        if not group.backend.supports_device_cpu_query_lens_mismatch():
            return group.backend.__name__
    return None


def get_varlen_cudagraph_unsupported_backend(
    attn_groups: Sequence[Sequence[AttentionGroup]],
    vllm_config: Any,
    max_query_len: int,
    checked_layer_names: set[str] | None = None,
) -> tuple[str, int | None] | None:
    """The first checked backend whose full graphs cannot replay decode batches of 1 to
    ``max_query_len`` tokens per request, with the bound its builder reports (None: no
    bound), or None. ``ALWAYS`` builders replay any batch; ``NEVER`` ones none, whatever
    bound they report."""
    for group in _checked_groups(attn_groups, checked_layer_names):
        builder = group.get_metadata_builder(0)
        support = builder.get_cudagraph_support(vllm_config, group.kv_cache_spec)
        if support == AttentionCGSupport.ALWAYS:
            continue
        bound = (
            None
            if support == AttentionCGSupport.NEVER
            else builder.get_varlen_cudagraph_max_query_len(vllm_config, group.kv_cache_spec)
        )
        if bound is None or bound < max_query_len:
            return group.backend.__name__, bound
    return None


@dataclass(frozen=True)
class FastPrefillBatchMetadata:
    """One step's fast-prefill inputs: the logits indices padded to a captured size, how many
    are real, and the most logits of one request."""

    logits_indices_padded: torch.Tensor
    num_logits_indices: int
    max_logits_per_req: int


class FastPrefillHelper:
    """Decides each step whether the KV-sharing fast-prefill path runs (a prefill outside a
    full graph and microbatching) and stages its logits indices in a persistent buffer of
    ``max_num_tokens``. ``cudagraph_manager``: anything with ``device`` and the graph
    manager's ``dispatch(num_reqs=, num_tokens=, uniform_token_count=, num_active_loras=)``."""

    def __init__(self, cudagraph_manager: Any, max_num_tokens: int) -> None:
        if isinstance(max_num_tokens, bool) or not isinstance(max_num_tokens, int):
            raise TypeError(f"max_num_tokens: expected an int, got {type(max_num_tokens).__name__}")
        if max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens: expected a positive int, got {max_num_tokens}")
        self.max_num_tokens = max_num_tokens
        self.cudagraph_manager = cudagraph_manager
        self.logits_indices_buf = torch.zeros(
            max_num_tokens, dtype=torch.int32, device=cudagraph_manager.device
        )

    def prepare(
        self,
        logits_indices: torch.Tensor,
        num_reqs: int,
        cu_num_logits_np: np.ndarray,
        has_prefill: bool,
        batch_desc: BatchExecutionDescriptor,
        num_active_loras: int = 0,
    ) -> FastPrefillBatchMetadata | None:
        """None when the path does not run this step; ``ValueError`` for no logits or more
        than the buffer holds."""
        if (
            not has_prefill
            or batch_desc.cg_mode == CUDAGraphMode.FULL
            or batch_desc.num_ubatches > 1
        ):
            return None
        num_logits = logits_indices.shape[0]
        if not 0 < num_logits <= self.max_num_tokens:
            raise ValueError(
                f"logits_indices: expected 1 to {self.max_num_tokens} indices, got {num_logits}"
            )
        buf = self.logits_indices_buf
        buf[:num_logits].copy_(logits_indices)
        # Rows past the real ones may hold a previous step's indices: repeat the last real
        # one so that a padded row still points into this batch.
        buf[num_logits:] = logits_indices[-1]
        # The sharing layers run only the logits rows: pad them to a captured piecewise size,
        # under the same LoRA variant as the step's main dispatch.
        desc = self.cudagraph_manager.dispatch(
            num_reqs=num_reqs,
            num_tokens=num_logits,
            uniform_token_count=None,
            num_active_loras=num_active_loras,
        )
        return FastPrefillBatchMetadata(
            logits_indices_padded=buf[: min(desc.num_tokens, self.max_num_tokens)],
            num_logits_indices=num_logits,
            max_logits_per_req=int(np.diff(cu_num_logits_np).max()),
        )
