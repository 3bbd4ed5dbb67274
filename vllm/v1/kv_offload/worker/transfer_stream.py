"""Running host-submitted copy jobs in order on a device stream or a worker thread.

A :class:`TransferStream` runs a handler's jobs in submission order: :class:`CudaTransferStream`
on one dedicated CUDA stream (one event per job), :class:`ThreadTransferStream` on one
background thread (CPU-only machines). :class:`StreamOffloadingHandler` is the bookkeeping every
handler of such jobs shares: submission, in-order reporting, cross-handler waits
(``depends_on``) and per-job errors.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from vllm.v1.kv_offload.base import OffloadingHandler, TransferResult, TransferType


class TransferEvent(ABC):
    """Completion marker of one job on a :class:`TransferStream`."""

    @abstractmethod
    def query(self) -> bool:
        """True once the job's copies have completed (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the job's copies have completed."""

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the job, if it failed after submission."""
        return None

    def elapsed_seconds(self) -> float | None:
        """Time the job's copies took in seconds (after completion), if measured."""
        return None


class TransferStream(ABC):
    """The device-specific part of a handler: runs submitted jobs in submission order."""

    @abstractmethod
    def submit(
        self,
        copy_fn: Callable[[], None],
        wait_for_compute: bool,
        wait_events: Sequence[TransferEvent] = (),
        reuse: TransferEvent | None = None,
    ) -> TransferEvent:
        """Queue ``copy_fn`` after every earlier job and return its completion event.

        With ``wait_for_compute``, the copies also wait for the work the submitting thread has
        queued on the device so far (the producer of the pages being read). The copies also
        start only after every job of ``wait_events`` (events of other streams) has completed,
        without blocking the submitting thread; the job fails when one of them failed.
        ``reuse``: a completed event of this kind of stream to record again (pooled events
        save allocations); another kind is ignored and a fresh event returned.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release the stream's resources after its jobs have finished."""


class _CudaEvent(TransferEvent):
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event):
        self._start = start
        self._end = end

    def query(self) -> bool:
        return self._end.query()

    def synchronize(self) -> None:
        self._end.synchronize()

    def elapsed_seconds(self) -> float | None:
        return self._start.elapsed_time(self._end) / 1000.0


