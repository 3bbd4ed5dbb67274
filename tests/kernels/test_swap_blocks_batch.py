"""swap_blocks_batch (torch.ops._C_cache_ops): raw address copies, byte-exact, bad
descriptors rejected before any byte moves."""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as ops

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA"))]


def _addrs(tensors: list[torch.Tensor], offsets: list[int] | None = None) -> torch.Tensor:
    offsets = offsets or [0] * len(tensors)
    addresses = [t.data_ptr() + o for t, o in zip(tensors, offsets, strict=True)]
    return torch.tensor(addresses, dtype=torch.int64)


def _random(n: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(device)


@pytest.mark.parametrize("src_device", DEVICES)
@pytest.mark.parametrize("dst_device", DEVICES)
def test_copies_each_descriptor(src_device: str, dst_device: str) -> None:
    """Odd sizes and offsets, a zero-size descriptor, and many descriptors (the host path
    splits them across threads): exactly the named bytes change."""
    sizes = [1, 7, 4096, 0, 8192 + 3] + [64] * 100
    srcs = [_random(s + 5, i, src_device) for i, s in enumerate(sizes)]
    dsts = [_random(s + 9, 1000 + i, dst_device) for i, s in enumerate(sizes)]
    expected = [d.cpu().clone() for d in dsts]
    for e, s, n in zip(expected, srcs, sizes, strict=True):
        e[4 : 4 + n] = s.cpu()[3 : 3 + n]
    ops.swap_blocks_batch(
        _addrs(srcs, [3] * len(srcs)), _addrs(dsts, [4] * len(dsts)), torch.tensor(sizes)
    )
    if HAS_CUDA:
        torch.cuda.synchronize()
    for d, e in zip(dsts, expected, strict=True):
        assert torch.equal(d.cpu(), e)


def test_empty_batch_and_src_order_flag() -> None:
    empty = torch.empty(0, dtype=torch.int64)
    ops.swap_blocks_batch(empty, empty, empty, True)
    src, dst = _random(32, 1, "cpu"), torch.zeros(32, dtype=torch.uint8)
    ops.swap_blocks_batch(_addrs([src]), _addrs([dst]), torch.tensor([32]), True)
    assert torch.equal(src, dst)


def _bad_cases() -> list[tuple[tuple[torch.Tensor, ...], str]]:
    ptr = torch.tensor([4096], dtype=torch.int64)
    size = torch.tensor([8], dtype=torch.int64)
    return [
        ((ptr.int(), ptr, size), r"src_ptrs: expected dtype int64, got int32"),
        ((ptr, ptr.view(1, 1), size), r"dst_ptrs: expected a 1-D tensor, got shape \[1, 1\]"),
        ((ptr, ptr, size.float()), r"sizes: expected dtype int64, got float32"),
        ((ptr, torch.tensor([4096, 8192]), size), r"dst_ptrs: expected 1 addresses .*got 2"),
        ((ptr, ptr, torch.tensor([8, 8])), r"sizes: expected 1 byte counts .*got 2"),
        ((ptr, ptr, torch.tensor([-1])), r"sizes: expected byte counts >= 0, got sizes\[0\] = -1"),
        ((torch.tensor([0]), ptr, size), r"expected nonzero addresses .*src_ptrs\[0\] = 0"),
        ((torch.tensor([4096, 0]), torch.tensor([4096, 0]), torch.tensor([0, 0])), ""),
    ]


@pytest.mark.parametrize("args,message", _bad_cases())
def test_bad_descriptors(args: tuple[torch.Tensor, ...], message: str) -> None:
    """Every malformed descriptor set is refused naming the argument; zero-size descriptors
    may carry any address (nothing is read or written)."""
    if not message:
        ops.swap_blocks_batch(*args)
        return
    with pytest.raises(RuntimeError, match=message):
        ops.swap_blocks_batch(*args)


def test_checks_precede_copies() -> None:
    """A bad descriptor late in the batch: the good ones before it are not copied either."""
    src, dst = _random(16, 2, "cpu"), torch.zeros(16, dtype=torch.uint8)
    srcs = torch.tensor([src.data_ptr(), src.data_ptr()])
    dsts = torch.tensor([dst.data_ptr(), dst.data_ptr()])
    with pytest.raises(RuntimeError, match=r"sizes\[1\] = -4"):
        ops.swap_blocks_batch(srcs, dsts, torch.tensor([16, -4]))
    assert not dst.any()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_descriptors_must_be_on_cpu() -> None:
    ptr = torch.tensor([4096], dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"src_ptrs: expected a CPU tensor, got device cuda"):
        ops.swap_blocks_batch(ptr.cuda(), ptr, torch.tensor([8]))
