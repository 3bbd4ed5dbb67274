"""The KVCR tier against an in-process stand-in for KVCR: what upstream's test_kvcr_tier.py
leaves out. Config errors fail before any resource exists, job bookkeeping (empty jobs,
failed stores and loads, foreign operations, completions spread over polls), inventory
events, stats pass-through and the buffers kept when KVCR cannot be stopped."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("msgspec")
pytest.importorskip("kvcr")

from kvcr.types import (  # noqa: E402
    CacheTier,
    InventoryEvent,
    OpEntryResult,
    OpEntryStatus,
    QueryStatus,
)

from vllm.v1.kv_offload.base import Medium, OffloadKey, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.kvcr import manager as kvcr_manager  # noqa: E402
from vllm.v1.kv_offload.tiering.kvcr.manager import KVCRSecondaryTierManager  # noqa: E402

CTX = ReqContext(req_id="r")
KEYS = [OffloadKey(b"k0"), OffloadKey(b"k1")]


class FakeKVCR:
    """Records operations; their block results are queued by :meth:`finish`."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, dict]] = []
        self.completed: list[tuple[int, dict]] = []
        self.stats: Any = None
        self.close_error: BaseException | None = None
        self.closed = 0

    def query(self, keys, request_id=None):
        return [(QueryStatus.MISS, None) for _ in keys]

    def deliver(self, blocks, request_id=None) -> int:
        self.ops.append(("deliver", dict(blocks)))
        return len(self.ops)

    def deposit(self, blocks) -> int:
        self.ops.append(("deposit", dict(blocks)))
        return len(self.ops)

    def finish(self, op: int, results: Mapping[bytes, bool]) -> None:
        self.completed.append(
            (
                op,
                {
                    key: OpEntryResult(OpEntryStatus.SUCCESS if ok else OpEntryStatus.FAILED)
                    for key, ok in results.items()
                },
            )
        )

    def poll_completed(self):
        completed, self.completed = self.completed, []
        return completed

    def get_stats(self):
        return self.stats

    def discard_hint(self, request_id) -> None:
        pass

    def close(self) -> None:
        self.closed += 1
        if self.close_error is not None:
            raise self.close_error


class Harness:
    """Builds tiers over a fake KVCR and counts the control channels opened and closed."""

    def __init__(self, monkeypatch) -> None:
        self.kvcr = FakeKVCR()
        self.bindings: Any = None
        self.backends: Any = None
        self.guard: Any = None
        self.controls_opened = 0
        self.controls_closed = 0
        self.startup_error: BaseException | None = None
        monkeypatch.setattr(kvcr_manager, "KVCR", self._make_kvcr)
        monkeypatch.setattr(kvcr_manager, "ZmqPeerControlChannel", self._make_control)

    def _make_kvcr(self, config, bindings, backends, guard):
        self.bindings, self.backends, self.guard = bindings, backends, guard
        if self.startup_error is not None:
            raise self.startup_error
        return self.kvcr

    def _make_control(self, host, port, advertise):
        self.controls_opened += 1
        harness = self

        class Control:
            def close(self) -> None:
                harness.controls_closed += 1

        return Control()

    def tier(
        self,
        view: memoryview | None = None,
        *,
        events: bool = False,
        **config: Any,
    ) -> KVCRSecondaryTierManager:
        spec = SimpleNamespace(
            config=SimpleNamespace(parallel=SimpleNamespace(data_parallel_rank_local=None)),
            kv_events_config=SimpleNamespace(
                enable_kv_cache_events=events, self_describing_kv_events=events
            ),
        )
        config.setdefault("router_capabilities", ["router_hint"])
        config.setdefault("control_ports", [7777])
        return KVCRSecondaryTierManager(
            offloading_spec=spec,  # type: ignore[arg-type]
            primary_kv_view=view if view is not None else memoryview(np.zeros((4, 8), np.int8)),
            tier_type="kvcr",
            control_advertise_host="127.0.0.1",
            **config,
        )


@pytest.fixture
def harness(monkeypatch) -> Harness:
    return Harness(monkeypatch)


def _job(job_id: int, keys: list[OffloadKey], rows: list[int]) -> TransferJob:
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(rows, dtype=np.int64),
        is_promotion=True,
        req_context=CTX,
    )


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"secondary_g2_slots": -1}, ValueError, "secondary_g2_slots: expected an int >= 0"),
        ({"operation_timeout_ms": 0}, ValueError, "operation_timeout_ms: expected an int >= 1"),
        ({"control_ports": [1, 2]}, ValueError, "control_ports: expected exactly one port"),
        ({"router_capabilities": []}, ValueError, "router_capabilities: expected to include"),
        ({"g3": {"paths": "/x"}}, ValueError, "g3.paths: expected a list"),
        ({"policy": "nope"}, ValueError, "policy: expected one of"),
    ],
)
def test_bad_config_fails_before_any_resource(harness, config, error, match):
    with pytest.raises(error, match=match):
        harness.tier(**config)
    assert harness.controls_opened == 0 and harness.bindings is None


