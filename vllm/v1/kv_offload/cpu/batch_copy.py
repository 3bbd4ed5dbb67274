"""Batch copy functions for address descriptors: ``fn(src, dst, sizes,
is_src_access_order_any=False)`` copies ``sizes[i]`` bytes from address ``src[i]`` to address
``dst[i]`` (int64 CPU tensors of one length) on the current stream.

Upstream v0.33 uses ``vllm._custom_ops.swap_blocks_batch`` (``cuMemcpyBatchAsync``) for DMA and
the Triton kernel of :mod:`~vllm.v1.kv_offload.cpu.swap_blocks_triton` for small pages. This
library's extension has no ``swap_blocks_batch`` yet, so until it does DMA goes through
:func:`swap_blocks_per_descriptor` (``ops.swap_blocks`` once per descriptor), and a KV cache
that lives in host memory (CPU-only machines) copies with :func:`host_swap_blocks_batch`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch


class SwapBlocksBatchFn(Protocol):
    def __call__(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        sizes: torch.Tensor,
        is_src_access_order_any: bool = False,
    ) -> None: ...


def _check_descriptors(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor) -> None:
    for name, t in (("src", src), ("dst", dst), ("sizes", sizes)):
        if t.dtype != torch.int64 or t.dim() != 1 or t.device.type != "cpu":
            raise ValueError(
                f"{name}: expected a 1-D int64 CPU tensor, got {t.dtype} of shape "
                f"{tuple(t.shape)} on {t.device}"
            )
    if not len(src) == len(dst) == len(sizes):
        raise ValueError(
            f"src/dst/sizes: expected one length, got {len(src)}, {len(dst)}, {len(sizes)}"
        )
    if len(sizes) and int(sizes.min()) < 0:
        raise ValueError(f"sizes: expected non-negative byte counts, got {int(sizes.min())}")


def host_swap_blocks_batch(
    src: torch.Tensor,
    dst: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
) -> None:
    """Copy between host addresses (both sides in this process's memory), in order.
    ``is_src_access_order_any`` changes nothing: host copies are synchronous."""
    _check_descriptors(src, dst, sizes)
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


class _CudaBytes:
    """``n`` device bytes at a raw address, for ``torch.as_tensor`` (CUDA array interface)."""

    def __init__(self, address: int, n: int):
        self.__cuda_array_interface__ = {
            "shape": (1, n),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _bytes_at(address: int, n: int, on_device: bool) -> torch.Tensor:
    """A ``[1, n]`` uint8 tensor over ``n`` bytes at ``address`` (no copy)."""
    if on_device:
        return torch.as_tensor(_CudaBytes(address, n), device="cuda")
    array = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))
    return torch.from_numpy(array).view(1, n)


def swap_blocks_per_descriptor(
    src: torch.Tensor,
    dst: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
    *,
    swap_blocks: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None],
    src_on_device: bool,
    dst_on_device: bool,
) -> None:
    """Run each descriptor as a one-page ``swap_blocks(src, dst, bytes, [[0, 0]])`` call over
    ``[1, size]`` byte tensors at its addresses (``*_on_device``: that side is CUDA memory).
    One call per descriptor, so slower than a batch op for many small pages."""
    _check_descriptors(src, dst, sizes)
    first = torch.zeros((1, 2), dtype=torch.int64)
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        if n:
            swap_blocks(_bytes_at(s, n, src_on_device), _bytes_at(d, n, dst_on_device), n, first)
