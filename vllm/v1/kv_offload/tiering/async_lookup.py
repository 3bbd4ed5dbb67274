"""Asynchronous key lookups for secondary tiers whose lookups are slow (upstream v0.33's
``tiering.async_lookup``).

The scheduler's ``lookup`` must return at once, so a tier that asks a file system or a
remote store subclasses :class:`AsyncLookupManager`: the first ``lookup`` of a key answers
``None`` (ask again) and queues the key; ``flush`` (once per scheduler step) hands the queued
keys to a worker thread, which calls :meth:`AsyncLookupManager.batch_lookup` once per
requesting request; later ``lookup`` calls return the verdict. A key is probed once however
many requests ask; a request's ``cleanup`` forgets its keys (a probe in flight stays, and
serves the next request that asks for the key). Every method but ``batch_lookup`` runs on the
scheduler thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from enum import Enum, auto

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

logger = logging.getLogger(__name__)

LookupResults = list[tuple[OffloadKey, int, bool]]
"""One flushed batch's verdicts: ``(key, generation, present)``."""
LookupGroups = list[tuple[ReqContext, list[tuple[OffloadKey, int]]]]
"""One flushed batch: per requesting request, its ``(key, generation)`` probes."""


class LookupPhase(Enum):
    PENDING = auto()
    """Queued, not yet handed to the worker (the next ``flush`` does)."""
    IN_FLIGHT = auto()
    """Handed to the worker; the verdict has not been applied yet."""
    RESOLVED = auto()
    """The verdict is known (``result``)."""


@dataclass
class _LookupEntry:
    phase: LookupPhase
    generation: int
    """Tells this probe's verdict from one of an earlier, forgotten probe of the same key."""
    req_context: ReqContext
    """The request the probe runs for (its context goes to ``batch_lookup``)."""
    req_ids: set[str] = field(default_factory=set)
    """The requests that asked; with none left the entry goes once it is not in flight."""
    result: bool | None = None


class AsyncLookupManager(ABC):
    """Key lookups answered by a worker thread (see the module docstring)."""

    def __init__(self, tier_type: str) -> None:
        self.tier_type = tier_type
        self._lookup_state: dict[OffloadKey, _LookupEntry] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._lookup_batch: list[OffloadKey] = []
        self._generations = itertools.count()
        self._lookup_queue: queue.SimpleQueue[LookupGroups | None] = queue.SimpleQueue()
        self._pending_results: queue.SimpleQueue[LookupResults] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"kv-tier-lookup-{tier_type}", daemon=True
        )
        self._thread.start()

    @abstractmethod
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Whether each of ``keys`` is held by the tier, in order (runs on the worker thread;
        an exception, or too few answers, counts every key of the call as absent)."""

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True / False once the verdict on ``key`` is known; None while it is being probed
        (the first call queues the probe)."""
        self.drain_results()
        entry = self._lookup_state.get(key)
        if entry is None:
            entry = _LookupEntry(LookupPhase.PENDING, next(self._generations), req_context)
            self._lookup_state[key] = entry
            self._lookup_batch.append(key)
        entry.req_ids.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        return entry.result if entry.phase is LookupPhase.RESOLVED else None

    def flush(self) -> None:
        """Apply finished verdicts, then hand the queued probes to the worker (one batch)."""
        self.drain_results()
        groups: dict[str, tuple[ReqContext, list[tuple[OffloadKey, int]]]] = {}
        for key in self._lookup_batch:
            entry = self._lookup_state.get(key)
            # A key forgotten (or queued twice) since it was queued is probed at most once.
            if entry is None or entry.phase is not LookupPhase.PENDING:
                continue
            entry.phase = LookupPhase.IN_FLIGHT
            ctx = entry.req_context
            groups.setdefault(ctx.req_id, (ctx, []))[1].append((key, entry.generation))
        self._lookup_batch = []
        if groups:
            self._lookup_queue.put(list(groups.values()))

    def drain_results(self) -> None:
        """Apply the verdicts the worker posted; a verdict of a forgotten probe is dropped,
        and a probe no request asks for any more is forgotten once decided."""
        while True:
            try:
                batch = self._pending_results.get_nowait()
            except queue.Empty:
                return
            for key, generation, present in batch:
                entry = self._lookup_state.get(key)
                if entry is None or entry.generation != generation:
                    continue
                if entry.phase is not LookupPhase.IN_FLIGHT:
                    # Each probe is queued once: a second verdict could undo a mark_miss.
                    raise AssertionError(
                        f"lookup result: expected one verdict per probe, got another for a "
                        f"{entry.phase.name} key of generation {generation}"
                    )
                entry.phase, entry.result = LookupPhase.RESOLVED, present
                if not entry.req_ids:
                    del self._lookup_state[key]

    def mark_miss(self, keys: Collection[OffloadKey]) -> None:
        """Turn the known verdicts on ``keys`` into misses (a load from the tier failed), so
        lookups answer False without probing again; keys being probed afresh, or unknown
        keys, are left alone."""
        for key in keys:
            entry = self._lookup_state.get(key)
            if entry is not None and entry.phase is LookupPhase.RESOLVED:
                entry.result = False

    def cleanup(self, req_id: str) -> None:
        """Forget request ``req_id``'s lookups (a key another request asked for stays)."""
        for key in self._req_keys.pop(req_id, ()):
            entry = self._lookup_state.get(key)
            if entry is None:
                continue
            entry.req_ids.discard(req_id)
            if not entry.req_ids and entry.phase is not LookupPhase.IN_FLIGHT:
                del self._lookup_state[key]

    def shutdown(self) -> None:
        """Let the worker finish the batches handed to it, stop it, and apply their
        verdicts."""
        if self._thread.is_alive():
            self._lookup_queue.put(None)
            self._thread.join()
        self.drain_results()

    def _run(self) -> None:
        while (groups := self._lookup_queue.get()) is not None:
            results: LookupResults = []
            for req_context, probes in groups:
                keys = [key for key, _ in probes]
                try:
                    found = list(self.batch_lookup(keys, req_context))
                    if len(found) != len(keys):
                        raise ValueError(f"expected {len(keys)} answers, got {len(found)}")
                except Exception:
                    logger.warning(
                        "%s tier: lookup of %d keys failed; counted as misses",
                        self.tier_type,
                        len(keys),
                        exc_info=True,
                    )
                    found = [False] * len(keys)
                results.extend(
                    (key, generation, bool(present))
                    for (key, generation), present in zip(probes, found, strict=True)
                )
            self._pending_results.put(results)
