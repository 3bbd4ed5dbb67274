"""A Triton kernel that copies a batch of byte ranges given by address (upstream v0.33's
``swap_blocks_batch`` fast path for many small CPU -> GPU copies).

Job ``j`` copies ``sizes[j]`` bytes from address ``src_addrs[j]`` to ``dst_addrs[j]`` as
8-byte words, ``BYTES_PER_CHUNK`` bytes per step; the programs stride over the jobs. On a GPU
the source may be pinned host memory (the kernel reads it through unified addressing); under
Triton's interpreter the kernel runs on the CPU over CPU addresses.
"""

from __future__ import annotations

import torch

from vllm.triton_utils import HAS_TRITON, tl, triton, triton_interpreted
from vllm.triton_utils.aot import TritonCompileCase

NUM_SMS = 12
"""Programs launched at most (upstream's H100 tuning: a small slice of the SMs already reaches
about peak host-link bandwidth for 8-32 KiB pages)."""
THRESHOLD_BYTES = 28 * 1024
"""Largest page (bytes) for which the kernel beats the copy engines (upstream's tuning);
callers send larger pages to a DMA copy."""
MIN_N = 16
"""Fewest copies for which the kernel's launch cost pays off (upstream's tuning); callers send
smaller batches to a DMA copy."""
MAX_BYTES_PER_CHUNK = 8192
"""Largest ``bytes_per_chunk`` (bytes): one step's tile of words stays in registers."""


@triton.jit
def _swap_blocks_kernel(
    src_addrs,
    dst_addrs,
    sizes,
    n_jobs,
    BYTES_PER_CHUNK: tl.constexpr,
):
    WORDS: tl.constexpr = BYTES_PER_CHUNK // 8
    lanes = tl.arange(0, WORDS)
    for job in range(tl.program_id(0), n_jobs, tl.num_programs(0)):
        src = tl.load(src_addrs + job).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_addrs + job).to(tl.pointer_type(tl.int64))
        num_words = tl.load(sizes + job) // 8
        for first in range(0, num_words, WORDS):
            word = first + lanes
            inside = word < num_words
            tl.store(dst + word, tl.load(src + word, mask=inside), mask=inside)


def _check_batch(
    src_addrs: torch.Tensor, dst_addrs: torch.Tensor, sizes: torch.Tensor, bytes_per_chunk: int
) -> None:
    for name, tensor in (("src_addrs", src_addrs), ("dst_addrs", dst_addrs), ("sizes", sizes)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.dim() != 1:
            got = tensor if not isinstance(tensor, torch.Tensor) else (tensor.dtype, tensor.shape)
            raise TypeError(f"{name}: expected a 1-D torch.int64 tensor, got {got!r}")
    if not src_addrs.numel() == dst_addrs.numel() == sizes.numel():
        raise ValueError(
            "sizes: expected one entry per address pair, got "
            f"{src_addrs.numel()} sources, {dst_addrs.numel()} destinations, {sizes.numel()} sizes"
        )
    if (
        isinstance(bytes_per_chunk, bool)
        or not isinstance(bytes_per_chunk, int)
        or not 8 <= bytes_per_chunk <= MAX_BYTES_PER_CHUNK
        or bytes_per_chunk & (bytes_per_chunk - 1)
    ):
        raise ValueError(
            f"bytes_per_chunk: expected a power of two in [8, {MAX_BYTES_PER_CHUNK}], "
            f"got {bytes_per_chunk!r}"
        )
    bad = ((sizes < 0) | (sizes % 8 != 0)).nonzero()
    if bad.numel():
        index = int(bad[0])
        raise ValueError(
            f"sizes: expected non-negative multiples of 8 bytes, got {int(sizes[index])} at "
            f"index {index}"
        )


def swap_blocks_batch(
    src_addrs: torch.Tensor,
    dst_addrs: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
    *,
    bytes_per_chunk: int,
) -> None:
    """Copy ``sizes[j]`` bytes (a multiple of 8) from address ``src_addrs[j]`` to
    ``dst_addrs[j]`` for every ``j`` (1-D int64 tensors), on the current CUDA stream (on the
    CPU under Triton's interpreter), ``bytes_per_chunk`` bytes per step (a power of two, at
    most :data:`MAX_BYTES_PER_CHUNK`; the next power of two of the largest size fits best).
    ``is_src_access_order_any`` is the DMA path's ordering hint; the kernel reads the sources
    in stream order either way. Ranges must not overlap."""
    _check_batch(src_addrs, dst_addrs, sizes, bytes_per_chunk)
    if not HAS_TRITON:
        raise RuntimeError("swap_blocks_batch: Triton cannot launch kernels in this process")
    num_jobs = src_addrs.numel()
    if num_jobs == 0:
        return
    device = "cpu" if triton_interpreted() else "cuda"
    _swap_blocks_kernel[(min(NUM_SMS, num_jobs),)](
        src_addrs.to(device, non_blocking=True),
        dst_addrs.to(device, non_blocking=True),
        sizes.to(device, non_blocking=True),
        num_jobs,
        BYTES_PER_CHUNK=bytes_per_chunk,
    )


def triton_compile_cases() -> list[TritonCompileCase]:
    """The kernel at the smallest, a middle and the largest step (bytes per chunk)."""
    signature = {"src_addrs": "*i64", "dst_addrs": "*i64", "sizes": "*i64", "n_jobs": "i32"}
    return [
        TritonCompileCase(
            f"swap_blocks_batch/chunk{chunk}",
            _swap_blocks_kernel,
            signature,
            {"BYTES_PER_CHUNK": chunk},
            divisible_by_16=("src_addrs", "dst_addrs", "sizes"),
        )
        for chunk in (8, 1024, MAX_BYTES_PER_CHUNK)
    ]
