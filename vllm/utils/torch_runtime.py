"""How torch runs in this process: the CPU threads it may use (aware of CPU affinity and
cgroup quotas), a guard against initializing CUDA by accident, host-to-device copies that do
not wait, and the current and auxiliary streams.

Re-exported by :mod:`vllm.utils.torch_utils`, upstream vLLM's home of these names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm.utils import check_device, check_positive_int

logger = logging.getLogger(__name__)

OMP_NUM_THREADS_SET_BY_VLLM = "VLLM_OMP_NUM_THREADS_SET_BY_VLLM"
"""Environment variable (upstream's name) set to ``1`` next to an ``OMP_NUM_THREADS`` that vLLM
chose for its worker processes' startup, so that a worker may drop that value once serving
starts; without it ``OMP_NUM_THREADS`` is the user's and is respected."""

_PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_CGROUP_ROOT = Path("/sys/fs/cgroup")

_logged: set[tuple[int, str, tuple[object, ...]]] = set()


def on_cuda() -> bool:
    """Whether this process runs on CUDA: torch sees a CUDA device (the one rule by which
    :data:`vllm.platforms.current_platform` is chosen too)."""
    return torch.cuda.is_available()


def _log_once(level: int, msg: str, *args: object) -> None:
    """Log a message once per process: these are called once per worker, and again on every
    engine restart within it."""
    key = (level, msg, args)
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def _cgroup_v2_quota(directory: Path) -> float | None:
    """CPUs allowed by ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``); None when
    unlimited or unreadable."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _cgroup_v1_quota(directory: Path) -> float | None:
    """CPUs allowed by the CFS quota (``-1``: unlimited); None when unlimited or unreadable."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        if quota <= 0:
            return None
        return quota / int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _cgroup_cpu_limit() -> float | None:
    """The tightest CPU quota (in CPUs, maybe fractional) over this process's cgroup and its
    ancestors, cgroup v2 or v1; None when nothing limits it or nothing can be read.

    The cgroup mount's root is read too: inside a container it is the container's own cgroup,
    while ``/proc/self/cgroup`` may name the host's path, which is not mounted there.
    """
    try:
        lines = _PROC_SELF_CGROUP.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        read: Callable[[Path], float | None]
        if controllers == "":
            base, read = _CGROUP_ROOT, _cgroup_v2_quota
        elif "cpu" in controllers.split(","):
            base, read = _CGROUP_ROOT / "cpu", _cgroup_v1_quota
        else:
            continue
        parts = [part for part in path.split("/") if part]
        if ".." in parts:  # a path outside our cgroup namespace: only the mount root is ours
            parts = []
        for depth in range(len(parts), -1, -1):
            quota = read(base.joinpath(*parts[:depth]))
            if quota is not None:
                quotas.append(quota)
    return min(quotas, default=None)


def available_cpu_count() -> int:
    """CPUs this process can really use: on Linux the CPUs of its affinity mask, capped by the
    cgroup CPU quota (rounded down, at least 1), where ``os.cpu_count()`` counts the host's;
    elsewhere ``os.cpu_count()``."""
    if sys.platform != "linux":
        return os.cpu_count() or 1
    count = len(os.sched_getaffinity(0))
    limit = _cgroup_cpu_limit()
    if limit is not None:
        count = min(count, int(limit))
    return max(1, count)


def startup_omp_num_threads(num_local_procs: int) -> int:
    """Torch threads for each of ``num_local_procs`` worker processes of this node during
    startup (weight loading is CPU-parallel): an even share of :func:`available_cpu_count`,
    at least 1. ``0`` counts as one process."""
    if isinstance(num_local_procs, bool) or not isinstance(num_local_procs, int):
        raise ValueError(f"num_local_procs: expected a non-negative int, got {num_local_procs!r}")
    if num_local_procs < 0:
        raise ValueError(f"num_local_procs: expected a non-negative int, got {num_local_procs}")
    return max(1, available_cpu_count() // max(1, num_local_procs))


def set_torch_threads_for_runtime() -> None:
    """Drop torch to one intra-op thread for serving.

    Idle OpenMP workers spin after each parallel region, taking cycles (and cgroup quota) from
    the serial work of every step, and no CPU op of a serving step gains from intra-op
    parallelism. An ``OMP_NUM_THREADS`` set by the user is respected (logged once when above
    1); one that vLLM set for startup (:data:`OMP_NUM_THREADS_SET_BY_VLLM` is ``1``) is not.
    """
    omp_num_threads = os.environ.get("OMP_NUM_THREADS")
    if omp_num_threads is not None and os.environ.get(OMP_NUM_THREADS_SET_BY_VLLM) != "1":
        with contextlib.suppress(ValueError):  # not a number: torch's own business
            if int(omp_num_threads) > 1:
                _log_once(
                    logging.WARNING,
                    "OMP_NUM_THREADS=%s is set, so torch keeps %d threads for serving; "
                    "multi-threaded CPU ops in the serving loop spin-wait and use up cgroup "
                    "CPU quota, which can slow serving down",
                    omp_num_threads,
                    torch.get_num_threads(),
                )
        return
    if torch.get_num_threads() != 1:
        _log_once(
            logging.INFO,
            "Setting torch threads from %d to 1 for serving (set OMP_NUM_THREADS to keep more)",
            torch.get_num_threads(),
        )
        torch.set_num_threads(1)


def _omp_num_threads_or_one() -> int:
    """``OMP_NUM_THREADS`` when it is a positive int, else 1 (logged once)."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None:
        _log_once(logging.DEBUG, "OMP_NUM_THREADS is not set: using 1 torch thread")
        return 1
    try:
        return check_positive_int("OMP_NUM_THREADS", int(value))
    except ValueError:
        _log_once(logging.WARNING, "OMP_NUM_THREADS=%r is not a positive int: using 1", value)
        return 1


@contextlib.contextmanager
def set_default_torch_num_threads(num_threads: int | None = None) -> Iterator[None]:
    """Run the block with torch using ``num_threads`` intra-op threads, restoring the previous
    count afterwards, also on an exception. ``None`` takes ``OMP_NUM_THREADS``, or 1 when it
    is unset or not a positive int."""
    if num_threads is None:
        num_threads = _omp_num_threads_or_one()
    else:
        check_positive_int("num_threads", num_threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def guard_cuda_initialization() -> Iterator[None]:
    """Run the block with no CUDA device visible (``CUDA_VISIBLE_DEVICES=""``), so that code
    which would initialize CUDA in this process fails instead; on a non-CUDA platform it does
    nothing. Like upstream's, it turns any error of the block into a ``RuntimeError`` (torch's
    "No CUDA GPUs are available" into "CUDA initialization is blocked."), chained to it.
    """
    if not on_cuda():
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    except Exception as e:
        blocked = "No CUDA GPUs are available" in str(e)
        raise RuntimeError("CUDA initialization is blocked." if blocked else str(e)) from e
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


PIN_MEMORY: bool = on_cuda() and "microsoft" not in platform.uname().release.lower()
"""Whether host staging buffers are pinned: on CUDA, except under WSL, whose pinned memory
upstream leaves off by default (the CPU platform has no pinned memory)."""


def _host_tensor(data: Any, dtype: torch.dtype | None) -> tuple[torch.Tensor, bool]:
    """``data`` as a CPU tensor, and whether that tensor shares the caller's memory."""
    if isinstance(data, torch.Tensor):
        if not data.is_cpu:
            raise ValueError(f"data: expected a host (CPU) tensor, got one on {data.device}")
        return data, True
    try:
        if isinstance(data, np.ndarray):
            return torch.from_numpy(data), True
        return torch.tensor(data, dtype=dtype, device="cpu", pin_memory=PIN_MEMORY), False
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"data: expected a list, NumPy array or CPU tensor of numbers, got "
            f"{type(data).__name__} ({e})"
        ) from None


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def async_tensor_h2d(
    data: list[Any] | np.ndarray | torch.Tensor,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy host ``data`` (a list, NumPy array or CPU tensor) to ``device``, or into ``out``,
    without waiting for the copy; returns the new tensor, or ``out``.

    ``dtype`` defaults to ``out``'s (and must equal it), else to the source's. The source is
    first staged into a contiguous host buffer of that dtype, pinned where memory is pinned
    (:data:`PIN_MEMORY`), unless it already is one: a copy from pageable memory, or one that
    converts or gathers a strided source, would make the caller wait. A new tensor is
    contiguous and never shares the source's memory (also on ``device="cpu"``, where upstream's
    may). With ``out``, the source's shape must broadcast to ``out``'s.
    """
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype: expected out's dtype {out.dtype} or None, got {dtype}")
        dtype = out.dtype
    elif device is None:
        raise ValueError("device: expected a destination device when out is not given, got None")
    else:
        device = check_device("device", device)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: expected a torch.dtype or None, got {dtype!r}")
    host, shared = _host_tensor(data, dtype)
    target = dtype or host.dtype
    if out is not None and not _broadcasts_to(host.shape, out.shape):
        raise ValueError(
            f"out: expected a shape that data's {tuple(host.shape)} broadcasts to, "
            f"got {tuple(out.shape)}"
        )
    ready = host.dtype == target and host.is_contiguous() and (host.is_pinned() or not PIN_MEMORY)
    if not ready:
        buffer = torch.empty(host.shape, dtype=target, device="cpu", pin_memory=PIN_MEMORY)
        host, shared = buffer.copy_(host), False
    if out is not None:
        return out.copy_(host, non_blocking=True)
    return host.to(device=device, non_blocking=True, copy=shared)


def np_to_pinned_tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a CPU tensor, in pinned memory (a copy) where memory is pinned
    (:data:`PIN_MEMORY`), else sharing the array's memory."""
    if not isinstance(array, np.ndarray):
        raise ValueError(f"array: expected a NumPy array, got {type(array).__name__}")
    t = torch.from_numpy(array)
    return t.pin_memory() if PIN_MEMORY else t


