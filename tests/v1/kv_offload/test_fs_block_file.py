"""Damaged, foreign and misplaced block files of the file-system tier: each is a miss (a failed
load that reports nothing as loaded), is dropped, and the next store of its key writes it again.
Every tier test runs on both I/O paths: the ``vllm.fs_io_C`` extension and per-block Python."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from tiering_test_utils import stub_spec, wait_until

from vllm.v1.attention.backends.utils import kv_cache_layout
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import io as fs_io
from vllm.v1.kv_offload.tiering.fs.block_file import HEADER_BYTES, BadBlockFile, BlockFileHeader
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

CTX = ReqContext(req_id="r")
ROW = 4096
SENTINEL = 0xA5


def key(i: int):
    return make_offload_key(i.to_bytes(8, "big"), 0)


class Tier:
    """A file-system tier over four rows: row 0 holds the block stored, row 1 receives it."""

    def __init__(self, root: Path, layout: str = "NHD") -> None:
        self.rows = torch.zeros((4, ROW), dtype=torch.uint8)
        with kv_cache_layout(layout):
            self.fs = FileSystemTierManager(
                stub_spec(), memoryview(self.rows.numpy()), "fs_python", str(root), 1, 1
            )
        self._next_job = 0
        self._next_ctx = 0

    def path(self, i: int) -> str:
        return self.fs.file_mapper.get_file_name(key(i))

    def _run(self, i: int, row: int, promotion: bool) -> bool:
        self._next_job += 1
        job = TransferJob(self._next_job, [key(i)], np.array([row]), promotion, CTX)
        (self.fs.submit_load if promotion else self.fs.submit_store)(job)
        results: list = []
        wait_until(lambda: results.extend(self.fs.get_finished_jobs()) or bool(results))
        assert [r.job_id for r in results] == [self._next_job]
        return results[0].success

    def store(self, i: int, row: int = 0) -> bool:
        return self._run(i, row, promotion=False)

    def load(self, i: int, row: int = 1) -> bool:
        """Load block ``i`` into ``row`` (first set to a sentinel)."""
        self.rows[row] = SENTINEL
        return self._run(i, row, promotion=True)

    def lookup(self, i: int) -> bool:
        """Whether a fresh request finds block ``i`` (waiting out the asynchronous probe)."""
        self._next_ctx += 1
        ctx = ReqContext(req_id=f"lookup-{self._next_ctx}")
        verdict: list[LookupResult] = []

        def answered() -> bool:
            verdict[:] = [self.fs.lookup(key(i), ctx)]
            self.fs.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
            return verdict[0] is not LookupResult.RETRY

        wait_until(answered)
        self.fs.on_request_finished(ctx)
        return verdict[0] is LookupResult.HIT


@pytest.fixture(params=["fs_io_C", "python"])
def io_path(request, monkeypatch) -> str:
    """Run the test on the extension's batched I/O, then on the per-block Python I/O."""
    if request.param == "fs_io_C":
        assert fs_io._HAS_FSIO_C, "vllm.fs_io_C is not built (see setup.py / CMakeLists.txt)"
    else:
        monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)
    return request.param


@pytest.fixture
def tier(tmp_path, io_path):
    t = Tier(tmp_path)
    t.rows[0] = torch.randint(0, 256, (ROW,), dtype=torch.uint8, generator=torch.Generator())
    yield t
    t.fs.shutdown()


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def loads_exactly(t: Tier, i: int) -> bool:
    return t.load(i) and torch.equal(t.rows[1], t.rows[0])


