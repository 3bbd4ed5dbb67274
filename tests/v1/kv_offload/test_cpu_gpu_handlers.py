"""CPU<->GPU offloading handlers: ordered completion, stream waits, validation.

The CPU-path tests run everywhere (the "GPU" KV cache is a CPU tensor, jobs run on a thread).
The CUDA tests need a GPU and skip otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.page_copy import (
    CpuGpuOffloadingHandlers,
    PageCopyHandler,
    expand_block_ids,
)
from vllm.v1.kv_offload.worker.page_views import canonicalize_kv_caches
from vllm.v1.kv_offload.worker.transfer_stream import TransferEvent, TransferStream
from vllm.v1.kv_offload.worker.worker import OffloadingWorker

try:
    from vllm import _custom_ops as ops

    SWAP_BLOCKS: Callable[..., None] | None = ops.swap_blocks
except ImportError:
    SWAP_BLOCKS = None

NO_CUDA = "needs a CUDA GPU"

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def reference_swap_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_size_in_bytes: int, mapping: torch.Tensor
) -> None:
    """Pure-torch swap_blocks for the handlers' 2-D uint8 page tensors."""
    assert src.shape[1] == dst.shape[1] == block_size_in_bytes
    dst[mapping[:, 1].to(dst.device)] = src[mapping[:, 0].to(src.device)].to(dst.device)


def swap_blocks(*args: object) -> None:
    (SWAP_BLOCKS or reference_swap_blocks)(*args)  # type: ignore[arg-type]


NUM_BLOCKS = 8


def make_config(num_blocks: int = NUM_BLOCKS, head_size: int = 64) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16
    )
    names = ["layers.0.attn", "layers.1.attn"]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n]) for n in names
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def make_handlers(
    device: str = "cpu",
    num_blocks: int = NUM_BLOCKS,
    swap: Callable[..., None] = swap_blocks,
    head_size: int = 64,
    num_cpu_blocks: int = 4,
    cpu_block_size: int = 32,
) -> tuple[CpuGpuOffloadingHandlers, list[torch.Tensor]]:
    config = make_config(num_blocks, head_size)
    raw = [torch.zeros(t.size, dtype=torch.int8, device=device) for t in config.kv_cache_tensors]
    kv_caches = {t.shared_by[0]: r for t, r in zip(config.kv_cache_tensors, raw, strict=True)}
    handlers = CpuGpuOffloadingHandlers(
        canonicalize_kv_caches(kv_caches, config),
        block_size_factor=cpu_block_size // 16,
        num_cpu_blocks=num_cpu_blocks,
        swap_blocks=swap,
    )
    return handlers, raw


def store_spec(
    gpu: list[int], cpu: list[int], index: int = 0
) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    return GPULoadStoreSpec(gpu, [len(gpu)], [index]), CPULoadStoreSpec(cpu)


def load_spec(
    cpu: list[int], gpu: list[int], index: int = 0
) -> tuple[CPULoadStoreSpec, GPULoadStoreSpec]:
    return CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu, [len(gpu)], [index])


def test_expand_block_ids() -> None:
    out = np.empty(5, dtype=np.int64)
    expand_block_ids(np.array([2, 0]), 3, out, skip_count=1)
    assert out.tolist() == [7, 8, 0, 1, 2]


class _ManualEvent(TransferEvent):
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        assert self.done, "would block forever"


class _ManualStream(TransferStream):
    """A stream whose jobs complete when the test says so, in any order."""

    def __init__(self) -> None:
        self.events: list[_ManualEvent] = []
        self.waits: list[bool] = []
        self.waited_events: list[list[TransferEvent]] = []

    def submit(
        self,
        copy_fn: Callable[[], None],
        wait_for_compute: bool,
        wait_events: Sequence[TransferEvent] = (),
    ) -> TransferEvent:
        copy_fn()
        self.waits.append(wait_for_compute)
        self.waited_events.append(list(wait_events))
        self.events.append(_ManualEvent())
        return self.events[-1]


