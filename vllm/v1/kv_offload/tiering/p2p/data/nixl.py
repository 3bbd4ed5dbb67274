"""NIXL data plane of the peer-to-peer tier (upstream v0.33's ``tiering.p2p.data.nixl``).

:class:`NixlTransport` registers the local block region with a NIXL agent once (DRAM, one
descriptor per block) and WRITEs blocks into peers' regions through prepared descriptor lists.

Threading: the agent runs without NIXL's own locking (no ``enable_listen``), so every call into
it must be serialized by the caller (the tiering manager's lock). The one exception is peer
registration, which costs one descriptor per remote block and therefore runs on a private
single-thread executor, off the scheduler thread and serialized against itself. A generation
number per peer makes a registration that finishes after its peer was removed or registered
again release its handles instead of publishing them.

Failure classification (see :mod:`.base`): a transfer ends in ``failed`` when NIXL reports a
state other than in progress or done. A check that raises faults the peer at once; only a
remote disconnect also ends the transfer, since after any other error the WRITE may still be
landing and its blocks must stay pinned until the peer's teardown. Three transfer failures in
a row, with no success between, fault the peer too.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from vllm.distributed.nixl_utils import NixlWrapper as _NixlAgent
from vllm.distributed.nixl_utils import nixl_agent_config as _NixlAgentConfig
from vllm.v1.kv_offload.tiering.p2p.data.base import CancelMode, DataTransport, PollResult

logger = logging.getLogger(__name__)

# Returned whenever nothing changed (immutable, so it can be shared).
_EMPTY_POLL_RESULT = PollResult(done=(), failed=())

# Transfer failures in a row (no success between) that fault a peer.
_MAX_CONSECUTIVE_TRANSFER_FAILURES = 3

# NIXL exceptions that fault a peer at once, by binding class name, with their status text
# (also matched in the message, so a renamed binding class is still recognized).
_PEER_FAULT_ERRORS = {
    "nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
    "nixlNotFoundError": "NIXL_ERR_NOT_FOUND",
}
_REMOTE_DISCONNECT = "NIXL_ERR_REMOTE_DISCONNECT"

_IN_PROGRESS_STATES = ("PROC", "PEND")
_DONE_STATE = "DONE"
_ERROR_STATE = "ERR"
# NIXL names the local side of a prepared descriptor list so.
_LOCAL_AGENT = "NIXL_INIT_AGENT"
_MEM_TYPE = "DRAM"
# UCX would otherwise also wire GPU (rc_gda) lanes to every peer, whose reconnect fails after
# a peer stalls; this tier moves host memory only. UCX_* environment variables still win.
_UCX_ENGINE_CONFIG = "TLS=^rc_gda"


def _peer_fault_status(exc: Exception) -> str | None:
    """The NIXL status of ``exc`` when it is a peer-scope error, else ``None``."""
    status = _PEER_FAULT_ERRORS.get(type(exc).__name__)
    if status is not None:
        return status
    text = str(exc)
    return next((s for s in _PEER_FAULT_ERRORS.values() if s in text), None)


def _ends_transfer(exc: Exception) -> bool:
    """Whether a raising state check proves the WRITE can land no more (remote disconnect);
    after NOT_FOUND a WRITE has been seen to keep landing."""
    return _peer_fault_status(exc) == _REMOTE_DISCONNECT


class _Inflight(NamedTuple):
    """A submitted transfer: its peer (for scoped polls), its NIXL handle, and whether it has
    already counted against its peer (a check that keeps raising counts once)."""

    peer_id: str
    handle: object
    struck: bool = False


class NixlTransport(DataTransport):
    """Block WRITEs over NIXL (UCX by default) between host-memory regions.

    ``agent_name``: the NIXL agent's name (unique per process). ``view`` / ``config_fields``:
    as for :class:`DataTransport`. ``backends``: NIXL backends (default ``["UCX"]``; any
    other one is handed to the agent config as is). ``num_threads``: UCX worker threads (UCX
    only; 0 leaves UCX's default). Without NIXL installed the transport is built but not
    :attr:`available`.
    """

    def __init__(
        self,
        agent_name: str,
        view: memoryview,
        config_fields: dict | None = None,
        backends: list[str] | None = None,
        num_threads: int = 4,
    ) -> None:
        super().__init__(view, config_fields=config_fields)
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
            raise ValueError(f"num_threads: expected an int >= 0, got {num_threads!r}")
        self._agent_name = agent_name
        self._backends = list(backends) if backends else ["UCX"]
        self._num_threads = num_threads
        self._agent: Any = None
        self._reg: Any = None
        self._local_dlist: Any = None
        self._remote_dlists: dict[str, Any] = {}
        self._peer_nixl_names: dict[str, str] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._next_id = itertools.count()
        # peer_id -> transfer failures since its last success / why it is faulted.
        self._peer_strikes: dict[str, int] = {}
        self._peer_faults: dict[str, str] = {}
        self._reg_executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="vllm-p2p-nixl-reg"
        )
        # peer_id -> registration generation, bumped by every add and remove; guarded with
        # the published handles by _peer_lock so that check and publish are one step.
        self._peer_gen: dict[str, int] = {}
        self._peer_lock = threading.Lock()
        self._init_agent()

    @property
    def available(self) -> bool:
        """Whether a NIXL agent backs this transport."""
        return self._agent is not None

    def _init_agent(self) -> None:
        if _NixlAgent is None:
            return
        ucx_only = all(backend == "UCX" for backend in self._backends)
        # UCX-only: the agent starts with no backend and UCX is created below with our
        # parameters; otherwise the agent config creates the named backends itself.
        config = _NixlAgentConfig(
            backends=[] if ucx_only else self._backends, capture_telemetry=True
        )
        self._agent = _NixlAgent(self._agent_name, config)
        if ucx_only:
            params = {"engine_config": _UCX_ENGINE_CONFIG}
            if self._num_threads > 0:
                params["num_threads"] = str(self._num_threads)
            self._agent.create_backend("UCX", params)
        logger.info(
            "NixlTransport %s: backends=%s, %d blocks of %d bytes",
            self._agent_name,
            self._backends,
            self._num_blocks,
            self._block_len,
        )
        self._reg = self._agent.register_memory(
            [(self._base_addr, self._num_blocks * self._block_len, 0, "")], mem_type=_MEM_TYPE
        )
        descs = self._agent.get_xfer_descs(
            self._block_descs(self._base_addr, self._num_blocks, self._block_len),
            mem_type=_MEM_TYPE,
        )
        self._local_dlist = self._agent.prep_xfer_dlist(_LOCAL_AGENT, descs)

    @staticmethod
    def _block_descs(base_addr: int, num_blocks: int, block_len: int) -> list[tuple]:
        """One (address, bytes, device 0) descriptor per block."""
        return [(base_addr + i * block_len, block_len, 0) for i in range(num_blocks)]

    def get_agent_metadata(self) -> bytes:
        if self._agent is None:
            raise RuntimeError(f"NixlTransport {self._agent_name}: NIXL is not available")
        return self._agent.get_agent_metadata()

    # Peers ----------------------------------------------------------------------------------

    def add_remote_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        # Through the executor too, so that it is serialized with async registrations.
        self.add_remote_peer_async(
            peer_id, agent_metadata, base_addr, num_blocks, block_len
        ).result()

    def add_remote_peer_async(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> Future[None]:
        for name, value in (("num_blocks", num_blocks), ("block_len", block_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self._agent is None:
            # A failed future, as for any registration failure: the session rejects the peer.
            unavailable: Future[None] = Future()
            unavailable.set_exception(
                RuntimeError(f"NixlTransport {self._agent_name}: NIXL is not available")
            )
            return unavailable
        with self._peer_lock:
            gen = self._peer_gen[peer_id] = self._peer_gen.get(peer_id, 0) + 1

        def register() -> None:
            nixl_name, dlist = self._build_peer_handles(
                peer_id, agent_metadata, base_addr, num_blocks, block_len
            )
            if not self._publish_peer(peer_id, gen, nixl_name, dlist):
                raise RuntimeError(
                    f"registration of peer {peer_id} was superseded (the peer was removed "
                    "or registered again meanwhile)"
                )

        return self._reg_executor.submit(register)

    def remove_remote_peer(self, peer_id: str) -> None:
        with self._peer_lock:
            # A registration still being built for this peer is now stale.
            self._peer_gen[peer_id] = self._peer_gen.get(peer_id, 0) + 1
            nixl_name = self._peer_nixl_names.pop(peer_id, None)
            dlist = self._remote_dlists.pop(peer_id, None)
        self._peer_strikes.pop(peer_id, None)
        self._peer_faults.pop(peer_id, None)
        self._release_remote_handles(peer_id, dlist, nixl_name)

    def _build_peer_handles(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> tuple[str, Any]:
        """Load the peer's agent and prepare one descriptor per remote block (on the
        registration thread, outside the peer lock: this is the slow part)."""
        nixl_name = self._agent.add_remote_agent(agent_metadata)
        try:
            descs = self._agent.get_xfer_descs(
                self._block_descs(base_addr, num_blocks, block_len), mem_type=_MEM_TYPE
            )
            dlist = self._agent.prep_xfer_dlist(nixl_name, descs)
        except Exception:
            # Loading metadata already known gives back the published name: that agent
            # belongs to the live registration, so only a fresh one is rolled back. Builds
            # are serialized, so no other one can publish the name in between.
            with self._peer_lock:
                published = nixl_name in self._peer_nixl_names.values()
            if not published:
                self._release_remote_handles(peer_id, None, nixl_name)
            raise
        return nixl_name, dlist

    def _publish_peer(self, peer_id: str, gen: int, nixl_name: str, dlist: Any) -> bool:
        """Install built handles unless generation ``gen`` is stale; stale handles are
        released here (nothing else saw them) and ``False`` returned."""
        with self._peer_lock:
            fresh = self._peer_gen.get(peer_id) == gen
            if fresh:
                self._peer_nixl_names[peer_id] = nixl_name
                self._remote_dlists[peer_id] = dlist
        if not fresh:
            logger.info(
                "NixlTransport %s: dropping a superseded registration of peer %s",
                self._agent_name,
                peer_id,
            )
            self._release_remote_handles(peer_id, dlist, nixl_name)
        return fresh

    def _release_remote_handles(self, peer_id: str, dlist: Any, nixl_name: str | None) -> None:
        """Release a peer's descriptor list and remote agent, each even if the other fails
        (a skipped agent removal would leave a stale registration behind)."""
        if self._agent is None:
            return
        if dlist is not None:
            try:
                self._agent.release_dlist_handle(dlist)
            except Exception as exc:
                logger.warning(
                    "NixlTransport %s: releasing the descriptor list of peer %s failed: %s",
                    self._agent_name,
                    peer_id,
                    exc,
                )
        if nixl_name:
            try:
                self._agent.remove_remote_agent(nixl_name)
            except Exception as exc:
                logger.warning(
                    "NixlTransport %s: removing the remote agent of peer %s failed: %s",
                    self._agent_name,
                    peer_id,
                    exc,
                )

    # Transfers ------------------------------------------------------------------------------

    def write_blocks(
        self,
        peer_id: str,
        local_idxs: list[int],
        remote_idxs: list[int],
    ) -> int | None:
        if len(local_idxs) != len(remote_idxs):
            raise ValueError(
                f"remote_idxs: expected {len(local_idxs)} indexes (one per local index), "
                f"got {len(remote_idxs)}"
            )
        dlist = self._remote_dlists.get(peer_id)
        if dlist is None:
            logger.warning(
                "NixlTransport %s: write_blocks to unregistered peer %s (known: %s)",
                self._agent_name,
                peer_id,
                list(self._remote_dlists),
            )
            return None
        handle = None
        try:
            handle = self._agent.make_prepped_xfer(
                "WRITE",
                self._local_dlist,
                np.asarray(local_idxs, dtype=np.int32),
                dlist,
                np.asarray(remote_idxs, dtype=np.int32),
            )
            # A failed post comes back as a status, not an exception.
            if self._agent.transfer(handle) == _ERROR_STATE:
                raise RuntimeError("transfer() posted with status ERR")
        except Exception as exc:
            logger.warning(
                "NixlTransport %s: write_blocks to peer %s failed: %s",
                self._agent_name,
                peer_id,
                exc,
            )
            if handle is not None:
                self._release_handles([handle])
            status = _peer_fault_status(exc)
            if status is not None:
                self._set_peer_fault(peer_id, status)
            else:
                self._record_transfer_failure(peer_id, f"{type(exc).__name__}: {exc}")
            return None
        transfer_id = next(self._next_id)
        self._inflight[transfer_id] = _Inflight(peer_id, handle)
        return transfer_id

    def poll(self, peer_id: str | None = None) -> PollResult:
        done: list[int] = []
        failed: list[int] = []
        # Strikes are settled after the whole batch: a poll sees completions, not their
        # order, so any success in the batch counts as "between" the peer's failures.
        succeeded: set[str] = set()
        failures: list[tuple[str, str]] = []
        for transfer_id, entry in self._inflight.items():  # only values change
            if peer_id is not None and entry.peer_id != peer_id:
                continue
            try:
                state = self._agent.check_xfer_state(entry.handle)
            except Exception as exc:
                # A check that keeps raising warns once.
                (logger.debug if entry.struck else logger.warning)(
                    "NixlTransport %s: check_xfer_state failed for transfer %d: %s",
                    self._agent_name,
                    transfer_id,
                    exc,
                )
                if not entry.struck:
                    self._fault_on_state_check(entry.peer_id, exc)
                    entry = self._inflight[transfer_id] = entry._replace(struck=True)
                if not _ends_transfer(exc):
                    continue  # may still be landing: kept until the peer's teardown
                state = _ERROR_STATE
            if state == _DONE_STATE:
                done.append(transfer_id)
                succeeded.add(entry.peer_id)
            elif state not in _IN_PROGRESS_STATES:
                failed.append(transfer_id)
                if not entry.struck:
                    failures.append((entry.peer_id, f"state {state}"))
        for pid in succeeded:
            self._peer_strikes.pop(pid, None)
        for pid, cause in failures:
            self._record_transfer_failure(pid, cause)
        self._release_handles([self._inflight.pop(tid).handle for tid in done + failed])
        fault = self._peer_faults.get(peer_id) if peer_id is not None else None
        if not done and not failed and fault is None:
            return _EMPTY_POLL_RESULT
        return PollResult(
            done=done or _EMPTY_POLL_RESULT.done,
            failed=failed or _EMPTY_POLL_RESULT.failed,
            peer_fault=fault,
        )

    def cancel(
        self,
        transfer_ids: Iterable[int],
        mode: CancelMode = "immediate",
    ) -> list[int]:
        if mode not in ("immediate", "wait"):
            raise ValueError(f"mode: expected 'immediate' or 'wait', got {mode!r}")
        if mode == "immediate":
            ids = [tid for tid in transfer_ids if tid in self._inflight]
            self._release_handles([self._inflight.pop(tid).handle for tid in ids])
            return []
        # Releasing a running WRITE does not stop it (UCX frees the request, the bytes keep
        # landing), so only transfers NIXL reports stopped are released.
        still_running: list[int] = []
        for tid in transfer_ids:
            entry = self._inflight.get(tid)
            if entry is None:
                continue
            try:
                state = self._agent.check_xfer_state(entry.handle)
            except Exception as exc:
                logger.debug(
                    "NixlTransport %s: cancel's state check failed for transfer %d: %s",
                    self._agent_name,
                    tid,
                    exc,
                )
                self._fault_on_state_check(entry.peer_id, exc)
                if not _ends_transfer(exc):
                    still_running.append(tid)
                    continue
                # Ended either way; its handle may not be releasable any more.
                self._release_handles([self._inflight.pop(tid).handle])
                continue
            if state in _IN_PROGRESS_STATES:
                still_running.append(tid)
                continue
            try:
                self._agent.release_xfer_handle(entry.handle)
            except Exception as exc:
                logger.debug(
                    "NixlTransport %s: transfer %d not releasable yet: %s",
                    self._agent_name,
                    tid,
                    exc,
                )
                still_running.append(tid)
                continue
            del self._inflight[tid]
        return still_running

    # Lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        # Let a registration in progress finish before the agent goes away under it.
        self._reg_executor.shutdown(wait=True)
        if self._agent is None:
            return
        self._release_handles([entry.handle for entry in self._inflight.values()])
        self._inflight.clear()
        for peer_id in list(self._remote_dlists):
            self.remove_remote_peer(peer_id)
        if self._local_dlist is not None:
            self._agent.release_dlist_handle(self._local_dlist)
            self._local_dlist = None
        if self._reg is not None:
            self._agent.deregister_memory(self._reg)
            self._reg = None
        self._agent = None

    # Failure bookkeeping --------------------------------------------------------------------

    def _fault_on_state_check(self, peer_id: str, exc: Exception) -> None:
        """Fault ``peer_id`` for a raising ``check_xfer_state``.

        The bindings raise for every error status, so this is a failure NIXL reported. It
        faults the peer rather than adding a strike: successes could reset strikes forever
        while this transfer stays in flight holding its blocks.
        """
        status = _peer_fault_status(exc)
        self._set_peer_fault(
            peer_id, status or f"check_xfer_state raised {type(exc).__name__}: {exc}"
        )

    def _record_transfer_failure(self, peer_id: str, cause: str) -> None:
        strikes = self._peer_strikes[peer_id] = self._peer_strikes.get(peer_id, 0) + 1
        if strikes >= _MAX_CONSECUTIVE_TRANSFER_FAILURES:
            self._set_peer_fault(
                peer_id, f"{strikes} consecutive transfer failures (last: {cause})"
            )

    def _set_peer_fault(self, peer_id: str, cause: str) -> None:
        if peer_id in self._peer_faults:
            return
        self._peer_faults[peer_id] = cause
        logger.warning(
            "NixlTransport %s: peer %s judged unusable: %s", self._agent_name, peer_id, cause
        )

    def _release_handles(self, handles: list[object]) -> None:
        if self._agent is None:
            return
        for handle in handles:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:
                logger.warning(
                    "NixlTransport %s: release_xfer_handle failed: %s", self._agent_name, exc
                )
