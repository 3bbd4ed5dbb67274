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


def test_two_workers_interleave_rows_and_creator_removes_file() -> None:
    iid = str(uuid.uuid4())
    kwargs = dict(total_size_bytes=3 * 2 * PAGE, num_blocks=3, num_workers=2, cpu_page_size=PAGE)
    r0 = SharedOffloadRegion(iid, rank=0, **kwargs)  # type: ignore[arg-type]
    r1 = SharedOffloadRegion(iid, rank=1, **kwargs)  # type: ignore[arg-type]
    assert r0._creator and not r1._creator
    a, b = r0.create_next_view(PAGE // 2), r0.create_next_view(PAGE // 2)
    c = r1.create_next_view(PAGE)
    assert a.shape == (3, PAGE // 2) and a.stride() == (2 * PAGE, 1)
    with pytest.raises(RegionOverflowError, match="exceeds worker area end"):
        r0.create_next_view(1)
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


def test_too_small_file_and_bad_mp_method(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="total_size_bytes"):
        SharedOffloadRegion(str(uuid.uuid4()), PAGE, 2, 0, 1, PAGE)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert get_mp_context().get_start_method() == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "threads")
    with pytest.raises(ValueError, match="VLLM_WORKER_MULTIPROC_METHOD"):
        get_mp_context()
