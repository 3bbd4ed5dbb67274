"""Serving side of one peer session: match stored blocks with the peer's fetch demand,
write them over the data plane, and report store jobs finished.

Supply arrives through :meth:`ServerRole.add_stored_blocks` (the manager's store jobs, or
pins taken while answering probes, see :mod:`.server_lookup`); demand through
:meth:`ServerRole.on_fetch`. Both are kept per kv_request_id and round. A round ends with
TransferDoneMsg, or with AbortAckMsg when the peer aborted it; the ack waits until no
transfer of the round can still write into the peer's blocks. Protocol violations the role
detects raise ``ValueError`` so the session disconnects. Times are ``time.monotonic()``
seconds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.p2p.session.protocol import (
    TYPE_KEY,
    AbortAckMsg,
    TransferDoneMsg,
)
from vllm.v1.kv_offload.tiering.p2p.session.server_lookup import (
    _LOOKUP_PENDING_TIMEOUT_S,
    _LookupServing,
)
from vllm.v1.kv_offload.tiering.p2p.session.server_state import (
    StoreResult,
    _ActiveLookup,
    _InflightXfer,
    _MatchResult,
    _OutboundRequestState,
    _PendingLookup,
    _ServerRequestState,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import JobId
    from vllm.v1.kv_offload.tiering.p2p.data import DataTransport

__all__ = [
    "_LOOKUP_PENDING_TIMEOUT_S",
    "ServerRole",
    "StoreResult",
    "_ActiveLookup",
    "_InflightXfer",
    "_MatchResult",
    "_OutboundRequestState",
    "_PendingLookup",
    "_ServerRequestState",
]

logger = logging.getLogger(__name__)

# Seconds a store job may wait for its blocks to be fetched and written.
_STORE_TIMEOUT_S = 30.0
# Seconds after which a still-draining abort is reported (it keeps waiting regardless).
_CANCEL_DRAIN_TIMEOUT_S = 10.0
# Minimum seconds between two wait-mode cancels of one round: each call goes into the
# data plane on the scheduler thread.
_CANCEL_RETRY_INTERVAL_S = 0.1


class ServerRole(_LookupServing):
    """Store and serve state machine toward one peer; sends through ``send``."""

    def __init__(
        self, peer_id: str, transport: DataTransport, send: Callable[[dict], None]
    ) -> None:
        self._peer_id = peer_id
        self._transport = transport
        self._send = send
        self._requests: dict[str, _ServerRequestState] = {}
        self._serve_pending: set[str] = set()
        # transfer id -> transfer; change only through _inflight_add / _inflight_pop.
        self._inflight: dict[int, _InflightXfer] = {}
        self._store_jobs: dict[int, float] = {}  # job id -> submitted at
        self._pending_store_results: list[StoreResult] = []  # reported by the next poll
        self._finished_lookup_ctxs: list[ReqContext] = []
        self._lookup_id_counter = 0
        # (kv_request_id, round) -> when the peer's abort arrived; waiting to drain.
        self._pending_aborts: dict[tuple[str, int], float] = {}
        self._slow_aborts: set[tuple[str, int]] = set()  # already warned about
        # The data plane's fault report for this peer; no new write is started after it.
        self.peer_fault: str | None = None

    @property
    def has_inflight_transfers(self) -> bool:
        return bool(self._inflight)

    def _get_or_create_request(self, kv_request_id: str) -> _ServerRequestState:
        st = self._requests.get(kv_request_id)
        if st is None:
            st = self._requests[kv_request_id] = _ServerRequestState()
        return st

    def _maybe_prune(self, kv_request_id: str) -> None:
        st = self._requests.get(kv_request_id)
        if st is None or st.outbound or st.inflight_tids or st.lookups or st.pending_lookups:
            return
        if any(req_id == kv_request_id for req_id, _ in self._pending_aborts):
            return
        del self._requests[kv_request_id]

    def _round(self, kv_request_id: str, round_seq: int) -> _OutboundRequestState:
        st = self._get_or_create_request(kv_request_id)
        rnd = st.outbound.get(round_seq)
        if rnd is None:
            rnd = st.outbound[round_seq] = _OutboundRequestState()
        return rnd

    def _is_current(self, kv_request_id: str, round_key: int, rnd: _OutboundRequestState) -> bool:
        """Whether ``rnd`` is still the registered round ``round_key`` of the request."""
        st = self._requests.get(kv_request_id)
        return st is not None and st.outbound.get(round_key) is rnd

    def add_stored_blocks(
        self,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        block_ids: Sequence[int],
        job_id: JobId,
        round_seq: int = 0,
        *,
        from_lookup: bool = False,
    ) -> None:
        """Offer stored blocks (job ``job_id``) to round ``round_seq``; PD stores use 0."""
        self._store_jobs[job_id] = time.monotonic()
        rnd = self._round(kv_request_id, round_seq)
        if rnd.cancelled:
            del self._store_jobs[job_id]
            self._pending_store_results.append(StoreResult(job_id, success=False))
            return
        rnd.lookup_supplied |= from_lookup
        match = rnd.add_stored_blocks(keys, block_ids, job_id)
        if match.local_idxs and rnd.demand_received:
            self._submit_transfer(kv_request_id, match, rnd, round_seq)

    def on_fetch(
        self,
        kv_request_id: str,
        keys: Sequence[OffloadKey],
        block_indexes: Sequence[int],
        round_seq: int = 0,
    ) -> None:
        """The peer's FetchMsg: bind demand to its round (an empty one ends the request).

        A second fetch for a round that already has demand raises ValueError.
        """
        st = self._requests.get(kv_request_id)
        existing = st.outbound.get(round_seq) if st is not None else None
        if existing is not None and existing.demand_received:
            raise ValueError(f"duplicate fetch for kv_request_id={kv_request_id} round={round_seq}")
        rnd = self._round(kv_request_id, round_seq)
        match = rnd.add_fetch_demand(keys, block_indexes)
        if not keys:
            # Nobody waits for a TransferDoneMsg here: close probes and drain every round.
            self._finish_inbound_lookups(kv_request_id)
            st = self._requests.get(kv_request_id)
            for key in list(st.outbound) if st is not None else ():
                self._finalize_outbound(kv_request_id, key, send_done=False)
            return
        if rnd.lookup_supplied and rnd.demanded:
            # Probe pins always come before the fetch, so unmet demand can never be met.
            logger.warning(
                "P2PSession %s: fetch %s round %s wants %d blocks that were not pinned",
                self._peer_id,
                kv_request_id,
                round_seq,
                len(rnd.demanded),
            )
            self._finalize_outbound(kv_request_id, round_seq, success=False)
        elif match.local_idxs:
            self._submit_transfer(kv_request_id, match, rnd, round_seq)
        elif rnd.finishing and rnd.inflight == 0:
            # The request finished here before the fetch came: settle now.
            self._finalize_outbound(kv_request_id, round_seq)

    def on_abort_fetch(self, kv_request_id: str, round_seq: int = 0) -> None:
        """The peer's AbortFetchMsg; a repeat only retries the drain."""
        st = self._requests.get(kv_request_id)
        if (st is None or not st.outbound) and not self._has_inflight_for(kv_request_id):
            logger.warning(
                "P2PSession %s: abort_fetch for unknown %s (late or duplicate)",
                self._peer_id,
                kv_request_id,
            )
        self._get_or_create_request(kv_request_id)
        self._pending_aborts.setdefault((kv_request_id, round_seq), time.monotonic())
        self._drain_abort(kv_request_id, round_seq)

    def finish(self, kv_request_id: str) -> None:
        """The request ended locally: no more stores will come for it.

        Rounds with demand and nothing in flight end now (failed if demand is unmet); a
        round without demand yet ends when its fetch arrives, one with transfers in flight
        when the last of them is terminal.
        """
        self._finish_inbound_lookups(kv_request_id)
        st = self._requests.get(kv_request_id)
        if st is None:
            return
        for key, rnd in list(st.outbound.items()):
            rnd.finishing = True
            if rnd.demand_received and not rnd.inflight:
                self._finalize_outbound(kv_request_id, key)

    def collect_results(self) -> list[StoreResult]:
        """Apply store timeouts, take this peer's finished transfers, drain results."""
        results = self._timeout_pending_store_jobs()
        # Scoped to this peer: the data transport is shared by every session.
        polled = self._transport.poll(self._peer_id)
        if polled.peer_fault is not None:
            self.peer_fault = polled.peer_fault
        for tid in polled.done:
            xfer = self._pop_reported(tid, "done")
            if xfer is None:
                continue
            rnd, key, req_id = xfer.round, xfer.round_key, xfer.kv_request_id
            results.extend(self._settle_xfer_jobs(xfer, success=not rnd.cancelled))
            if self._is_current(req_id, key, rnd):
                rnd.remaining -= xfer.block_count
                assert rnd.remaining >= 0, f"remaining went negative for {req_id}"
                if rnd.cancelled:
                    if rnd.inflight == 0:
                        self._finalize_cancelled(req_id, key)
                elif rnd.remaining == 0:
                    self._finalize_outbound(req_id, key, success=True)
                elif rnd.finishing and rnd.inflight == 0:
                    self._finalize_outbound(req_id, key, success=False)
            self._maybe_prune(req_id)
        for tid in polled.failed:
            xfer = self._pop_reported(tid, "failed")
            if xfer is None:
                continue
            rnd, key, req_id = xfer.round, xfer.round_key, xfer.kv_request_id
            current = self._is_current(req_id, key, rnd)
            if current and not rnd.cancelled:
                # One failure fails the round; its other transfers may still be writing.
                rnd.cancelled = True
                results.extend(self._fail_unwritten_round_jobs(rnd))
            results.extend(self._settle_xfer_jobs(xfer, success=False))
            if current and rnd.inflight == 0:
                self._finalize_cancelled(req_id, key)
            self._maybe_prune(req_id)
        results.extend(self._pending_store_results)
        self._pending_store_results.clear()
        return results

    def _pop_reported(self, tid: int, outcome: str) -> _InflightXfer | None:
        xfer = self._inflight_pop(tid)
        if xfer is None:
            # A bookkeeping bug: its jobs will only end through the store timeout.
            logger.error(
                "P2PSession %s: transport reported %s for unknown transfer %d",
                self._peer_id,
                outcome,
                tid,
            )
        return xfer

    def collect_idle_timeouts(self) -> list[StoreResult]:
        """Store timeouts only, for a session without a connection (nothing in flight)."""
        return self._timeout_pending_store_jobs()

    def drain_pending_aborts(self) -> None:
        """Retry every waiting abort (once per poll)."""
        for kv_request_id, round_seq in list(self._pending_aborts):
            self._drain_abort(kv_request_id, round_seq)

    def close(self) -> tuple[list[int], list[ReqContext]]:
        """Cancel transfers and forget everything.

        Returns the store job ids to fail and the synthetic lookup contexts still owing
        ``on_request_finished`` (the manager releases them at its next serve).
        """
        failed_stores = list(self._store_jobs)
        if self._inflight:
            self._transport.cancel(list(self._inflight))
        failed_serves = [lu.ctx for st in self._requests.values() for lu in st.lookups.values()]
        failed_serves.extend(self._finished_lookup_ctxs)
        for container in (
            self._store_jobs,
            self._inflight,
            self._pending_store_results,
            self._requests,
            self._serve_pending,
            self._pending_aborts,
            self._slow_aborts,
            self._finished_lookup_ctxs,
        ):
            container.clear()
        return failed_stores, failed_serves

    def _has_inflight_for(self, kv_request_id: str) -> bool:
        st = self._requests.get(kv_request_id)
        return st is not None and bool(st.inflight_tids)

    def _inflight_add(self, tid: int, xfer: _InflightXfer) -> None:
        self._inflight[tid] = xfer
        self._get_or_create_request(xfer.kv_request_id).inflight_tids.add(tid)

    def _inflight_pop(self, tid: int) -> _InflightXfer | None:
        """Forget transfer ``tid``; the caller prunes the request afterwards if needed."""
        xfer = self._inflight.pop(tid, None)
        if xfer is None:
            return None
        xfer.round.inflight -= 1
        assert xfer.round.inflight >= 0
        st = self._requests.get(xfer.kv_request_id)
        if st is not None:
            st.inflight_tids.discard(tid)
        return xfer

    def _read_job_ids(self, rnd: _OutboundRequestState | None = None) -> set[int]:
        """Jobs an in-flight transfer (of ``rnd`` if given) still reads: they keep pins."""
        return {
            job_id
            for xfer in self._inflight.values()
            if rnd is None or xfer.round is rnd
            for job_id in xfer.job_ids
        }

    def _report_jobs(self, job_ids: Iterable[int], success: bool) -> list[StoreResult]:
        """Results for the jobs of ``job_ids`` not reported yet (each is reported once)."""
        return [
            StoreResult(job_id, success)
            for job_id in job_ids
            if self._store_jobs.pop(job_id, None) is not None
        ]

    def _settle_xfer_jobs(self, xfer: _InflightXfer, success: bool) -> list[StoreResult]:
        """Report the jobs of a terminal transfer, except (in a cancelled round) those that
        another transfer still reads."""
        still_read = self._read_job_ids() if xfer.round.cancelled else set()
        settled = [j for j in xfer.job_ids if j not in still_read]
        results = self._report_jobs(settled, success)
        xfer.round.pending_job_ids.difference_update(r.job_id for r in results)
        return results

    def _fail_round_jobs(self, rnd: _OutboundRequestState) -> list[StoreResult]:
        results = self._report_jobs(rnd.pending_job_ids, False)
        rnd.pending_job_ids.clear()
        return results

    def _fail_unwritten_round_jobs(self, rnd: _OutboundRequestState) -> list[StoreResult]:
        """Fail the cancelled round's jobs that no in-flight transfer reads."""
        unread = rnd.pending_job_ids - self._read_job_ids(rnd)
        rnd.pending_job_ids -= unread
        return self._report_jobs(unread, False)

    def _finalize_cancelled(self, kv_request_id: str, round_key: int) -> None:
        """End a cancelled round; a peer-aborted one is answered by its AbortAckMsg instead
        of a TransferDoneMsg."""
        self._finalize_outbound(
            kv_request_id,
            round_key,
            success=False,
            send_done=(kv_request_id, round_key) not in self._pending_aborts,
        )

    def _finalize_outbound(
        self,
        kv_request_id: str,
        round_key: int,
        success: bool | None = None,
        send_done: bool = True,
    ) -> None:
        """Remove one round, queue its jobs' results and tell the peer (TransferDoneMsg,
        if it asked and ``send_done``). ``success`` None means "all demand written"."""
        st = self._requests[kv_request_id]
        rnd = st.outbound[round_key]
        if rnd.cancelled and rnd.inflight:
            return
        del st.outbound[round_key]
        if rnd.cancelled:
            success = False
        elif success is None:
            success = rnd.demand_received and rnd.remaining == 0
        self._pending_store_results.extend(self._report_jobs(rnd.pending_job_ids, success))
        rnd.pending_job_ids.clear()
        if send_done and rnd.demand_received:
            self._send(
                {
                    TYPE_KEY: TransferDoneMsg.TYPE,
                    TransferDoneMsg.KV_REQUEST_ID: kv_request_id,
                    TransferDoneMsg.SUCCESS: success,
                    TransferDoneMsg.ROUND_SEQ: round_key,
                }
            )
        self._maybe_prune(kv_request_id)

    def _drain_abort(self, kv_request_id: str, round_seq: int) -> None:
        """One attempt to finish a peer abort: cancel the round and its transfers.

        AbortAckMsg lets the peer reuse its blocks, so it goes only once the data plane
        reports every transfer of the round stopped; a transfer is never given up on, as
        neither releasing it nor dropping the peer stops a started WRITE.
        """
        st = self._requests[kv_request_id]
        rnd = st.outbound.get(round_seq)
        if rnd is not None and not rnd.cancelled:
            rnd.cancelled = True
            self._pending_store_results.extend(self._fail_unwritten_round_jobs(rnd))
        tids = [
            tid
            for tid, x in self._inflight.items()
            if x.kv_request_id == kv_request_id and x.round_key == round_seq
        ]
        if tids:
            now = time.monotonic()
            key = (kv_request_id, round_seq)
            if now - self._pending_aborts[key] >= _CANCEL_DRAIN_TIMEOUT_S and (
                key not in self._slow_aborts
            ):
                self._slow_aborts.add(key)
                logger.warning(
                    "P2PSession %s: abort of %s round %s still waits for %d transfers "
                    "after %.0fs; their pins and the ack are held until they stop",
                    self._peer_id,
                    kv_request_id,
                    round_seq,
                    len(tids),
                    _CANCEL_DRAIN_TIMEOUT_S,
                )
            if not self._cancel_due(self._inflight[tids[0]].round, now):
                return
            still = set(self._transport.cancel(tids, mode="wait"))
            for tid in tids:
                if tid not in still:
                    self._inflight_pop(tid)
            if still:
                return
        if rnd is not None and self._is_current(kv_request_id, round_seq, rnd):
            self._finalize_outbound(kv_request_id, round_seq, success=False, send_done=False)
        self._pending_aborts.pop((kv_request_id, round_seq), None)
        self._slow_aborts.discard((kv_request_id, round_seq))
        self._send(
            {
                TYPE_KEY: AbortAckMsg.TYPE,
                AbortAckMsg.KV_REQUEST_ID: kv_request_id,
                AbortAckMsg.ROUND_SEQ: round_seq,
            }
        )
        self._maybe_prune(kv_request_id)

    @staticmethod
    def _cancel_due(rnd: _OutboundRequestState, now: float) -> bool:
        """Pace wait-mode cancels of one round to one per ``_CANCEL_RETRY_INTERVAL_S``."""
        if rnd.last_cancel_at is not None and now - rnd.last_cancel_at < _CANCEL_RETRY_INTERVAL_S:
            return False
        rnd.last_cancel_at = now
        return True

    def _submit_transfer(
        self,
        kv_request_id: str,
        match: _MatchResult,
        rnd: _OutboundRequestState,
        round_key: int,
    ) -> None:
        """Start writing ``match``; if the data plane refuses, the round fails once nothing
        of it is in flight any more."""
        tid = None
        if self.peer_fault is None:
            tid = self._transport.write_blocks(self._peer_id, match.local_idxs, match.remote_idxs)
        if tid is not None:
            rnd.inflight += 1
            self._inflight_add(
                tid,
                _InflightXfer(
                    kv_request_id=kv_request_id,
                    block_count=len(match.local_idxs),
                    job_ids=match.job_ids,
                    round=rnd,
                    round_key=round_key,
                ),
            )
            return
        logger.warning(
            "P2PSession %s: write_blocks refused for %s (%d blocks)",
            self._peer_id,
            kv_request_id,
            len(match.local_idxs),
        )
        # The matched blocks left supply and demand, so remaining can never reach 0.
        rnd.finishing = True
        if rnd.inflight == 0 and self._is_current(kv_request_id, round_key, rnd):
            self._finalize_outbound(kv_request_id, round_key, success=False)

    def _timeout_pending_store_jobs(self) -> list[StoreResult]:
        """Fail store jobs older than ``_STORE_TIMEOUT_S``, cancelling transfers that read
        them; a job keeps its pin until the data plane confirms no transfer reads it."""
        if not self._store_jobs:
            return []
        now = time.monotonic()
        timed_out = [j for j, at in self._store_jobs.items() if at <= now - _STORE_TIMEOUT_S]
        if not timed_out and not any(x.round.cancelled for x in self._inflight.values()):
            return []
        expired = set(timed_out)
        rounds = {
            (x.kv_request_id, x.round_key): x.round
            for x in self._inflight.values()
            if x.round.cancelled or expired & x.job_ids
        }
        results: list[StoreResult] = []
        for (kv_request_id, round_key), rnd in rounds.items():
            rnd.cancelled = True
            if not self._cancel_due(rnd, now):
                continue
            tids = [tid for tid, x in self._inflight.items() if x.round is rnd]
            still = set(self._transport.cancel(tids, mode="wait"))
            for tid in tids:
                if tid not in still:
                    xfer = self._inflight_pop(tid)
                    assert xfer is not None
                    results.extend(self._settle_xfer_jobs(xfer, success=False))
            if rnd.inflight == 0 and self._is_current(kv_request_id, round_key, rnd):
                self._finalize_cancelled(kv_request_id, round_key)
        still_read = self._read_job_ids()
        for job_id in timed_out:
            if job_id not in still_read and self._store_jobs.pop(job_id, None) is not None:
                logger.warning("P2PSession %s: store job %d timed out", self._peer_id, job_id)
                results.append(StoreResult(job_id, success=False))
        if expired:
            # The engine unpins a failed job's blocks: they must not serve a later fetch.
            for st in self._requests.values():
                for rnd in st.outbound.values():
                    if rnd.pending_job_ids & expired:
                        rnd.pending_job_ids -= expired
                        rnd.available = {
                            k: v for k, v in rnd.available.items() if v[0] not in expired
                        }
        return results
