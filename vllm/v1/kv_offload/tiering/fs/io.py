"""Block file I/O of the file-system tier: one offloaded block per file, whole and verified or
not at all.

A file is a header and the block's bytes (:mod:`.block_file`). A store writes a temporary file
next to the destination and renames it over the destination, so a reader sees either no file or
a complete one. A file already at the destination is kept when it verifies (its header and its
CRC), else replaced; anything else there (a directory) fails the store before anything is
written. A load checks the file's size and header before a byte reaches the buffer and the
payload's CRC after: a file that fails is a :class:`BadBlockFile` and is removed, so it is a miss
from then on; other errors (a transient read error) leave the file. Direct I/O (``O_DIRECT``,
bypassing the page cache) is used when the buffer, offset and size are 4 KiB-aligned and the file
system accepts it; otherwise ordinary buffered I/O.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import threading
import uuid
from collections.abc import Callable

from vllm.v1.kv_offload.tiering.fs.block_file import (
    HEADER_BYTES,
    BadBlockFile,
    BlockFileHeader,
    payload_checksum,
)

logger = logging.getLogger(__name__)

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_DIRECT_ALIGNMENT = 4096
_VERIFY_CHUNK = 1 << 20
_local = threading.local()


def _tmp_suffix() -> str:
    """A per-thread suffix, unique across threads and processes."""
    suffix = getattr(_local, "suffix", None)
    if suffix is None:
        suffix = _local.suffix = f".{uuid.uuid4().hex}.tmp"
    return suffix


def _header_buffer() -> memoryview:
    """A per-thread header buffer, page-aligned as direct I/O needs."""
    buffer = getattr(_local, "header", None)
    if buffer is None:
        buffer = _local.header = memoryview(mmap.mmap(-1, HEADER_BYTES))
    return buffer


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


def _with_direct_io(transfer: Callable[[int], None], data: memoryview) -> None:
    """``transfer(extra open flags)``: direct I/O where ``data`` allows it, buffered if the
    file system refuses it (``EINVAL``)."""
    direct = _direct_flag(data)
    try:
        transfer(direct)
    except OSError as exc:
        if not (direct and exc.errno == errno.EINVAL):
            raise
        transfer(0)


def _check_kind(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a special file"
        raise BadBlockFile(f"{path}: expected a block file, got {kind}")


def _check_size(path: str, st: os.stat_result, block_size: int) -> None:
    _check_kind(path, st)
    if st.st_size != HEADER_BYTES + block_size:
        raise BadBlockFile(f"{path}: expected {HEADER_BYTES + block_size} bytes, got {st.st_size}")


def block_file_present(path: str, block_size: int) -> bool:
    """Whether ``path`` is a file of a ``block_size``-byte block's size (one ``stat``; the
    header and CRC are checked by the load)."""
    try:
        _check_size(path, os.stat(path), block_size)
    except (OSError, BadBlockFile):
        return False
    return True


def _write_file(path: str, flags: int, parts: tuple[memoryview, ...]) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flags, 0o644)
    try:
        for part in parts:
            done = 0
            while done < len(part):
                n = os.write(fd, part[done:])
                if n <= 0:
                    raise OSError(f"{path}: short write at byte {done}")
                done += n
    finally:
        os.close(fd)


def _read_fully(fd: int, path: str, into: memoryview) -> None:
    done = 0
    while done < len(into):
        n = os.readv(fd, [into[done:]])
        if n <= 0:  # the file shrank after the size check
            raise BadBlockFile(f"{path}: expected {len(into)} more bytes, got {done}")
        done += n


def _read_file(path: str, flags: int, header: BlockFileHeader, target: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        st = os.fstat(fd)
        try:
            _check_size(path, st, len(target))
            raw = _header_buffer()
            _read_fully(fd, path, raw)
            checksum = header.check(raw.tobytes(), len(target), path)
            _read_fully(fd, path, target)
            if (actual := payload_checksum(target)) != checksum:
                raise BadBlockFile(
                    f"{path}: expected payload CRC-32 {checksum:#010x}, got {actual:#010x}"
                )
        except BadBlockFile as exc:
            exc.file_identity = (st.st_dev, st.st_ino)
            raise
    finally:
        os.close(fd)


def _verifies(path: str, header: BlockFileHeader, block_size: int) -> bool:
    """Whether ``path`` is a complete, undamaged file of ``header``'s block (read buffered, in
    chunks); False for no file or a bad one, :class:`BadBlockFile` for a directory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    _check_kind(path, st)
    try:
        with open(path, "rb", buffering=0) as f:
            _check_size(path, os.fstat(f.fileno()), block_size)
            checksum = header.check(f.read(HEADER_BYTES), block_size, path)
            actual, done = 0, 0
            while chunk := f.read(min(_VERIFY_CHUNK, block_size - done)):
                actual = payload_checksum(chunk, actual)
                done += len(chunk)
    except (OSError, BadBlockFile):
        return False
    return done == block_size and actual == checksum


def store_block(
    dest_path: str, buffer: memoryview, offset: int, block_size: int, header: BlockFileHeader
) -> None:
    """Write bytes ``[offset, offset + block_size)`` of ``buffer`` as ``dest_path``'s block,
    unless a file there holds it already and verifies."""
    data = _byte_slice(buffer, offset, block_size)
    if _verifies(dest_path, header, block_size):
        return
    raw = _header_buffer()
    raw[:] = header.pack(block_size, payload_checksum(data))
    os.makedirs(os.path.dirname(dest_path), exist_ok=True)
    tmp_path = dest_path + _tmp_suffix()
    try:
        _with_direct_io(lambda flags: _write_file(tmp_path, flags, (raw, data)), data)
        os.replace(tmp_path, dest_path)
    except BaseException:
        _remove(tmp_path)
        raise


def load_block(
    source_path: str, view: memoryview, offset: int, block_size: int, header: BlockFileHeader
) -> None:
    """Read ``source_path``'s block into bytes ``[offset, offset + block_size)`` of ``view``.
    A bad file (:class:`BadBlockFile`) is removed; a bad header writes nothing into ``view``."""
    target = _byte_slice(view, offset, block_size)
    try:
        _with_direct_io(lambda flags: _read_file(source_path, flags, header, target), target)
    except BadBlockFile as exc:
        _remove_bad_file(source_path, exc.file_identity)
        raise


def _remove_bad_file(path: str, identity: tuple[int, int] | None) -> None:
    """Remove the bad file a load read: never a directory in the way, nor the good file a
    concurrent store renamed into its place meanwhile (another inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == identity:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)
