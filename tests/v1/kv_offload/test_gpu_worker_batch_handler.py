"""Upstream v0.33's address-batch handler (``gpu_worker.SingleDirectionOffloadingHandler``) and
worker on a CPU-only machine: the "GPU" side is a CPU tensor, copies run on a worker thread.
Covers what upstream's CUDA-only tests pin (the canonical round trip across ranks), the copy
function choice, descriptor math, pooling, failures and the error paths."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CanonicalPageMapping,
    CopyRun,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.batch_copy import host_swap_blocks_batch, swap_blocks_per_descriptor
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.copy_descriptors import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.swap_blocks_triton import swap_blocks_batch


def finish(handler, n: int = 1) -> list:
    results: list = []
    deadline = time.monotonic() + 10
    while len(results) < n and time.monotonic() < deadline:
        results += handler.get_finished()
        time.sleep(0.001)
    assert len(results) == n
    return results


def run(handler: SingleDirectionOffloadingHandler, job_id: int, gpu: list[int], cpu: list[int]):
    gpu_spec = GPULoadStoreSpec(gpu, group_sizes=(len(gpu),), block_indices=(0,))
    cpu_spec = CPULoadStoreSpec(cpu)
    src, dst = (gpu_spec, cpu_spec) if handler.gpu_to_cpu else (cpu_spec, gpu_spec)
    assert handler.transfer_async(job_id, src, dst)
    return finish(handler)[0]


def handler(gpu, cpu, refs, gpu_to_cpu, **kwargs) -> SingleDirectionOffloadingHandler:
    return SingleDirectionOffloadingHandler(
        gpu_tensors=[gpu], cpu_tensors=[cpu], blocks_per_chunk=kwargs.pop("bpc", 1),
        layer_refs_per_group=refs, gpu_to_cpu=gpu_to_cpu, **kwargs,
    )  # fmt: skip


def tp2_mapping(rank: int, writers: tuple[int, int] = (1, 0)) -> CanonicalPageMapping:
    # 4 tokens x 4 heads of 64 B per K/V; a TP2 rank holds 2 heads: 128 B per token.
    runs = (
        CopyRun(0, rank * 128, 128, 4, 128, 256),
        CopyRun(512, 1024 + rank * 128, 128, 4, 128, 256),
    )
    return CanonicalPageMapping(2048, 1024, runs, *writers, True)


def mapped(mapping: CanonicalPageMapping) -> list[list[CanonicalKVCacheRef]]:
    return [[CanonicalKVCacheRef(0, mapping.local_page_size_bytes, mapping)]]


def test_sub_block_pointers_follow_strided_rows_and_skip() -> None:
    rows = torch.zeros(4, 1024, dtype=torch.int8)[:, :600]  # strided rows of 3 x 200 B
    out = np.empty(4, dtype=np.uint64)
    compute_sub_block_ptrs(np.array([2, 0]), 3, out, rows, skip_count=1)
    base = rows.data_ptr()
    assert out.tolist() == [base + 2 * 1024 + 200, base + 2 * 1024 + 400, base, base + 200]
    with pytest.raises(ValueError, match="skip_count: expected 0 <= skip_count < 3, got 3"):
        compute_sub_block_ptrs(np.array([0]), 3, out[:1], rows, skip_count=3)


def test_host_batch_copy_and_its_checks() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    p, q = src.data_ptr(), dst.data_ptr()
    host_swap_blocks_batch(
        torch.tensor([p + 8, p]), torch.tensor([q, q + 40]), torch.tensor([16, 4])
    )
    assert dst[:16].tolist() == list(range(8, 24)) and dst[40:44].tolist() == [0, 1, 2, 3]
    assert int(dst[16:40].sum()) == 0
    with pytest.raises(ValueError, match="sizes: expected non-negative byte counts, got -1"):
        host_swap_blocks_batch(torch.tensor([p]), torch.tensor([q]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="src: expected a 1-D int64 CPU tensor, got torch.int32"):
        host_swap_blocks_batch(
            torch.tensor([1], dtype=torch.int32), torch.tensor([q]), torch.tensor([1])
        )
    with pytest.raises(ValueError, match="expected one length, got 2, 1, 1"):
        host_swap_blocks_batch(torch.tensor([p, p]), torch.tensor([q]), torch.tensor([1]))


def test_per_descriptor_copy_runs_the_page_op_once_per_descriptor() -> None:
    src = torch.arange(32, dtype=torch.uint8)
    dst = torch.zeros(32, dtype=torch.uint8)
    calls: list[int] = []

    def page_op(s: torch.Tensor, d: torch.Tensor, n: int, m: torch.Tensor) -> None:
        calls.append(n)
        ops.swap_blocks(s, d, n, m)

    swap_blocks_per_descriptor(
        torch.tensor([src.data_ptr() + 4, src.data_ptr()]),
        torch.tensor([dst.data_ptr(), dst.data_ptr() + 24]),
        torch.tensor([8, 0]),
        swap_blocks=page_op,
        src_on_device=False,
        dst_on_device=False,
    )
    assert calls == [8]  # empty descriptors are skipped
    assert dst[:8].tolist() == list(range(4, 12)) and int(dst[8:].sum()) == 0


@pytest.mark.parametrize("rank_writers", [((1, 0), (1, 0)), ((2, 0), (2, 1))])
def test_canonical_round_trip_across_ranks(rank_writers) -> None:
    """Two TP2 ranks scatter into one canonical host page; each rank reloads its shard and a
    whole-page (TP1) reader sees the assembled page. With two writers per page (replicas)
    each rank stores only its turn, so pages assemble from both ranks' turns."""
    torch.manual_seed(0)
    gpu = [torch.randint(-128, 128, (4, 1024), dtype=torch.int8) for _ in range(2)]
    host = torch.zeros(4, 2048, dtype=torch.int8)
    for rank in (0, 1):
        refs = mapped(tp2_mapping(rank, rank_writers[rank]))
        result = run(
            handler(gpu[rank], host, refs, True, canonical_layout=True),
            1,
            [0, 1, 2, 3],
            [0, 1, 2, 3],
        )
        assert result.success
        stored_pages = 4 if rank_writers[rank][0] == 1 else 2
        assert result.transfer_size == stored_pages * 1024
    expected = np.zeros((4, 2048), dtype=np.int8)
    for rank in (0, 1):
        writers, index = rank_writers[rank]
        for run_ in tp2_mapping(rank).runs:
            for i in range(run_.num_fragments):
                lo = run_.local_offset + i * run_.local_stride
                co = run_.canonical_offset + i * run_.canonical_stride
                rows = [p for p in range(4) if p % writers == index]
                expected[rows, co : co + 128] = gpu[rank].numpy()[rows, lo : lo + 128]
    assert np.array_equal(host.numpy(), expected)
    if rank_writers[0][0] == 1:
        back = torch.zeros(4, 1024, dtype=torch.int8)
        refs = mapped(tp2_mapping(0))
        assert run(
            handler(back, host, refs, False, canonical_layout=True), 2, [0, 1, 2, 3], [0, 1, 2, 3]
        ).success
        assert torch.equal(back, gpu[0])
    full = torch.zeros(4, 2048, dtype=torch.int8)
    whole = CanonicalPageMapping(2048, 2048, (CopyRun(0, 0, 2048, 1, 2048, 2048),), 1, 0, True)
    assert run(
        handler(full, host, mapped(whole), False, canonical_layout=True),
        3,
        [3, 2, 1, 0],
        [3, 2, 1, 0],
    ).success
    assert torch.equal(full, host)


