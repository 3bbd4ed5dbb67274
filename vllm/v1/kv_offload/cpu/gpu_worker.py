"""CPU <-> GPU offloading of KV-cache pages, upstream v0.33's worker of the CPU medium.

:class:`CPUOffloadingWorker` runs three :class:`SingleDirectionOffloadingHandler` (stores,
loads, expedited loads). A handler turns each job into copy descriptors (source address,
destination address, bytes; :mod:`~vllm.v1.kv_offload.cpu.copy_descriptors`) and runs them
with one batch copy function (:func:`_select_swap_blocks_fn`) on a transfer stream.

Ordering: a handler's jobs run in submission order and are reported in that order. Every job
(store or load) first waits for the work queued so far on the compute stream: a store reads
pages the model writes, and a load must land after pending writes (zeroing) of its
destination blocks. The directions are independent: the engine loads only chunks whose
store it has seen finish. v0.22's handler pair over ``ops.swap_blocks`` (loads waiting for
unreported stores) is :class:`~vllm.v1.kv_offload.cpu.page_copy.CpuGpuOffloadingHandlers`.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm import _custom_ops as ops
from vllm.platforms import current_platform
from vllm.triton_utils import HAS_TRITON, triton
from vllm.utils import check_positive_int
from vllm.utils.torch_utils import PIN_MEMORY
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.batch_copy import (
    SwapBlocksBatchFn,
    host_swap_blocks_batch,
    swap_blocks_per_descriptor,
)
from vllm.v1.kv_offload.cpu.canonical_copy import (
    CopyPlan,
    build_copy_plan,
    canonical_block_sizes,
    canonical_page_ids,
)
from vllm.v1.kv_offload.cpu.copy_descriptors import (
    DescriptorFiller,
    compute_sub_block_ptrs,
    new_descriptor_buffers,
)
from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister
from vllm.v1.kv_offload.cpu.page_copy import (
    CpuGpuOffloadingHandlers,
    SwapBlocksFn,
    check_worker_inputs,
    expand_block_ids,
)
from vllm.v1.kv_offload.cpu.region_pinning import (
    MAX_HOST_REGISTER_CHUNK_BYTES,
    MIN_HOST_REGISTER_SAVED_BYTES,
    pin_region,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.swap_blocks_triton import THRESHOLD_BYTES, swap_blocks_batch
from vllm.v1.kv_offload.worker.page_views import canonical_page_tensor
from vllm.v1.kv_offload.worker.transfer_stream import (
    TransferEvent,
    TransferStream,
    make_transfer_stream,
)

__all__ = [
    "CPUOffloadingWorker",
    "CopyPlan",
    "CpuGpuOffloadingHandlers",
    "MAX_HOST_REGISTER_CHUNK_BYTES",
    "MIN_HOST_REGISTER_SAVED_BYTES",
    "SingleDirectionOffloadingHandler",
    "SwapBlocksFn",
    "Transfer",
    "compute_sub_block_ptrs",
    "expand_block_ids",
    "pin_mmap_region",
]

logger = logging.getLogger(__name__)

# upstream v0.33's names of the canonical-layout helpers
_build_copy_plan = build_copy_plan
_canonical_page_ids = canonical_page_ids
_canonical_block_sizes = canonical_block_sizes


def _dma_swap_blocks_batch(gpu_to_cpu: bool) -> SwapBlocksBatchFn:
    """The extension's ``swap_blocks_batch`` (upstream's DMA batch op) when it has one; this
    library's extension does not yet, so each descriptor goes through ``ops.swap_blocks``."""
    batch_op = getattr(ops, "swap_blocks_batch", None)
    if batch_op is not None:
        return batch_op
    return functools.partial(
        swap_blocks_per_descriptor,
        swap_blocks=ops.swap_blocks,
        src_on_device=gpu_to_cpu,
        dst_on_device=not gpu_to_cpu,
    )


def _select_swap_blocks_fn(
    layer_refs_per_group: Sequence[Sequence[CanonicalKVCacheRef]],
    gpu_to_cpu: bool,
    host_memory_is_pinned: bool = True,
) -> SwapBlocksBatchFn:
    """The batch copy function of a handler, chosen once: the Triton kernel only for loads
    of small 8-byte-multiple pages into the GPU from pinned host memory (the kernel reads
    host memory from the device, which needs pinned, UVA-mapped pages: not on XPU or ROCm),
    DMA otherwise (stores are bandwidth-bound: the copy engine wins)."""
    if gpu_to_cpu or not host_memory_is_pinned:
        return _dma_swap_blocks_batch(gpu_to_cpu)
    if not HAS_TRITON or current_platform.is_xpu() or current_platform.is_rocm():
        return _dma_swap_blocks_batch(gpu_to_cpu)
    sizes = [ref.page_size_bytes for refs in layer_refs_per_group for ref in refs]
    if not sizes or max(sizes) >= THRESHOLD_BYTES or any(s % 8 for s in sizes):
        return _dma_swap_blocks_batch(gpu_to_cpu)
    chunk = min(triton.next_power_of_2(max(sizes)), 8192)
    return functools.partial(swap_blocks_batch, bytes_per_chunk=chunk)