class _HostStream:
    """:func:`current_stream` on a platform without streams (CPU): work there is synchronous,
    so waiting for it is a no-op."""

    def synchronize(self) -> None:
        return None


_current_stream = threading.local()
"""Per thread: the stream last set through ``torch.cuda.set_stream`` (``value``)."""

# torch's own set_stream, also when this module is reloaded (set_stream is then our wrapper).
_torch_set_stream: Callable[[torch.cuda.Stream], None] = getattr(
    torch.cuda.set_stream, "_torch_set_stream", torch.cuda.set_stream
)


def _set_stream_and_remember(stream: torch.cuda.Stream) -> None:
    # torch.cuda.set_stream (and the torch.cuda.stream context manager, which calls it) records
    # the stream for current_stream, as upstream does; None stays a no-op, as in torch.
    if stream is not None:
        _current_stream.value = stream
    _torch_set_stream(stream)


_set_stream_and_remember._torch_set_stream = _torch_set_stream  # type: ignore[attr-defined]
torch.cuda.set_stream = _set_stream_and_remember


def current_stream() -> torch.cuda.Stream | _HostStream:
    """The calling thread's current stream, without building a new ``torch.cuda.Stream`` on
    every call as ``torch.cuda.current_stream()`` does (upstream's helper).

    It is the stream last set in this thread through ``torch.cuda.set_stream`` or the
    ``torch.cuda.stream`` context (streams set from C++ are not seen). On CUDA, a thread that
    has set none gets a dedicated stream of its own, set as current, rather than the default
    stream, on which CUDA graphs cannot be captured. On CPU it is a placeholder whose
    ``synchronize()`` does nothing.
    """
    stream = getattr(_current_stream, "value", None)
    if stream is None:
        if on_cuda():
            dedicated = torch.cuda.Stream()
            # Work already queued on the stream torch has as current must run first.
            dedicated.wait_stream(torch.cuda.current_stream())
            torch.cuda.set_stream(dedicated)
        else:
            _current_stream.value = _HostStream()
        stream = _current_stream.value
    return stream


_aux_stream: torch.cuda.Stream | None = None


def aux_stream() -> torch.cuda.Stream | None:
    """The process's one auxiliary CUDA stream for work overlapped with the current stream
    (upstream: MoE shared experts), created on first use; one for all callers keeps the stream
    count and profiles small. ``None`` on a platform without CUDA streams."""
    global _aux_stream
    if _aux_stream is None and on_cuda():
        _aux_stream = torch.cuda.Stream()
    return _aux_stream
