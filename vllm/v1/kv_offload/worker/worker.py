"""Transfer-handler abstractions of the offloading worker.

A handler moves blocks from one medium to another asynchronously: :meth:`transfer_async`
submits a job, :meth:`get_finished` reports finished jobs. :class:`OffloadingWorker` routes
each job to the handler registered for its (source medium, destination medium) pair.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
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
    """Routes transfer jobs to the handler registered for their media."""

    def __init__(self) -> None:
        self.handlers: list[OffloadingHandler] = []
        self.transfer_type_to_handler: dict[TransferType, OffloadingHandler] = {}

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
        return handler.transfer_async(job_id, spec)

    def get_finished(self) -> list[TransferResult]:
        """Finished jobs of every handler (each handler's in its submission order)."""
        results: list[TransferResult] = []
        for handler in self.handlers:
            results.extend(handler.get_finished())
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished, whichever handler runs them."""
        ids = set(job_ids)
        for handler in self.handlers:
            handler.wait(ids)

    def shutdown(self) -> None:
        """Shut every handler down."""
        for handler in self.handlers:
            handler.shutdown()
