"""One shared-memory file holding the CPU offload chunks of every worker of an engine.

File ``/dev/shm/vllm_offload_<engine_id>.mmap`` of ``num_chunks`` rows of
``kv_bytes_per_chunk`` bytes (a multiple of the page size, so rows stay page-aligned); row
``c`` (one offloaded chunk) holds worker ``r``'s cell of ``cpu_page_size`` bytes at byte
``r * cpu_page_size``, then padding; a worker's cell holds its canonical tensors' pages one
after the other (:meth:`SharedOffloadRegion.create_next_worker_view`). The first opener
creates and sizes the file (``O_EXCL``); the others wait for its size, then map it. With a
``barrier`` (every worker of the engine reaches it), the creator unlinks the file once all
have mapped it, so the memory goes back when the last mapping does, however workers exit.
A large region may be split by rows into several files (``.1``, ``.2``, ... after the first
one) mapped back to back into one contiguous range, so each file faults in on its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator

import torch

from vllm.v1.kv_offload.cpu.host_register import host_unregister

logger = logging.getLogger(__name__)

# madvise(MADV_POPULATE_WRITE) (Linux 5.14+): fault the pages in now, writable.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)

# Faulting one file in is bound by one kernel lock per file; a segment file of at least
# this many bytes is worth its own file (pre-faulted in parallel by the workers).
_MIN_SEGMENT_BYTES = 1 << 30


class RegionOverflowError(ValueError, AssertionError):
    """A view would reach past this worker's cell of a row."""


