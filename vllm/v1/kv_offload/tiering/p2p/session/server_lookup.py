"""Answering a symmetric-P2P consumer's probes (LookupMsg), for :class:`.server.ServerRole`.

A LookupMsg is only queued while messages are dispatched; it is answered in
:meth:`_LookupServing.serve_external_requests`, the one call that holds a
:class:`ParentManager` handle. Each LookupMsg becomes a synthetic request on the parent
(``on_new_request`` ... ``on_request_finished``); keys that hit are pinned at once through
``create_store_job`` and parked as supply for the probe's round, so the consumer's fetch
finds them. Keys the parent cannot answer yet (HIT_PENDING / RETRY) are asked again on
later serves until ``_LOOKUP_PENDING_TIMEOUT_S`` turns them into misses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.p2p.session.protocol import TYPE_KEY, LookupRespMsg
from vllm.v1.kv_offload.tiering.p2p.session.server_state import (
    _ActiveLookup,
    _PendingLookup,
    _ServerRequestState,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import JobId, ParentManager

logger = logging.getLogger(__name__)

# Seconds a probed key may stay HIT_PENDING / RETRY before it is answered as a miss: long
# enough for a running store or promotion to land, short enough not to stall the consumer.
_LOOKUP_PENDING_TIMEOUT_S = 5.0


class _LookupServing:
    """Probe-answering half of the serving role; ServerRole supplies the state below."""

    _peer_id: str
    _send: Callable[[dict], None]
    _requests: dict[str, _ServerRequestState]
    # kv_request_ids with probes to process or re-ask on the next serve.
    _serve_pending: set[str]
    # Synthetic requests closed outside a serve, owing parent.on_request_finished.
    _finished_lookup_ctxs: list[ReqContext]
    _lookup_id_counter: int

    if TYPE_CHECKING:

        def _get_or_create_request(self, kv_request_id: str) -> _ServerRequestState: ...

        def _maybe_prune(self, kv_request_id: str) -> None: ...

        def add_stored_blocks(
            self,
            kv_request_id: str,
            keys: Sequence[OffloadKey],
            block_ids: Sequence[int],
            job_id: JobId,
            round_seq: int = 0,
            *,
            from_lookup: bool = False,
        ) -> None: ...

    def on_lookup(self, kv_request_id: str, keys: Sequence[OffloadKey], round_seq: int = 0) -> None:
        """Queue a received LookupMsg for the next serve."""
        self._get_or_create_request(kv_request_id).pending_lookups.append(
            _PendingLookup(keys=list(keys), enqueued_at=time.monotonic(), round_seq=round_seq)
        )
        self._serve_pending.add(kv_request_id)

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Answer queued probes and re-ask parked keys; ``parent`` is valid for this call.

        The whole call runs under the tiering manager's lock, so a key found HIT cannot be
        evicted before it is pinned.
        """
        for kv_request_id in list(self._serve_pending):
            st = self._requests.get(kv_request_id)
            if st is not None and st.pending_lookups:
                queued, st.pending_lookups = st.pending_lookups, []
                for pl in queued:
                    self._process_inbound_lookup(
                        kv_request_id, pl.keys, pl.enqueued_at, pl.round_seq, parent
                    )
            self._resolve_pending_lookups(kv_request_id, parent)
            st = self._requests.get(kv_request_id)
            if st is None or not (st.pending_lookups or st.lookups):
                self._serve_pending.discard(kv_request_id)
                self._maybe_prune(kv_request_id)
        if self._finished_lookup_ctxs:
            for ctx in self._finished_lookup_ctxs:
                parent.on_request_finished(ctx)
            self._finished_lookup_ctxs = []

    def _poll_lookup_keys(
        self, lookup: _ActiveLookup, keys: Iterable[OffloadKey], parent: ParentManager
    ) -> list[OffloadKey]:
        """Ask ``parent`` about each unsettled key; pin the new hits and return them."""
        new_hits: list[OffloadKey] = []
        for key in keys:
            if key in lookup.resolved:
                continue
            result = parent.lookup(key, lookup.ctx)
            if result is LookupResult.HIT or result is LookupResult.MISS:
                lookup.resolved[key] = result is LookupResult.HIT
                lookup.pending.discard(key)
                if result is LookupResult.HIT:
                    new_hits.append(key)
            else:
                lookup.pending.add(key)
        if new_hits:
            self._pin_and_register_hits(lookup, new_hits, parent)
        return new_hits

    def _process_inbound_lookup(
        self,
        kv_request_id: str,
        keys: list[OffloadKey],
        enqueued_at: float,
        round_seq: int,
        parent: ParentManager,
    ) -> None:
        """Open a synthetic request for one LookupMsg and settle what can be settled."""
        self._lookup_id_counter += 1
        lookup_id = self._lookup_id_counter
        lookup = _ActiveLookup(
            lookup_id=lookup_id,
            kv_request_id=kv_request_id,
            ctx=ReqContext(req_id=f"p2p:{self._peer_id}:{kv_request_id}:lu{lookup_id}"),
            round_seq=round_seq,
            keys=list(keys),
            deadline=enqueued_at + _LOOKUP_PENDING_TIMEOUT_S,
        )
        parent.on_new_request(lookup.ctx)
        # dict.fromkeys: ask once per distinct key, in wire order.
        self._poll_lookup_keys(lookup, dict.fromkeys(lookup.keys), parent)
        if lookup.pending:
            self._get_or_create_request(kv_request_id).lookups[lookup_id] = lookup
        else:
            self._finalize_lookup(lookup, parent)

    def _pin_and_register_hits(
        self, lookup: _ActiveLookup, keys: list[OffloadKey], parent: ParentManager
    ) -> None:
        """Pin ``keys`` (all HIT) and offer them as supply for the probe's round."""
        job = parent.create_store_job(keys, lookup.ctx)
        self.add_stored_blocks(
            lookup.kv_request_id,
            list(job.keys),
            [int(b) for b in job.chunk_ids],
            job.job_id,
            round_seq=lookup.round_seq,
            from_lookup=True,
        )

    def _resolve_pending_lookups(self, kv_request_id: str, parent: ParentManager) -> None:
        """Re-ask parked keys of ``kv_request_id``; past the deadline they become misses."""
        st = self._requests.get(kv_request_id)
        if st is None or not st.lookups:
            return
        now = time.monotonic()
        settled: list[int] = []
        for lookup_id, lookup in st.lookups.items():
            self._poll_lookup_keys(lookup, list(lookup.pending), parent)
            if lookup.pending and now >= lookup.deadline:
                for key in lookup.pending:
                    lookup.resolved[key] = False
                lookup.pending.clear()
            if not lookup.pending:
                settled.append(lookup_id)
        for lookup_id in settled:
            self._finalize_lookup(st.lookups.pop(lookup_id), parent)

    def _finalize_lookup(self, lookup: _ActiveLookup, parent: ParentManager) -> None:
        """Send the one LookupRespMsg (keys in wire order) and close the synthetic request."""
        if lookup.keys:
            self._send(
                {
                    TYPE_KEY: LookupRespMsg.TYPE,
                    LookupRespMsg.KV_REQUEST_ID: lookup.kv_request_id,
                    LookupRespMsg.KEYS: list(lookup.keys),
                    LookupRespMsg.HITS: [lookup.resolved[k] for k in lookup.keys],
                }
            )
        parent.on_request_finished(lookup.ctx)

    def _finish_inbound_lookups(self, kv_request_id: str) -> None:
        """No more probes will come for ``kv_request_id`` (terminal fetch or local finish).

        Parked lookups are dropped without an answer and their contexts queued for
        ``on_request_finished`` at the next serve; unprocessed LookupMsgs never opened a
        synthetic request, so nothing is owed for them.
        """
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        st.pending_lookups.clear()
        self._finished_lookup_ctxs.extend(lu.ctx for lu in st.lookups.values())
        st.lookups.clear()
        self._serve_pending.discard(kv_request_id)
        self._maybe_prune(kv_request_id)
