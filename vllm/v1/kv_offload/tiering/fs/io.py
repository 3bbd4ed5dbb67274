"""Block file I/O of the file-system tier: one offloaded block per file, whole and verified or
not at all.

A file is a header and the block's bytes (:mod:`.block_file`). A store writes a temporary file
next to the destination and renames it over the destination, so a reader sees either no file or
a complete one. A file of the full size already at the destination is kept (names are content
hashes; a damaged one is caught and removed by the next load); anything else there (a directory)
fails the store. A load checks the file's size and header before a byte reaches the buffer and
the payload's CRC after: a file that fails is a :class:`BadBlockFile` and is removed, so it is a
miss from then on; other errors (a transient read error) leave the file. Direct I/O
(``O_DIRECT``, bypassing the page cache) is used when asked for, the buffer, offset and size are
4 KiB-aligned and the file system accepts it; otherwise ordinary buffered I/O.

A batch (:func:`batch_store_block`, :func:`batch_load_block`) runs in the ``vllm.fs_io_C``
extension, the GIL released for the whole batch, when it is built (``_HAS_FSIO_C``), else block
by block here; both stop at the first failing block and report how many blocks succeeded before
it (``num_succeeded`` on the exception).
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
    CHECKSUM_OFFSET,
    HEADER_BYTES,
    BadBlockFile,
    BlockFileHeader,
    payload_checksum,
)

try:
    from vllm.fs_io_C import batch_load_block as _batch_load_C
    from vllm.fs_io_C import batch_store_block as _batch_store_C

    _HAS_FSIO_C = True
except ImportError:  # not built (a source checkout without the extension): per-block Python
    _HAS_FSIO_C = False

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


def _with_direct_io(transfer: Callable[[int], None], data: memoryview, use_o_direct: bool) -> None:
    """``transfer(extra open flags)``: direct I/O where asked for and ``data`` allows it,
    buffered if the file system refuses it (``EINVAL``)."""
    direct = _direct_flag(data) if use_o_direct else 0
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


def probe_o_direct(directory: str) -> bool:
    """Whether direct I/O works in ``directory``: one aligned page written and removed. Some
    file systems (overlayfs, older tmpfs, some NFS mounts) refuse ``O_DIRECT``, and a tier there
    should not try it on every block."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, ".o_direct_probe" + _tmp_suffix())
    page = mmap.mmap(-1, _DIRECT_ALIGNMENT)
    try:
        _write_file(path, _O_DIRECT, (memoryview(page),))
        return True
    except OSError:
        return False
    finally:
        page.close()
        _remove(path)


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
            exc.file_identity = (st.st_dev, st.st_ino, st.st_ctime_ns)
            raise
    finally:
        os.close(fd)


def _remove_bad_file(path: str, identity: tuple[int, int, int] | None) -> None:
    """Remove the bad file a load read: never a directory in the way, nor the good file a
    concurrent store renamed into its place meanwhile (another inode, or the same inode number
    reused, with another change time)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino, st.st_ctime_ns) == identity:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)


def _failed_at(exc: BaseException, index: int) -> BaseException:
    """``exc`` noting that the blocks of its batch before ``index`` succeeded."""
    exc.num_succeeded = index  # type: ignore[attr-defined]
    return exc


def store_block(
    dest_path: str,
    buffer: memoryview,
    offset: int,
    block_size: int,
    header: BlockFileHeader,
    use_o_direct: bool = True,
) -> None:
    """Write bytes ``[offset, offset + block_size)`` of ``buffer`` as ``dest_path``'s block,
    unless a file of the block file's size is there already."""
    data = _byte_slice(buffer, offset, block_size)
    try:
        st = os.stat(dest_path)
    except FileNotFoundError:
        pass
    else:
        _check_kind(dest_path, st)
        if st.st_size == HEADER_BYTES + block_size:
            return
    raw = _header_buffer()
    raw[:] = header.pack(block_size, payload_checksum(data))
    os.makedirs(os.path.dirname(dest_path), exist_ok=True)
    tmp_path = dest_path + _tmp_suffix()
    try:
        _with_direct_io(lambda flags: _write_file(tmp_path, flags, (raw, data)), data, use_o_direct)
        os.replace(tmp_path, dest_path)
    except FileExistsError:
        # Some shared file systems refuse to replace a file another writer just published;
        # names are content hashes, so that file holds this block.
        _remove(tmp_path)
    except BaseException:
        _remove(tmp_path)
        raise