def _wait_for_file_size(fd: int, expected_size: int, timeout: float = 30.0) -> None:
    """Poll until the file of ``fd`` has ``expected_size`` bytes (its creator sized it);
    ``RuntimeError`` when the file was unlinked meanwhile (its creator failed and cleaned up),
    ``TimeoutError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stat = os.fstat(fd)
        if stat.st_size >= expected_size:
            return
        if stat.st_nlink == 0:
            raise RuntimeError(
                "shared offload file was removed before reaching its size: its creator failed"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"shared offload file still under {expected_size} bytes after {timeout} s"
            )
        time.sleep(0.005)


def check_shm_free_space(num_bytes: int, allocation_name: str) -> None:
    """``RuntimeError`` when ``/dev/shm`` has fewer than ``num_bytes`` bytes free (checked
    before a file is sized, so a too-large region fails clearly instead of by SIGBUS)."""
    stat = os.statvfs("/dev/shm")
    free = stat.f_bavail * stat.f_frsize
    if free < num_bytes:
        raise RuntimeError(
            f"Insufficient space in /dev/shm for the {allocation_name}: {num_bytes} bytes "
            f"required, {free} free"
        )


def _madvise_populate_write(region: mmap.mmap, offset: int, length: int) -> None:
    """Fault ``length`` bytes at ``offset`` (page-aligned) in now, writable."""
    region.madvise(_MADV_POPULATE_WRITE, offset, length)


def _fallback_populate_write(region: mmap.mmap, offset: int, length: int) -> None:
    """Fault the pages in by rewriting one byte of each (the bytes stay as they were), for
    kernels without ``MADV_POPULATE_WRITE``."""
    for page in range(offset, offset + length, mmap.PAGESIZE):
        region[page] = region[page]


def _get_populate_write_fn(region: mmap.mmap) -> Callable[[mmap.mmap, int, int], None]:
    """How to pre-fault ``region``: ``MADV_POPULATE_WRITE`` when the kernel takes it (probed
    on the first page), else page-by-page writes; other errors propagate."""
    try:
        _madvise_populate_write(region, 0, mmap.PAGESIZE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return _fallback_populate_write
    return _madvise_populate_write


class SharedOffloadRegion:
    """This worker's mapping of the engine's shared offload file.

    ``rank`` None maps (and pre-faults) the whole file without a cell of its own, e.g. for a
    reader of every worker's chunks (:meth:`create_kv_memoryview`). ``populate_shard=(index,
    count)`` pre-faults only the ``index``-th of ``count`` contiguous row ranges instead (every
    worker maps the same bytes, so they share the faulting); the barrier is then reached a
    second time, after pre-faulting. ``creator_memory_check(total bytes)`` runs in the
    creating process before the file is sized (it may raise). ``num_segments`` splits the rows
    over at most that many files of at least ``_MIN_SEGMENT_BYTES`` each (mapped back to back,
    so the region stays one contiguous range); workers start pre-faulting on different files.
    """

    BLOCK_SIZE_ALIGNMENT: int = mmap.PAGESIZE
    """Row sizes (``kv_bytes_per_chunk``) must be multiples of this (bytes)."""

    def __init__(
        self,
        engine_id: str,
        num_chunks: int,
        rank: int | None,
        kv_bytes_per_chunk: int,
        cpu_page_size: int,
        barrier: Callable[[], None] | None = None,
        *,
        creator_memory_check: Callable[[int], None] | None = None,
        populate_shard: tuple[int, int] | None = None,
        num_segments: int = 1,
    ) -> None:
        _check_layout(num_chunks, rank, kv_bytes_per_chunk, cpu_page_size, populate_shard)
        if isinstance(num_segments, bool) or not isinstance(num_segments, int) or num_segments < 1:
            raise ValueError(f"num_segments: expected a positive int, got {num_segments!r}")
        self.num_chunks = num_chunks
        self.rank = rank
        self.cpu_page_size = cpu_page_size
        self._row_stride = kv_bytes_per_chunk
        self.total_size_bytes = num_chunks * kv_bytes_per_chunk
        self.mmap_path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
        self.page_size = mmap.PAGESIZE
        self._segments = _plan_segments(
            self.mmap_path, num_chunks, kv_bytes_per_chunk, num_segments
        )
        """``(path, byte offset in the region, length in bytes)`` of each backing file."""
        self._worker_offset = (rank or 0) * cpu_page_size  # next view's cell offset
        self._worker_area_end = self._worker_offset + cpu_page_size
        self._canonical_offset = 0  # next canonical view's offset in every row
        self._creator = False
        self.fd: int | None = None
        self.mmap_obj: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self.pinned_addresses: list[int] = []
        """Addresses of this mapping's host registrations (see ``pin_mmap_region``)."""
        self.is_pinned = False
        # Every worker reaches the barrier as often as the others, even after a failure (its
        # peers would block until the collective times out); a failed creator first drops
        # the file, so the next start does not find a stub.
        barriers_left = 0 if barrier is None else 1 + (populate_shard is not None)
        try:
            self._open(creator_memory_check)
            if barrier is not None:
                barriers_left -= 1
                barrier()
                self._unlink()
            self._prefault(populate_shard)
            if barrier is not None and populate_shard is not None:
                barriers_left -= 1
                barrier()  # every shard is faulted in before anyone uses the rows
        except BaseException:
            self.cleanup()
            for _ in range(barriers_left):
                assert barrier is not None
                # The setup error explains the failure; a peer's barrier error would not.
                with contextlib.suppress(Exception):
                    barrier()
            raise
        self._base = torch.frombuffer(memoryview(self.mmap_obj), dtype=torch.int8)

    @property
    def num_blocks(self) -> int:
        """v0.22's name of :attr:`num_chunks`."""
        return self.num_chunks

    def _open(self, creator_memory_check: Callable[[int], None] | None) -> None:
        try:
            self.fd = os.open(self.mmap_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            self.fd = os.open(self.mmap_path, os.O_RDWR)
            # The creator sizes the first file last: the others are sized by then.
            _wait_for_file_size(self.fd, self._segments[0][2])
        else:
            # Owned from here: a failure below unlinks it, so joiners do not wait on a stub.
            self._creator = True
            if creator_memory_check is not None:
                creator_memory_check(self.total_size_bytes)
            check_shm_free_space(
                self.total_size_bytes,
                allocation_name="CPU KV offload shared region in /dev/shm",
            )
            for path, _, length in self._segments[1:]:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, length)
                finally:
                    os.close(fd)
            os.ftruncate(self.fd, self._segments[0][2])
        single = len(self._segments) == 1
        # Several files: reserve one private range, then map each file over its part.
        self.mmap_obj = mmap.mmap(
            self.fd if single else -1,
            self.total_size_bytes,
            flags=mmap.MAP_SHARED if single else mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        if not single:
            self._map_segments()

    def _map_segments(self) -> None:
        """Map each segment file (``MAP_FIXED``) over its part of the reserved range."""
        assert self.mmap_obj is not None and self.fd is not None
        base = _buffer_address(self.mmap_obj)
        libc_mmap = _libc_mmap()
        for path, offset, length in self._segments:
            fd = self.fd if offset == 0 else os.open(path, os.O_RDWR)
            try:
                address = libc_mmap(
                    base + offset,
                    length,
                    mmap.PROT_READ | mmap.PROT_WRITE,
                    mmap.MAP_SHARED | _MAP_FIXED,
                    fd,
                    0,
                )
            finally:
                if fd != self.fd:
                    os.close(fd)
            if address != base + offset:
                raise OSError(ctypes.get_errno(), f"mmap of segment file {path} failed")

    def _unlink(self) -> None:
        """Remove the file if this mapping created it (the mappings stay valid)."""
        if self._creator:
            self._creator = False
            for path, _, _ in self._segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    def _prefault(self, populate_shard: tuple[int, int] | None) -> None:
        """Fault in this worker's part: a page-rounded contiguous share of the file with
        ``populate_shard``, the whole file without a rank, else the worker's cells."""
        assert self.mmap_obj is not None
        page = mmap.PAGESIZE
        populate = _get_populate_write_fn(self.mmap_obj)
        if populate_shard is not None:
            index, count = populate_shard
            pages = -(-self.total_size_bytes // page)
            share = -(-pages // count)
            first, last = index * share, min((index + 1) * share, pages)
            if last > first:
                populate(self.mmap_obj, first * page, (last - first) * page)
            return
        if self.rank is None:
            populate(self.mmap_obj, 0, self.total_size_bytes)
            return
        for offset, length in self.iter_worker_slot_ranges():
            populate(self.mmap_obj, offset, length)

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
        """This worker's cell of every row as a page-aligned ``(offset, length)`` byte range.
        With several segment files, workers start on different rows (spread over the files)
        and wrap around, so they fault different files in at once."""
        if self.rank is None:
            raise ValueError("iter_worker_slot_ranges: needs a region opened with a rank")
        page = self.page_size
        cell = self.rank * self.cpu_page_size
        first = 0
        if len(self._segments) > 1:
            first = self.rank * self.num_chunks // (self._row_stride // self.cpu_page_size)
        for i in range(self.num_chunks):
            start = (first + i) % self.num_chunks * self._row_stride + cell
            aligned = start - start % page
            end = -(-(start + self.cpu_page_size) // page) * page
            yield aligned, end - aligned

    @property
    def base_tensor(self) -> torch.Tensor:
        """The whole region as a flat ``int8`` tensor (bytes); ``RuntimeError`` once cleaned up."""
        if self._base is None:
            raise RuntimeError("base_tensor: the shared offload region is cleaned up")
        return self._base

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next canonical tensor's pages in this worker's cells: an ``int8`` tensor
        ``[num_chunks, tensor_page_size]`` with strides ``(row stride, 1)``, placed right
        after the previous view's bytes in each cell (bytes)."""
        if self.rank is None or self._base is None:
            raise ValueError("create_next_worker_view: needs a region opened with a rank")
        end = self._worker_offset + tensor_page_size
        if end > self._worker_area_end:
            raise RegionOverflowError(
                f"tensor_page_size: a view ending at byte {end} of the row exceeds worker area "
                f"end {self._worker_area_end} by {end - self._worker_area_end} bytes"
            )
        view = torch.as_strided(
            self._base,
            (self.num_chunks, tensor_page_size),
            (self._row_stride, 1),
            self._worker_offset,
        )
        self._worker_offset = end
        self._views.append(view)
        return view

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor:
        """The next canonical tensor's pages, at the same bytes for every worker (the
        canonical host layout: each worker writes its own fragments of them): an ``int8``
        tensor ``[num_chunks, tensor_page_size]`` with strides ``(row stride, 1)``, placed
        right after the previous canonical view's bytes from the start of each row (bytes).
        Use instead of :meth:`create_next_worker_view`, not with it."""
        if self._base is None:
            raise ValueError("create_next_canonical_view: the region is cleaned up")
        end = self._canonical_offset + tensor_page_size
        if tensor_page_size < 0 or end > self._row_stride:
            raise RegionOverflowError(
                f"tensor_page_size: a canonical view ending at byte {end} exceeds the "
                f"{self._row_stride}-byte row"
            )
        view = torch.as_strided(
            self._base,
            (self.num_chunks, tensor_page_size),
            (self._row_stride, 1),
            self._canonical_offset,
        )
        self._canonical_offset = end
        self._views.append(view)
        return view

    create_next_view = create_next_worker_view
    """v0.22's name of :meth:`create_next_worker_view`."""

    def create_kv_memoryview(self) -> memoryview:
        """The whole file as a zero-copy ``[num_chunks, kv_bytes_per_chunk]`` memoryview (row
        ``c`` is offloaded chunk ``c`` of every worker, then padding)."""
        if self._base is None:
            raise ValueError("create_kv_memoryview: the region is cleaned up")
        rows = self._base.view(self.num_chunks, self._row_stride)
        array = rows.numpy()
        if array.ctypes.data != self._base.data_ptr():
            raise RuntimeError("create_kv_memoryview: the view copied the shared buffer")
        return memoryview(array)

    def cleanup(self) -> None:
        """Unpin, unmap and close; the creator also removes the file. Idempotent."""
        # Release in reverse registration order (a split registration has several ranges).
        for address in reversed(self.pinned_addresses):
            host_unregister(address)
        self.pinned_addresses = []
        self.is_pinned = False
        # Views and the base hold exports of the mmap buffer: drop them before closing it.
        self._views.clear()
        self._base = None
        if self.mmap_obj is not None:
            try:
                self.mmap_obj.close()
                self.mmap_obj = None
            except BufferError:
                # Unmapping under a live export (a NIC's registration, say) would let it
                # write into reused memory: the mapping stays until the export is dropped.
                logger.warning("shared offload mmap still exported; not closed", exc_info=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._unlink()


def _plan_segments(
    path: str, num_chunks: int, row_bytes: int, num_segments: int
) -> list[tuple[str, int, int]]:
    """Split ``num_chunks`` rows of ``row_bytes`` over at most ``num_segments`` files of at
    least ``_MIN_SEGMENT_BYTES`` (whole rows, equal shares, the last one shorter):
    ``(path, offset, length)`` in bytes; the first file keeps ``path``, the others get
    ``.1``, ``.2``, ... appended."""
    total = num_chunks * row_bytes
    count = max(1, min(num_segments, total // _MIN_SEGMENT_BYTES))
    rows = -(-num_chunks // count)
    return [
        (f"{path}.{i}" if i else path, row * row_bytes, min(rows, num_chunks - row) * row_bytes)
        for i, row in enumerate(range(0, num_chunks, rows))
    ]


def _libc_mmap() -> Callable[..., int | None]:
    """libc's ``mmap`` (Python's cannot map at a fixed address)."""
    fn = ctypes.CDLL(None, use_errno=True).mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return fn


def _buffer_address(region: mmap.mmap) -> int:
    """Start address of ``region`` (the temporary buffer export ends on return)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def _check_layout(
    num_chunks: int,
    rank: int | None,
    kv_bytes_per_chunk: int,
    cpu_page_size: int,
    populate_shard: tuple[int, int] | None,
) -> None:
    """Reject a layout the file cannot hold, before anything is created."""
    for name, value, low in (
        ("num_chunks", num_chunks, 1),
        ("kv_bytes_per_chunk", kv_bytes_per_chunk, 1),
        ("cpu_page_size", cpu_page_size, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
    if kv_bytes_per_chunk % mmap.PAGESIZE:
        raise ValueError(
            f"kv_bytes_per_chunk: expected a multiple of the page size {mmap.PAGESIZE} bytes, "
            f"got {kv_bytes_per_chunk}"
        )
    if rank is not None and (rank < 0 or (rank + 1) * cpu_page_size > kv_bytes_per_chunk):
        raise ValueError(
            f"rank: expected a worker whose {cpu_page_size}-byte cell fits a row of "
            f"{kv_bytes_per_chunk} bytes, got {rank}"
        )
    if populate_shard is not None:
        index, count = populate_shard
        if not 0 <= index < count:
            raise ValueError(
                f"populate_shard: expected (index, count) with 0 <= index < count, got "
                f"{populate_shard!r}"
            )