def test_read_only_primary_view_is_rejected(harness):
    view = memoryview(bytes(32)).cast("B", (4, 8))
    with pytest.raises(TypeError, match="primary_kv_view: expected a writable"):
        harness.tier(view)
    assert harness.controls_opened == 0


def test_service_owns_local_dram(harness, caplog):
    with caplog.at_level(logging.WARNING, logger=kvcr_manager.__name__):
        harness.tier(secondary_g2_slots=2, kvcr_service_socket_path="/s", compatibility_digest="d")
    assert harness.backends.local_dram is None
    assert harness.guard.guard_index == 0
    assert "secondary_g2_slots is ignored" in caplog.text


def test_control_channel_failure_unmaps_local_dram(harness, monkeypatch):
    mappings: list[mmap.mmap] = []

    def make_mapping(*args):
        mappings.append(mmap.mmap(*args))
        return mappings[-1]

    def broken_control(*args):
        raise OSError("port in use")

    monkeypatch.setattr(kvcr_manager, "mmap", SimpleNamespace(mmap=make_mapping))
    monkeypatch.setattr(kvcr_manager, "ZmqPeerControlChannel", broken_control)
    with pytest.raises(OSError, match="port in use"):
        harness.tier(secondary_g2_slots=1)
    assert [mapping.closed for mapping in mappings] == [True]


def test_empty_job_finishes_at_once(harness):
    tier = harness.tier()
    tier.submit_store(_job(1, [], []))
    tier.submit_load(_job(2, [], []))
    assert harness.kvcr.ops == []
    assert list(tier.get_finished_jobs()) == [JobResult(1, True), JobResult(2, True)]


def test_rows_must_match_keys(harness):
    tier = harness.tier()
    with pytest.raises(ValueError, match=r"chunk_ids: expected one row per key \(2\), got 1"):
        tier.submit_load(_job(1, KEYS, [0]))
    assert harness.kvcr.ops == []


def test_failed_store_and_failed_load_report_no_partial_keys(harness):
    tier = harness.tier()
    tier.submit_store(_job(1, KEYS, [0, 1]))
    tier.submit_load(_job(2, KEYS, [2, 3]))
    harness.kvcr.finish(1, {KEYS[0]: True, KEYS[1]: False})
    harness.kvcr.finish(2, {KEYS[0]: False, KEYS[1]: False})
    assert list(tier.get_finished_jobs()) == [JobResult(1, False), JobResult(2, False)]


def test_completions_over_several_polls_and_foreign_ops(harness):
    tier = harness.tier()
    tier.submit_load(_job(3, KEYS, [0, 1]))
    harness.kvcr.finish(99, {b"x": True})  # not this tier's operation
    harness.kvcr.finish(1, {KEYS[1]: True})
    assert list(tier.get_finished_jobs()) == []
    harness.kvcr.finish(1, {KEYS[0]: True})
    assert list(tier.get_finished_jobs()) == [JobResult(3, True)]
    [(_, blocks)] = harness.kvcr.ops
    assert [ref.element_index for refs in blocks.values() for ref in refs] == [0, 1]


def test_inventory_events_only_for_local_tiers(harness):
    tier = harness.tier(events=True)
    sink = harness.bindings.inventory_sink
    sink(InventoryEvent((b"k0",), CacheTier.G3, True))
    with pytest.raises(ValueError, match="event.tier: expected one of"):
        sink(InventoryEvent((b"k0",), CacheTier.REMOTE_G2, False))
    [event] = tier.take_events()
    assert (event.keys, event.medium, event.removed) == ([KEYS[0]], Medium.STORAGE, True)
    assert list(tier.take_events()) == []


def test_no_sink_and_no_stats_when_off(harness):
    tier = harness.tier()
    assert harness.bindings.inventory_sink is None
    assert harness.bindings.stats_factory is None
    assert tier.get_stats() is None
    assert tier.has_pending_work()


def test_shutdown_unmaps_local_dram(harness, monkeypatch):
    mappings: list[mmap.mmap] = []
    monkeypatch.setattr(
        kvcr_manager,
        "mmap",
        SimpleNamespace(mmap=lambda *args: mappings.append(mmap.mmap(*args)) or mappings[-1]),
    )
    tier = harness.tier(secondary_g2_slots=2)
    assert len(mappings[0]) == 2 * tier.block_size_bytes
    tier.shutdown()
    assert harness.kvcr.closed == 1 and mappings[0].closed


def test_failed_close_keeps_registered_buffers(harness, monkeypatch):
    retained: list[object] = []
    monkeypatch.setattr(kvcr_manager, "_RETAINED_NATIVE_BUFFERS", retained)
    primary = mmap.mmap(-1, mmap.PAGESIZE)
    view = memoryview(primary)
    tier = harness.tier(view)
    harness.kvcr.close_error = RuntimeError("nixl stuck")
    with pytest.raises(RuntimeError, match="nixl stuck"):
        tier.shutdown()
    view.release()
    with pytest.raises(BufferError):
        primary.close()
    retained.clear()
    primary.close()