def test_get_finished_never_reports_a_later_job_first() -> None:
    """Even when later jobs' events complete first, results come in submission order."""
    streams: list[_ManualStream] = []

    def factory(device: torch.device, name: str) -> TransferStream:
        streams.append(_ManualStream())
        return streams[-1]

    config = make_config()
    raw = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    handlers = CpuGpuOffloadingHandlers(
        canonicalize_kv_caches(
            {t.shared_by[0]: r for t, r in zip(config.kv_cache_tensors, raw, strict=True)}, config
        ),
        block_size_factor=1,
        num_cpu_blocks=4,
        swap_blocks=reference_swap_blocks,
        transfer_stream_factory=factory,
    )
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    for job_id in (10, 11, 12):
        assert store.transfer_async(job_id, store_spec([job_id - 10], [job_id - 10]))
    load.transfer_async(20, load_spec([0], [5]))
    # GPU -> CPU waits for the producer of the pages; CPU -> GPU does not by default.
    assert streams[0].waits == [True, True, True] and streams[1].waits == [False]
    # The load waits (on its stream) for the three earlier stores, none reported yet.
    assert streams[0].waited_events == [[], [], []]
    assert streams[1].waited_events == [streams[0].events]

    streams[0].events[2].done = True
    streams[0].events[1].done = True
    assert store.get_finished() == []
    streams[0].events[0].done = True
    results = store.get_finished()
    assert [r.job_id for r in results] == [10, 11, 12]
    assert all(r.success and r.transfer_type == ("GPU", "CPU") for r in results)
    assert results[0].transfer_size == 2 * 8192  # one page of each of the two buffers
    assert store.get_finished() == []
    streams[1].events[0].done = True
    assert [r.job_id for r in load.get_finished()] == [20]


def test_thread_path_orders_a_tiny_job_after_a_slow_one() -> None:
    """CPU path: a slow first job and tiny later ones finish and are reported in order."""
    release = threading.Event()
    calls: list[int] = []

    def slow_swap(src: torch.Tensor, dst: torch.Tensor, size: int, mapping: torch.Tensor) -> None:
        if mapping.shape[0] > 1:
            release.wait(timeout=10)
        calls.append(mapping.shape[0])
        swap_blocks(src, dst, size, mapping)

    handlers, raw = make_handlers(swap=slow_swap, cpu_block_size=16)
    store = handlers.gpu_to_cpu_handler
    store.transfer_async(0, store_spec([0, 1, 2, 3], [0, 1, 2, 3]))
    store.transfer_async(1, store_spec([4], [0]))
    store.transfer_async(2, store_spec([5], [1]))
    time.sleep(0.05)
    assert store.get_finished() == []  # the slow job blocks the tiny ones
    release.set()
    seen: list[int] = []
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        seen.extend(r.job_id for r in store.get_finished())
        assert seen == [0, 1, 2][: len(seen)]
        time.sleep(0.001)
    assert seen == [0, 1, 2]
    assert calls == [4, 4, 1, 1, 1, 1]  # both buffers per job, in submission order
    handlers.shutdown()


def test_gpu_to_cpu_sees_data_written_just_before_submission() -> None:
    handlers, raw = make_handlers()
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    pages = handlers.gpu_tensors
    for round_ in range(3):
        for p in pages:
            p[2].fill_(round_ + 1)
            p[3].fill_(round_ + 101)
        store.transfer_async(round_, store_spec([2, 3], [1]))  # block size factor 2
        # Written after submission: the job may or may not see it; the test does not depend on it.
        store.wait([round_])
        for cpu in handlers.cpu_tensors:
            assert bool((cpu[2] == round_ + 1).all()) and bool((cpu[3] == round_ + 101).all())
        assert [r.job_id for r in store.get_finished()] == [round_]
    # Load the second page of CPU block 1 (skip the first) into GPU block 6.
    load.transfer_async(7, load_spec([1], [6], index=1))
    load.wait([7])
    for p in pages:
        assert bool((p[6] == 103).all())
    assert [(r.job_id, r.transfer_type) for r in load.get_finished()] == [(7, ("CPU", "GPU"))]
    handlers.shutdown()


