"""Block file I/O of the file-system tier: one offloaded block per file, whole or not at all.

A store writes a temporary file next to the destination and renames it over the destination,
so a reader sees either no file or the complete block; an existing file is kept (same key,
same bytes). A load fails unless the file holds exactly the block's size, and then removes the
file, so a damaged block is a miss from then on. Direct I/O (``O_DIRECT``, bypassing the page
cache) is used when the buffer, offset and size are 4 KiB-aligned and the file system accepts
it; otherwise ordinary buffered I/O.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import uuid

logger = logging.getLogger(__name__)

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGNMENT = 4096
_local = threading.local()


def _tmp_suffix() -> str:
    """A per-thread suffix, unique across threads and processes."""
    suffix = getattr(_local, "suffix", None)
    if suffix is None:
        suffix = _local.suffix = f".{uuid.uuid4().hex}.tmp"
    return suffix


def _byte_slice(buffer: memoryview, offset: int, size: int) -> memoryview:
    flat = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
    if offset < 0 or offset + size > flat.nbytes:
        raise ValueError(
            f"bytes [{offset}, {offset + size}) are outside the {flat.nbytes}-byte buffer"
        )
    return flat[offset : offset + size]


def _direct_flag(view: memoryview) -> int:
    if not _O_DIRECT or len(view) % _DIRECT_ALIGNMENT:
        return 0
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else -1
    return _O_DIRECT if address >= 0 and address % _DIRECT_ALIGNMENT == 0 else 0


def _transfer_once(path: str, flags: int, data: memoryview, write: bool) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        if not write and (size := os.fstat(fd).st_size) != len(data):
            raise OSError(f"{path}: {size} bytes, expected {len(data)}")
        done = 0
        while done < len(data):
            rest = data[done:]
            n = os.write(fd, rest) if write else os.readv(fd, [rest])
            if n <= 0:
                raise OSError(f"{path}: short {'write' if write else 'read'} at byte {done}")
            done += n
    finally:
        os.close(fd)


def _transfer(path: str, flags: int, data: memoryview, write: bool) -> None:
    """Write ``data`` to ``path`` or read exactly ``len(data)`` bytes of it into ``data``:
    direct I/O where allowed, buffered if the file system refuses it (``EINVAL``)."""
    direct = _direct_flag(data)
    try:
        _transfer_once(path, flags | direct, data, write)
    except OSError as exc:
        if not (direct and exc.errno == errno.EINVAL):
            raise
        if write:  # the direct attempt may have created the file
            flags = (flags & ~os.O_EXCL) | os.O_TRUNC
        _transfer_once(path, flags, data, write)


def store_block(dest_path: str, buffer: memoryview, offset: int, block_size: int) -> None:
    """Write bytes ``[offset, offset + block_size)`` of ``buffer`` to ``dest_path``."""
    if os.path.exists(dest_path):
        return
    data = _byte_slice(buffer, offset, block_size)
    os.makedirs(os.path.dirname(dest_path), exist_ok=True)
    tmp_path = dest_path + _tmp_suffix()
    try:
        _transfer(tmp_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, data, write=True)
        os.replace(tmp_path, dest_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise


def load_block(source_path: str, view: memoryview, offset: int, block_size: int) -> None:
    """Read ``source_path`` (exactly ``block_size`` bytes) into bytes
    ``[offset, offset + block_size)`` of ``view``; on any failure the file is removed."""
    target = _byte_slice(view, offset, block_size)
    try:
        _transfer(source_path, os.O_RDONLY, target, write=False)
    except BaseException:
        try:
            os.remove(source_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove unreadable block file %s: %s", source_path, exc)
        raise
