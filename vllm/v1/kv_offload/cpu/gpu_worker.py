"""CPU <-> GPU offloading of KV-cache pages: both directions' handlers over private or shared
(:class:`SharedOffloadRegion`) host memory, its pinning, and the v0.33 worker of the CPU
medium. The copies themselves and their ordering contract are
:mod:`vllm.v1.kv_offload.cpu.page_copy`'s.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import torch

from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.canonical_copy import (
    CopyPlan,  # noqa: F401
    build_copy_plan,
    canonical_block_sizes,
    canonical_page_ids,
)
from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister
from vllm.v1.kv_offload.cpu.page_copy import (
    SingleDirectionOffloadingHandler,
    SwapBlocksFn,
    default_swap_blocks,  # noqa: F401
    expand_block_ids,  # noqa: F401
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.worker.page_views import canonical_page_tensor
from vllm.v1.kv_offload.worker.transfer_stream import (
    TransferStream,
    make_transfer_stream,
)

logger = logging.getLogger(__name__)

# upstream v0.33's names of the canonical-layout helpers
_build_copy_plan = build_copy_plan
_canonical_page_ids = canonical_page_ids
_canonical_block_sizes = canonical_block_sizes

MAX_HOST_REGISTER_CHUNK_BYTES = 64 * 1024**3
"""Largest single host registration (bytes); a larger region registers in row-aligned
chunks."""
MIN_HOST_REGISTER_SAVED_BYTES = 3 * 1024**2
"""Registering only this worker's slots (not whole rows) pays when it skips at least this
many bytes of each row; else a few whole-region calls are cheaper."""


def _registration_ranges(
    region: SharedOffloadRegion, worker_slot_only: bool
) -> list[tuple[int, int]]:
    """(address, bytes) of each registration: this worker's page-rounded slot per row when
    asked for and worth it, else the whole file in chunks that end on row boundaries (so no
    chunk transfer straddles two registrations)."""
    assert region._base is not None
    base = region._base.data_ptr()
    page = mmap.PAGESIZE
    stride = region._row_stride
    if worker_slot_only and region.rank is not None:
        start = region.rank * region.cpu_page_size
        first = start - start % page
        span = -(-(start + region.cpu_page_size) // page) * page - first
        if stride - span >= max(page, MIN_HOST_REGISTER_SAVED_BYTES):
            return [(base + row * stride + first, span) for row in range(region.num_chunks)]
    chunk = max(MAX_HOST_REGISTER_CHUNK_BYTES // stride, 1) * stride
    total = region.total_size_bytes
    return [(base + offset, min(chunk, total - offset)) for offset in range(0, total, chunk)]


def pin_mmap_region(region: SharedOffloadRegion, worker_slot_only: bool = False) -> None:
    """Page-lock the shared offload file (or only this worker's slots,
    ``worker_slot_only``), all or nothing: when a registration fails, the earlier ones are
    released and copies to and from the region stay unpinned (slower)."""
    registered: list[int] = []
    for address, size in _registration_ranges(region, worker_slot_only):
        if not host_register(address, size):
            for done in reversed(registered):
                host_unregister(done)
            region.pinned_addresses, region.is_pinned = [], False
            logger.warning("the shared offload region (rank %s) stays pageable", region.rank)
            return
        registered.append(address)
    region.pinned_addresses, region.is_pinned = registered, True


class CpuGpuOffloadingHandlers:
    """The two handlers (GPU -> CPU and CPU -> GPU) of a worker's KV cache, and the CPU buffers.

    Per canonical tensor (``[num_gpu_blocks, page_size_bytes]`` pages) one CPU buffer of
    ``torch.uint8``: without ``mmap_region`` a ``[num_cpu_blocks * block_size_factor,
    page_size_bytes]`` tensor (pinned when ``pin_memory``, by default when the KV cache is on
    a CUDA device), CPU block ``c`` holding pages ``c * f .. c * f + f - 1``; with
    ``mmap_region`` (a :class:`SharedOffloadRegion` opened with this worker's rank) the
    region's next view ``[num_cpu_blocks, block_size_factor * page_size_bytes]``, whose rows
    are this worker's cells of the region's interleaved rows (pinned with ``cudaHostRegister``
    when ``pin_memory``). The GPU -> CPU handler owns the region: its :meth:`shutdown` drops
    the views and cleans the region up. A group moves the first ``page_size_bytes`` of each
    page of the tensors its :attr:`kv_cache_groups_data_refs` name, as raw bytes. The CPU
    buffers are not initialised: their bytes mean something only once stored.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int,
        num_cpu_blocks: int,
        mmap_region: SharedOffloadRegion | None = None,
        *,
        pin_memory: bool | None = None,
        swap_blocks: SwapBlocksFn | None = None,
        transfer_stream_factory: Callable[[torch.device, str], TransferStream] | None = None,
        wait_for_compute_on_load: bool = False,
        canonical_layout: bool = False,
    ):
        check_positive_int("block_size_factor", block_size_factor)
        check_positive_int("num_cpu_blocks", num_cpu_blocks)
        if not kv_caches.tensors:
            raise ValueError("kv_caches: expected at least one KV-cache tensor")
        if mmap_region is not None and mmap_region.num_blocks != num_cpu_blocks:
            raise ValueError(
                f"mmap_region: holds {mmap_region.num_blocks} blocks, expected "
                f"num_cpu_blocks={num_cpu_blocks}"
            )
        self.block_size_factor = block_size_factor
        self.num_cpu_blocks = num_cpu_blocks
        self.kv_cache_groups_data_refs = kv_caches.group_data_refs
        self.gpu_tensors = [
            canonical_page_tensor(t, f"kv_caches.tensors[{i}]")
            for i, t in enumerate(kv_caches.tensors)
        ]
        self.num_gpu_blocks = min(t.shape[0] for t in self.gpu_tensors)
        device = self.gpu_tensors[0].device
        if pin_memory is None:
            pin_memory = device.type == "cuda" and torch.cuda.is_available()
        # Host bytes per GPU block of each tensor: its canonical page, or the worker's own.
        host_pages = (
            canonical_block_sizes(kv_caches.group_data_refs, len(self.gpu_tensors))
            if canonical_layout
            else [t.shape[1] for t in self.gpu_tensors]
        )
        if mmap_region is not None:
            if pin_memory and not mmap_region.is_pinned:
                pin_mmap_region(mmap_region)
            next_view = (
                mmap_region.create_next_canonical_view
                if canonical_layout
                else mmap_region.create_next_worker_view
            )
            self.cpu_tensors = [
                next_view(block_size_factor * page).view(torch.uint8) for page in host_pages
            ]
        else:
            self.cpu_tensors = [
                torch.empty(
                    (num_cpu_blocks * block_size_factor, page),
                    dtype=torch.uint8,
                    device="cpu",
                    pin_memory=pin_memory,
                )
                for page in host_pages
            ]
        factory = transfer_stream_factory or make_transfer_stream
        common = dict(
            group_data_refs=kv_caches.group_data_refs,
            swap_blocks=swap_blocks,
            canonical_layout=canonical_layout,
        )
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            src_tensors=self.gpu_tensors,
            dst_tensors=self.cpu_tensors,
            src_block_size_factor=1,
            dst_block_size_factor=block_size_factor,
            transfer_type=("GPU", "CPU"),
            transfer_stream=factory(device, "kv-offload-gpu-to-cpu"),
            wait_for_compute=True,
            mmap_region=mmap_region,
            **common,  # type: ignore[arg-type]
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            src_tensors=self.cpu_tensors,
            dst_tensors=self.gpu_tensors,
            src_block_size_factor=block_size_factor,
            dst_block_size_factor=1,
            transfer_type=("CPU", "GPU"),
            transfer_stream=factory(device, "kv-offload-cpu-to-gpu"),
            wait_for_compute=wait_for_compute_on_load,
            # Read-after-write on CPU blocks: a load waits for every earlier unreported store.
            depends_on=self.gpu_to_cpu_handler,
            **common,  # type: ignore[arg-type]
        )

    def shutdown(self) -> None:
        """Wait for jobs in flight and release both handlers' streams (and the region)."""
        self.cpu_to_gpu_handler.shutdown()
        self.gpu_to_cpu_handler.shutdown()


