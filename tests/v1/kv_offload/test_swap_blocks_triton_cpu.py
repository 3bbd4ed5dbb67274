"""The Triton ``swap_blocks_batch`` kernel under the interpreter (CPU addresses), and its
argument checks."""

import pytest
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.v1.kv_offload.cpu.swap_blocks_triton import (
    MAX_BYTES_PER_CHUNK,
    swap_blocks_batch,
    triton_compile_cases,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton cannot launch kernels here")


def _addrs(buffers: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)


@needs_triton
@pytest.mark.parametrize("bytes_per_chunk", [64, MAX_BYTES_PER_CHUNK])
def test_copies_exactly_the_given_bytes(bytes_per_chunk):
    # More jobs than programs (grid stride), sizes across chunk boundaries, and a 0-byte job.
    sizes = [8, 4096, 8192, 8200, 4088, 0] * 3
    src = [torch.randint(256, (s + 16,), dtype=torch.uint8) for s in sizes]
    dst = [torch.zeros_like(s) for s in src]
    swap_blocks_batch(
        _addrs(src), _addrs(dst), torch.tensor(sizes), bytes_per_chunk=bytes_per_chunk
    )
    for s, d, n in zip(src, dst, sizes, strict=True):
        assert torch.equal(d[:n], s[:n])
        assert not d[n:].any()  # nothing past the range is written


@needs_triton
def test_empty_batch_is_a_no_op():
    empty = torch.empty(0, dtype=torch.int64)
    swap_blocks_batch(empty, empty, empty, bytes_per_chunk=8)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"sizes": torch.tensor([8, 8])}, ValueError, "sizes: expected one entry"),
        ({"sizes": torch.tensor([12])}, ValueError, "sizes: expected non-negative multiples"),
        ({"sizes": torch.tensor([8], dtype=torch.int32)}, TypeError, "sizes: expected a 1-D"),
        ({"bytes_per_chunk": 24}, ValueError, "bytes_per_chunk: expected a power of two"),
        ({"bytes_per_chunk": 2 * MAX_BYTES_PER_CHUNK}, ValueError, "bytes_per_chunk"),
    ],
)
def test_bad_arguments_raise_before_copying(kwargs, error, match):
    src = torch.ones(16, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    args = {"sizes": torch.tensor([8]), "bytes_per_chunk": 8, **kwargs}
    with pytest.raises(error, match=match):
        swap_blocks_batch(
            _addrs([src]), _addrs([dst]), args["sizes"], bytes_per_chunk=args["bytes_per_chunk"]
        )
    assert not dst.any()


def test_compile_cases_name_each_step_once():
    names = [case.name for case in triton_compile_cases()]
    assert len(names) == len(set(names)) == 3
