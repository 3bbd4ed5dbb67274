"""The object-store tier against a fake NIXL agent: what upstream's tests do not pin (argument
checks before any connection or transfer, object names, handle clean-up on a failed submission,
the engine kept stepping while transfers are in flight)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.obj import manager as obj_manager
from vllm.v1.kv_offload.tiering.obj.config import ObjStoreConfig
from vllm.v1.kv_offload.tiering.obj.manager import ObjectStoreSecondaryTierManager

CTX = ReqContext(req_id="r")
STORE = {"bucket": "b", "endpoint_override": "ep:9000"}


def key(i: int):
    return make_offload_key(i.to_bytes(8, "big"), 0)


def spec() -> SimpleNamespace:
    parallel = OffloadingParallelConfig(
        rank=0,
        world_size=1,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        data_parallel_index=0,
        data_parallel_size=1,
        data_parallel_rank_local=None,
        is_parallelism_agnostic=False,
    )
    config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=OffloadingModelConfig(name="org/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=parallel,
        replicated_layout=False,
    )
    return SimpleNamespace(config=config, blocks_per_chunk=1)


class FakeAgent:
    """Records every NIXL call; ``fail`` names the call that returns a refusal."""

    def __init__(self, name: str, config: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail: str | None = None
        self.state = "PROC"
        self.params: dict[str, str] = {}

    def _call(self, name: str, arg: Any = None) -> Any:
        self.calls.append((name, arg))
        return None if self.fail == name else f"{name}-handle"

    def create_backend(self, backend: str, params: dict[str, str]) -> None:
        self.params = params

    def query_memory(self, descs, mem_type, agent_name):
        if self.fail == "query_memory":
            raise RuntimeError("no route to host")
        return [None for _ in descs]

    def register_memory(self, descs, mem_type=None):
        handle = self._call("register_memory", (mem_type, descs))
        return None if handle is None else SimpleNamespace(trim=lambda: "trimmed", id=handle)

    def prep_xfer_dlist(self, agent, descs, mem_type=None):
        return self._call("prep_xfer_dlist", agent)

    def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx):
        return self._call("make_prepped_xfer", (op, local_idx.dtype, list(local_idx)))

    def transfer(self, handle):
        self.calls.append(("transfer", handle))
        return "ERR" if self.fail == "transfer" else "PROC"

    def check_xfer_state(self, handle):
        return self.state

    def get_xfer_telemetry(self, handle):
        return SimpleNamespace(xferDuration=2500)

    def release_xfer_handle(self, handle):
        self.calls.append(("release_xfer_handle", handle))

    def release_dlist_handle(self, handle):
        self.calls.append(("release_dlist_handle", handle))

    def deregister_memory(self, handle):
        self.calls.append(("deregister_memory", handle))


@pytest.fixture
def fake_nixl(monkeypatch) -> None:
    monkeypatch.setattr(obj_manager, "nixl_agent", FakeAgent)
    monkeypatch.setattr(obj_manager, "nixl_agent_config", lambda **kw: SimpleNamespace(**kw))


def make_tier(prefix: str = "runs/a", **kwargs: Any) -> ObjectStoreSecondaryTierManager:
    rows = torch.zeros((4, 256), dtype=torch.float32)
    return ObjectStoreSecondaryTierManager(
        spec(), memoryview(rows.numpy()), "obj", kwargs.pop("store_config", STORE), prefix, **kwargs
    )


def job(job_id: int, ids: list[int], rows: list[int]) -> TransferJob:
    return TransferJob(job_id, [key(i) for i in ids], np.array(rows, dtype=np.int64), False, CTX)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"store_config": "bucket=b"}, TypeError, "store_config: expected a dict, got str"),
        ({"store_config": {"bucket": "b"}}, TypeError, "endpoint_override"),
        ({"io_threads": 0}, ValueError, "io_threads: expected an int >= 1, got 0"),
        ({"io_threads": True}, ValueError, "io_threads: expected an int >= 1, got True"),
    ],
)
def test_bad_settings_fail_before_connecting(monkeypatch, kwargs, error, message) -> None:
    def no_agent(*args: Any, **kw: Any) -> None:
        raise AssertionError("connected before checking the settings")

    monkeypatch.setattr(obj_manager, "nixl_agent", no_agent)
    monkeypatch.setattr(obj_manager, "nixl_agent_config", lambda **kw: None)
    with pytest.raises(error, match=message):
        make_tier(**kwargs)


def test_without_nixl_the_tier_names_the_package(monkeypatch) -> None:
    monkeypatch.setattr(obj_manager, "nixl_agent", None)
    with pytest.raises(ImportError, match="NIXL's Python package"):
        make_tier()


def test_an_unreachable_store_fails_construction(fake_nixl, monkeypatch) -> None:
    def unreachable(self, descs, mem_type, agent_name):
        raise RuntimeError("no route to host")

    monkeypatch.setattr(FakeAgent, "query_memory", unreachable)
    with pytest.raises(RuntimeError, match="did not answer a probe.*no route to host"):
        make_tier()


@pytest.mark.parametrize(("prefix", "start"), [("runs/a", "runs/a/org_model_"), ("", "org_")])
def test_object_keys_have_no_empty_path_segment(fake_nixl, prefix: str, start: str) -> None:
    tier = make_tier(prefix=prefix)
    try:
        name = tier._object_key(key(1))
        assert name.startswith(start) and "//" not in name
        assert tier._agent.params == {
            "bucket": "b",
            "endpoint_override": "ep:9000",
            "scheme": "http",
            "num_threads": "4",
        }
    finally:
        tier.shutdown()


def test_chunk_ids_are_checked_before_anything_is_registered(fake_nixl) -> None:
    tier = make_tier()
    agent = tier._agent
    try:
        before = list(agent.calls)
        with pytest.raises(ValueError, match=r"job 1: chunk ids: expected ids in \[0, 4\), got"):
            tier.submit_store(job(1, [1, 2], [0, 4]))
        with pytest.raises(ValueError, match="job 2: expected one chunk id per key, got 1"):
            tier.submit_load(job(2, [1, 2], [0]))
        assert agent.calls == before and not tier._transfers
        # int64 ids reach NIXL as int32 indices.
        tier.submit_store(job(3, [1, 2], [3, 1]))
        assert ("make_prepped_xfer", ("WRITE", np.int32, [3, 1])) in agent.calls
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    ("fail", "released"),
    [
        ("register_memory", []),
        ("prep_xfer_dlist", ["deregister_memory"]),
        ("make_prepped_xfer", ["release_dlist_handle", "deregister_memory"]),
        ("transfer", ["release_xfer_handle", "release_dlist_handle", "deregister_memory"]),
    ],
)
def test_a_failed_submission_releases_what_it_took(fake_nixl, fail, released) -> None:
    tier = make_tier()
    agent = tier._agent
    try:
        agent.fail = fail
        start = len(agent.calls)
        tier.submit_store(job(1, [1], [0]))
        later = [name for name, _ in agent.calls[start:]]
        assert [n for n in later if n.startswith(("release", "deregister"))] == released
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
        assert not tier._transfers
    finally:
        tier.shutdown()


def test_the_engine_keeps_stepping_while_a_transfer_is_in_flight(fake_nixl) -> None:
    tier = make_tier()
    try:
        assert not tier.has_pending_work()
        tier.submit_store(job(1, [1], [0]))
        assert tier.has_pending_work() and list(tier.get_finished_jobs()) == []
        tier._agent.state = "DONE"
        (result,) = tier.get_finished_jobs()
        assert (result.job_id, result.success, result.transfer_time) == (1, True, 0.0025)
        assert not tier.has_pending_work()
    finally:
        tier.shutdown()


def test_shutdown_releases_the_primary_buffer_once(fake_nixl) -> None:
    tier = make_tier()
    agent = tier._agent
    tier.submit_store(job(1, [1], [0]))
    tier.shutdown()
    tier.shutdown()
    releases = [c for c in agent.calls if c[0] in ("release_dlist_handle", "deregister_memory")]
    # The job's two handles, then the primary rows' prepared list and registration.
    assert len(releases) == 4 and not tier._transfers


def test_config_repr_hides_secrets() -> None:
    cfg = ObjStoreConfig(bucket="b", endpoint_override="ep", access_key="AK", secret_key="SK")
    assert "AK" not in repr(cfg) and "SK" not in repr(cfg) and "bucket='b'" in repr(cfg)
