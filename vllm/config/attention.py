"""Attention settings the KV-cache planner reads: HiSparse's switch and its options."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttentionConfig", "HiSparseConfig"]


@dataclass
class HiSparseConfig:
    """HiSparse: sparse-MLA KV whose full history lives in host memory, with a bounded set of
    recently used pages ("hot") and the newest pages ("resident") kept on the device."""

    device_buffer_size: int | None = None
    """Per-request device hot-buffer rows (tokens), the newest-token slot included; None: one
    top-k per decode query plus one top-k of slack. Rounded up to whole pages."""

    eager_host_mirror: bool = True
    """Copy decode-written rows to host during the forward (spills then move nothing)."""

    def __post_init__(self) -> None:
        n = self.device_buffer_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
            raise ValueError(f"device_buffer_size: expected an int > 0 (tokens) or None, got {n!r}")


@dataclass
class AttentionConfig:
    """Attention settings the planner and the backends read: HiSparse's and TurboQuant's."""

    hisparse_config: HiSparseConfig | None = None
    """HiSparse options; None: HiSparse is off."""

    tq_max_kv_splits_for_cuda_graph: int = 32
    """TurboQuant's decode split count (key segments per request) under CUDA graphs: fixed so
    that every capture has the same grid, and its stage buffers are reserved for it."""