def load_block(
    source_path: str,
    view: memoryview,
    offset: int,
    block_size: int,
    header: BlockFileHeader,
    use_o_direct: bool = True,
) -> None:
    """Read ``source_path``'s block into bytes ``[offset, offset + block_size)`` of ``view``.
    A bad file (:class:`BadBlockFile`) is removed; a bad header writes nothing into ``view``."""
    target = _byte_slice(view, offset, block_size)
    try:
        _with_direct_io(
            lambda flags: _read_file(source_path, flags, header, target), target, use_o_direct
        )
    except BadBlockFile as exc:
        _remove_bad_file(source_path, exc.file_identity)
        raise


def _batch_args(
    paths: list[str], view: memoryview, offsets: list[int], block_size: int, headers: list
) -> list[memoryview]:
    """The blocks' byte ranges of ``view``, every argument checked before any I/O."""
    if not len(paths) == len(offsets) == len(headers):
        raise ValueError(
            f"paths, offsets, headers: expected equal lengths, got {len(paths)}, "
            f"{len(offsets)}, {len(headers)}"
        )
    return [_byte_slice(view, offset, block_size) for offset in offsets]


def _each_block(
    copy: Callable[[str, memoryview, int, int, BlockFileHeader, bool], None],
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    headers: list[BlockFileHeader],
    use_o_direct: bool,
) -> None:
    """Without the extension: ``copy`` each block in order; the first failure raises,
    carrying ``num_succeeded``."""
    for i, path in enumerate(paths):
        try:
            copy(path, view, offsets[i], block_size, headers[i], use_o_direct)
        except (OSError, BadBlockFile) as exc:
            _failed_at(exc, i)
            raise


def batch_store_block(
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    headers: list[BlockFileHeader],
    use_o_direct: bool = True,
) -> None:
    """Store block ``i`` (bytes ``[offsets[i], offsets[i] + block_size)`` of ``view``) as
    ``paths[i]`` with header ``headers[i]``, in order; the first failure raises, carrying
    ``num_succeeded``."""
    slices = _batch_args(paths, view, offsets, block_size, headers)
    if not _HAS_FSIO_C:
        _each_block(store_block, paths, view, offsets, block_size, headers, use_o_direct)
        return
    for folder in {os.path.dirname(path) for path in paths}:
        os.makedirs(folder, exist_ok=True)
    packed = [h.pack(block_size, payload_checksum(d)) for h, d in zip(headers, slices, strict=True)]
    tmp_paths = [path + _tmp_suffix() for path in paths]
    _batch_store_C(tmp_paths, paths, packed, slices, use_o_direct)


def batch_load_block(
    paths: list[str],
    view: memoryview,
    offsets: list[int],
    block_size: int,
    headers: list[BlockFileHeader],
    use_o_direct: bool = True,
) -> None:
    """Load ``paths[i]`` (header ``headers[i]``) into bytes ``[offsets[i], offsets[i] +
    block_size)`` of ``view``, in order. The first failure raises, carrying ``num_succeeded``:
    :class:`BadBlockFile` for a bad file (removed), ``OSError`` otherwise (file kept)."""
    targets = _batch_args(paths, view, offsets, block_size, headers)
    if not _HAS_FSIO_C:
        _each_block(load_block, paths, view, offsets, block_size, headers, use_o_direct)
        return
    expected = [h.pack(block_size, 0) for h in headers]
    try:
        raws = _batch_load_C(paths, expected, CHECKSUM_OFFSET, 4, targets, use_o_direct)
    except OSError as exc:
        if not getattr(exc, "bad_file", False):
            raise
        # The extension removed the file already.
        raise _failed_at(BadBlockFile(str(exc)), exc.num_succeeded) from exc  # type: ignore[attr-defined]
    for i, (path, raw, target) in enumerate(zip(paths, raws, targets, strict=True)):
        checksum = headers[i].check(raw, block_size, path)
        if (actual := payload_checksum(target)) != checksum:
            # Bad from the read on; a store never replaces a file of the full size, so the
            # file here now is the one read.
            _remove(path)
            raise _failed_at(
                BadBlockFile(
                    f"{path}: expected payload CRC-32 {checksum:#010x}, got {actual:#010x}"
                ),
                i,
            )
