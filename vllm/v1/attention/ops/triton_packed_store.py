"""The Triton store of a packed-slot format in the backends' store signature
``store(key, value, kv_cache, slot_mapping)`` (``[N, H, D]`` K and V into a ``(num_blocks,
block_size, H, slot bytes)`` uint8 cache; negative slots skipped): TurboQuant's presets through
:func:`~vllm.v1.attention.ops.triton_turboquant_store.triton_turboquant_store` with the format's
tables, ``ultraquant_4bit`` through its Triton slot store after the codec's key rotation, Octave
through :func:`~vllm.v1.attention.ops.triton_octave_store.triton_octave_store`. The backends write
with it on a GPU the extension has no kernel for; the bytes are the codec's (the stores' tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm.kv_quant.formats import KVCacheFormat
from vllm.kv_quant.octave import OctaveFormat
from vllm.kv_quant.turboquant.centroids import turboquant_tables
from vllm.kv_quant.turboquant.config import TurboQuantConfig
from vllm.kv_quant.ultraquant import DEFAULT_CONSTANT_C
from vllm.kv_quant.ultraquant_codec import rotate_keys
from vllm.v1.attention.ops.triton_octave_store import triton_octave_store
from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store
from vllm.v1.attention.ops.ultraquant.triton_slot_store import triton_ultraquant_store

__all__ = ["triton_packed_store"]

Store = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def triton_packed_store(fmt: KVCacheFormat, head_size: int, rope_dim: int) -> Store:
    """The Triton store of the packed-slot format ``fmt`` for heads of ``head_size`` (Octave:
    ``rope_dim`` rotary dims, the codec's). Arguments are the caller's to check (the backends
    check them before any store); the tables follow the cache to its device."""
    mode = fmt.quant_mode
    if mode.is_octave:
        geometry = OctaveFormat.from_cache_dtype(fmt.name, head_size, rope_dim)

        def octave(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
            triton_octave_store(k, v, c.transpose(1, 2), s, geometry)

        return octave
    if mode.is_ultraquant:

        def ultraquant(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
            slots = s.to(device=c.device, dtype=torch.int64)
            triton_ultraquant_store(rotate_keys(k), v, c, slots, DEFAULT_CONSTANT_C)

        return ultraquant
    cfg = TurboQuantConfig.from_cache_dtype(fmt.name, head_size)
    tables = turboquant_tables(head_size, cfg.centroid_bits)
    on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def turboquant(k: torch.Tensor, v: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> None:
        if c.device not in on_device:  # copied once, not on every step
            on_device[c.device] = tables.rotation.to(c.device), tables.midpoints.to(c.device)
        pit, mids = on_device[c.device]
        triton_turboquant_store(
            k, v, c, s, pit, mids, cfg.key_mse_bits, cfg.key_packed_size, cfg.value_quant_bits,
            cfg.key_fp8,
        )  # fmt: skip

    return turboquant