class CPUOffloadingWorker(OffloadingWorker):
    """The v0.33 worker of the CPU medium: :class:`CpuGpuOffloadingHandlers` behind
    ``submit_store`` / ``submit_load``.

    ``blocks_per_chunk`` GPU blocks per CPU chunk, ``num_cpu_chunks`` chunks; the CPU side is
    ``mmap_region`` (this worker's cells; the worker owns it once built and cleans it up on
    :meth:`shutdown`) or private tensors. Loads run in submission order behind earlier
    stores, so an ``expedited`` load cannot jump a queue and runs like any other.
    ``canonical_layout``: host pages are canonical (parallelism-free) pages, shared by every
    worker of ``mmap_region`` (see :mod:`~vllm.v1.kv_offload.cpu.canonical_copy`); every data
    reference of ``kv_caches`` must carry its mapping.
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
        self.handlers = CpuGpuOffloadingHandlers(
            kv_caches,
            blocks_per_chunk,
            num_cpu_chunks,
            mmap_region,
            swap_blocks=swap_blocks,
            canonical_layout=canonical_layout,
        )

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self.handlers.gpu_to_cpu_handler.transfer_async(job_id, (src_spec, dst_spec))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self.handlers.cpu_to_gpu_handler.transfer_async(job_id, (src_spec, dst_spec))

    def get_finished(self) -> list[TransferResult]:
        return (
            self.handlers.gpu_to_cpu_handler.get_finished()
            + self.handlers.cpu_to_gpu_handler.get_finished()
        )

    def wait(self, job_ids: set[int]) -> None:
        self.handlers.gpu_to_cpu_handler.wait(job_ids)
        self.handlers.cpu_to_gpu_handler.wait(job_ids)

    def shutdown(self) -> None:
        self.handlers.shutdown()