class CudaTransferStream(TransferStream):
    """Jobs run on one dedicated CUDA stream of ``device``; one end event per job."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def submit(
        self,
        copy_fn: Callable[[], None],
        wait_for_compute: bool,
        wait_events: Sequence[TransferEvent] = (),
        reuse: TransferEvent | None = None,
    ) -> TransferEvent:
        for event in wait_events:
            if isinstance(event, _CudaEvent):
                # cudaStreamWaitEvent: device-side wait, the host does not block.
                self.stream.wait_event(event._end)
            else:
                event.synchronize()  # an event of another kind of stream: wait on the host
        if wait_for_compute:
            # Recorded now, on the stream the model runs on: the copy starts only after the
            # work queued there so far (which writes the pages) has finished.
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(produced)
        if isinstance(reuse, _CudaEvent):
            start, end = reuse._start, reuse._end
        else:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start.record(self.stream)
            copy_fn()
            end.record(self.stream)
        return _CudaEvent(start, end)


class _ThreadEvent(TransferEvent):
    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._seconds: float | None = None

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def elapsed_seconds(self) -> float | None:
        return self._seconds

    def _reset(self) -> None:
        self._done.clear()
        self._error = None
        self._seconds = None

    def _finish(self, seconds: float, error: BaseException | None) -> None:
        self._seconds = seconds
        self._error = error
        self._done.set()


class ThreadTransferStream(TransferStream):
    """Jobs run FIFO on one background thread (for a GPU side that is a CPU tensor).

    ``wait_for_compute`` needs no action: CPU work is synchronous, and everything the host
    wrote before :meth:`submit` is visible to the worker thread.
    """

    def __init__(self, name: str = "kv-offload"):
        self._name = name
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], None], _ThreadEvent, tuple[TransferEvent, ...]] | None
        ] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            copy_fn, event, wait_events = item
            error: BaseException | None = None
            for awaited in wait_events:
                awaited.synchronize()
                if awaited.error is not None and error is None:
                    error = RuntimeError(
                        f"an earlier transfer this job waits for failed: {awaited.error!r}"
                    )
            start = time.perf_counter()
            if error is None:
                try:
                    copy_fn()
                except BaseException as e:  # reported through the job's result
                    error = e
            event._finish(time.perf_counter() - start, error)

    def submit(
        self,
        copy_fn: Callable[[], None],
        wait_for_compute: bool,
        wait_events: Sequence[TransferEvent] = (),
        reuse: TransferEvent | None = None,
    ) -> TransferEvent:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        event = reuse if isinstance(reuse, _ThreadEvent) else _ThreadEvent()
        event._reset()
        self._jobs.put((copy_fn, event, tuple(wait_events)))
        return event

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()


def make_transfer_stream(device: torch.device, name: str = "kv-offload") -> TransferStream:
    """The transfer stream for a GPU side on ``device``: CUDA stream, or a thread on CPU."""
    if device.type == "cuda":
        return CudaTransferStream(device)
    if device.type == "cpu":
        return ThreadTransferStream(name)
    raise ValueError(f"device: KV offloading supports cuda and cpu KV caches, got {device}")


@dataclass
class _Transfer:
    job_id: int
    event: TransferEvent
    num_bytes: int


class StreamOffloadingHandler(OffloadingHandler):
    """Runs each job's copy function on a :class:`TransferStream` and reports jobs in order.

    The bookkeeping shared by every handler whose jobs are host-submitted copy functions: jobs
    run in submission order on ``transfer_stream``; :meth:`get_finished` polls them in
    submission order and stops at the first unfinished one. ``depends_on``: another handler
    whose earlier, unreported jobs each new job waits for (see the module's ordering
    contract). A job whose copy function raised is reported with ``success=False``; its
    exception stays readable through :meth:`job_error`.
    """

    def __init__(
        self,
        transfer_type: TransferType,
        transfer_stream: TransferStream,
        wait_for_compute: bool,
        depends_on: StreamOffloadingHandler | None = None,
    ):
        self.transfer_type = transfer_type
        self.transfer_stream = transfer_stream
        self.wait_for_compute = wait_for_compute
        self.depends_on = depends_on
        self._transfers: deque[_Transfer] = deque()
        self._in_flight: dict[int, _Transfer] = {}
        self._errors: dict[int, BaseException] = {}

    def unreported_events(self) -> list[TransferEvent]:
        """Completion events of the jobs submitted and not yet reported, in submission order."""
        return [transfer.event for transfer in self._transfers]

    def submit_job(self, job_id: int, copy_fn: Callable[[], None], num_bytes: int) -> bool:
        """Queue ``copy_fn`` as job ``job_id`` moving ``num_bytes`` bytes; returns True."""
        if job_id in self._in_flight:
            raise ValueError(f"job_id: job {job_id} is already in flight")
        if self.depends_on is not None and (waits := self.depends_on.unreported_events()):
            event = self.transfer_stream.submit(copy_fn, self.wait_for_compute, waits)
        else:
            event = self.transfer_stream.submit(copy_fn, self.wait_for_compute)
        transfer = _Transfer(job_id, event, num_bytes)
        self._transfers.append(transfer)
        self._in_flight[job_id] = transfer
        return True

    def job_error(self, job_id: int) -> BaseException | None:
        """The exception that failed reported job ``job_id`` (None when it succeeded)."""
        return self._errors.get(job_id)

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        # Poll in submission order; stop at the first job still running, so that a later
        # job is never reported before an earlier one.
        while self._transfers and self._transfers[0].event.query():
            transfer = self._transfers.popleft()
            del self._in_flight[transfer.job_id]
            error = transfer.event.error
            if error is not None:
                self._errors[transfer.job_id] = error
            results.append(
                TransferResult(
                    job_id=transfer.job_id,
                    success=error is None,
                    transfer_size=transfer.num_bytes,
                    transfer_time=transfer.event.elapsed_seconds(),
                    transfer_type=self.transfer_type,
                )
            )
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            transfer = self._in_flight.get(job_id)
            if transfer is not None:
                transfer.event.synchronize()

    def wait_all(self) -> None:
        """Block until every submitted job has finished (results stay unreported)."""
        for transfer in list(self._transfers):
            transfer.event.synchronize()

    def shutdown(self) -> None:
        self.wait_all()
        self.transfer_stream.close()