def pin_mmap_region(region: SharedOffloadRegion, worker_slot_only: bool = False) -> None:
    """Page-lock ``region`` (or this worker's slots) all or nothing, with this module's
    ``host_register`` / ``host_unregister`` and size limits (see
    :func:`~vllm.v1.kv_offload.cpu.region_pinning.pin_region`)."""
    pin_region(
        region,
        worker_slot_only,
        register=host_register,
        unregister=host_unregister,
        max_chunk_bytes=MAX_HOST_REGISTER_CHUNK_BYTES,
        min_saved_bytes=MIN_HOST_REGISTER_SAVED_BYTES,
    )


@dataclass
class Transfer:
    """One submitted job: its stream, completion event, bytes moved and descriptor buffers
    (back to the pools once it is reported)."""

    job_id: int
    stream: TransferStream
    end_event: TransferEvent
    num_bytes: int
    batch_src: torch.Tensor
    batch_dst: torch.Tensor
    batch_sizes: torch.Tensor


def _check_page_tensor(name: str, t: torch.Tensor, device_type: str) -> None:
    if t.element_size() != 1 or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{name}: expected a 2-D one-byte [num_rows, row_bytes] tensor with unit column "
            f"stride, got {t.dtype} of shape {tuple(t.shape)} and strides {t.stride()}"
        )
    if t.device.type != device_type:
        raise ValueError(f"{name}: expected a tensor on {device_type}, got {t.device}")


