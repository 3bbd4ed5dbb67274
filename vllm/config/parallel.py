"""Parallelism settings the KV-cache functions read (upstream's ``ParallelConfig``, reduced)."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["ParallelConfig"]


@dataclass
class ParallelConfig:
    """World sizes (ranks). With decode / prefill context parallelism each rank keeps
    ``cdiv(max_model_len, dcp * pcp)`` tokens of a full-attention layer."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{f.name}: expected a positive int (ranks), got {value!r}")
