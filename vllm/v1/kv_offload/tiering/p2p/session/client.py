"""Requesting side of one peer session: loads (fetch, completion, abort) and probes.

The session parses incoming messages and calls in here with typed arguments; everything
this role sends goes through the ``send`` callback, which holds messages back until the
peer's ConnectAckMsg. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.p2p.session.protocol import (
    TYPE_KEY,
    AbortFetchMsg,
    FetchMsg,
    LookupMsg,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import JobId

logger = logging.getLogger(__name__)

# Seconds a fetch may wait for TransferDoneMsg before it is aborted.
_LOAD_TIMEOUT_S = 30.0
# Seconds an aborted fetch waits for AbortAckMsg before it is failed anyway.
_ABORT_ACK_TIMEOUT_S = 10.0
# Seconds a request's probes may go without any new answer before the session is dropped.
_LOOKUP_TIMEOUT_S = 30.0


@dataclass
class _InboundLoadState:
    """One fetch in flight (one round of a request)."""

    job_id: int
    submitted_at: float
    aborted_at: float | None = None


@dataclass
class _ClientRequestState:
    """What this side tracks for one kv_request_id; dropped once all of it is empty."""

    # Probe answers: None until the peer's LookupRespMsg says hit (True) or miss (False).
    probes: dict[OffloadKey, bool | None] = field(default_factory=dict)
    # Probed keys the next flush still has to send.
    unsent: list[OffloadKey] = field(default_factory=list)
    # Round the next probe or fetch belongs to; each fetch closes it and moves on.
    round_seq: int = 0
    # The request probed, so a fetch with keys may only name keys probed as hits.
    probed: bool = False
    # A LookupMsg went out since the last fetch: finishing owes the peer an empty fetch.
    peer_lookup_open: bool = False
    # Fetches in flight by round (the scheduler may load a request in several parts).
    loads: dict[int, _InboundLoadState] = field(default_factory=dict)


class LoadResult(NamedTuple):
    """A finished load, reported by the session's poll."""

    job_id: int
    kv_request_id: str
    success: bool


class ClientCloseResult(NamedTuple):
    """Work a dead peer cannot finish: load jobs to fail, and every kv_request_id with a
    load in flight or an unanswered probe (its lookup must stop waiting)."""

    failed_jobs: list[int]
    failed_req_ids: list[str]


