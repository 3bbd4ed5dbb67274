"""The file-system tier: block files, failures, and byte-exact round trips of every cache format
through the tiering manager (CPU primary rows in a shared offload region)."""

from __future__ import annotations

import errno
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from tiering_test_utils import FORMATS, region, stub_spec, wait_until, worker_pages

from vllm.v1.attention.backends.utils import kv_cache_layout
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering import factory
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs import io
from vllm.v1.kv_offload.tiering.fs.block_file import HEADER_BYTES, BlockFileHeader
from vllm.v1.kv_offload.tiering.fs.io import load_block, store_block
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

CTX = ReqContext(req_id="r")


def key(i: int, group: int = 0):
    return make_offload_key(i.to_bytes(8, "big"), group)


def job(job_id: int, ids: list[int], rows: list[int], promotion: bool = False) -> TransferJob:
    return TransferJob(job_id, [key(i) for i in ids], np.array(rows), promotion, CTX)


def found(tier: FileSystemTierManager, i: int, ctx: ReqContext = CTX) -> bool:
    """The tier's verdict on key ``i`` for ``ctx``, waiting out the asynchronous probe."""
    verdict: list[LookupResult] = []

    def answered() -> bool:
        verdict[:] = [tier.lookup(key(i), ctx)]
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        return verdict[0] is not LookupResult.RETRY

    wait_until(answered)
    return verdict[0] is LookupResult.HIT


def finished(tier: FileSystemTierManager, n: int) -> dict[int, bool]:
    results: dict[int, bool] = {}

    def poll() -> bool:
        results.update((r.job_id, r.success) for r in tier.get_finished_jobs())
        return len(results) >= n

    wait_until(poll)
    return results


@pytest.fixture
def tier(tmp_path):
    rows = torch.zeros((4, 4096), dtype=torch.uint8)
    fs = FileSystemTierManager(stub_spec(), memoryview(rows.numpy()), "fs_python", str(tmp_path))
    yield fs, rows
    fs.shutdown()


def test_block_files_config_and_byte_exact_load(tier) -> None:
    fs, rows = tier
    config = json.loads(Path(fs.file_mapper.get_config_file_path()).read_text())
    assert config == fs.file_mapper.get_run_config()
    rows[:2] = torch.randint(0, 256, (2, 4096), dtype=torch.uint8)
    want = rows[:2].clone()
    fs.submit_store(job(1, [7, 8], [0, 1]))
    assert finished(fs, 1) == {1: True}
    assert os.path.getsize(fs.file_mapper.get_file_name(key(7))) == HEADER_BYTES + 4096
    assert found(fs, 7) and not found(fs, 9)
    fs.submit_load(job(2, [8, 7], [2, 3], promotion=True))
    assert finished(fs, 1) == {2: True}
    assert torch.equal(rows[2], want[1]) and torch.equal(rows[3], want[0])
    # An empty job finishes at once.
    fs.submit_store(job(3, [], []))
    assert finished(fs, 1) == {3: True}


def test_existing_file_is_kept_and_no_temp_files_stay(tier) -> None:
    fs, rows = tier
    rows[0] = 1
    fs.submit_store(job(1, [1], [0]))
    finished(fs, 1)
    rows[0] = 2
    fs.submit_store(job(2, [1], [0]))
    finished(fs, 1)
    path = fs.file_mapper.get_file_name(key(1))
    assert Path(path).read_bytes()[HEADER_BYTES:] == bytes([1]) * 4096
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_truncated_or_missing_file_fails_the_job_and_is_removed(tier) -> None:
    fs, rows = tier
    fs.submit_store(job(1, [1, 2], [0, 1]))
    finished(fs, 1)
    path = fs.file_mapper.get_file_name(key(2))
    with open(path, "r+b") as f:
        f.truncate(100)
    rows[2:] = 5
    fs.submit_load(job(2, [1, 2, 3], [2, 3, 0], promotion=True))
    assert finished(fs, 1) == {2: False}
    assert not os.path.exists(path) and found(fs, 1)


def test_nhd_and_hnd_caches_never_share_block_files(tmp_path) -> None:
    """Tiers of an NHD and an HND cache of one config under one root: other folders, so the
    NHD block is a miss for the HND tier and its promotion fails; an HND block is found by HND."""
    nhd_rows = torch.zeros((2, 4096), dtype=torch.uint8)
    hnd_rows = torch.zeros((2, 4096), dtype=torch.uint8)
    nhd = FileSystemTierManager(stub_spec(), memoryview(nhd_rows.numpy()), "fs", str(tmp_path))
    with kv_cache_layout("HND"):
        hnd = FileSystemTierManager(stub_spec(), memoryview(hnd_rows.numpy()), "fs", str(tmp_path))
    try:
        assert nhd.file_mapper.base_path != hnd.file_mapper.base_path
        assert nhd.file_mapper.get_file_name(key(1)) != hnd.file_mapper.get_file_name(key(1))
        nhd_rows[0] = 7
        nhd.submit_store(job(1, [1], [0]))
        assert finished(nhd, 1) == {1: True}
        assert not found(hnd, 1)
        hnd.submit_load(job(2, [1], [1], promotion=True))
        assert finished(hnd, 1) == {2: False}
        hnd_rows[0] = 9
        hnd.submit_store(job(3, [2], [0]))
        assert finished(hnd, 1) == {3: True}
        assert found(hnd, 2) and not found(nhd, 2)
    finally:
        nhd.shutdown()
        hnd.shutdown()