def test_invalid_specs_raise_before_copying() -> None:
    handlers, raw = make_handlers(cpu_block_size=32)
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    with pytest.raises(ValueError, match=r"GPU \(source\) block ids must be in \[0, 8\)"):
        store.transfer_async(0, store_spec([7, 8], [0]))
    with pytest.raises(ValueError, match=r"CPU \(destination\) block ids must be in \[0, 4\)"):
        store.transfer_async(0, store_spec([0, 1], [4]))
    with pytest.raises(ValueError, match="1 CPU block ids are too few for group sizes"):
        store.transfer_async(0, store_spec([0, 1, 2], [0]))
    with pytest.raises(ValueError, match="2 source and 2 destination block ids, but the groups"):
        load.transfer_async(0, load_spec([0, 1], [0, 1]))
    with pytest.raises(ValueError, match="group_sizes has 2 entries for 1 KV-cache groups"):
        store.transfer_async(0, (GPULoadStoreSpec([0, 1], [1, 1], [0, 0]), CPULoadStoreSpec([0])))
    with pytest.raises(ValueError, match="expected a 1-D sequence of ints"):
        CPULoadStoreSpec([[1, 2]])
    assert store.get_finished() == [] and load.get_finished() == []
    store.transfer_async(1, store_spec([0, 1], [0]))
    with pytest.raises(ValueError, match="job 1 is already in flight"):
        store.transfer_async(1, store_spec([2, 3], [1]))
    store.wait([1, 99])  # unknown ids are ignored
    assert [r.job_id for r in store.get_finished()] == [1]
    handlers.shutdown()


def test_failed_copy_reports_failure_in_order() -> None:
    def failing_swap(src: torch.Tensor, dst: torch.Tensor, size: int, m: torch.Tensor) -> None:
        if int(m[0, 0]) == 3:
            raise RuntimeError("copy failed")
        swap_blocks(src, dst, size, m)

    handlers, _ = make_handlers(swap=failing_swap, cpu_block_size=16)
    store = handlers.gpu_to_cpu_handler
    for job_id, block in enumerate([1, 3, 5]):
        store.transfer_async(job_id, store_spec([block], [job_id]))
    store.wait([0, 1, 2])
    assert [(r.job_id, r.success) for r in store.get_finished()] == [
        (0, True),
        (1, False),
        (2, True),
    ]
    handlers.shutdown()


def test_offloading_worker_routes_by_medium() -> None:
    handlers, _ = make_handlers()
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler)
    with pytest.raises(ValueError, match="no handler registered for CPU -> GPU"):
        worker.transfer_async(0, load_spec([0], [0, 1]))
    with pytest.raises(ValueError, match="already registered"):
        worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler)
    worker.transfer_async(0, store_spec([0, 1], [0]))
    worker.transfer_async(1, load_spec([0], [2, 3]))
    worker.wait([0])
    worker.wait([1])
    assert sorted(r.job_id for r in worker.get_finished()) == [0, 1]
    worker.shutdown()


def test_handler_rejects_mismatched_tensors() -> None:
    handlers, _ = make_handlers()
    gpu = handlers.gpu_tensors
    with pytest.raises(ValueError, match=r"page size 4096 bytes differs from the source's 8192"):
        PageCopyHandler(
            [gpu[0]],
            [torch.empty(4, 4096, dtype=torch.uint8)],
            1,
            1,
            ("GPU", "CPU"),
            handlers.gpu_to_cpu_handler.transfer_stream,
            True,
        )
    with pytest.raises(ValueError, match="expected a torch.uint8 \\[num_rows, row_bytes\\]"):
        PageCopyHandler(
            [gpu[0].view(torch.int8)],
            [gpu[0]],
            1,
            1,
            ("GPU", "CPU"),
            handlers.gpu_to_cpu_handler.transfer_stream,
            True,
        )
    handlers.shutdown()


def test_page_views_share_memory_with_the_kv_cache() -> None:
    config = make_config()
    raw = [torch.zeros(t.size, dtype=torch.int8) for t in config.kv_cache_tensors]
    canonical = canonicalize_kv_caches(
        {t.shared_by[0]: r for t, r in zip(config.kv_cache_tensors, raw, strict=True)}, config
    )
    canonical.tensors[1].tensor[3, 5] = 7
    assert int(raw[1][3 * 8192 + 5]) == 7