# Offsets from the start (the header, if any) and from the end (the last payload byte).
@pytest.mark.parametrize("offset", [0, 12, 40, 2000, -1, -ROW // 2])
def test_a_flipped_byte_is_a_miss_and_the_next_store_writes_the_file_again(tier, offset) -> None:
    assert tier.store(1)
    path = tier.path(1)
    size = os.path.getsize(path)
    before = os.stat(path)
    flip(path, offset % size)
    # A store finds a file of the full size and keeps it (names are content hashes): no
    # store reads whole files back; the load that finds the damage drops the file.
    assert tier.store(1)
    assert os.stat(path).st_ino == before.st_ino
    assert not tier.load(1)
    assert not tier.lookup(1) and not os.path.exists(path)  # dropped: a miss from now on
    assert tier.store(1) and loads_exactly(tier, 1)


@pytest.mark.parametrize("offset", [0, 12, 40, 2000])
def test_a_damaged_header_writes_nothing_into_the_row(tier, offset) -> None:
    assert tier.store(1)
    flip(tier.path(1), offset)
    assert not tier.load(1)
    assert bool((tier.rows[1] == SENTINEL).all())


@pytest.mark.parametrize("cut", [1, ROW // 2])
def test_a_truncated_file_is_not_present_and_is_replaced(tier, cut) -> None:
    assert tier.store(1)
    path = tier.path(1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - cut)
    assert not tier.lookup(1)
    assert not tier.load(1)
    assert tier.store(1) and tier.lookup(1) and loads_exactly(tier, 1)


def test_a_truncated_file_is_replaced_by_a_store_without_a_load_between(tier) -> None:
    assert tier.store(1)
    path = tier.path(1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)
    assert tier.store(1) and loads_exactly(tier, 1)


def test_a_directory_at_the_path_fails_the_store_and_is_never_present(tier) -> None:
    path = tier.path(1)
    os.makedirs(path)
    assert not tier.store(1)
    assert not tier.lookup(1)
    assert not tier.load(1) and bool((tier.rows[1] == SENTINEL).all())
    assert os.path.isdir(path)  # never removed by the tier
    os.rmdir(path)
    assert tier.store(1) and loads_exactly(tier, 1)


def test_a_file_of_another_page_format_is_a_miss(tier, tmp_path) -> None:
    """An HND cache's file put at the NHD tier's path (same key, same size) is refused."""
    hnd = Tier(tmp_path, layout="HND")
    try:
        hnd.rows[0] = tier.rows[0] ^ 0xFF
        assert hnd.store(1)
        os.makedirs(os.path.dirname(tier.path(1)))
        shutil.copyfile(hnd.path(1), tier.path(1))
        assert not tier.load(1) and bool((tier.rows[1] == SENTINEL).all())
        assert not os.path.exists(tier.path(1))
        assert hnd.load(1) and torch.equal(hnd.rows[1], hnd.rows[0])  # its own file is fine
    finally:
        hnd.fs.shutdown()


def test_a_file_at_another_keys_path_is_a_miss(tier) -> None:
    assert tier.store(1)
    os.makedirs(os.path.dirname(tier.path(2)), exist_ok=True)
    shutil.copyfile(tier.path(1), tier.path(2))
    assert not tier.load(2) and bool((tier.rows[1] == SENTINEL).all())
    assert loads_exactly(tier, 1)


def test_a_valid_file_is_kept_by_a_later_store(tier) -> None:
    assert tier.store(1)
    before = os.stat(tier.path(1))
    assert tier.store(1)
    after = os.stat(tier.path(1))
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert loads_exactly(tier, 1)


def test_the_file_is_a_header_then_the_block(tier) -> None:
    assert tier.store(1)
    raw = Path(tier.path(1)).read_bytes()
    block = tier.rows[0].numpy().tobytes()
    assert len(raw) == HEADER_BYTES + ROW and raw[HEADER_BYTES:] == block
    magic, version, fingerprint, key_digest, size, crc = struct.unpack_from("<8sI32s16sQI", raw)
    assert (magic, version, size, crc) == (b"VKVFSBLK", 1, ROW, zlib.crc32(block))
    assert fingerprint == tier.fs.file_mapper.fingerprint
    assert key_digest == hashlib.blake2b(key(1), digest_size=16).digest()
    assert raw[struct.calcsize("<8sI32s16sQI") : HEADER_BYTES] == bytes(HEADER_BYTES - 72)


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        (0, "expected magic b'VKVFSBLK', got b'F"),
        (8, "expected version 1, got 17"),
        (12, "expected settings fingerprint"),
        (44, "expected key digest"),
        (60, "expected payload bytes 4096, got 4112"),
        (100, "expected zeros after the header fields"),
    ],
)
def test_a_bad_header_names_the_field(offset: int, message: str) -> None:
    header = BlockFileHeader(bytes(range(32)), key(1))
    raw = bytearray(header.pack(ROW, 7))
    raw[offset] ^= 0x10
    with pytest.raises(BadBlockFile, match=f"f.bin: {re.escape(message)}"):
        header.check(bytes(raw), ROW, "f.bin")
    assert header.check(header.pack(ROW, 7), ROW, "f.bin") == 7
    with pytest.raises(ValueError, match="fingerprint: expected 32 bytes, got 12"):
        BlockFileHeader(bytes(12), key(1))


def test_a_read_error_fails_the_load_but_keeps_the_file(tier, monkeypatch) -> None:
    """Only a file shown to be bad is removed; an I/O error may be transient."""
    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)  # the error is injected in the Python path
    assert tier.store(1)
    real_readv = os.readv

    def failing_readv(fd, buffers):
        monkeypatch.setattr(fs_io.os, "readv", real_readv)
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fs_io.os, "readv", failing_readv)
    assert not tier.load(1)
    assert tier.lookup(1) and loads_exactly(tier, 1)


def test_a_failed_load_never_removes_a_good_file_stored_meanwhile(tier, monkeypatch) -> None:
    """A load that finds the file bad removes that file only: when a good file took its place
    while the load was reading, the good file stays and loads."""
    monkeypatch.setattr(fs_io, "_HAS_FSIO_C", False)  # the race is staged in the Python path
    assert tier.store(1)
    flip(tier.path(1), 2000)
    read = fs_io._read_file

    def read_then_race(path: str, *args) -> None:
        try:
            read(path, *args)
        finally:
            # Another process drops the damaged file and a store writes the block again, all
            # before this load removes what it read.
            os.remove(path)
            header = BlockFileHeader(tier.fs.file_mapper.fingerprint, key(1))
            fs_io.store_block(path, memoryview(tier.rows.numpy()), 0, ROW, header)

    monkeypatch.setattr(fs_io, "_read_file", read_then_race)
    assert not tier.load(1)
    assert tier.lookup(1) and loads_exactly(tier, 1)
