"""Parallelism settings the KV-cache functions read (upstream's ``ParallelConfig``, reduced)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["ParallelConfig"]


@dataclass
class ParallelConfig:
    """World sizes (ranks). With decode / prefill context parallelism each rank keeps
    ``cdiv(max_model_len, dcp * pcp)`` tokens of a full-attention layer."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    rank: int = 0
    """This worker's global rank (0-based)."""
    world_size: int = field(init=False)
    """Workers of one engine: pipeline x tensor x prefill-context parallel sizes, set at
    construction (as upstream; decode context parallelism reuses the tensor-parallel ranks)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            low = 0 if f.name == "rank" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                kind = "a non-negative int (rank)" if low == 0 else "a positive int (ranks)"
                raise ValueError(f"{f.name}: expected {kind}, got {value!r}")
        self.world_size = (
            self.pipeline_parallel_size
            * self.tensor_parallel_size
            * self.prefill_context_parallel_size
        )