class ClientRole:
    """Load and probe state machine toward one peer."""

    def __init__(self, peer_id: str, send: Callable[[dict], None]) -> None:
        self._peer_id = peer_id
        self._send = send
        self._requests: dict[str, _ClientRequestState] = {}
        # Work-lists, so per-step calls touch only the requests concerned: ids with keys
        # still to flush, and ids with a fetch in flight or aborting.
        self._flush_pending: set[str] = set()
        self._active_loads: set[str] = set()
        self._completed_loads: list[LoadResult] = []
        # Per kv_request_id: when its probes time out unless another answer arrives.
        self._lookup_deadlines: dict[str, float] = {}

    @property
    def has_active_loads(self) -> bool:
        """True while any fetch is in flight or awaiting its abort ack."""
        return bool(self._active_loads)

    def _state(self, kv_request_id: str) -> _ClientRequestState:
        st = self._requests.get(kv_request_id)
        if st is None:
            st = self._requests[kv_request_id] = _ClientRequestState()
        return st

    def _maybe_prune(self, kv_request_id: str) -> None:
        st = self._requests.get(kv_request_id)
        if st is not None and not (st.loads or st.probes or st.unsent):
            del self._requests[kv_request_id]

    def _end_load(self, kv_request_id: str, round_seq: int, success: bool) -> bool:
        """Report the load of ``round_seq`` finished; False when there was none."""
        st = self._requests.get(kv_request_id)
        load = st.loads.pop(round_seq, None) if st is not None else None
        if load is None:
            return False
        self._completed_loads.append(LoadResult(load.job_id, kv_request_id, success))
        if not st.loads:
            self._active_loads.discard(kv_request_id)
            self._maybe_prune(kv_request_id)
        return True

    def _send_abort(self, kv_request_id: str, round_seq: int) -> None:
        self._send(
            {
                TYPE_KEY: AbortFetchMsg.TYPE,
                AbortFetchMsg.KV_REQUEST_ID: kv_request_id,
                AbortFetchMsg.ROUND_SEQ: round_seq,
            }
        )

    def _send_fetch(
        self, kv_request_id: str, keys: list, block_ids: list[int], round_seq: int
    ) -> None:
        self._send(
            {
                TYPE_KEY: FetchMsg.TYPE,
                FetchMsg.KV_REQUEST_ID: kv_request_id,
                FetchMsg.KEYS: keys,
                FetchMsg.BLOCK_INDEXES: block_ids,
                FetchMsg.ROUND_SEQ: round_seq,
            }
        )

    def get_expired_lookup(self) -> tuple[str, float] | None:
        """A kv_request_id whose probes timed out, with seconds since the last progress."""
        now = time.monotonic()
        for req_id, deadline in self._lookup_deadlines.items():
            if now >= deadline:
                return req_id, now - deadline + _LOOKUP_TIMEOUT_S
        return None

    def request_blocks(
        self,
        job_id: JobId,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        block_ids: Sequence[int],
        send_ready: bool,
    ) -> None:
        """Fetch ``keys`` into local blocks ``block_ids``, closing the current round.

        ``send_ready`` is for the log only: the session's send callback queues until ready.
        """
        logger.debug(
            "P2PSession %s: fetch job %d for %s (%d blocks, ready=%s)",
            self._peer_id,
            job_id,
            kv_request_id,
            len(block_ids),
            send_ready,
        )
        st = self._state(kv_request_id)
        if st.probed and keys:
            unconfirmed = [k for k in keys if st.probes.get(k) is not True]
            assert not unconfirmed, (
                f"fetch for {kv_request_id} names {len(unconfirmed)} keys not probed as hits"
            )
        round_seq = st.round_seq
        st.round_seq += 1
        st.loads[round_seq] = _InboundLoadState(job_id=job_id, submitted_at=time.monotonic())
        self._active_loads.add(kv_request_id)
        st.peer_lookup_open = False
        self._send_fetch(kv_request_id, list(keys), [int(b) for b in block_ids], round_seq)
        # Served blocks get unpinned on the peer, so cached hits must not outlive the round.
        st.probes.clear()
        self._lookup_deadlines.pop(kv_request_id, None)

    def finish(self, kv_request_id: str) -> None:
        """The request ended locally: abort its loads, close the peer's lookup state and
        forget the probes. Aborted loads stay until their ack (or its timeout)."""
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        now = time.monotonic()
        for round_seq, load in st.loads.items():
            if load.aborted_at is None:
                self._send_abort(kv_request_id, round_seq)
                load.aborted_at = now
        if st.peer_lookup_open:
            st.peer_lookup_open = False
            self._send_fetch(kv_request_id, [], [], st.round_seq)
        st.probes.clear()
        st.unsent.clear()
        self._lookup_deadlines.pop(kv_request_id, None)
        self._flush_pending.discard(kv_request_id)
        self._maybe_prune(kv_request_id)

    def on_transfer_done(self, kv_request_id: str, success: bool, round_seq: int) -> None:
        if not self._end_load(kv_request_id, round_seq, success):
            # A duplicate from the peer or a race with a local abort/timeout: harmless.
            logger.warning(
                "P2PSession %s: transfer_done for unknown %s round %s",
                self._peer_id,
                kv_request_id,
                round_seq,
            )

    def on_abort_ack(self, kv_request_id: str, round_seq: int) -> None:
        if not self._end_load(kv_request_id, round_seq, False):
            logger.warning(
                "P2PSession %s: abort_ack for unknown %s round %s",
                self._peer_id,
                kv_request_id,
                round_seq,
            )

    def register_lookup(self, kv_request_id: str, key: bytes) -> bool | None:
        """Probe ``key`` for ``kv_request_id``: None while unanswered, else the hit flag.

        Answers are kept until a fetch closes the round or the request finishes, so asking
        again each scheduler step costs nothing and sends nothing twice.
        """
        st = self._state(kv_request_id)
        st.probed = True
        okey = OffloadKey(key)
        if okey in st.probes:
            return st.probes[okey]
        st.probes[okey] = None
        st.unsent.append(okey)
        self._flush_pending.add(kv_request_id)
        return None

    def flush_pending_lookups(self, send_ready: bool) -> None:
        """Send one LookupMsg per request with new probes (once per scheduler step).

        Nothing goes out, and no deadline starts, before the handshake completed.
        """
        if not send_ready:
            return
        deadline = time.monotonic() + _LOOKUP_TIMEOUT_S
        for req_id in self._flush_pending:
            st = self._requests.get(req_id)
            if st is None or not st.unsent:
                continue
            st.peer_lookup_open = True
            self._lookup_deadlines.setdefault(req_id, deadline)
            self._send(
                {
                    TYPE_KEY: LookupMsg.TYPE,
                    LookupMsg.KV_REQUEST_ID: req_id,
                    LookupMsg.KEYS: list(st.unsent),
                    LookupMsg.ROUND_SEQ: st.round_seq,
                }
            )
            st.unsent = []
        self._flush_pending.clear()

    def on_lookup_resp(
        self, kv_request_id: str, keys: Sequence[bytes], hits: Sequence[bool]
    ) -> None:
        """Record the answers; pairs for keys no longer probed are dropped."""
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        progressed = False
        for raw, hit in zip(keys, hits, strict=True):
            key = OffloadKey(raw)
            if key in st.probes:
                progressed |= st.probes[key] is None
                st.probes[key] = hit
        if all(hit is not None for hit in st.probes.values()):
            self._lookup_deadlines.pop(kv_request_id, None)
        elif progressed:
            # Only a newly answered probe extends the deadline; repeats do not.
            self._lookup_deadlines[kv_request_id] = time.monotonic() + _LOOKUP_TIMEOUT_S

    def collect_results(self) -> list[LoadResult]:
        """Apply load timeouts (abort, then fail when the ack is late); drain results."""
        now = time.monotonic()
        expired: list[tuple[str, int]] = []
        for req_id in self._active_loads:
            for round_seq, load in self._requests[req_id].loads.items():
                if load.aborted_at is None:
                    if now - load.submitted_at >= _LOAD_TIMEOUT_S:
                        logger.warning(
                            "P2PSession %s: %s round %s timed out, aborting",
                            self._peer_id,
                            req_id,
                            round_seq,
                        )
                        load.aborted_at = now
                        self._send_abort(req_id, round_seq)
                elif now - load.aborted_at >= _ABORT_ACK_TIMEOUT_S:
                    expired.append((req_id, round_seq))
        for req_id, round_seq in expired:
            logger.warning(
                "P2PSession %s: no abort_ack for %s round %s", self._peer_id, req_id, round_seq
            )
            self._end_load(req_id, round_seq, False)
        results, self._completed_loads = self._completed_loads, []
        return results

    def close(self) -> ClientCloseResult:
        """Forget everything, returning the work the peer will never finish."""
        failed_jobs = [ld.job_id for st in self._requests.values() for ld in st.loads.values()]
        failed_req_ids = [
            req_id
            for req_id, st in self._requests.items()
            if st.loads or any(hit is None for hit in st.probes.values())
        ]
        self._requests.clear()
        self._flush_pending.clear()
        self._active_loads.clear()
        self._completed_loads.clear()
        self._lookup_deadlines.clear()
        return ClientCloseResult(failed_jobs=failed_jobs, failed_req_ids=failed_req_ids)
