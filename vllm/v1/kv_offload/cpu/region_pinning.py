"""Page-locking a :class:`SharedOffloadRegion` for DMA (``cudaHostRegister``), all or nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from vllm.v1.kv_offload.cpu.host_register import host_register, host_unregister
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

logger = logging.getLogger(__name__)

MAX_HOST_REGISTER_CHUNK_BYTES = 64 * 1024**3
"""Largest single host registration (bytes); a larger region registers in row-aligned
chunks."""
MIN_HOST_REGISTER_SAVED_BYTES = 3 * 1024**2
"""Registering only this worker's slots (not whole rows) pays when it skips at least this
many bytes of each row; else a few whole-region calls are cheaper."""


def _registration_ranges(
    region: SharedOffloadRegion, worker_slot_only: bool, max_chunk_bytes: int, min_saved_bytes: int
) -> Iterable[tuple[int, int]]:
    """(offset, bytes) of each registration: this worker's page-rounded slot per row when
    asked for and worth it, else the whole file in chunks that end on row boundaries (so no
    chunk transfer straddles two registrations)."""
    stride = region._row_stride
    min_saved = max(region.page_size, min_saved_bytes)
    if worker_slot_only and region.rank is not None and stride - region.cpu_page_size >= min_saved:
        return region.iter_worker_slot_ranges()
    logger.info(
        "registering the whole offload region (rank %s, row %d bytes, slot %d bytes)",
        region.rank,
        stride,
        region.cpu_page_size,
    )
    chunk = max(max_chunk_bytes // stride, 1) * stride
    total = region.total_size_bytes
    return [(offset, min(chunk, total - offset)) for offset in range(0, total, chunk)]


def pin_region(
    region: SharedOffloadRegion,
    worker_slot_only: bool = False,
    *,
    register: Callable[[int, int], bool] = host_register,
    unregister: Callable[[int], None] = host_unregister,
    max_chunk_bytes: int = MAX_HOST_REGISTER_CHUNK_BYTES,
    min_saved_bytes: int = MIN_HOST_REGISTER_SAVED_BYTES,
) -> None:
    """Page-lock the shared offload file (or only this worker's slots,
    ``worker_slot_only``), all or nothing: when a registration fails, the earlier ones are
    released and copies to and from the region stay unpinned (slower). The registration
    calls and size limits (bytes) can be swapped (``gpu_worker.pin_mmap_region`` passes
    its module's)."""
    base = region.base_tensor.data_ptr()
    registered: list[int] = []
    ranges = _registration_ranges(region, worker_slot_only, max_chunk_bytes, min_saved_bytes)
    for offset, size in ranges:
        if not register(base + offset, size):
            for done in reversed(registered):
                unregister(done)
            logger.warning(
                "host registration failed at byte %d of %d: the offload region (rank %s) "
                "stays pageable",
                offset,
                region.total_size_bytes,
                region.rank,
            )
            return
        registered.append(base + offset)
    region.pinned_addresses.extend(registered)
    region.is_pinned = True
