"""vllm.utils.torch_runtime: thread counts, the CUDA guard, host-to-device copies, streams (all
re-exported by vllm.utils.torch_utils, upstream's path)."""

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vllm.utils.torch_runtime as torch_runtime
import vllm.utils.torch_utils as torch_utils
from vllm.utils.torch_runtime import (
    OMP_NUM_THREADS_SET_BY_VLLM,
    PIN_MEMORY,
    async_tensor_h2d,
    aux_stream,
    available_cpu_count,
    current_stream,
    guard_cuda_initialization,
    np_to_pinned_tensor,
    set_default_torch_num_threads,
    set_torch_threads_for_runtime,
    startup_omp_num_threads,
)

CUDA = torch.cuda.is_available()
RUNTIME_LOGGER = torch_runtime.__name__


def test_torch_utils_reexports_the_runtime_names() -> None:
    for name in (
        "OMP_NUM_THREADS_SET_BY_VLLM",
        "PIN_MEMORY",
        "async_tensor_h2d",
        "aux_stream",
        "available_cpu_count",
        "current_stream",
        "guard_cuda_initialization",
        "np_to_pinned_tensor",
        "set_default_torch_num_threads",
        "set_torch_threads_for_runtime",
        "startup_omp_num_threads",
    ):
        assert getattr(torch_utils, name) is getattr(torch_runtime, name)
    assert OMP_NUM_THREADS_SET_BY_VLLM == "VLLM_OMP_NUM_THREADS_SET_BY_VLLM"  # crosses processes


# ------------------------------------------------------------------ CPU count and threads


def _fake_cgroups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proc: str, files: dict[str, str]
) -> None:
    (tmp_path / "proc").write_text(proc)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(torch_runtime, "_PROC_SELF_CGROUP", tmp_path / "proc")
    monkeypatch.setattr(torch_runtime, "_CGROUP_ROOT", tmp_path / "fs")


@pytest.mark.parametrize(
    ("proc", "files", "limit"),
    [
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000"}, None),
        ("0::/a/b\n", {"a/b/cpu.max": "150000 100000"}, 1.5),
        # The tightest quota along the path wins, the mount root included.
        (
            "0::/a/b\n",
            {"a/b/cpu.max": "max 1", "a/cpu.max": "250000 100000", "cpu.max": "4 1"},
            2.5,
        ),
        ("0::/\n", {"cpu.max": "300000 100000"}, 3.0),
        # cgroup v1: the host path is not mounted in a container; its mount root is.
        (
            "4:memory:/x\n3:cpu,cpuacct:/docker/x\n",
            {"cpu/cpu.cfs_quota_us": "200000", "cpu/cpu.cfs_period_us": "100000"},
            2.0,
        ),
        ("3:cpu:/k\n", {"cpu/k/cpu.cfs_quota_us": "-1", "cpu/k/cpu.cfs_period_us": "1"}, None),
        ("0::/../../elsewhere\n", {"cpu.max": "100000 100000", "elsewhere/cpu.max": "0 1"}, 1.0),
        ("0::/a\n", {"a/cpu.max": "garbage", "cpu.max": "1 0"}, None),  # unreadable: ignored
        ("garbage\n1:memory:/\n", {"cpu.max": "1 1"}, None),
    ],
)
def test_cgroup_cpu_limit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    proc: str,
    files: dict[str, str],
    limit: float | None,
) -> None:
    _fake_cgroups(tmp_path, monkeypatch, proc, files)
    assert torch_runtime._cgroup_cpu_limit() == limit


def test_cgroup_cpu_limit_without_proc_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_runtime, "_PROC_SELF_CGROUP", tmp_path / "missing")
    assert torch_runtime._cgroup_cpu_limit() is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
