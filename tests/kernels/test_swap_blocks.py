"""swap_blocks (torch.ops._C_cache_ops): whole pages copied byte for byte, bad ids rejected."""

from __future__ import annotations

import pytest
import torch

from vllm import _custom_ops as ops

HAS_CUDA = torch.cuda.is_available()
_needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DIRECTIONS = [
    ("cpu", "cpu"),
    pytest.param("cpu", "cuda", marks=_needs_cuda),
    pytest.param("cuda", "cpu", marks=_needs_cuda),
    pytest.param("cuda", "cuda", marks=_needs_cuda),
]


def _random_bytes(nbytes: int, seed: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


def _pages(t: torch.Tensor, page_bytes: int) -> torch.Tensor:
    """The bytes of `t` (from its data_ptr to the end of its storage) as [pages, page_bytes]."""
    start = t.storage_offset() * t.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    avail = (flat.numel() - start) // page_bytes * page_bytes
    return flat[start : start + avail].view(-1, page_bytes)


@pytest.mark.parametrize("src_device,dst_device", DIRECTIONS)
@pytest.mark.parametrize("page_bytes", [64, 18_432, 65_536])
def test_copies_mapped_pages_only(src_device: str, dst_device: str, page_bytes: int) -> None:
    """Pages of a (B, 2, N, H, F) uint8 NVFP4-style cache and of a bf16 cache move byte-exact;
    pages not named as destinations keep their bytes."""
    num_src, num_dst = 7, 5
    src = _random_bytes(num_src * page_bytes, 1, src_device).view(torch.bfloat16)
    dst = _random_bytes(num_dst * page_bytes, 2, dst_device)
    mapping = torch.tensor([[6, 0], [0, 3], [2, 4], [2, 1]], dtype=torch.int64)
    expected = _pages(dst, page_bytes).cpu().clone()
    for s, d in mapping.tolist():
        expected[d] = _pages(src, page_bytes)[s].cpu()
    ops.swap_blocks(src, dst, page_bytes, mapping)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert torch.equal(_pages(dst, page_bytes).cpu(), expected)


@pytest.mark.parametrize("src_device,dst_device", DIRECTIONS)
def test_pages_start_at_data_ptr(src_device: str, dst_device: str) -> None:
    """Views with a storage offset: page p starts p pages after the view's data_ptr."""
    page_bytes = 256
    src_base = _random_bytes(10 * page_bytes, 3, src_device)
    dst_base = _random_bytes(10 * page_bytes, 4, dst_device)
    src, dst = src_base[100:], dst_base[page_bytes + 7 :]  # 9 and 8 whole pages remain
    mapping = torch.tensor([[8, 7], [1, 0]], dtype=torch.int64)
    expected = dst_base.cpu().clone()
    for s, d in mapping.tolist():
        start = page_bytes + 7 + d * page_bytes
        expected[start : start + page_bytes] = src_base[100 + s * page_bytes :][:page_bytes].cpu()
    ops.swap_blocks(src, dst, page_bytes, mapping)
    if HAS_CUDA:
        torch.cuda.synchronize()
    assert torch.equal(dst_base.cpu(), expected)


def test_empty_mapping_is_a_no_op() -> None:
    src, dst = _random_bytes(512, 5, "cpu"), _random_bytes(512, 6, "cpu")
    before = dst.clone()
    ops.swap_blocks(src, dst, 128, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(dst, before)


def test_opcheck() -> None:
    src, dst = _random_bytes(1024, 7, "cpu"), _random_bytes(1024, 8, "cpu")
    mapping = torch.tensor([[0, 1], [3, 2]], dtype=torch.int64)
    torch.library.opcheck(torch.ops._C_cache_ops.swap_blocks.default, (src, dst, 256, mapping))


BAD = [
    ("src_id_too_large", 256, [[0, 0], [4, 1]],
     r"block_mapping: expected src page ids in \[0, 4\) .*got block_mapping\[1\]\[0\] = 4"),
    ("dst_id_too_large", 256, [[0, 0], [1, 3]],
     r"block_mapping: expected dst page ids in \[0, 3\) .*got block_mapping\[1\]\[1\] = 3"),
    ("negative_id", 256, [[-1, 0]],
     r"block_mapping: expected src page ids in \[0, 4\) .*= -1"),
    ("page_larger_than_dst", 1024, [[0, 0]],
     r"block_mapping: expected dst page ids in \[0, 0\)"),
    ("zero_page_size", 0, [[0, 0]], r"block_size_in_bytes: expected a positive size, got 0"),
]  # fmt: skip


@pytest.mark.parametrize("src_device,dst_device", DIRECTIONS)
@pytest.mark.parametrize(
    "page_bytes,mapping,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_page_ids(
    src_device: str, dst_device: str, page_bytes: int, mapping: list, message: str
) -> None:
    """Out-of-range ids are reported before any page is copied."""
    src = _random_bytes(1024, 9, src_device)
    dst = _random_bytes(3 * 256 + 100, 10, dst_device)  # 3 whole 256-byte pages
    before = dst.clone()
    with pytest.raises(RuntimeError, match=message):
        ops.swap_blocks(src, dst, page_bytes, torch.tensor(mapping, dtype=torch.int64))
    assert torch.equal(dst, before)


@pytest.mark.parametrize("src_device,dst_device", DIRECTIONS)
def test_page_ids_are_bounded_by_the_view(src_device: str, dst_device: str) -> None:
    """A layer's view into a shared buffer cannot reach the pages of its neighbours."""
    src = _random_bytes(4 * 256, 15, src_device)
    shared = _random_bytes(8 * 256, 16, dst_device)
    dst = shared[256 : 3 * 256]  # pages 1 and 2 of the shared buffer
    before = shared.clone()
    with pytest.raises(
        RuntimeError, match=r"block_mapping: expected dst page ids in \[0, 2\) .*= 2"
    ):
        ops.swap_blocks(src, dst, 256, torch.tensor([[0, 1], [1, 2]], dtype=torch.int64))
    assert torch.equal(shared, before)


@pytest.mark.parametrize(
    "mapping,message",
    [
        (
            torch.tensor([[0, 1]], dtype=torch.int32),
            r"block_mapping: expected dtype int64, got int32",
        ),
        (torch.tensor([0, 1]), r"block_mapping: expected shape \[n, 2\] .*got \[2\]"),
        (torch.tensor([[0, 1, 2]]), r"block_mapping: expected shape \[n, 2\] .*got \[1, 3\]"),
    ],
    ids=["int32", "1d", "three_columns"],
)
def test_bad_mapping(mapping: torch.Tensor, message: str) -> None:
    src, dst = _random_bytes(1024, 11, "cpu"), _random_bytes(1024, 12, "cpu")
    before = dst.clone()
    with pytest.raises(RuntimeError, match=message):
        ops.swap_blocks(src, dst, 256, mapping)
    assert torch.equal(dst, before)


@_needs_cuda
def test_mapping_must_be_on_cpu() -> None:
    src, dst = _random_bytes(1024, 13, "cuda"), _random_bytes(1024, 14, "cpu")
    with pytest.raises(RuntimeError, match=r"block_mapping: expected a CPU tensor"):
        ops.swap_blocks(src, dst, 256, torch.tensor([[0, 1]], device="cuda"))


def test_meta_arguments() -> None:
    """All tensors on meta (shape propagation) is fine; a real tensor next to a meta one is an
    error naming the argument (the dispatcher would run the fake kernel and copy nothing)."""
    src, dst = _random_bytes(1024, 17, "cpu"), _random_bytes(1024, 18, "cpu")
    mapping = torch.tensor([[0, 1]], dtype=torch.int64)
    ops.swap_blocks(src.to("meta"), dst.to("meta"), 256, mapping.to("meta"))
    before = dst.clone()
    for args, message in [
        ((src.to("meta"), dst, 256, mapping), r"src: expected a real device \(dst is on cpu\)"),
        ((src, dst, 256, mapping.to("meta")), r"block_mapping: expected a real device .*got meta"),
        ((src, dst.to("meta"), 256, mapping), r"src: expected a meta tensor \(dst is on meta"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            torch.ops._C_cache_ops.swap_blocks(*args)
    assert torch.equal(dst, before)
