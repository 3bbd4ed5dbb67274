"""The P2P tier manager's settings and their errors, its registration, and the unbound-store
timeout (beyond upstream's tests)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.p2p import manager as manager_module
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager
from vllm.v1.metrics.cache_hit_source import CacheHitSource


@pytest.fixture
def build(monkeypatch):
    """Construct managers with both transports replaced by recorders."""
    built: dict = {}
    monkeypatch.setattr(
        manager_module.FileMapper,
        "from_offloading_spec",
        lambda **_: SimpleNamespace(get_run_config=lambda: {}),
    )
    monkeypatch.setattr(manager_module, "NixlTransport", lambda *a, **k: built.update(nixl=(a, k)))
    monkeypatch.setattr(manager_module, "ZmqTransport", lambda *a, **k: built.update(zmq=(a, k)))

    def make(**kwargs) -> P2PSecondaryTierManager:
        spec = SimpleNamespace(
            config=SimpleNamespace(parallel=SimpleNamespace(data_parallel_index=0)),
            blocks_per_chunk=1,
        )
        return P2PSecondaryTierManager(spec, memoryview(bytearray(16)), **kwargs)

    make.built = built  # type: ignore[attr-defined]
    return make


def test_registered_in_the_factory():
    cls = SecondaryTierFactory.get_tier_class({"type": "p2p"})
    assert cls is P2PSecondaryTierManager
    assert cls.cache_hit_source is CacheHitSource.P2P
    assert cls.tolerates_off_thread_polling is True


@pytest.mark.parametrize("timeout", [0, -1.0, "soon", None, float("nan")])
def test_bad_unbound_store_timeout_is_rejected(build, timeout):
    with pytest.raises(ValueError, match="unbound_store_timeout_s: expected a positive"):
        build(unbound_store_timeout_s=timeout)
    assert "nixl" not in build.built  # rejected before any transport is built


def test_timeout_given_as_text_is_accepted(build):
    assert build(unbound_store_timeout_s="2.5")._unbound_store_timeout_s == 2.5


def test_bad_port_setting_is_rejected(build, monkeypatch):
    monkeypatch.setenv("VLLM_P2P_SIDE_CHANNEL_PORT", "fifty")
    with pytest.raises(ValueError, match="VLLM_P2P_SIDE_CHANNEL_PORT: expected an integer"):
        build()


def test_bad_peer_limit_setting_is_rejected(build, monkeypatch):
    mgr = build(host="127.0.0.1", port=5710)
    monkeypatch.setenv("VLLM_P2P_MAX_PEERS", "lots")
    with pytest.raises(ValueError, match="VLLM_P2P_MAX_PEERS: expected an integer, got 'lots'"):
        mgr._get_or_create_session("10.0.0.1:8000")


def test_transport_settings_are_passed_through(build):
    build(host="10.1.1.1", port=6000, backends=["UCX"], num_threads="2")
    nixl_args, nixl_kwargs = build.built["nixl"]
    agent_name = nixl_args[0]
    assert nixl_kwargs["backends"] == ["UCX"] and nixl_kwargs["num_threads"] == 2
    assert build.built["zmq"][0] == ("10.1.1.1:6000", "10.1.1.1", 6000)
    assert agent_name != "10.1.1.1:6000"


def _store_job(job_id: int, kv_request_id: str) -> TransferJob:
    ctx = ReqContext(
        req_id="r", kv_transfer_params={"remote_decoder": {"kv_request_id": kv_request_id}}
    )
    manager_module._annotate_req_context(ctx)
    return TransferJob(
        job_id=job_id,
        keys=[OffloadKey(b"k")],
        chunk_ids=np.array([0]),
        is_promotion=False,
        req_context=ctx,
    )


def test_unbound_store_timeout_setting_is_honoured(build):
    mgr = build(unbound_store_timeout_s=30)
    mgr._control = SimpleNamespace(poll=lambda: [])
    mgr.submit_store(_store_job(1, "kv-1"))
    assert list(mgr.get_finished_jobs()) == []
    mgr._unbound_stores["kv-1"][0].submitted_at = time.monotonic() - 31
    assert list(mgr.get_finished_jobs()) == [JobResult(job_id=1, success=False)]
    # The id is remembered: a later store under it fails at once instead of parking.
    mgr.submit_store(_store_job(2, "kv-1"))
    assert mgr._unbound_stores == {}
    assert list(mgr.get_finished_jobs()) == [JobResult(job_id=2, success=False)]


def test_unknown_settings_are_ignored_with_a_warning(build, caplog):
    with caplog.at_level("WARNING", logger=manager_module.__name__):
        build(unbound_store_timeout=5)
    assert "ignoring unknown settings ['unbound_store_timeout']" in caplog.text


def test_control_socket_failure_closes_the_data_plane(build, monkeypatch):
    closed = []
    monkeypatch.setattr(
        manager_module,
        "NixlTransport",
        lambda *a, **k: SimpleNamespace(close=lambda: closed.append(True)),
    )

    def refuse(*args, **kwargs):
        raise OSError("Address already in use")

    monkeypatch.setattr(manager_module, "ZmqTransport", refuse)
    with pytest.raises(OSError, match="Address already in use"):
        build(host="127.0.0.1", port=5710)
    assert closed == [True]