# --- CUDA: the dedicated transfer stream, events and the wait on the compute stream ---------


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.skipif(SWAP_BLOCKS is None, reason="vllm._custom_ops is not built")
def test_cuda_gpu_to_cpu_waits_for_the_compute_stream() -> None:
    handlers, raw = make_handlers(device="cuda", num_blocks=64)
    store = handlers.gpu_to_cpu_handler
    pages = handlers.gpu_tensors
    for job_id in range(3):
        # Queue a long kernel and then the write on the compute stream; submit at once,
        # without a host sync. The copy must see the write.
        torch.cuda._sleep(50_000_000)
        for p in pages:
            p[job_id].fill_(job_id + 1)
        store.transfer_async(job_id, store_spec([job_id, 63], [job_id]))
    store.wait([2])
    for cpu in handlers.cpu_tensors:
        for job_id in range(3):
            assert bool((cpu[2 * job_id] == job_id + 1).all())
    assert [r.job_id for r in store.get_finished()] == [0, 1, 2]
    handlers.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.skipif(SWAP_BLOCKS is None, reason="vllm._custom_ops is not built")
def test_cuda_ordered_completion_and_load() -> None:
    """A large store and tiny later stores: events are polled in order and jobs never
    complete out of order; a load's pages are on the GPU once it is reported."""
    num_blocks = 512
    handlers, raw = make_handlers(
        device="cuda",
        num_blocks=num_blocks,
        head_size=256,
        num_cpu_blocks=num_blocks,
        cpu_block_size=16,
    )
    store, load = handlers.gpu_to_cpu_handler, handlers.cpu_to_gpu_handler
    for p in handlers.gpu_tensors:
        p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device="cuda"))
    torch.cuda._sleep(20_000_000)  # the big job also waits for this
    big = list(range(num_blocks))
    store.transfer_async(0, store_spec(big, big))
    for job_id in range(1, 4):
        store.transfer_async(job_id, store_spec([job_id], [job_id]))
    seen: list[int] = []
    while len(seen) < 4:
        seen.extend(r.job_id for r in store.get_finished())
        assert seen == [0, 1, 2, 3][: len(seen)]
    for gpu, cpu in zip(handlers.gpu_tensors, handlers.cpu_tensors, strict=True):
        assert torch.equal(gpu.cpu(), cpu)
    expected = [cpu[10].clone() for cpu in handlers.cpu_tensors]
    for p in handlers.gpu_tensors:
        p[3].zero_()
    # Loads do not wait for the compute stream (the engine only loads into free blocks).
    torch.cuda.current_stream().synchronize()
    load.transfer_async(4, load_spec([10], [3]))
    while not load.get_finished():
        pass
    for gpu, want in zip(handlers.gpu_tensors, expected, strict=True):
        assert torch.equal(gpu[3].cpu(), want)
    assert handlers.cpu_tensors[0].is_pinned()
    handlers.shutdown()


# --- Ordering across directions: loads wait for earlier stores, results in submission order ---


def _make_connector_worker(
    swap: Callable[..., None], device: str = "cpu", num_blocks: int = NUM_BLOCKS
) -> tuple[OffloadingWorker, CpuGpuOffloadingHandlers]:
    handlers, _ = make_handlers(
        device=device, num_blocks=num_blocks, swap=swap, cpu_block_size=16, num_cpu_blocks=4
    )
    worker = OffloadingWorker()
    worker.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu_handler)
    worker.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu_handler)
    return worker, handlers


def test_load_after_a_slow_store_reads_the_stored_bytes() -> None:
    """Thread path: a load of a CPU block submitted while the store filling it is still
    copying (slow swap) waits for it and returns the stored bytes; results in order."""
    release = threading.Event()
    store_started = threading.Event()

    def slow_store_swap(src: torch.Tensor, dst: torch.Tensor, size: int, m: torch.Tensor) -> None:
        if dst.device.type == "cpu" and dst.data_ptr() in cpu_ptrs:  # GPU -> CPU
            store_started.set()
            release.wait(timeout=10)
        swap_blocks(src, dst, size, m)

    worker, handlers = _make_connector_worker(slow_store_swap)
    cpu_ptrs = {t.data_ptr() for t in handlers.cpu_tensors}
    gpu = handlers.gpu_tensors
    for i, p in enumerate(gpu):
        p[1].fill_(17 + i)
        p[6].zero_()
    worker.transfer_async(0, store_spec([1], [2]))
    worker.transfer_async(1, load_spec([2], [6]))
    assert store_started.wait(timeout=10)
    time.sleep(0.05)
    assert worker.get_finished() == []  # neither the store nor the load behind it finished
    for p in gpu:
        assert bool((p[6] == 0).all())  # the load has not overtaken the store
    release.set()
    worker.wait([1])
    for i, p in enumerate(gpu):
        assert bool((p[6] == 17 + i).all())
    assert [(r.job_id, r.success, r.transfer_type) for r in worker.get_finished()] == [
        (0, True, ("GPU", "CPU")),
        (1, True, ("CPU", "GPU")),
    ]
    worker.shutdown()


