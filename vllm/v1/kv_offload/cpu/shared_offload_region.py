"""One shared-memory file holding the CPU offload blocks of every worker of an engine.

File ``/dev/shm/vllm_offload_<instance_id>.mmap`` of ``total_size_bytes``; row ``b`` (one
offloaded block) is ``num_workers`` cells of ``cpu_page_size`` bytes, worker ``r``'s at byte
``r * cpu_page_size`` of the row; a worker's cell holds its canonical tensors' pages one after
the other (:meth:`SharedOffloadRegion.create_next_view`). The first opener creates and sizes
the file (``O_EXCL``); the others wait for its size, then map it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time

import torch

logger = logging.getLogger(__name__)

# madvise(MADV_POPULATE_WRITE) (Linux 5.14+): fault the pages in now, writable.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class RegionOverflowError(ValueError, AssertionError):
    """A view would reach past this worker's cell of a row."""


def _wait_for_file_size(fd: int, expected_size: int, timeout: float = 30.0) -> None:
    """Poll until the file of ``fd`` has ``expected_size`` bytes (its creator sized it);
    ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while os.fstat(fd).st_size < expected_size:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"shared offload file still under {expected_size} bytes after {timeout} s"
            )
        time.sleep(0.005)


def _populate(region: mmap.mmap, start: int, length: int) -> None:
    aligned = start - start % mmap.PAGESIZE
    # Older kernels refuse the advice: pages then fault in on first use.
    with contextlib.suppress(OSError):
        region.madvise(_MADV_POPULATE_WRITE, aligned, start + length - aligned)


class SharedOffloadRegion:
    """This worker's mapping of the engine's shared offload file.

    ``rank`` None maps (and pre-faults) the whole file without a cell of its own, e.g. for a
    reader of every worker's blocks (:meth:`create_kv_memoryview`).
    """

    def __init__(
        self,
        instance_id: str,
        total_size_bytes: int,
        num_blocks: int,
        rank: int | None,
        num_workers: int,
        cpu_page_size: int,
    ) -> None:
        self.total_size_bytes = total_size_bytes
        self.num_blocks = num_blocks
        self.rank = rank
        self.mmap_path = f"/dev/shm/vllm_offload_{instance_id}.mmap"
        self._row_stride = cpu_page_size * num_workers
        if num_blocks * self._row_stride > total_size_bytes:
            raise ValueError(
                f"total_size_bytes: {total_size_bytes} bytes hold fewer than num_blocks="
                f"{num_blocks} rows of {num_workers} x {cpu_page_size} bytes"
            )
        self._worker_offset = (rank or 0) * cpu_page_size  # next view's cell offset
        self._worker_area_end = self._worker_offset + cpu_page_size
        self._creator = False
        try:
            self.fd: int | None = os.open(self.mmap_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            self._creator = True
            os.ftruncate(self.fd, total_size_bytes)
        except FileExistsError:
            self.fd = os.open(self.mmap_path, os.O_RDWR)
            _wait_for_file_size(self.fd, total_size_bytes)
        self.mmap_obj: mmap.mmap | None = mmap.mmap(
            self.fd, total_size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        if rank is None:
            _populate(self.mmap_obj, 0, total_size_bytes)
        else:
            for row in range(num_blocks):
                _populate(
                    self.mmap_obj, row * self._row_stride + self._worker_offset, cpu_page_size
                )
        self._base: torch.Tensor | None = torch.frombuffer(
            memoryview(self.mmap_obj), dtype=torch.int8
        )
        self._views: list[torch.Tensor] = []
        self.is_pinned = False

    def create_next_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next canonical tensor's pages in this worker's cells: an ``int8`` tensor
        ``[num_blocks, tensor_page_size]`` with strides ``(row stride, 1)``, placed right
        after the previous view's bytes in each cell."""
        if self.rank is None or self._base is None:
            raise ValueError("create_next_view: needs a region opened with a rank")
        end = self._worker_offset + tensor_page_size
        if end > self._worker_area_end:
            raise RegionOverflowError(
                f"tensor_page_size: a view ending at byte {end} of the row exceeds worker area "
                f"end {self._worker_area_end} by {end - self._worker_area_end} bytes"
            )
        view = torch.as_strided(
            self._base,
            (self.num_blocks, tensor_page_size),
            (self._row_stride, 1),
            self._worker_offset,
        )
        self._worker_offset = end
        self._views.append(view)
        return view

    def create_kv_memoryview(self) -> memoryview:
        """The whole file as a zero-copy ``[num_blocks, row bytes]`` memoryview (row ``b`` is
        offloaded block ``b`` of every worker)."""
        if self._base is None:
            raise ValueError("create_kv_memoryview: the region is cleaned up")
        rows = self._base[: self.num_blocks * self._row_stride].view(
            self.num_blocks, self._row_stride
        )
        array = rows.numpy()
        if array.ctypes.data != self._base.data_ptr():
            raise RuntimeError("create_kv_memoryview: the view copied the shared buffer")
        return memoryview(array)

    def cleanup(self) -> None:
        """Unpin, unmap and close; the creator also removes the file. Idempotent."""
        if self.is_pinned and self._base is not None:
            status = torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
            if int(getattr(status, "value", status)) != 0:
                logger.warning("cudaHostUnregister failed (rank %s): %s", self.rank, status)
            self.is_pinned = False
        # Views and the base hold exports of the mmap buffer: drop them before closing it.
        self._views.clear()
        self._base = None
        if self.mmap_obj is not None:
            try:
                self.mmap_obj.close()
            except BufferError:
                logger.warning("shared offload mmap still exported; not closed", exc_info=True)
            self.mmap_obj = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._creator:
            self._creator = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.mmap_path)