def test_pools_are_reused_and_a_failed_copy_reports_failure() -> None:
    gpu = torch.randint(-128, 128, (8, 64), dtype=torch.int8)
    cpu = torch.zeros(4, 128, dtype=torch.int8)
    fail = [False]

    def copy(*args, **kwargs) -> None:
        if fail[0]:
            raise RuntimeError("copy engine down")
        host_swap_blocks_batch(*args, **kwargs)

    refs = [[CanonicalKVCacheRef(0, 64)]]
    h = handler(gpu, cpu, refs, True, bpc=2, swap_blocks_batch=copy)
    first = run(h, 1, [4, 5, 6], [1, 2])
    assert first.success and first.transfer_size == 3 * 64 and first.transfer_time > 0
    assert torch.equal(cpu[1], gpu[4:6].reshape(-1)) and torch.equal(cpu[2, :64], gpu[6])
    pooled = (h._stream_pool[0], h._buffer_pool[0][0])
    fail[0] = True
    assert not run(h, 2, [0], [3]).success
    assert (h._stream_pool[0], h._buffer_pool[0][0]) == pooled
    h.shutdown()
    assert not h.src_tensors and not h._stream_pool


def test_bad_jobs_raise_before_anything_is_written() -> None:
    gpu = torch.zeros(4, 64, dtype=torch.int8)
    cpu = torch.ones(2, 64, dtype=torch.int8)
    h = handler(gpu, cpu, [[CanonicalKVCacheRef(0, 64)]], False)
    load = (CPULoadStoreSpec([0]), GPULoadStoreSpec([9], (1,), (0,)))
    with pytest.raises(ValueError, match=r"dst_spec: expected block ids in \[0, 4\)"):
        h.transfer_async(1, *load)
    with pytest.raises(ValueError, match="gpu spec: expected 1 group sizes and block indices"):
        h.transfer_async(1, CPULoadStoreSpec([0]), GPULoadStoreSpec([0], (1, 0), (0, 0)))
    with pytest.raises(ValueError, match="expected 1 and 1 block ids for the group sizes, got 2"):
        h.transfer_async(1, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([0], (1,), (0,)))
    with pytest.raises(TypeError, match="gpu spec: expected a GPULoadStoreSpec"):
        h.transfer_async(1, CPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    assert not h._transfers and int(gpu.abs().sum()) == 0
    assert h.transfer_async(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([2], (1,), (0,)))
    with pytest.raises(ValueError, match="job_id: expected a job not in flight, got 1"):
        h.transfer_async(1, CPULoadStoreSpec([1]), GPULoadStoreSpec([2], (1,), (0,)))
    finish(h)
    assert torch.equal(gpu[2], cpu[1])
    h.shutdown()


def test_handler_rejects_mismatched_tensors_and_refs() -> None:
    gpu = torch.zeros(4, 64, dtype=torch.int8)
    refs = [[CanonicalKVCacheRef(0, 64)]]
    with pytest.raises(
        ValueError, match="cpu_tensors\\[0\\]: expected rows of 2 x 64 bytes, got 64"
    ):
        handler(gpu, torch.zeros(2, 64, dtype=torch.int8), refs, True, bpc=2)
    with pytest.raises(ValueError, match="gpu_tensors\\[0\\]: expected a 2-D one-byte"):
        handler(gpu.view(torch.int16), torch.zeros(2, 64, dtype=torch.int8), refs, True)
    with pytest.raises(ValueError, match="layer_refs_per_group: expected a tensor index below 1"):
        handler(gpu, torch.zeros(2, 64, dtype=torch.int8), [[CanonicalKVCacheRef(1, 64)]], True)
    with pytest.raises(ValueError, match="ref: expected a CanonicalKVCacheRef with a mapping"):
        handler(gpu, torch.zeros(2, 64, dtype=torch.int8), refs, True, canonical_layout=True)


def test_copy_function_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_worker, "HAS_TRITON", True)
    monkeypatch.setattr(gpu_worker.current_platform, "is_xpu", lambda: False)
    monkeypatch.setattr(gpu_worker.current_platform, "is_rocm", lambda: False)
    small = [[CanonicalKVCacheRef(0, 512), CanonicalKVCacheRef(1, 1000)]]
    fn = gpu_worker._select_swap_blocks_fn(small, gpu_to_cpu=False)
    assert isinstance(fn, functools.partial) and fn.func is swap_blocks_batch
    assert fn.keywords == {"bytes_per_chunk": 1024}
    large = [[CanonicalKVCacheRef(0, 28 * 1024)]]
    odd = [[CanonicalKVCacheRef(0, 100)]]
    for refs, gpu_to_cpu, pinned in (
        (small, True, True),
        (small, False, False),
        (large, False, True),
        (odd, False, True),
    ):
        dma = gpu_worker._select_swap_blocks_fn(refs, gpu_to_cpu, pinned)
        if hasattr(ops, "swap_blocks_batch"):
            assert dma is ops.swap_blocks_batch
        else:
            assert dma.func is swap_blocks_per_descriptor
            assert dma.keywords["src_on_device"] is gpu_to_cpu