class SingleDirectionOffloadingHandler:
    """Copies pages between GPU and CPU tensors in one direction, jobs in submission order.

    ``gpu_tensors[i]``: ``[num_gpu_blocks, gpu_page_bytes]`` pages; ``cpu_tensors[i]``:
    ``[num_cpu_chunks, blocks_per_chunk * host_page_bytes]`` host rows (rows may be strided
    apart), where the host page is the GPU page, or with ``canonical_layout`` the largest
    canonical page of the tensor's refs. ``layer_refs_per_group``: per KV-cache group, the
    references (tensor, leading bytes of each page) it moves. ``host_memory_is_pinned``: the
    device may read the host rows directly (picks the copy function). ``swap_blocks_batch``
    overrides the copy function (default: :func:`_select_swap_blocks_fn`, or host copies when
    the "GPU" tensors live in host memory). Each job runs on a pooled transfer stream after
    the previous job and after the compute stream's queued work.
    """

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: list[list[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        canonical_layout: bool = False,
        host_memory_is_pinned: bool = True,
        *,
        swap_blocks_batch: SwapBlocksBatchFn | None = None,
    ):
        check_positive_int("blocks_per_chunk", blocks_per_chunk)
        if len(gpu_tensors) != len(cpu_tensors) or not gpu_tensors:
            raise ValueError(
                f"gpu_tensors/cpu_tensors: expected the same non-zero number of tensors, got "
                f"{len(gpu_tensors)} and {len(cpu_tensors)}"
            )
        device = gpu_tensors[0].device
        for i, (gpu, cpu) in enumerate(zip(gpu_tensors, cpu_tensors, strict=True)):
            _check_page_tensor(f"gpu_tensors[{i}]", gpu, device.type)
            _check_page_tensor(f"cpu_tensors[{i}]", cpu, "cpu")
        host_pages = (
            canonical_block_sizes(layer_refs_per_group, len(gpu_tensors))
            if canonical_layout
            else [t.shape[1] for t in gpu_tensors]
        )
        for i, cpu in enumerate(cpu_tensors):
            if cpu.shape[1] != host_pages[i] * blocks_per_chunk:
                raise ValueError(
                    f"cpu_tensors[{i}]: expected rows of {blocks_per_chunk} x {host_pages[i]} "
                    f"bytes, got {cpu.shape[1]} bytes"
                )
        for refs in layer_refs_per_group:
            for ref in refs:
                t = ref.tensor_idx
                if not 0 <= t < len(gpu_tensors) or not (
                    canonical_layout or 0 < ref.page_size_bytes <= gpu_tensors[t].shape[1]
                ):
                    raise ValueError(
                        f"layer_refs_per_group: expected a tensor index below "
                        f"{len(gpu_tensors)} and at most that tensor's page size, got {ref}"
                    )
        self.gpu_to_cpu = gpu_to_cpu
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.layer_refs_per_group = layer_refs_per_group
        self.src_blocks_per_chunk = 1 if gpu_to_cpu else blocks_per_chunk
        self.dst_blocks_per_chunk = blocks_per_chunk if gpu_to_cpu else 1
        self._num_src_blocks = min(t.shape[0] for t in self.src_tensors)
        self._num_dst_blocks = min(t.shape[0] for t in self.dst_tensors)
        if swap_blocks_batch is None:
            swap_blocks_batch = (
                host_swap_blocks_batch
                if device.type == "cpu"
                else _select_swap_blocks_fn(layer_refs_per_group, gpu_to_cpu, host_memory_is_pinned)
            )
        self._swap_blocks_batch = swap_blocks_batch
        self._filler = DescriptorFiller(
            self.src_tensors,
            self.dst_tensors,
            self.src_blocks_per_chunk,
            self.dst_blocks_per_chunk,
            layer_refs_per_group,
            gpu_to_cpu,
            canonical_layout,
        )
        self._device = device
        # A device reads the descriptors asynchronously: page-lock them for it.
        self._pin_descriptors = device.type != "cpu" and PIN_MEMORY
        self._transfer_type = ("GPU", "CPU") if gpu_to_cpu else ("CPU", "GPU")
        self._transfer_events: dict[int, TransferEvent] = {}
        self._transfers: deque[Transfer] = deque()
        self._stream_pool: list[TransferStream] = []
        self._event_pool: list[TransferEvent] = []
        self._buffer_pool: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def _group_blocks(
        self, name: str, ids: np.ndarray, offset: int, count: int, num_blocks: int
    ) -> np.ndarray:
        blocks = ids[offset : offset + count]
        if len(blocks) != count:
            raise ValueError(
                f"{name}: expected at least {offset + count} block ids for the group sizes "
                f"and block indices, got {len(ids)}"
            )
        if count and (blocks.min() < 0 or blocks.max() >= num_blocks):
            raise ValueError(f"{name}: expected block ids in [0, {num_blocks}), got {blocks}")
        return blocks

    def transfer_async(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Queue job ``job_id`` copying ``src_spec``'s pages to ``dst_spec``'s; True once
        queued. The GPU side is a :class:`GPULoadStoreSpec`; the host side lists the chunks of
        group 0, then group 1, ...: a group starting at request block ``i`` with ``n`` GPU
        blocks spans ``ceil((i % f + n) / f)`` chunks of ``f`` pages, skipping ``i % f``."""
        for name, spec in (("src_spec", src_spec), ("dst_spec", dst_spec)):
            if not isinstance(spec, BlockIDsLoadStoreSpec):
                raise TypeError(f"{name}: expected a block-id spec, got {type(spec).__name__}")
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu_spec = src_spec if self.gpu_to_cpu else dst_spec
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise TypeError(f"gpu spec: expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
        num_groups = len(self.layer_refs_per_group)
        if len(gpu_spec.group_sizes) != num_groups or len(gpu_spec.block_indices) != num_groups:
            raise ValueError(
                f"gpu spec: expected {num_groups} group sizes and block indices, got "
                f"{len(gpu_spec.group_sizes)} and {len(gpu_spec.block_indices)}"
            )
        if job_id in self._transfer_events:
            raise ValueError(f"job_id: expected a job not in flight, got {job_id}")
        src_ids, dst_ids = src_spec.block_ids, dst_spec.block_ids
        # Resolve every group's blocks (and check them) before anything is written.
        groups = []
        offsets = [0, 0]
        for g, (size, index) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            if size < 0 or index < 0:
                raise ValueError(f"gpu spec: expected non-negative sizes, got {size}, {index}")
            if size == 0:
                continue
            sides = []
            for col, (name, ids, per_chunk, num_blocks) in enumerate(
                (
                    ("src_spec", src_ids, self.src_blocks_per_chunk, self._num_src_blocks),
                    ("dst_spec", dst_ids, self.dst_blocks_per_chunk, self._num_dst_blocks),
                )
            ):
                skip = index % per_chunk
                count = -(-(skip + size) // per_chunk)
                sides.append((self._group_blocks(name, ids, offsets[col], count, num_blocks), skip))
                offsets[col] += count
            groups.append((g, size, sides))
        if offsets != [len(src_ids), len(dst_ids)]:
            raise ValueError(
                f"src_spec/dst_spec: expected {offsets[0]} and {offsets[1]} block ids for the "
                f"group sizes, got {len(src_ids)} and {len(dst_ids)}"
            )

        max_ops = self._filler.max_copy_ops(gpu_spec.group_sizes)
        buffers = self._buffer_pool.pop() if self._buffer_pool else None
        if buffers is None or buffers[0].numel() < max_ops:
            buffers = new_descriptor_buffers(max_ops, self._pin_descriptors)
        batch_src, batch_dst, batch_sizes = buffers
        all_src, all_dst, all_sizes = (b[:max_ops].numpy() for b in buffers)
        op_idx = num_bytes = 0
        for g, size, ((src_blocks, src_skip), (dst_blocks, dst_skip)) in groups:
            op_idx, group_bytes = self._filler.fill_group(
                g, src_blocks, dst_blocks, size, src_skip, dst_skip,
                all_src, all_dst, all_sizes, op_idx,
            )  # fmt: skip
            num_bytes += group_bytes
        src, dst, sizes = batch_src[:op_idx], batch_dst[:op_idx], batch_sizes[:op_idx]
        copy = self._swap_blocks_batch
        # Loads read host memory no stream writes, so the source may be read in any order;
        # stores read the live KV cache and keep stream order.
        order_any = not self.gpu_to_cpu

        def copy_pages() -> None:
            if op_idx:
                copy(src, dst, sizes, is_src_access_order_any=order_any)

        stream = self._stream_pool.pop() if self._stream_pool else self._new_stream()
        waits = [self._transfers[-1].end_event] if self._transfers else []
        reuse = self._event_pool.pop() if self._event_pool else None
        event = stream.submit(copy_pages, True, waits, reuse=reuse)
        self._transfer_events[job_id] = event
        self._transfers.append(
            Transfer(job_id, stream, event, num_bytes, batch_src, batch_dst, batch_sizes)
        )
        return True

    def _new_stream(self) -> TransferStream:
        direction = "gpu-to-cpu" if self.gpu_to_cpu else "cpu-to-gpu"
        return make_transfer_stream(self._device, f"kv-offload-{direction}")

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs in submission order (stops at the first one still running)."""
        results: list[TransferResult] = []
        while self._transfers and self._transfers[0].end_event.query():
            transfer = self._transfers.popleft()
            event = transfer.end_event
            results.append(
                TransferResult(
                    job_id=transfer.job_id,
                    success=event.error is None,
                    transfer_size=transfer.num_bytes,
                    transfer_time=event.elapsed_seconds(),
                    transfer_type=self._transfer_type,
                )
            )
            self._stream_pool.append(transfer.stream)
            self._event_pool.append(event)
            self._buffer_pool.append((transfer.batch_src, transfer.batch_dst, transfer.batch_sizes))
            del self._transfer_events[transfer.job_id]
        return results

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs (those in flight) have finished."""
        for job_id in job_ids:
            event = self._transfer_events.get(job_id)
            if event is not None:
                event.synchronize()

    def shutdown(self) -> None:
        """Wait for the jobs in flight and release streams, events, buffers and tensor views.
        When waiting fails (device lost), the remaining jobs are dropped unwaited and the
        error is raised after the release."""
        error: Exception | None = None
        streams = list(self._stream_pool)
        while self._transfers:
            transfer = self._transfers[0]
            try:
                transfer.end_event.synchronize()
            except Exception as e:
                logger.exception(
                    "waiting for a transfer failed; %d later transfers are not waited for",
                    len(self._transfers) - 1,
                )
                self._transfers.clear()
                error = e
                break
            streams.append(self._transfers.popleft().stream)
        if error is None:
            for stream in streams:
                stream.close()
        self._transfer_events.clear()
        self._stream_pool.clear()
        self._event_pool.clear()
        self._buffer_pool.clear()
        # The tensors may be views of a shared region that cannot unmap while they live.
        self.src_tensors.clear()
        self.dst_tensors.clear()
        if error is not None:
            raise error


class CPUOffloadingWorker(OffloadingWorker):
    """The worker of the CPU medium: stores, loads and expedited loads (their own handler,
    so they do not queue behind regular loads), each a :class:`SingleDirectionOffloadingHandler`.

    ``blocks_per_chunk`` GPU blocks per CPU chunk, ``num_cpu_chunks`` chunks. The host side
    is ``mmap_region`` (this worker's cells; pinned when pinning is available; the worker
    owns it once built and cleans it up on :meth:`shutdown`) or private zeroed tensors.
    ``canonical_layout``: host pages are canonical (parallelism-free) pages shared by every
    worker of ``mmap_region`` (or private with one worker); every data reference needs its
    mapping. ``swap_blocks``: a v0.22 page-copy op (``ops.swap_blocks``'s signature) run once
    per descriptor instead of the selected batch copy.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion | None = None,
        canonical_layout: bool = False,
        *,
        swap_blocks: SwapBlocksFn | None = None,
    ):
        check_worker_inputs(
            kv_caches,
            "blocks_per_chunk",
            blocks_per_chunk,
            "num_cpu_chunks",
            num_cpu_chunks,
            mmap_region,
        )
        host_pages = (
            canonical_block_sizes(kv_caches.group_data_refs, len(kv_caches.tensors))
            if canonical_layout
            else [t.page_size_bytes for t in kv_caches.tensors]
        )
        gpu_tensors = [
            canonical_page_tensor(t, f"kv_caches.tensors[{i}]").view(torch.int8)
            for i, t in enumerate(kv_caches.tensors)
        ]
        device = gpu_tensors[0].device
        pin_memory = PIN_MEMORY and device.type != "cpu"
        if mmap_region is not None and pin_memory:
            pin_mmap_region(mmap_region, worker_slot_only=not canonical_layout)
        host_memory_is_pinned = pin_memory and (mmap_region is None or mmap_region.is_pinned)
        cpu_tensors: list[torch.Tensor] = []
        for page in host_pages:
            row_bytes = page * blocks_per_chunk
            if mmap_region is None:
                cpu_tensors.append(
                    torch.zeros(
                        (num_cpu_chunks, row_bytes), dtype=torch.int8, pin_memory=pin_memory
                    )
                )
            elif canonical_layout:
                cpu_tensors.append(mmap_region.create_next_canonical_view(row_bytes))
            else:
                cpu_tensors.append(mmap_region.create_next_worker_view(row_bytes))
        make_handler = functools.partial(
            SingleDirectionOffloadingHandler,
            gpu_tensors=gpu_tensors,
            cpu_tensors=cpu_tensors,
            blocks_per_chunk=blocks_per_chunk,
            layer_refs_per_group=kv_caches.group_data_refs,
            canonical_layout=canonical_layout,
            host_memory_is_pinned=host_memory_is_pinned,
        )

        def batch_fn(gpu_to_cpu: bool) -> SwapBlocksBatchFn | None:
            if swap_blocks is None:
                return None
            on_device = device.type != "cpu"
            return functools.partial(
                swap_blocks_per_descriptor,
                swap_blocks=swap_blocks,
                src_on_device=on_device and gpu_to_cpu,
                dst_on_device=on_device and not gpu_to_cpu,
            )

        self._store_handler = make_handler(gpu_to_cpu=True, swap_blocks_batch=batch_fn(True))
        self._load_handler = make_handler(gpu_to_cpu=False, swap_blocks_batch=batch_fn(False))
        self._expedited_load_handler = make_handler(
            gpu_to_cpu=False, swap_blocks_batch=batch_fn(False)
        )
        # The caller owns the region until here; from now on the worker releases it.
        self._mmap_region = mmap_region

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._store_handler.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        handler = self._expedited_load_handler if expedited else self._load_handler
        return handler.transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return (
            self._store_handler.get_finished()
            + self._load_handler.get_finished()
            + self._expedited_load_handler.get_finished()
        )

    def wait(self, job_ids: set[int]) -> None:
        for handler in (self._store_handler, self._load_handler, self._expedited_load_handler):
            handler.wait(job_ids)

    def shutdown(self) -> None:
        """Drain stores, then loads, then expedited loads, then release the region. A handler
        that fails to drain is logged; the device is then synchronized (best effort) before
        the region is unmapped, so no copy still in flight touches freed memory."""
        failed = False
        for name, handler in (
            ("store", self._store_handler),
            ("load", self._load_handler),
            ("load", self._expedited_load_handler),
        ):
            try:
                handler.shutdown()
            except Exception:
                logger.exception("Failed to shut down %s offloading handler", name)
                failed = True
        if self._mmap_region is None:
            return
        if failed:
            try:
                torch.accelerator.synchronize()
            except Exception:
                logger.warning(
                    "Device sync before mmap cleanup failed; cleaning the region up anyway",
                    exc_info=True,
                )
        self._mmap_region.cleanup()
        self._mmap_region = None
