"""CPU <-> GPU handlers whose CPU side is a SharedOffloadRegion (upstream's ``mmap_region``).

Two workers share one region; each worker's CPU block ``b`` is its cell of row ``b``, the cell
holding, per canonical tensor, ``block_size_factor`` pages back to back. Moves in both
directions must be byte-exact for every cache format and touch no other byte of the region
(the other worker's cells included) or of the KV cache.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from tiering_test_utils import FORMATS, region, worker_pages

from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.page_copy import CpuGpuOffloadingHandlers, PageCopyHandler
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

try:
    from vllm import _custom_ops as ops
except ImportError:  # pragma: no cover - the extension is built in CI
    pytest.skip("vllm._custom_ops (the compiled extension) is not built", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")

NUM_ROWS = 4
WORKERS = 2
SENTINEL = 0xA5


def canonical(pages: list[torch.Tensor], sizes: list[int]) -> CanonicalKVCaches:
    tensors = [CanonicalKVCacheTensor(p, s) for p, s in zip(pages, sizes, strict=True)]
    refs = [[CanonicalKVCacheRef(i, s) for i, s in enumerate(sizes)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


def run(handler: PageCopyHandler, job_id: int, spec) -> int:
    assert handler.transfer_async(job_id, spec)
    handler.wait({job_id})
    (result,) = handler.get_finished()
    assert (result.job_id, result.success) == (job_id, True)
    return result.transfer_size


def cell_page(
    rows: np.ndarray, worker: int, cell: int, sizes: list[int], t: int, row: int, j: int, f: int
) -> np.ndarray:
    """Page ``j`` of tensor ``t`` in ``worker``'s cell of ``row``."""
    start = worker * cell + f * sum(sizes[:t]) + j * sizes[t]
    return rows[row, start : start + sizes[t]]


@pytest.mark.parametrize("block_size_factor", [1, 2])
@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_every_format_moves_byte_exact_through_a_shared_region(
    cache_dtype: str, block_size_factor: int
) -> None:
    f = block_size_factor
    # Worker 1 adds a third tensor of another page size (per-layer page sizes).
    caches = [worker_pages(cache_dtype, seed) for seed in range(WORKERS)]
    caches[1][0].append(caches[1][0][0][:, : caches[1][1][0] // 2].clone())
    caches[1][1].append(caches[1][1][0] // 2)
    cell = max(f * sum(sizes) for _, sizes in caches)
    name = f"test_{uuid.uuid4().hex}"
    reader = region(NUM_ROWS, cell, None, WORKERS, name)
    regions = [region(NUM_ROWS, cell, r, WORKERS, name) for r in range(WORKERS)]
    rows = np.frombuffer(reader.create_kv_memoryview(), dtype=np.uint8).reshape(NUM_ROWS, -1)
    rows[:] = SENTINEL
    handlers = [
        CpuGpuOffloadingHandlers(
            canonical(pages, sizes), f, NUM_ROWS, r, swap_blocks=ops.swap_blocks
        )
        for (pages, sizes), r in zip(caches, regions, strict=True)
    ]
    try:
        originals = [[p.clone() for p in pages] for pages, _ in caches]
        gpu_blocks, cpu_rows = [5, 1, 3, 0][: 2 * f], [2, 0]
        for w, h in enumerate(handlers):
            spec = (GPULoadStoreSpec(gpu_blocks, (2 * f,), (0,)), CPULoadStoreSpec(cpu_rows))
            size = run(h.gpu_to_cpu_handler, 1, spec)
            assert size == 2 * f * sum(caches[w][1])
        expected = np.full_like(rows, SENTINEL)
        for w, (_, sizes) in enumerate(caches):
            for t in range(len(sizes)):
                for i, block in enumerate(gpu_blocks):
                    row, j = cpu_rows[i // f], i % f
                    page = originals[w][t][block].numpy()
                    cell_page(expected, w, cell, sizes, t, row, j, f)[:] = page
        assert np.array_equal(rows, expected)

        # Load into other GPU blocks, starting mid-block when f > 1 (row 2's first page skipped).
        for pages, _ in caches:
            for p in pages:
                p.fill_(0)
        skip = f - 1
        targets = [4, 2, 5][: 2 * f - skip]
        for h in handlers:
            spec = (CPULoadStoreSpec(cpu_rows), GPULoadStoreSpec(targets, (len(targets),), (skip,)))
            run(h.cpu_to_gpu_handler, 2, spec)
        for w, (pages, _) in enumerate(caches):
            for t, p in enumerate(pages):
                for block in range(p.shape[0]):
                    if block in targets:
                        source = gpu_blocks[targets.index(block) + skip]
                        assert torch.equal(p[block], originals[w][t][source]), (w, t, block)
                    else:
                        assert not p[block].any(), (w, t, block)
        assert np.array_equal(rows, expected)  # loads leave the region as it was
    finally:
        for h in handlers:
            h.shutdown()
        del rows
        reader.cleanup()


def test_partial_refs_move_only_their_bytes_and_region_is_cleaned_up() -> None:
    """A group's reference with a smaller page size moves that prefix of each page; the
    transfer size counts it; the store handler's shutdown drops the views and the region."""
    gpu = torch.arange(6 * 64, dtype=torch.int32).view(torch.uint8).view(6, 256)
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(gpu, 256)],
        group_data_refs=[[CanonicalKVCacheRef(0, 96)]],
    )
    shared: SharedOffloadRegion = region(3, 256, 0)
    handlers = CpuGpuOffloadingHandlers(kv, 1, 3, shared, swap_blocks=ops.swap_blocks)
    assert handlers.kv_cache_groups_data_refs is kv.group_data_refs
    assert handlers.gpu_to_cpu_handler.kv_cache_groups_data_refs == [[CanonicalKVCacheRef(0, 96)]]
    cpu = handlers.cpu_tensors[0]
    cpu.fill_(7)
    spec = (GPULoadStoreSpec([4], (1,), (0,)), CPULoadStoreSpec([1]))
    assert run(handlers.gpu_to_cpu_handler, 1, spec) == 96
    assert torch.equal(cpu[1, :96], gpu[4, :96]) and bool((cpu[1, 96:] == 7).all())
    assert bool((cpu[0] == 7).all()) and bool((cpu[2] == 7).all())
    del cpu
    handlers.shutdown()
    assert shared.mmap_obj is None and handlers.cpu_tensors == []


def test_region_of_another_size_is_rejected() -> None:
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(torch.zeros(4, 128, dtype=torch.uint8), 128)],
        group_data_refs=[[CanonicalKVCacheRef(0, 128)]],
    )
    shared = region(3, 128, 0)
    try:
        with pytest.raises(
            ValueError, match=r"mmap_region: expected 4 host pages \(num_cpu_blocks\), got 3"
        ):
            CpuGpuOffloadingHandlers(kv, 1, 4, shared)
    finally:
        shared.cleanup()
