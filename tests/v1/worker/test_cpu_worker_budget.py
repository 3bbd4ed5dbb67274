"""The CPU worker's KV-cache budget (``vllm/v1/worker/cpu_worker.py``): the explicit size, the
warm-up before measuring, and the argument errors (upstream's own file covers the auto-sized
budget and its two shortfalls)."""

from types import SimpleNamespace

import pytest

import vllm.v1.worker.cpu_worker as cpu_worker_mod
from vllm.utils.cpu_resource_utils import MemoryNodeInfo
from vllm.v1.worker.cpu_worker import CPUWorker

GiB = 1 << 30


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cpu_worker_mod, "get_allowed_cpu_list", lambda: [SimpleNamespace(numa_node=1)]
    )
    monkeypatch.setattr(
        cpu_worker_mod,
        "get_memory_node_info",
        lambda n: MemoryNodeInfo(total_memory=8 * GiB, available_memory=4 * GiB),
    )
    process = SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=1 * GiB))
    monkeypatch.setattr(cpu_worker_mod.psutil, "Process", lambda pid: process)


def test_explicit_size_is_taken_when_it_fits(node: None) -> None:
    worker = CPUWorker(SimpleNamespace(kv_cache_memory_bytes=3 * GiB), 6 * GiB)
    assert worker.determine_available_memory() == 3 * GiB


def test_explicit_size_above_free_memory_is_refused(node: None) -> None:
    worker = CPUWorker(SimpleNamespace(kv_cache_memory_bytes=5 * GiB), 6 * GiB)
    with pytest.raises(
        ValueError, match=r"kv_cache_memory_bytes: expected at most the free memory of node 1"
    ):
        worker.determine_available_memory()


def test_runner_is_warmed_up_before_measuring(node: None) -> None:
    calls: list[str] = []
    runner = SimpleNamespace(warming_up_model=lambda: calls.append("warm"))
    worker = CPUWorker(SimpleNamespace(kv_cache_memory_bytes=None), 3 * GiB, runner)
    assert worker.determine_available_memory() == 2 * GiB
    assert calls == ["warm"]


@pytest.mark.parametrize("reserved", [0, -1, True, 2.5, "1GiB"])
def test_bad_reservation_is_refused(reserved: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"requested_cpu_memory: expected"):
        CPUWorker(SimpleNamespace(kv_cache_memory_bytes=None), reserved)  # type: ignore[arg-type]
