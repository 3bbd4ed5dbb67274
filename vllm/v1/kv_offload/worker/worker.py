"""The worker that routes transfer jobs to handlers.

A handler (:class:`~vllm.v1.kv_offload.base.OffloadingHandler`, importable from here as in
upstream) moves blocks from one medium to another asynchronously. :class:`OffloadingWorker`
routes each job to the handler registered for its (source medium, destination medium) pair.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)
from vllm.v1.kv_offload.base import OffloadingWorker as MediumWorker

__all__ = [
    "OffloadingHandler",
    "OffloadingWorker",
    "TransferResult",
    "TransferSpec",
    "TransferType",
]

logger = logging.getLogger(__name__)


class OffloadingWorker(MediumWorker):
    """Routes transfer jobs to the handler registered for their media (v0.22's worker; as a
    v0.33 :class:`~vllm.v1.kv_offload.base.OffloadingWorker`, stores and loads route the same
    way).

    A handler that raises while submitting is logged and the job reported not submitted
    (``transfer_async`` returns False). :meth:`get_finished` passes every handler's results
    through as they come: jobs of different handlers are independent (ordering between
    directions is the handlers' business, see :mod:`vllm.v1.kv_offload.cpu.page_copy`).
    """

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
        """Submit job ``job_id`` to the handler of its media; False when it was not submitted."""
        src, dst = spec
        transfer_type = (src.medium(), dst.medium())
        handler = self.transfer_type_to_handler.get(transfer_type)
        if handler is None:
            raise ValueError(
                f"spec: no handler registered for {transfer_type[0]} -> {transfer_type[1]}; "
                f"registered: {sorted(self.transfer_type_to_handler)}"
            )
        try:
            submitted = handler.transfer_async(job_id, spec)
        except Exception:
            logger.warning("%r transfer %d failed to submit", transfer_type, job_id, exc_info=True)
            return False
        if not submitted:
            logger.warning("%r transfer %d was not submitted", transfer_type, job_id)
        return submitted

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self.transfer_async(job_id, (src_spec, dst_spec))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # Handlers run jobs in submission order per direction: nothing to jump ahead of.
        return self.transfer_async(job_id, (src_spec, dst_spec))

    def get_finished(self) -> list[TransferResult]:
        """Jobs of every handler that finished since the last call."""
        return [result for handler in self.handlers for result in handler.get_finished()]

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished."""
        ids = set(job_ids)
        for handler in self.handlers:
            handler.wait(ids)

    def shutdown(self) -> None:
        """Shut every handler down."""
        for handler in self.handlers:
            handler.shutdown()