def test_finished_jobs_are_not_held_behind_another_handlers() -> None:
    """A store submitted after a slow load finishes first, and is reported first."""
    release = threading.Event()

    def slow_load_swap(src: torch.Tensor, dst: torch.Tensor, size: int, m: torch.Tensor) -> None:
        if src.data_ptr() in cpu_ptrs:  # CPU -> GPU
            release.wait(timeout=10)
        swap_blocks(src, dst, size, m)

    worker, handlers = _make_connector_worker(slow_load_swap)
    cpu_ptrs = {t.data_ptr() for t in handlers.cpu_tensors}
    worker.transfer_async(0, store_spec([0], [0]))
    worker.wait([0])
    worker.transfer_async(1, load_spec([0], [5]))  # slow
    worker.transfer_async(2, store_spec([3], [1]))  # fast, a later job
    handlers.gpu_to_cpu_handler.wait([2])
    seen = [r.job_id for r in worker.get_finished()]
    assert seen == [0, 2]  # job 1 (another handler's) still runs: 2 is not held back
    release.set()
    worker.wait([1])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    assert worker.get_finished() == []
    worker.shutdown()


def test_worker_reports_a_handlers_exception_as_not_submitted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker, _ = _make_connector_worker(swap_blocks)
    assert worker.transfer_async(3, store_spec([4], [2]))
    with caplog.at_level("WARNING"):
        assert not worker.transfer_async(3, store_spec([5], [3]))  # job 3 is in flight
    assert "job 3 is already in flight" in caplog.text
    worker.wait([3])
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(3, True)]
    worker.shutdown()


def test_load_fails_when_the_store_it_waits_for_fails() -> None:
    release = threading.Event()

    def failing_store_swap(
        src: torch.Tensor, dst: torch.Tensor, size: int, m: torch.Tensor
    ) -> None:
        if dst.data_ptr() in cpu_ptrs:
            release.wait(timeout=10)
            raise RuntimeError("store failed")
        swap_blocks(src, dst, size, m)

    worker, handlers = _make_connector_worker(failing_store_swap)
    cpu_ptrs = {t.data_ptr() for t in handlers.cpu_tensors}
    worker.transfer_async(0, store_spec([1], [2]))
    worker.transfer_async(1, load_spec([2], [6]))
    release.set()
    worker.wait([1])
    assert sorted((r.job_id, r.success) for r in worker.get_finished()) == [
        (0, False),
        (1, False),
    ]
    worker.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.skipif(SWAP_BLOCKS is None, reason="vllm._custom_ops is not built")
def test_cuda_load_waits_for_an_earlier_slow_store() -> None:
    """CUDA: the store waits for a long kernel on the compute stream; the load of the same CPU
    block, submitted at once, must wait (stream wait on the store's event) and see its bytes."""
    worker, handlers = _make_connector_worker(swap_blocks, device="cuda", num_blocks=64)
    gpu = handlers.gpu_tensors
    for p in gpu:
        p[6].zero_()
    torch.cuda.current_stream().synchronize()
    torch.cuda._sleep(100_000_000)
    for i, p in enumerate(gpu):
        p[1].fill_(17 + i)
    worker.transfer_async(0, store_spec([1], [2]))
    worker.transfer_async(1, load_spec([2], [6]))
    worker.transfer_async(2, store_spec([3], [1]))
    seen: list[int] = []
    while len(seen) < 3:
        seen.extend(r.job_id for r in worker.get_finished())
        assert seen == [0, 1, 2][: len(seen)]
    for i, p in enumerate(gpu):
        assert bool((p[6] == 17 + i).all())
    worker.shutdown()
