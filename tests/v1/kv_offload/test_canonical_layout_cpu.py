"""The canonical (parallelism-free) host layout on a CPU machine: workers of one tensor-parallel
size scatter their head shards into shared canonical pages, workers of another size gather
theirs back; replicated workers take turns storing a page; bad mappings fail before copying."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers, CPUOffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import RegionOverflowError, SharedOffloadRegion

pytest.importorskip("vllm._custom_ops")
pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

HEADS, HEAD_BYTES, TOKENS = 4, 16, 4
ROW = HEADS * HEAD_BYTES  # one token of every head (bytes)
CANONICAL_PAGE = 2 * TOKENS * ROW  # [K: token x head][V: token x head]


def shard_mapping(tp: int, rank: int, writers: tuple[int, int] = (1, 0)) -> CanonicalPageMapping:
    """``rank``'s heads (of ``tp``) as K and V runs of one fragment per token."""
    frag = HEADS // tp * HEAD_BYTES
    runs = tuple(
        CopyRun(side * TOKENS * frag, side * TOKENS * ROW + rank * frag, frag, TOKENS, frag, ROW)
        for side in (0, 1)
    )
    return CanonicalPageMapping(CANONICAL_PAGE, 2 * TOKENS * frag, runs, *writers, True)


def shard(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """``rank``'s local pages out of ``[blocks, 2, tokens, heads, head bytes]``."""
    per = HEADS // tp
    return full[:, :, :, rank * per : (rank + 1) * per].reshape(full.shape[0], -1).clone()


def handlers(
    pages: torch.Tensor, mapping: CanonicalPageMapping, f: int, chunks: int, region=None
) -> CpuGpuOffloadingHandlers:
    ref = CanonicalKVCacheRef(0, pages.shape[1], mapping)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(pages, pages.shape[1])], [[ref]])
    return CpuGpuOffloadingHandlers(kv, f, chunks, region, canonical_layout=True)


def move(h: CpuGpuOffloadingHandlers, store: bool, gpu_ids: list[int], cpu_ids: list[int]) -> int:
    gpu = GPULoadStoreSpec(gpu_ids, group_sizes=(len(gpu_ids),), block_indices=(0,))
    cpu = CPULoadStoreSpec(cpu_ids)
    handler = h.gpu_to_cpu_handler if store else h.cpu_to_gpu_handler
    assert handler.transfer_async(7, (gpu, cpu) if store else (cpu, gpu))
    handler.wait({7})
    (result,) = handler.get_finished()
    assert result.success
    return result.transfer_size


@pytest.mark.parametrize("writer_tp,reader_tp", [(2, 4), (4, 2), (2, 1), (1, 4)])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_pages_stored_at_one_tp_load_at_another(writer_tp, reader_tp, blocks_per_chunk):
    f, blocks = blocks_per_chunk, 4
    full = torch.randint(0, 256, (blocks, 2, TOKENS, HEADS, HEAD_BYTES), dtype=torch.uint8)
    page = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    name = f"test_{uuid.uuid4().hex}"
    reader = SharedOffloadRegion(name, blocks // f, None, page, page // 8)
    rows = np.frombuffer(reader.create_kv_memoryview(), dtype=np.uint8).reshape(blocks // f, -1)
    rows[:] = 0xA5
    made = []
    try:
        for rank in range(writer_tp):
            region = SharedOffloadRegion(name, blocks // f, rank, page, page // writer_tp)
            made.append(
                h := handlers(
                    shard(full, writer_tp, rank),
                    shard_mapping(writer_tp, rank),
                    f,
                    blocks // f,
                    region,
                )
            )
            assert move(h, True, list(range(blocks)), list(range(blocks // f))) == blocks * (
                CANONICAL_PAGE // writer_tp
            )
        # The host row holds the canonical pages back to back, the rest of the row untouched.
        canonical = full.reshape(blocks // f, f * CANONICAL_PAGE).numpy()
        assert np.array_equal(rows[:, : f * CANONICAL_PAGE], canonical)
        assert (rows[:, f * CANONICAL_PAGE :] == 0xA5).all()
        for rank in range(reader_tp):
            region = SharedOffloadRegion(name, blocks // f, rank, page, page // reader_tp)
            out = torch.zeros_like(shard(full, reader_tp, rank))
            made.append(h := handlers(out, shard_mapping(reader_tp, rank), f, blocks // f, region))
            move(h, False, list(range(blocks)), list(range(blocks // f)))
            assert torch.equal(out, shard(full, reader_tp, rank))
    finally:
        for h in made:
            h.shutdown()
        del rows
        reader.cleanup()


def test_replicated_workers_take_turns_storing_pages():
    full = torch.randint(0, 256, (4, CANONICAL_PAGE), dtype=torch.uint8)
    identity = (CopyRun(0, 0, CANONICAL_PAGE, 1, CANONICAL_PAGE, CANONICAL_PAGE),)
    hosts = []
    for index in range(2):
        mapping = CanonicalPageMapping(CANONICAL_PAGE, CANONICAL_PAGE, identity, 2, index, True)
        h = handlers(full.clone(), mapping, 1, 4)
        h.cpu_tensors[0].zero_()
        assert move(h, True, [0, 1, 2, 3], [3, 2, 1, 0]) == 2 * CANONICAL_PAGE
        hosts.append(h.cpu_tensors[0].clone())
        h.shutdown()
    for host_page in range(4):
        writer = host_page % 2  # the writer of host page p is index p % num_writers
        assert torch.equal(hosts[writer][host_page], full[3 - host_page])
        assert not hosts[1 - writer][host_page].any()


def test_canonical_layout_needs_a_mapping_on_every_ref():
    pages = torch.zeros(4, 64, dtype=torch.uint8)
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(pages, 64)], [[CanonicalKVCacheRef(0, 64)]])
    with pytest.raises(ValueError, match="ref: expected a CanonicalKVCacheRef with a mapping"):
        CPUOffloadingWorker(kv, 1, 4, canonical_layout=True)


def test_canonical_views_share_bytes_and_stop_at_the_row():
    page = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    name = f"test_{uuid.uuid4().hex}"
    a = SharedOffloadRegion(name, 2, 0, page, page // 2)
    b = SharedOffloadRegion(name, 2, 1, page, page // 2)
    try:
        a.create_next_canonical_view(64).fill_(3)
        assert (b.create_next_canonical_view(64) == 3).all()  # same bytes, either rank
        with pytest.raises(RegionOverflowError, match="exceeds the"):
            a.create_next_canonical_view(page)
    finally:
        b.cleanup()
        a.cleanup()
