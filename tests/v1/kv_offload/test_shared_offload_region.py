"""SharedOffloadRegion: one /dev/shm file holding every worker's CPU offload blocks."""

from __future__ import annotations

import mmap
import os
import uuid

import pytest
import torch

from vllm.utils.system_utils import get_mp_context
from vllm.v1.kv_offload.cpu.shared_offload_region import RegionOverflowError, SharedOffloadRegion

PAGE = mmap.PAGESIZE


def region(engine_id: str, rank: int | None, **kwargs: object) -> SharedOffloadRegion:
    args: dict = dict(num_chunks=3, kv_bytes_per_chunk=2 * PAGE, cpu_page_size=PAGE)
    args.update(kwargs)
    return SharedOffloadRegion(engine_id, rank=rank, **args)


def test_two_workers_interleave_rows_and_creator_removes_file() -> None:
    iid = str(uuid.uuid4())
    r0, r1 = region(iid, 0), region(iid, 1)
    assert r0._creator and not r1._creator
    assert r0.num_chunks == r0.num_blocks == 3 and r0.total_size_bytes == 6 * PAGE
    a, b = r0.create_next_worker_view(PAGE // 2), r0.create_next_view(PAGE // 2)
    c = r1.create_next_worker_view(PAGE)
    assert a.shape == (3, PAGE // 2) and a.stride() == (2 * PAGE, 1)
    with pytest.raises(RegionOverflowError, match="exceeds worker area end"):
        r0.create_next_worker_view(1)
    a.fill_(1)
    b.fill_(2)
    c.fill_(3)
    rows = torch.frombuffer(r1.create_kv_memoryview(), dtype=torch.int8).view(3, 2 * PAGE)
    assert rows[:, : PAGE // 2].eq(1).all() and rows[:, PAGE // 2 : PAGE].eq(2).all()
    assert rows[:, PAGE:].eq(3).all()
    del a, b, c, rows
    r1.cleanup()
    assert os.path.exists(r0.mmap_path)
    r0.cleanup()
    r0.cleanup()
    assert not os.path.exists(r0.mmap_path)


def test_rows_are_padded_to_pages_and_the_padding_is_no_cell() -> None:
    r = region(str(uuid.uuid4()), None, kv_bytes_per_chunk=PAGE, cpu_page_size=PAGE // 4)
    try:
        assert r.create_kv_memoryview().shape == (3, PAGE)
        with pytest.raises(ValueError, match="needs a region opened with a rank"):
            r.create_next_worker_view(1)
    finally:
        r.cleanup()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_bytes_per_chunk": PAGE + 1}, "kv_bytes_per_chunk: expected a multiple of the page"),
        ({"num_chunks": 0}, "num_chunks: expected an int >= 1, got 0"),
        ({"rank": 2}, "rank: expected a worker whose"),
        ({"populate_shard": (2, 2)}, "populate_shard: expected"),
        ({"num_segments": 0}, "num_segments: expected a positive int, got 0"),
    ],
)
def test_bad_layouts_fail_before_a_file_exists(kwargs: dict, message: str) -> None:
    iid = str(uuid.uuid4())
    rank = kwargs.pop("rank", 0)
    with pytest.raises(ValueError, match=message):
        region(iid, rank, **kwargs)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{iid}.mmap")


def test_barrier_unlinks_after_mapping_and_shards_prefault_between_barriers() -> None:
    calls: list[bool] = []
    iid = str(uuid.uuid4())
    path = f"/dev/shm/vllm_offload_{iid}.mmap"

    def barrier() -> None:
        calls.append(os.path.exists(path))

    r = region(iid, 0, barrier=barrier, populate_shard=(1, 2))
    try:
        # Reached twice (mapped, then pre-faulted); the file is gone after the first.
        assert calls == [True, False] and not os.path.exists(path)
        view = r.create_next_worker_view(PAGE)
        view.fill_(7)
        assert bool(view.eq(7).all())
        del view
    finally:
        r.cleanup()


def test_a_failed_memory_check_removes_the_file() -> None:
    iid = str(uuid.uuid4())

    def refuse(total: int) -> None:
        raise MemoryError(f"{total} bytes")

    with pytest.raises(MemoryError, match=str(6 * PAGE)):
        region(iid, 0, creator_memory_check=refuse)
    assert not os.path.exists(f"/dev/shm/vllm_offload_{iid}.mmap")


def test_bad_mp_method(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert get_mp_context().get_start_method() == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "threads")
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD"):
        get_mp_context()
