"""Transfer-handler abstractions of the offloading worker.

A handler moves blocks from one medium to another asynchronously: :meth:`transfer_async`
submits a job, :meth:`get_finished` reports finished jobs. :class:`OffloadingWorker` routes
each job to the handler registered for its (source medium, destination medium) pair and
reports finished jobs in submission order across all its handlers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.kv_offload.abstract import LoadStoreSpec

TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]
"""(source, destination) of one transfer job."""

TransferType = tuple[str, str]
"""(source medium, destination medium), e.g. ``("GPU", "CPU")``."""


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one finished job.

    ``transfer_size`` is in bytes (every page moved, all tensors); ``transfer_time`` is in
    seconds, measured on the device that did the copy (CUDA events, or wall time of the copy
    thread), when the handler measures it.
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: TransferType | None = None


class OffloadingHandler(ABC):
    """Moves blocks between two media asynchronously."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit job ``job_id`` and return without waiting for the copy.

        Returns True when the job was submitted. Invalid specs raise ``ValueError`` before
        anything is copied.
        """

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of jobs that finished since the last call (each reported once)."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs (those still in flight) have finished.

        Their results are still reported by the next :meth:`get_finished`.
        """

    def shutdown(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Release resources (threads, streams). Jobs in flight are waited for first."""


class OffloadingWorker:
    """Routes transfer jobs to the handler registered for their media.

    Ordered completion across handlers: :meth:`get_finished` reports jobs in the order they
    were submitted through :meth:`transfer_async`, whatever their direction — a job that
    finished before an earlier job (e.g. a store submitted after a load) is held back until
    every earlier job has been reported. :meth:`wait` therefore waits for the given jobs and
    every job submitted before them, so their results are reported by the next
    :meth:`get_finished`. (Data dependencies between directions — a load waiting for earlier
    stores — are the handlers' business; see :mod:`vllm.v1.kv_offload.worker.cpu_gpu`.)
    """

    def __init__(self) -> None:
        self.handlers: list[OffloadingHandler] = []
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}
        # Submitted, not yet reported jobs in submission order, and their handlers.
        self._order: deque[int] = deque()
        self._job_handler: dict[int, OffloadingHandler] = {}
        # Results collected from the handlers, held until every earlier job is reported.
        self._held: dict[int, TransferResult] = {}

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        """Use ``handler`` for jobs from ``src_cls``'s medium to ``dst_cls``'s medium."""
        transfer_type = (src_cls.medium(), dst_cls.medium())
        if transfer_type in self.transfer_type_to_handler:
            raise ValueError(f"transfer_type: a handler for {transfer_type} is already registered")
        self.transfer_type_to_handler[transfer_type] = handler
        if all(h is not handler for h in self.handlers):
            self.handlers.append(handler)

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit job ``job_id`` to the handler of its media; see
        :meth:`OffloadingHandler.transfer_async`."""
        src, dst = spec
        transfer_type = (src.medium(), dst.medium())
        handler = self.transfer_type_to_handler.get(transfer_type)
        if handler is None:
            raise ValueError(
                f"spec: no handler registered for {transfer_type[0]} -> {transfer_type[1]}; "
                f"registered: {sorted(self.transfer_type_to_handler)}"
            )
        if job_id in self._job_handler:
            raise ValueError(f"job_id: job {job_id} is already in flight")
        submitted = handler.transfer_async(job_id, spec)
        if submitted:
            self._order.append(job_id)
            self._job_handler[job_id] = handler
        return submitted

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs of every handler, in submission order across handlers.

        A finished job is reported only once every job submitted before it has been reported.
        """
        results: list[TransferResult] = []
        for handler in self.handlers:
            for result in handler.get_finished():
                if result.job_id in self._job_handler:
                    self._held[result.job_id] = result
                else:  # submitted to the handler directly, not through this worker
                    results.append(result)
        while self._order and self._order[0] in self._held:
            job_id = self._order.popleft()
            del self._job_handler[job_id]
            results.append(self._held.pop(job_id))
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs and every job submitted before them have finished.

        Unknown or already reported ids are ignored.
        """
        ids = set(job_ids)
        last = max((i for i, job_id in enumerate(self._order) if job_id in ids), default=-1)
        by_handler: dict[int, tuple[OffloadingHandler, list[int]]] = {}
        for i, job_id in enumerate(self._order):
            if i > last:
                break
            handler = self._job_handler[job_id]
            by_handler.setdefault(id(handler), (handler, []))[1].append(job_id)
        for handler, handler_ids in by_handler.values():
            handler.wait(handler_ids)
        untracked = ids - set(self._job_handler)
        if untracked:
            for handler in self.handlers:
                handler.wait(untracked)

    def shutdown(self) -> None:
        """Shut every handler down."""
        for handler in self.handlers:
            handler.shutdown()
