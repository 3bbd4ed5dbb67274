"""The arguments of upstream vLLM's CPU attention ops (``cpu_attn_reshape_and_cache``,
``cpu_attn_get_scheduler_metadata``, ``cpu_attention_with_kv_cache`` in :mod:`vllm._custom_ops`,
served by this library's CPU kernels) turned into the kernels' own, and the scheduler metadata.

Their cache is upstream's CPU layout: one side per tensor, ``[num_blocks, num_kv_heads,
block_size, head_size]`` (any strides but the last), which is this library's HND layout seen
through a transpose, so the writer is :func:`vllm._custom_ops.reshape_and_cache_flash` and the
reader :func:`vllm._custom_ops.paged_attention`, bit for bit the same bytes and sums as every
other path. ``isa`` takes every name upstream's ISA choice returns; the kernels then run at the
widest instruction set this build and CPU have, whatever the name (no name needs its hardware).
The scheduler metadata is a small int32 tensor recording the call's geometry and choices (key
split or not); the attention op refuses metadata made for another geometry, and plans its work
itself.
"""

from __future__ import annotations

import torch

CPU_ATTN_ISAS = ("amx", "amx_fp8", "vec", "vec16", "neon", "vxe", "rvv", "vsx")
"""The ISA names of upstream's CPU attention ops, all accepted."""

_MAGIC = 0x4B56434D
_FIELDS = (
    "magic",
    "num_reqs",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "causal",
    "sliding_window",
    "isa",
    "enable_kv_split",
    "dynamic_causal",
)


def check_isa(isa: str) -> int:
    """The index of ``isa`` in :data:`CPU_ATTN_ISAS`; ``ValueError`` for another name."""
    if isa not in CPU_ATTN_ISAS:
        raise ValueError(f"isa: expected one of {', '.join(CPU_ATTN_ISAS)}, got {isa!r}")
    return CPU_ATTN_ISAS.index(isa)


def window_arg(name: str, sliding_window: int) -> int | None:
    """Upstream's window argument (``-1``: none) as the kernels' (``None``: none)."""
    if sliding_window == -1 or sliding_window == 0:
        return None
    if sliding_window < 0:
        raise ValueError(f"{name}: expected a window in tokens or -1 (none), got {sliding_window}")
    return int(sliding_window)


def scale_arg(value: float) -> torch.Tensor:
    """Upstream's per-tensor float scale as the kernels' fp32 ``[1]`` tensor."""
    return torch.tensor([float(value)], dtype=torch.float32)


def cache_view(cache: torch.Tensor, name: str) -> torch.Tensor:
    """``[num_blocks, num_kv_heads, block_size, D]`` as the kernels' ``[num_blocks, block_size,
    num_kv_heads, D]`` (the same memory)."""
    if cache.dim() != 4:
        raise ValueError(
            f"{name}: expected a 4-D tensor [num_blocks, num_kv_heads, block_size, head_size], "
            f"got shape {tuple(cache.shape)}"
        )
    return cache.transpose(1, 2)


def dynamic_causal_arg(dynamic_causal: torch.Tensor | None, num_reqs: int) -> torch.Tensor | None:
    """Upstream's per-request causality flags as the kernels' int32 ``seq_causal``."""
    if dynamic_causal is None:
        return None
    if dynamic_causal.dtype.is_floating_point or dynamic_causal.shape != (num_reqs,):
        raise ValueError(
            f"dynamic_causal: expected an integer tensor [num_reqs] = [{num_reqs}], got "
            f"{dynamic_causal.dtype} of shape {tuple(dynamic_causal.shape)}"
        )
    return dynamic_causal.to(torch.int32).contiguous()


def cpu_attn_get_scheduler_metadata(
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    causal: bool,
    sliding_window_size: int,
    isa: str,
    enable_kv_split: bool,
    dynamic_causal: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """The metadata :func:`cpu_attention_with_kv_cache` takes for this geometry: int32
    ``[10]`` (a tag, ``num_reqs``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``causal``,
    ``sliding_window_size``, the ISA's index in :data:`CPU_ATTN_ISAS`, ``enable_kv_split``,
    whether ``dynamic_causal`` was given). ``enable_kv_split=False`` keeps each sequence's keys
    of a KV head on one thread."""
    isa_index = check_isa(isa)
    for name, value in (("num_reqs", num_reqs), ("num_heads", num_heads), ("head_dim", head_dim)):
        if value < 0 or (value == 0 and name != "num_reqs"):
            raise ValueError(f"{name}: expected a positive count, got {value}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}"
        )
    if seq_lens.shape != (num_reqs,):
        raise ValueError(
            f"seq_lens: expected shape ({num_reqs},) (num_reqs), got {tuple(seq_lens.shape)}"
        )
    if query_start_loc.shape != (num_reqs + 1,):
        raise ValueError(
            f"query_start_loc: expected shape ({num_reqs + 1},) (num_reqs + 1), got "
            f"{tuple(query_start_loc.shape)}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"dtype: expected the query's floating dtype, got {dtype}")
    window_arg("sliding_window_size", sliding_window_size)
    dynamic_causal_arg(dynamic_causal, num_reqs)
    values = (
        _MAGIC,
        num_reqs,
        num_heads,
        num_kv_heads,
        head_dim,
        int(causal),
        sliding_window_size,
        isa_index,
        int(enable_kv_split),
        int(dynamic_causal is not None),
    )
    return torch.tensor(values, dtype=torch.int32)


def check_metadata(metadata: torch.Tensor, expected: dict[str, int]) -> dict[str, int]:
    """The fields of ``metadata`` (from :func:`cpu_attn_get_scheduler_metadata`); ``ValueError``
    when it is not such a tensor or any of ``expected`` differs."""
    if (
        metadata.dtype != torch.int32
        or metadata.shape != (len(_FIELDS),)
        or int(metadata[0]) != _MAGIC
    ):
        raise ValueError(
            "scheduler_metadata: expected the tensor cpu_attn_get_scheduler_metadata returns, "
            f"got {metadata.dtype} of shape {tuple(metadata.shape)}"
        )
    fields = dict(zip(_FIELDS, (int(v) for v in metadata.tolist()), strict=True))
    for name, value in expected.items():
        if fields[name] != value:
            raise ValueError(
                f"scheduler_metadata: expected metadata made for {name}={value}, got "
                f"{name}={fields[name]}"
            )
    return fields