def test_unwritable_root_fails_at_construction() -> None:
    rows = torch.zeros((2, 64), dtype=torch.uint8)
    with pytest.raises(OSError):
        FileSystemTierManager(stub_spec(), memoryview(rows.numpy()), "fs_python", "/dev/null/x")


def test_direct_io_falls_back_when_the_file_system_refuses_it(monkeypatch, tmp_path) -> None:
    calls: list[int] = []
    real_open = os.open

    def refusing_open(path, flags, mode=0o777):
        calls.append(flags)
        if flags & 0x4000_0000:
            raise OSError(errno.EINVAL, "no direct I/O here")
        return real_open(path, flags, mode)

    monkeypatch.setattr(io, "_O_DIRECT", 0x4000_0000)
    monkeypatch.setattr(io, "_direct_flag", lambda view: 0x4000_0000)
    monkeypatch.setattr(io.os, "open", refusing_open)
    src = bytearray(os.urandom(8192))
    dest = str(tmp_path / "a" / "b.bin")
    header = BlockFileHeader(bytes(32), key(1))
    store_block(dest, memoryview(src), 4096, 4096, header)
    out = bytearray(8192)
    load_block(dest, memoryview(out), 0, 4096, header)
    assert out[:4096] == src[4096:] and out[4096:] == bytes(4096)
    assert [bool(f & 0x4000_0000) for f in calls] == [True, False, True, False]
    with pytest.raises(ValueError, match="outside the 8192-byte buffer"):
        store_block(str(tmp_path / "c.bin"), memoryview(src), 8000, 4096, header)


def test_factory_creates_the_tier(tmp_path) -> None:
    rows = torch.zeros((2, 64), dtype=torch.uint8)
    config = {"type": "fs_python", "root_dir": str(tmp_path), "n_read_threads": 1}
    fs = factory.SecondaryTierFactory.create_secondary_tier(
        config, memoryview(rows.numpy()), stub_spec()
    )
    assert isinstance(fs, FileSystemTierManager) and fs.tier_type == "fs_python"
    assert len(fs._pool._threads) == 17 and config["type"] == "fs_python"
    fs.shutdown()


Cells = list[tuple[torch.Tensor, torch.Tensor]]
"""(a worker's region view of one tensor, that tensor's GPU pages), per worker and tensor."""


def put(cells: Cells, row: int, block: int) -> None:
    for view, pages in cells:
        view[row] = pages[block].view(torch.int8)


def fill(cells: Cells, value: int) -> None:
    for view, _ in cells:
        view.fill_(value)


def holds(cells: Cells, row: int, block: int) -> bool:
    return all(torch.equal(view[row].view(torch.uint8), pages[block]) for view, pages in cells)


@pytest.mark.parametrize("cache_dtype", FORMATS)
def test_every_format_round_trips_byte_exact_through_the_fs_tier(cache_dtype, tmp_path) -> None:
    """Two workers' pages of four blocks: stored to the CPU rows, cascaded to files, evicted
    from the CPU tier, promoted back into other rows: every byte as stored."""
    num_rows, workers = 4, 2
    caches = [worker_pages(cache_dtype, seed) for seed in range(workers)]
    page = sum(caches[0][1])
    name = f"test_{uuid.uuid4().hex}"
    scheduler_region = region(num_rows, page, None, workers, name)
    worker_regions = [region(num_rows, page, r, workers, name) for r in range(workers)]
    cells: Cells = [
        (wr.create_next_view(page), pages)
        for wr, (layers, sizes) in zip(worker_regions, caches, strict=True)
        for pages, page in zip(layers, sizes, strict=True)
    ]
    primary = CPUPrimaryTierOffloadingManager(num_rows, scheduler_region)
    spec = stub_spec(cache_dtype=cache_dtype)
    fs = FileSystemTierManager(spec, primary.get_kv_memoryview(), "fs_python", str(tmp_path), 2, 2)
    manager = TieringOffloadingManager(primary, [fs])
    try:
        gpu_blocks = {key(i): b for i, b in enumerate([5, 1, 3, 0])}
        out = manager.prepare_store(list(gpu_blocks), CTX)
        assert out is not None
        for k, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            put(cells, row, gpu_blocks[k])
        manager.complete_store(out.keys_to_store, CTX)
        wait_until(lambda: not list(manager.take_events()) and not manager._transfer_jobs)
        # Four new keys evict the stored ones from the CPU tier; clobber the rows too.
        other = manager.prepare_store([key(i) for i in range(10, 14)], CTX)
        assert other is not None and set(other.evicted_keys) == set(gpu_blocks)
        manager.complete_store(other.keys_to_store, CTX, success=False)
        fill(cells, -1)
        wanted = [key(2), key(0)]
        step = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())

        def promoted() -> bool:
            # The tier's probe answers RETRY first, then the promotion runs (HIT_PENDING).
            verdicts = [manager.lookup(k, CTX) for k in wanted]
            assert LookupResult.MISS not in verdicts
            manager.on_schedule_end(step)
            list(manager.take_events())
            return all(v is LookupResult.HIT for v in verdicts)

        wait_until(promoted)
        rows = manager.prepare_load(wanted, CTX).block_ids
        for k, row in zip(wanted, rows, strict=True):
            assert holds(cells, row, gpu_blocks[k])
        manager.complete_load(wanted, CTX)
    finally:
        cells.clear()  # drop the views of the shared buffer before it is unmapped
        manager.shutdown()
        for wr in worker_regions:
            wr.cleanup()