def test_worker_expedited_loads_and_page_op_override() -> None:
    gpu = torch.randint(-128, 128, (4, 256), dtype=torch.int8)
    calls: list[int] = []

    def page_op(s: torch.Tensor, d: torch.Tensor, n: int, m: torch.Tensor) -> None:
        calls.append(n)
        ops.swap_blocks(s, d, n, m)

    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(gpu, 256)],
        group_data_refs=[[CanonicalKVCacheRef(0, 256)]],
    )
    worker = CPUOffloadingWorker(kv, 1, 4, swap_blocks=page_op)
    expected = gpu.clone()
    assert worker.submit_store(1, GPULoadStoreSpec([1, 2], (2,), (0,)), CPULoadStoreSpec([3, 0]))
    assert [r.job_id for r in finish(worker)] == [1]
    gpu.zero_()
    assert worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([3], (1,), (0,)), True)
    assert {x.job_id for x in worker._expedited_load_handler._transfers} == {2}
    assert not worker._load_handler._transfers
    worker.wait({2})
    assert [r.job_id for r in finish(worker)] == [2]
    assert torch.equal(gpu[3], expected[2]) and calls == [256, 256, 256]
    worker.shutdown()
    with pytest.raises(ValueError, match="num_cpu_chunks"):
        CPUOffloadingWorker(kv, 1, 0)
