"""``vllm.fs_io_C``, the file-system tier's batched block-file I/O, called directly, and the
argument checks of :mod:`vllm.v1.kv_offload.tiering.fs.io` that run before any I/O: what the
tier's tests do not reach (bad arguments, the skip-if-present rule, which failures remove a
file)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from vllm import fs_io_C  # built by `pip install -e .` (CMake target fs_io_C)
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.fs import io as fs_io
from vllm.v1.kv_offload.tiering.fs.block_file import BlockFileHeader

PAGE = mmap.PAGESIZE


def aligned(n_bytes: int, fill: int = 0) -> memoryview:
    """A page-aligned writable buffer (an anonymous mapping), as direct I/O needs."""
    view = memoryview(mmap.mmap(-1, n_bytes))
    view[:] = bytes([fill]) * n_bytes
    return view


def test_batch_lookup_checks_the_kind_and_the_size(tmp_path: Path) -> None:
    small, exact = tmp_path / "small", tmp_path / "exact"
    small.write_bytes(b"x" * 10)
    exact.write_bytes(b"x" * 64)
    folder = tmp_path / "folder"
    folder.mkdir()
    paths = [str(small), str(exact), str(folder), str(tmp_path / "none")]
    assert fs_io_C.batch_lookup(paths) == [True, True, False, False]
    assert fs_io_C.batch_lookup(paths, 64) == [False, True, False, False]


@pytest.mark.parametrize(
    ("paths", "message"),
    [
        (("a",), "paths: expected a list of str, got tuple"),
        (["a", b"b"], r"paths\[1\]: expected str, got bytes"),
        (["a", 3], r"paths\[1\]: expected str, got int"),
    ],
)
def test_batch_lookup_names_a_bad_argument(paths, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        fs_io_C.batch_lookup(paths)


def test_store_writes_header_then_payload_and_keeps_a_full_size_file(tmp_path: Path) -> None:
    header, payload = aligned(PAGE, 1), aligned(2 * PAGE, 2)
    dest, tmp = str(tmp_path / "b.bin"), str(tmp_path / "b.bin.tmp")
    fs_io_C.batch_store_block([tmp], [dest], [header], [payload], True)
    assert Path(dest).read_bytes() == bytes(header) + bytes(payload)
    assert not os.path.exists(tmp)
    before = os.stat(dest)
    fs_io_C.batch_store_block([tmp], [dest], [header], [aligned(2 * PAGE, 3)], False)
    after = os.stat(dest)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # A file of another size is not the block: it is replaced.
    Path(dest).write_bytes(b"short")
    fs_io_C.batch_store_block([tmp], [dest], [b"h"], [b"payload"], False)
    assert Path(dest).read_bytes() == b"hpayload"


def test_store_stops_at_the_first_failure_and_leaves_no_temp_file(tmp_path: Path) -> None:
    good, blocked = str(tmp_path / "a.bin"), str(tmp_path / "dir")
    os.mkdir(blocked)
    paths = [good, blocked, str(tmp_path / "c.bin")]
    tmps = [p + ".tmp" for p in paths]
    with pytest.raises(OSError) as info:
        fs_io_C.batch_store_block(tmps, paths, [b"h"] * 3, [b"p"] * 3, False)
    assert info.value.num_succeeded == 1 and info.value.bad_file is False
    assert info.value.filename == blocked
    assert os.path.isfile(good) and os.path.isdir(blocked)
    assert not os.path.exists(paths[2])
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "dir"]


def test_store_checks_its_arguments_before_writing(tmp_path: Path) -> None:
    dest = str(tmp_path / "b.bin")
    with pytest.raises(ValueError, match="tmp_paths: expected 1 items, got 2"):
        fs_io_C.batch_store_block(["x", "y"], [dest], [b"h"], [b"p"])
    with pytest.raises(ValueError, match="payloads: expected 1 items, got 0"):
        fs_io_C.batch_store_block([dest + ".t"], [dest], [b"h"], [])
    with pytest.raises(TypeError, match="headers: expected a list of buffers, got NoneType"):
        fs_io_C.batch_store_block([dest + ".t"], [dest], None, [b"p"])
    assert os.listdir(tmp_path) == []


def stored(tmp_path: Path, name: str, header: bytes, payload: bytes) -> str:
    path = str(tmp_path / name)
    Path(path).write_bytes(header + payload)
    return path


def test_load_returns_the_headers_with_the_skipped_bytes_as_read(tmp_path: Path) -> None:
    a = stored(tmp_path, "a", b"HEAD" + b"\x07", b"alpha")
    b = stored(tmp_path, "b", b"HEAD" + b"\x09", b"bravo")
    out = [bytearray(5), bytearray(5)]
    raws = fs_io_C.batch_load_block([a, b], [b"HEAD\0", b"HEAD\0"], 4, 1, out, False)
    assert raws == [b"HEAD\x07", b"HEAD\x09"] and out == [b"alpha", b"bravo"]
    assert fs_io_C.batch_load_block([], [], 0, 0, [], True) == []


@pytest.mark.parametrize("damage", ["header", "size"])
def test_a_bad_file_is_removed_and_writes_nothing(tmp_path: Path, damage: str) -> None:
    good = stored(tmp_path, "good", b"HEAD", b"alpha")
    body = b"alpha!" if damage == "size" else b"alpha"
    bad = stored(tmp_path, "bad", b"HXAD" if damage == "header" else b"HEAD", body)
    out = [bytearray(5), bytearray(b"-----")]
    with pytest.raises(OSError) as info:
        fs_io_C.batch_load_block([good, bad], [b"HEAD"] * 2, 0, 0, out, False)
    assert info.value.num_succeeded == 1 and info.value.bad_file is True
    assert out == [b"alpha", b"-----"]
    assert os.path.exists(good) and not os.path.exists(bad)


def test_an_open_error_keeps_the_file(tmp_path: Path) -> None:
    loop = str(tmp_path / "loop")
    os.symlink(loop, loop)
    with pytest.raises(OSError) as info:
        fs_io_C.batch_load_block([loop], [b"H"], 0, 0, [bytearray(1)], False)
    assert info.value.num_succeeded == 0 and info.value.bad_file is False
    assert os.path.lexists(loop)


def test_load_checks_its_arguments_before_reading(tmp_path: Path) -> None:
    path = stored(tmp_path, "a", b"HEAD", b"alpha")
    with pytest.raises(ValueError, match=r"headers\[1\]: expected 4 bytes, got 3"):
        fs_io_C.batch_load_block([path] * 2, [b"HEAD", b"HEA"], 0, 0, [bytearray(5)] * 2)
    with pytest.raises(ValueError, match="expected a range inside the 4-byte header, got 3, 2"):
        fs_io_C.batch_load_block([path], [b"HEAD"], 3, 2, [bytearray(5)])
    with pytest.raises(BufferError):  # a read-only payload cannot receive the block
        fs_io_C.batch_load_block([path], [b"HEAD"], 0, 0, [b"12345"])
    assert os.path.exists(path)


def test_batches_check_offsets_and_lengths_before_any_io(tmp_path: Path) -> None:
    buffer = memoryview(bytearray(2 * PAGE))
    header = BlockFileHeader(bytes(32), make_offload_key(b"k", 0))
    dest = str(tmp_path / "sub" / "b.bin")
    with pytest.raises(ValueError, match="outside the 8192-byte buffer"):
        fs_io.batch_store_block([dest, dest], buffer, [0, PAGE + 1], PAGE, [header] * 2)
    with pytest.raises(ValueError, match="expected equal lengths, got 1, 2, 1"):
        fs_io.batch_load_block([dest], buffer, [0, PAGE], PAGE, [header])
    assert not os.path.exists(tmp_path / "sub")


@pytest.mark.skipif(not fs_io._O_DIRECT, reason="the platform has no O_DIRECT")
def test_probe_o_direct_reports_a_refusing_file_system(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def refusing(path, flags, mode=0o777):
        if flags & fs_io._O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(fs_io.os, "open", refusing)
    assert fs_io.probe_o_direct(str(tmp_path)) is False
    assert os.listdir(tmp_path) == []


def test_a_rename_refused_with_eexist_counts_as_stored(tmp_path: Path, monkeypatch) -> None:
    """Some shared file systems refuse to replace a block another writer just published:
    the store is done (names are content hashes) and leaves no temporary file."""
    header = BlockFileHeader(bytes(32), make_offload_key(b"k", 0))
    dest = str(tmp_path / "b.bin")

    def refused(src: str, dst: str) -> None:
        raise FileExistsError(17, "File exists", dst)

    monkeypatch.setattr(fs_io.os, "replace", refused)
    fs_io.store_block(dest, memoryview(bytearray(PAGE)), 0, PAGE, header, use_o_direct=False)
    assert os.listdir(tmp_path) == []
