"""The KVCR tier's config checks and translations, its key adapter, its pin server and the KV
hints records: what upstream's test_kvcr_tier.py leaves out (error paths above all)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

msgspec = pytest.importorskip("msgspec")
pytest.importorskip("kvcr")

from kvcr.policy import FIFOPolicy, LRUPolicy  # noqa: E402
from kvcr.types import BlockKey, MemoryRef  # noqa: E402

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    OffloadingKVEventsConfig,
    RequestOffloadingContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.kvcr import settings  # noqa: E402
from vllm.v1.kv_offload.tiering.kvcr.pins import FrameworkPinServer  # noqa: E402


class NotAPolicy:
    pass


def test_builtin_and_external_policies_are_fresh_instances():
    assert settings.resolve_policy(None) is None
    first, second = settings.resolve_policy("lru"), settings.resolve_policy("lru")
    assert type(first) is LRUPolicy and first is not second
    assert type(settings.resolve_policy("kvcr.policy.FIFOPolicy")) is FIFOPolicy


@pytest.mark.parametrize(
    ("policy", "error", "match"),
    [
        ("mru", ValueError, "policy: expected one of"),
        (f"{__name__}.NotAPolicy", TypeError, "expected a KVCachePolicy subclass"),
        (f"{__name__}.Missing", TypeError, "expected a KVCachePolicy subclass, got None"),
        (3, TypeError, "policy: expected a str or None, got 3"),
    ],
)
def test_bad_policy_is_rejected(policy, error, match):
    with pytest.raises(error, match=match):
        settings.resolve_policy(policy)


def test_service_pair_and_router_capabilities():
    settings.check_service_pair(None, None)
    settings.check_service_pair("/tmp/s.sock", "digest")
    with pytest.raises(ValueError, match=r"configured together\), got None and 'd'"):
        settings.check_service_pair(None, "d")
    settings.check_router_capabilities(["router_hint", "other"])
    for declared in (None, [], ["other"]):
        with pytest.raises(ValueError, match=r"router_capabilities: expected to include"):
            settings.check_router_capabilities(declared)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_check_int_rejects_non_ints_and_low_values(value):
    with pytest.raises(ValueError, match=r"secondary_g2_slots: expected an int >= 0"):
        settings.check_int("secondary_g2_slots", value, 0)


def test_check_int_accepts_its_bound():
    assert settings.check_int("abandon_timeout_ms", 1, 1) == 1
    with pytest.raises(ValueError, match="abandon_timeout_ms: expected an int >= 1, got 0"):
        settings.check_int("abandon_timeout_ms", 0, 1)


@pytest.mark.parametrize(
    ("enabled", "self_describing", "local", "fails"),
    [
        (True, False, True, True),
        (True, True, True, False),
        (True, False, False, False),  # remote-only KVCR owns no local inventory
        (False, False, True, False),  # nothing is published
    ],
)
def test_inventory_events_need_self_describing_payloads(enabled, self_describing, local, fails):
    events = OffloadingKVEventsConfig(
        enable_kv_cache_events=enabled, self_describing_kv_events=self_describing
    )
    if fails:
        with pytest.raises(ValueError, match="self_describing_kv_events: expected True"):
            settings.check_inventory_events(events, local)
    else:
        settings.check_inventory_events(events, local)


def test_control_port_per_local_dp_rank():
    assert settings.select_control_port([7000], None) == 7000
    assert settings.select_control_port([7000, 7001], 1) == 7001


@pytest.mark.parametrize(
    ("ports", "rank", "match"),
    [
        (None, None, "expected a non-empty list of ports, got None"),
        ([], 0, "expected a non-empty list of ports"),
        ([7000, 7001], None, "exactly one port when data_parallel_rank_local is unset"),
        ([7000], 1, "a port for local data-parallel rank 1"),
        ([0], None, r"ports in \[1, 65535\], got 0"),
        ([70000], None, r"got 70000"),
        (["7000"], None, "got '7000'"),
    ],
)
def test_bad_control_ports_are_rejected(ports, rank, match):
    with pytest.raises(ValueError, match=f"control_ports: .*{match}"):
        settings.select_control_port(ports, rank)


def test_g3_options_from_strings(tmp_path):
    options = settings.g3_options(
        {"paths": [str(tmp_path / "a"), tmp_path / "b"], "capacity_bytes_per_file": 8}
    )
    assert options is not None
    assert options.paths == (tmp_path / "a", tmp_path / "b")
    assert all(isinstance(path, Path) for path in options.paths)
    assert settings.g3_options(None) is None


@pytest.mark.parametrize(
    ("g3", "error", "match"),
    [
        ({"capacity_bytes_per_file": 8}, ValueError, "g3.paths: expected a list"),
        ({"paths": "/tmp/one", "capacity_bytes_per_file": 8}, ValueError, "g3.paths"),
        ({"paths": ["/tmp/a"]}, TypeError, "g3: expected G3Options fields"),
        ({"paths": ["/tmp/a"], "capacity_bytes_per_file": 8, "bogus": 1}, TypeError, "bogus"),
        (["/tmp/a"], TypeError, "g3: expected a mapping"),
    ],
)
def test_bad_g3_config_is_rejected(g3, error, match):
    with pytest.raises(error, match=match):
        settings.g3_options(g3)


def test_key_adapter(monkeypatch):
    adapter = settings.VllmKeyAdapter()
    block_hash = (0x0102).to_bytes(8, "big")
    key = make_offload_key(block_hash, 3)
    assert adapter.encode(key) == key
    with pytest.raises(TypeError, match="framework_key: expected bytes, got str"):
        adapter.encode("k")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    assert adapter.decode(BlockKey(key)) == 0x0102


def test_metric_definitions_are_namespaced():
    definitions = settings.kvcr_metric_definitions()
    assert all(name.startswith("vllm:kvcr_") for name in definitions)
    assert definitions["vllm:kvcr_duration_seconds"].labelnames == ("scope", "result")


def test_kv_hints_round_trip_and_are_frozen():
    envelope = KvHintsEnvelope(
        protocol_version="0.1",
        message_id="m",
        actions=[KvHintAction("a", "kv.fetch", "1.0", {"peer": "x"})],
    )
    encoded = msgspec.json.encode(envelope)
    assert msgspec.json.decode(encoded, type=KvHintsEnvelope) == envelope
    assert msgspec.to_builtins(envelope)["actions"][0]["payload"] == {"peer": "x"}
    with pytest.raises(AttributeError):
        envelope.message_id = "other"  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"protocol_version": "0.1"}', type=KvHintsEnvelope)


class Parent:
    """A ParentManager whose primary tier holds ``hits``; records the calls it gets."""

    def __init__(self, hits, *, rows=None, fail_lookup=False, extra_key=None):
        self.hits = set(hits)
        self.rows = rows or {}
        self.fail_lookup = fail_lookup
        self.extra_key = extra_key
        self.calls: list[str] = []

    def on_new_request(self, req_context):
        self.calls.append(f"new:{req_context.req_id}")
        return RequestOffloadingContext()

    def lookup(self, key, req_context):
        if self.fail_lookup:
            raise RuntimeError("lookup broke")
        return LookupResult.HIT if key in self.hits else LookupResult.MISS

    def create_store_job(self, keys, req_context):
        keys = list(keys) + ([self.extra_key] if self.extra_key else [])
        return TransferJob(
            job_id=5,
            keys=keys,
            chunk_ids=np.array([self.rows.get(key, 0) for key in keys]),
            is_promotion=False,
            req_context=req_context,
        )

    def on_request_finished(self, req_context):
        self.calls.append(f"finished:{req_context.req_id}")


def _ref(row: int) -> MemoryRef:
    return MemoryRef(end_point_name="agent", element_index=row)


def test_pin_grant_release_is_idempotent():
    server = FrameworkPinServer(_ref)
    keys = (BlockKey(b"a"), BlockKey(b"b"))
    request = server.request_pin(keys)
    assert server.poll_pin_results() == []
    parent = Parent({b"b"}, rows={b"b": 9})
    server.serve(parent)
    [(answered, (handle, refs))] = server.poll_pin_results()
    assert answered == request
    assert refs == {keys[0]: None, keys[1]: [_ref(9)]}
    assert parent.calls == ["new:kvcr-source:0", "finished:kvcr-source:0"]
    assert server.has_active_pins() and server.take_job_results() == []
    assert server.release_pin(handle) is True
    assert server.release_pin(handle) is True  # a retried release is accepted again
    assert not server.has_active_pins()
    assert [(r.job_id, r.success) for r in server.take_job_results()] == [(5, True)]


def test_cancelled_request_is_never_served():
    server = FrameworkPinServer(_ref)
    request = server.request_pin([BlockKey(b"a")])
    server.cancel_pin_request(request)
    parent = Parent({b"a"})
    server.serve(parent)
    assert server.poll_pin_results() == [] and parent.calls == []


@pytest.mark.parametrize(
    ("parent", "job_failed"),
    [
        (Parent(set()), False),  # no hit: no job is made
        (Parent({b"a"}, fail_lookup=True), False),  # the parent raises: no pin
        (Parent({b"a"}, extra_key=b"z"), True),  # the job covers other keys: unpinned
    ],
    ids=["miss", "lookup-error", "mismatched-job"],
)
def test_unservable_pin_is_refused_and_its_request_closed(parent, job_failed):
    server = FrameworkPinServer(_ref)
    request = server.request_pin([BlockKey(b"a")])
    server.serve(parent)
    assert server.poll_pin_results() == [(request, None)]
    assert parent.calls[-1].startswith("finished:")
    assert not server.has_active_pins()
    failed = [(r.job_id, r.success) for r in server.take_job_results()]
    assert failed == ([(5, False)] if job_failed else [])


def test_pin_requests_get_distinct_ids_and_source_requests():
    server = FrameworkPinServer(_ref)
    first = server.request_pin([BlockKey(b"a")])
    second = server.request_pin([BlockKey(b"a")])
    assert first != second
    parent = Parent({b"a"})
    server.serve(parent)
    assert [answer[0] for answer in server.poll_pin_results()] == [first, second]
    assert len({call for call in parent.calls if call.startswith("new:")}) == 2