@pytest.mark.parametrize(("limit", "expected"), [(None, 64), (2.9, 2), (0.5, 1), (1000.0, 64)])
def test_available_cpu_count_caps_affinity_by_quota(
    monkeypatch: pytest.MonkeyPatch, limit: float | None, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(torch_runtime, "_cgroup_cpu_limit", lambda: limit)
    assert available_cpu_count() == expected


def test_available_cpu_count_here() -> None:
    assert 1 <= available_cpu_count() <= (os.cpu_count() or 1)


@pytest.mark.parametrize(("procs", "threads"), [(0, 8), (1, 8), (3, 2), (8, 1), (100, 1)])
def test_startup_omp_num_threads(monkeypatch: pytest.MonkeyPatch, procs: int, threads: int) -> None:
    monkeypatch.setattr(torch_runtime, "available_cpu_count", lambda: 8)
    assert startup_omp_num_threads(procs) == threads


@pytest.mark.parametrize("procs", [-1, 1.5, True, "2"])
def test_startup_omp_num_threads_rejects_bad_input(procs: Any) -> None:
    with pytest.raises(ValueError, match="num_local_procs: expected a non-negative int"):
        startup_omp_num_threads(procs)


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No OMP_NUM_THREADS, nothing logged yet; torch's thread count restored afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(OMP_NUM_THREADS_SET_BY_VLLM, raising=False)
    monkeypatch.setattr(torch_runtime, "_logged", set())
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize(
    ("omp", "set_by_vllm", "after", "logged"),
    [
        (None, False, 1, "Setting torch threads from 3 to 1"),
        ("3", True, 1, "Setting torch threads from 3 to 1"),  # vLLM's startup value: dropped
        ("3", False, 3, "OMP_NUM_THREADS=3 is set, so torch keeps 3 threads"),  # the user's
        ("1", False, 3, ""),
        ("many", False, 3, ""),  # not a number: left to torch, no warning
    ],
)
def test_set_torch_threads_for_runtime(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    omp: str | None,
    set_by_vllm: bool,
    after: int,
    logged: str,
) -> None:
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    if set_by_vllm:
        monkeypatch.setenv(OMP_NUM_THREADS_SET_BY_VLLM, "1")
    torch.set_num_threads(3)
    with caplog.at_level(logging.INFO, logger=RUNTIME_LOGGER):
        set_torch_threads_for_runtime()
        torch.set_num_threads(3)
        set_torch_threads_for_runtime()  # logged once only
    assert torch.get_num_threads() == after
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == (1 if logged else 0)
    assert all(logged in message for message in messages)


@pytest.mark.usefixtures("threads")
@pytest.mark.parametrize(
    ("omp", "inside", "warned"), [(None, 1, False), ("2", 2, False), ("0", 1, True), ("x", 1, True)]
)
def test_set_default_torch_num_threads_from_environment(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    omp: str | None,
    inside: int,
    warned: bool,
) -> None:
    if omp is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    torch.set_num_threads(3)
    with caplog.at_level(logging.WARNING, logger=RUNTIME_LOGGER), set_default_torch_num_threads():
        assert torch.get_num_threads() == inside
    assert torch.get_num_threads() == 3
    assert ("is not a positive int: using 1" in caplog.text) is warned


@pytest.mark.usefixtures("threads")
def test_set_default_torch_num_threads_explicit_and_on_error() -> None:
    torch.set_num_threads(3)
    with pytest.raises(KeyError), set_default_torch_num_threads(2):
        assert torch.get_num_threads() == 2
        raise KeyError("inside")
    assert torch.get_num_threads() == 3
    for bad in (0, -2, 1.5, True):
        with (
            pytest.raises(ValueError, match="num_threads: expected a positive int"),
            set_default_torch_num_threads(bad),  # type: ignore[arg-type]
        ):
            pass
    assert torch.get_num_threads() == 3


# ------------------------------------------------------------------ CUDA guard


@pytest.mark.skipif(CUDA, reason="the CPU platform's no-op")
def test_guard_cuda_initialization_is_a_no_op_off_cuda() -> None:
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with pytest.raises(KeyError), guard_cuda_initialization():
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
        raise KeyError("passes unchanged")


@pytest.mark.parametrize("previous", [None, "0,1"])
def test_guard_cuda_initialization_on_cuda(
    monkeypatch: pytest.MonkeyPatch, previous: str | None
) -> None:
    monkeypatch.setattr(torch_runtime, "on_cuda", lambda: True)
    if previous is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", previous)
    with guard_cuda_initialization():
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == previous
    with (
        pytest.raises(RuntimeError, match=r"^CUDA initialization is blocked\.$") as blocked,
        guard_cuda_initialization(),
    ):
        raise RuntimeError("Found no NVIDIA driver. No CUDA GPUs are available")
    assert isinstance(blocked.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="^other$") as other, guard_cuda_initialization():
        raise ValueError("other")
    assert isinstance(other.value.__cause__, ValueError)
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == previous


# ------------------------------------------------------------------ host-to-device copies

DEVICES = ["cpu", "cuda"] if CUDA else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
def test_async_tensor_h2d_stages_to_a_contiguous_converted_copy(device: str) -> None:
    src = torch.arange(12, dtype=torch.int64).reshape(3, 4).T  # strided, converted
    result = async_tensor_h2d(src, device=device, dtype=torch.int32)
    assert result.dtype == torch.int32 and result.is_contiguous()
    assert result.device.type == device and torch.equal(result.cpu(), src.to(torch.int32))
    # A new tensor never shares the source's memory, also when nothing needs converting.
    for source in (torch.arange(4), np.arange(4)):
        copied = async_tensor_h2d(source, device)
        source[0] = 99
        assert copied.tolist() == [0, 1, 2, 3]
    listed = async_tensor_h2d([[1, 2], [3, 4]], device, torch.float16)
    assert listed.dtype == torch.float16 and listed.tolist() == [[1, 2], [3, 4]]
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
def test_async_tensor_h2d_into_out(device: str) -> None:
    out = torch.zeros(2, 3, dtype=torch.int32, device=device)
    assert async_tensor_h2d(np.arange(6).reshape(2, 3), out=out) is out
    assert out.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
    async_tensor_h2d([7, 8, 9], out=out, dtype=torch.int32)  # broadcast over out's rows
    assert out.cpu().tolist() == [[7, 8, 9]] * 2
    with pytest.raises(ValueError, match="dtype: expected out's dtype torch.int32 or None"):
        async_tensor_h2d([1, 2, 3], out=out, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"out: expected a shape that data's \(4,\) broadcasts"):
        async_tensor_h2d([1, 2, 3, 4], out=out)
    assert out.cpu().tolist() == [[7, 8, 9]] * 2  # nothing written on bad input


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"data": [1]}, "device: expected a destination device when out is not given"),
        ({"data": [1], "device": "tpu:x"}, "device: expected a torch device"),
        ({"data": [1], "device": "cpu", "dtype": "int32"}, "dtype: expected a torch.dtype"),
        ({"data": "abc", "device": "cpu"}, "data: expected a list, NumPy array or CPU tensor"),
        ({"data": [[1, 2], [3]], "device": "cpu"}, "data: expected a list, NumPy array"),
        ({"data": np.array([object()]), "device": "cpu"}, "data: expected a list, NumPy"),
        ({"data": [1], "out": [0]}, "out: expected a torch.Tensor or None, got list"),
    ],
    ids=str,
)
def test_async_tensor_h2d_rejects_bad_input(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        async_tensor_h2d(**kwargs)


@pytest.mark.skipif(CUDA, reason="the CPU-only error")
def test_async_tensor_h2d_names_a_device_torch_cannot_use() -> None:
    with pytest.raises(ValueError, match="device: expected a device this torch can use"):
        async_tensor_h2d([1], device="cuda")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_async_tensor_h2d_rejects_a_device_tensor() -> None:
    with pytest.raises(ValueError, match="data: expected a host \\(CPU\\) tensor, got one on cuda"):
        async_tensor_h2d(torch.zeros(2, device="cuda"), device="cuda")


def test_np_to_pinned_tensor() -> None:
    array = np.arange(3, dtype=np.int32)
    t = np_to_pinned_tensor(array)
    assert t.dtype == torch.int32 and t.tolist() == [0, 1, 2]
    assert t.is_pinned() == PIN_MEMORY
    assert (t.data_ptr() == array.ctypes.data) is not PIN_MEMORY  # shared unless pinned
    with pytest.raises(ValueError, match="array: expected a NumPy array, got list"):
        np_to_pinned_tensor([1, 2])  # type: ignore[arg-type]


@pytest.mark.skipif(CUDA, reason="the CPU platform")
def test_no_pinned_memory_on_cpu() -> None:
    assert PIN_MEMORY is False


# ------------------------------------------------------------------ streams


def _in_new_thread(fn: Callable[[], Any]) -> Any:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join(timeout=10)
    return result[0]


@pytest.mark.skipif(CUDA, reason="the CPU platform's placeholder")
def test_current_stream_on_cpu_is_a_per_thread_placeholder() -> None:
    stream = current_stream()
    assert current_stream() is stream
    assert stream.synchronize() is None
    assert _in_new_thread(current_stream) is not stream
    assert aux_stream() is None


def test_set_stream_records_the_stream_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.set_stream (patched at import, as upstream does) records the stream that
    current_stream returns, in the calling thread only; None stays a no-op."""
    calls: list[object] = []
    monkeypatch.setattr(torch_runtime, "_torch_set_stream", calls.append)
    stream = object()

    def set_and_read() -> tuple[object, object]:
        torch.cuda.set_stream(stream)  # type: ignore[arg-type]
        first = current_stream()
        torch.cuda.set_stream(None)  # type: ignore[arg-type]
        return first, current_stream()

    assert _in_new_thread(set_and_read) == (stream, stream)
    assert calls == [stream, None]
    assert current_stream() is not stream
    assert torch.cuda.set_stream._torch_set_stream is not torch.cuda.set_stream  # type: ignore


class _FakeStream:
    """A CUDA stream stand-in that logs what is asked of it."""

    def __init__(self, events: list[tuple[str, object]]) -> None:
        self.events = events
        events.append(("created", self))

    def wait_stream(self, other: object) -> None:
        self.events.append(("waits for", other))


def test_dedicated_stream_waits_for_the_replaced_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a thread's first current_stream() makes a dedicated stream that waits for the
    stream torch had as current (work queued there runs first) before it becomes current."""
    events: list[tuple[str, object]] = []
    previous = object()
    monkeypatch.setattr(torch_runtime, "on_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: _FakeStream(events))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: previous)
    monkeypatch.setattr(torch_runtime, "_torch_set_stream", lambda s: events.append(("set", s)))
    stream, again = _in_new_thread(lambda: (current_stream(), current_stream()))
    assert again is stream
    assert events == [("created", stream), ("waits for", previous), ("set", stream)]
    monkeypatch.setattr(torch_runtime, "_aux_stream", None)
    assert aux_stream() is aux_stream() is not stream  # one, made on first use
    assert len(events) == 4


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_current_stream_on_cuda_is_dedicated_and_follows_the_context() -> None:
    def check() -> None:
        stream = current_stream()
        assert stream.cuda_stream != 0  # not the default stream: CUDA graphs can capture
        assert current_stream() is stream and torch.cuda.current_stream() == stream
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            assert current_stream() == other
        assert current_stream() == stream

    _in_new_thread(check)
