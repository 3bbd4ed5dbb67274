"""Argument checks of the Triton KV-cache writers (:mod:`.triton_reshape_and_cache_flash`): the
compiled op's rules and messages (``csrc/cache_ops_torch.cpp``), raised as its ``RuntimeError``."""

from __future__ import annotations

import torch

__all__ = [
    "check",
    "check_paged",
    "check_slot_mapping",
    "check_source",
    "check_sources",
    "dtype_name",
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check(ok: bool, message: str) -> None:
    """The compiled op's error type (TORCH_CHECK raises RuntimeError)."""
    if not ok:
        raise RuntimeError(message)


def check_slot_mapping(slot_mapping: object, tokens_padded: int, num_slots: int) -> None:
    """The slot_mapping rules of csrc/cache_ops_torch.cpp and, for CPU tensors, the CPU op's
    range check (a CUDA op skips slots >= num_slots instead of syncing to check them)."""
    check(
        isinstance(slot_mapping, torch.Tensor),
        f"slot_mapping: expected a torch.Tensor, got {type(slot_mapping).__name__}",
    )
    assert isinstance(slot_mapping, torch.Tensor)
    check(
        slot_mapping.dtype == torch.int64,
        f"slot_mapping: expected dtype int64, got {dtype_name(slot_mapping.dtype)}",
    )
    check(
        slot_mapping.dim() == 1,
        f"slot_mapping: expected a 1-D tensor [T], got shape {list(slot_mapping.shape)}",
    )
    check(
        slot_mapping.shape[0] <= 1 or slot_mapping.stride(0) == 1,
        f"slot_mapping: expected a contiguous tensor, got stride {slot_mapping.stride(0)}",
    )
    check(
        slot_mapping.shape[0] <= tokens_padded,
        f"slot_mapping: expected at most T_pad = key.size(0) = {tokens_padded} entries, "
        f"got {slot_mapping.shape[0]}",
    )
    if slot_mapping.device.type == "cpu" and slot_mapping.numel() > 0:
        bad = (slot_mapping >= num_slots).nonzero()
        if bad.numel() > 0:
            i = int(bad[0, 0])
            raise RuntimeError(
                f"slot_mapping: expected slots < num_blocks * block_size = {num_slots} "
                f"(negative to skip a token), got slot_mapping[{i}] = {int(slot_mapping[i])}"
            )


def check_source(x: object, name: str) -> torch.Tensor:
    """key / value: [T_pad, H, D] float, each token's [H, D] contiguous (csrc check_source)."""
    check(isinstance(x, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    assert isinstance(x, torch.Tensor)
    check(x.dim() == 3, f"{name}: expected a 3-D tensor [T_pad, H, D], got shape {list(x.shape)}")
    _, heads, dim = x.shape
    dense = (dim <= 1 or x.stride(2) == 1) and (heads <= 1 or x.stride(1) == dim)
    apart = x.shape[0] <= 1 or x.stride(0) >= heads * dim
    check(
        dense and apart,
        f"{name}: expected each token's [H, D] contiguous and tokens at least H*D = "
        f"{heads * dim} elements apart (strides [>= {heads * dim}, {dim}, 1]), got strides "
        f"{list(x.stride())}",
    )
    check(
        x.dtype in (torch.float32, torch.float16, torch.bfloat16),
        f"{name}: expected dtype float32, float16 or bfloat16, got {dtype_name(x.dtype)}",
    )
    return x


def check_sources(key: object, value: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sources checked, value in key's dtype."""
    key, value = check_source(key, "key"), check_source(value, "value")
    check(
        value.dtype == key.dtype,
        f"value: expected dtype {dtype_name(key.dtype)} (key's dtype), "
        f"got {dtype_name(value.dtype)}",
    )
    return key, value


def check_paged(cache: torch.Tensor, name: str, lead: list[int], last: int) -> None:
    """``cache`` is ``[*lead, last]`` with a contiguous last dim (any other strides)."""
    check(
        list(cache.shape) == [*lead, last] and (last <= 1 or cache.stride(-1) == 1),
        f"{name}: expected shape {[*lead, last]} with a contiguous last dim, got shape "
        f"{list(cache.shape)} and strides {list(cache.stride())}",
    )
