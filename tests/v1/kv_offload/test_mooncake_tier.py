"""The Mooncake tier's logic without a master: an in-process stand-in for the store client
(the real store is exercised in tests/distributed/kv_transfer/mooncake). Options, the row
format, key names, byte-exact cascades and promotions, the checks before a promotion writes,
failure records, the sticky miss of a corrupt block and the unreachable-store back-off."""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from tiering_test_utils import stub_spec, wait_until

from vllm.config import ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
    OBJECT_TOO_LARGE,
    RPC_FAILED,
)
from vllm.v1.attention.backends.utils import kv_cache_layout
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.mooncake import manager as tier_module
from vllm.v1.kv_offload.tiering.mooncake.blocks import OBJECT_NOT_FOUND, offload_key_name
from vllm.v1.kv_offload.tiering.mooncake.manager import (
    MooncakeTierManager,
    primary_rows,
    row_page_format,
)

CTX = ReqContext(req_id="r")

TRANSFER_FAILED = -800
"""Mooncake's answer to a read whose buffers are larger than the object."""


class FakeStore:
    """Objects of every client of one test (a shared store)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False


class FakeClient:
    """The calls of ``MooncakeStoreClient`` the tier makes, on a :class:`FakeStore`."""

    store = FakeStore()

    def __init__(self, config: Any) -> None:
        self.config = config
        self.closed = False

    def register(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()

    def exists(self, keys: Sequence[str]) -> list[int]:
        if self.store.down:
            return [-1] * len(keys)
        return [int(k in self.store.objects) for k in keys]

    def sizes(self, keys: Sequence[str]) -> list[int]:
        return [len(self.store.objects.get(k, b"")) or OBJECT_NOT_FOUND for k in keys]

    def put_from(self, keys, buffers, sizes) -> list[int]:
        """Mooncake's answers: 0, and an object already there kept as it is."""
        if self.store.down:
            return [RPC_FAILED] * len(keys)
        for key, ptrs, lens in zip(keys, buffers, sizes, strict=True):
            self.store.objects.setdefault(
                key, b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, lens, strict=True))
            )
        return [0] * len(keys)

    def get_into(self, keys, buffers, sizes) -> list[int]:
        """Mooncake's answers: the object scattered over the buffers when it fills them
        exactly, else a code and nothing written."""
        codes = []
        for key, ptrs, lens in zip(keys, buffers, sizes, strict=True):
            data = self.store.objects.get(key)
            if data is None:
                codes.append(OBJECT_NOT_FOUND)
            elif len(data) > sum(lens):
                codes.append(OBJECT_TOO_LARGE)
            elif len(data) < sum(lens):
                codes.append(TRANSFER_FAILED)
            else:
                start = 0
                for ptr, n in zip(ptrs, lens, strict=True):
                    ctypes.memmove(ptr, data[start : start + n], n)
                    start += n
                codes.append(len(data))
        return codes

    def remove(self, keys) -> list[int]:
        for key in keys:
            self.store.objects.pop(key, None)
        return [0] * len(keys)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def fake_client(monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    FakeClient.store = FakeStore()
    monkeypatch.setattr(tier_module, "MooncakeStoreClient", FakeClient)
    return FakeClient.store


def make_tier(
    rows: np.ndarray | None = None, workers: int = 1, **options: Any
) -> tuple[MooncakeTierManager, np.ndarray]:
    spec = stub_spec()
    if workers > 1:
        spec.vllm_config = dataclasses.replace(
            spec.vllm_config, parallel_config=ParallelConfig(tensor_parallel_size=workers)
        )
    row_bytes = row_page_format(spec).block_bytes
    if rows is None:
        rows = np.zeros((6, row_bytes), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "mooncake", "mooncake": {"master_server_address": "127.0.0.1:1"}, **options},
        memoryview(rows),
        spec,
    )
    assert isinstance(tier, MooncakeTierManager)
    return tier, rows


def keys(*names: str):
    return [make_offload_key(n.encode().ljust(8, b"."), 0) for n in names]


def run(tier: MooncakeTierManager, job_id: int, ks, block_ids, promotion: bool) -> bool:
    job = TransferJob(job_id, ks, np.array(block_ids, dtype=np.int64), promotion, CTX)
    (tier.submit_load if promotion else tier.submit_store)(job)
    results = []
    wait_until(lambda: results.extend(tier.get_finished_jobs()) or bool(results))
    assert [r.job_id for r in results] == [job_id] and tier.jobs_in_flight == 0
    return results[0].success


def test_row_format_follows_the_engine_and_options() -> None:
    spec = stub_spec()
    page = spec.kv_cache_config.kv_cache_tensors[0].size // 4
    fmt = row_page_format(spec)
    assert (fmt.model, fmt.kv_cache_dtype, fmt.num_workers) == ("org/model", "auto", 1)
    assert fmt.block_bytes == page
    other = row_page_format(spec, model="other/model")
    assert other.fingerprint != fmt.fingerprint
    tier, rows = make_tier(workers=2)
    assert tier.page_format.num_workers == 2 and rows.shape[1] == 2 * page
    tier.shutdown()


def test_cascade_and_promotion_are_byte_exact_across_instances() -> None:
    writer, w_rows = make_tier()
    reader, r_rows = make_tier()
    w_rows[:] = np.random.default_rng(0).integers(0, 256, w_rows.shape, dtype=np.uint8)
    ks = keys("a", "b", "c")
    assert [reader.lookup(k, CTX) for k in ks] == [LookupResult.MISS] * 3
    assert run(writer, 0, ks, [4, 0, 2], promotion=False)
    assert [reader.lookup(k, CTX) for k in ks] == [LookupResult.HIT] * 3
    assert run(reader, 1, ks[::-1], [5, 1, 3], promotion=True)
    assert np.array_equal(r_rows[[5, 1, 3]], w_rows[[2, 0, 4]])
    assert not r_rows[[0, 2, 4]].any()
    writer.shutdown()
    reader.shutdown()


@pytest.mark.parametrize("by_option", [True, False])
def test_nhd_and_hnd_instances_never_share_blocks(by_option: bool) -> None:
    """An HND cache's tier (by the tier option, or as the layout in effect) keys its blocks
    apart from an NHD cache's of the same config: the NHD block is a miss, its promotion writes
    nothing; the HND block of an HND writer is found again."""
    nhd, _ = make_tier()
    if by_option:
        hnd, hnd_rows = make_tier(kv_cache_layout="HND")
        other_hnd, other_rows = make_tier(kv_cache_layout="HND")
    else:
        with kv_cache_layout("HND"):
            hnd, hnd_rows = make_tier()
            other_hnd, other_rows = make_tier()
    assert (nhd.page_format.kv_cache_layout, hnd.page_format.kv_cache_layout) == ("NHD", "HND")
    assert nhd.page_format.fingerprint != hnd.page_format.fingerprint
    name = offload_key_name(keys("n")[0])
    assert nhd.rows.key(name) != hnd.rows.key(name)
    assert run(nhd, 0, keys("n"), [0], promotion=False)
    assert hnd.lookup(keys("n")[0], CTX) is LookupResult.MISS
    assert not run(hnd, 1, keys("n"), [1], promotion=True) and not hnd_rows.any()
    other_rows[2] = 3
    assert run(other_hnd, 2, keys("h"), [2], promotion=False)
    assert (
        hnd.lookup(keys("h")[0], CTX) is LookupResult.HIT
        and nhd.lookup(keys("h")[0], CTX) is LookupResult.MISS
    )
    assert run(hnd, 3, keys("h"), [4], promotion=True) and (hnd_rows[4] == 3).all()
    for tier in (nhd, hnd, other_hnd):
        tier.shutdown()


def test_a_corrupt_block_fails_its_promotion_and_stays_a_miss(fake_client) -> None:
    """A short object fails the promotion (the rows of a failed promotion are never handed out:
    the tiering manager drops them) and is not retried; offloaded again, it is replaced."""
    writer, w_rows = make_tier()
    reader, r_rows = make_tier()
    w_rows[:] = 7
    ks = keys("x", "y")
    assert run(writer, 0, ks, [0, 1], promotion=False)
    key = writer.rows.key(offload_key_name(ks[1]))
    header = writer.page_format.header()
    assert fake_client.objects[key] == header + bytes(w_rows[1])  # the header, then the block
    fake_client.objects[key] = b"\1" * 10
    assert not run(reader, 1, ks, [2, 3], promotion=True)
    assert not r_rows[3].any()  # Mooncake writes nothing of an object of another size
    error = reader.failure(ks[1])
    object_bytes = len(header) + writer.page_format.block_bytes
    assert isinstance(error, ValueError)
    assert f"expected {object_bytes} bytes (header and block), got 10 bytes" in str(error)
    assert reader.lookup(ks[1], CTX) is LookupResult.MISS  # not retried: recomputed
    assert reader.lookup(ks[0], CTX) is LookupResult.HIT
    # Recomputed and offloaded again by the reader: the bad object is replaced, then loads.
    r_rows[4] = 5
    assert run(reader, 5, ks[1:], [4], promotion=False)
    assert reader.lookup(ks[1], CTX) is LookupResult.HIT
    assert fake_client.objects[key] == header + bytes(r_rows[4])
    # A foreign header (another model's format, the same size) is refused the same way.
    foreign, _ = make_tier(model="other/model")
    key = writer.rows.key(offload_key_name(ks[0]))
    assert len(foreign.page_format.header()) == len(header)
    fake_client.objects[key] = (
        foreign.page_format.header() + fake_client.objects[key][len(header) :]
    )
    assert not run(reader, 2, ks[:1], [2], promotion=True)
    assert "header of block" in str(reader.failure(ks[0]))
    for tier in (writer, reader, foreign):
        tier.shutdown()


def test_a_missing_block_fails_the_promotion() -> None:
    tier, rows = make_tier()
    assert not run(tier, 0, keys("gone"), [0], promotion=True)
    assert type(tier.failure(keys("gone")[0])).__name__ == "StoreMiss"
    assert not rows.any()
    tier.shutdown()


def test_an_unreachable_store_is_a_fast_miss_then_retried(fake_client) -> None:
    tier, _ = make_tier(retry_after_s=0.2)
    ks = keys("k")
    assert run(tier, 0, ks, [0], promotion=False)
    fake_client.down = True
    assert tier.lookup(ks[0], CTX) is LookupResult.MISS
    fake_client.down = False
    assert tier.lookup(ks[0], CTX) is LookupResult.MISS  # within the back-off: no query
    assert not run(tier, 1, keys("later"), [1], promotion=False)
    assert "unreachable" in str(tier.failure(keys("later")[0]))
    time.sleep(0.25)
    assert tier.lookup(ks[0], CTX) is LookupResult.HIT
    tier.shutdown()


def test_one_batch_call_per_direction(monkeypatch) -> None:
    """A cascade is one put and a promotion one read (header inside the object): no existence,
    size or header-object call beside them."""
    calls: list[str] = []
    for name in ("exists", "sizes", "put_from", "get_into", "remove"):
        method = getattr(FakeClient, name)

        def counted(self, *args, _method=method, _name=name):
            calls.append(_name)
            return _method(self, *args)

        monkeypatch.setattr(FakeClient, name, counted)
    writer, w_rows = make_tier()
    reader, r_rows = make_tier()
    w_rows[:] = np.random.default_rng(1).integers(0, 256, w_rows.shape, dtype=np.uint8)
    ks = keys("one", "two", "three")
    calls.clear()
    assert run(writer, 0, ks, [0, 1, 2], promotion=False)
    assert calls == ["put_from"]
    calls.clear()
    assert run(reader, 1, ks, [3, 4, 5], promotion=True)
    assert calls == ["get_into"] and np.array_equal(r_rows[3:6], w_rows[0:3])
    for tier in (writer, reader):
        tier.shutdown()


def test_a_put_the_master_does_not_answer_starts_the_back_off(fake_client) -> None:
    """No existence query precedes a put: a put the master does not answer marks the store
    unreachable itself, so lookups miss at once during the back-off."""
    tier, _ = make_tier(retry_after_s=60.0)
    fake_client.down = True
    assert not run(tier, 0, keys("p"), [0], promotion=False)
    assert type(tier.failure(keys("p")[0])).__name__ == "StoreUnreachable"
    fake_client.down = False
    assert tier.lookup(keys("p")[0], CTX) is LookupResult.MISS  # no query: backing off
    tier.shutdown()


def test_a_successful_store_clears_the_failure_record() -> None:
    tier, _ = make_tier()
    k = keys("z")
    assert not run(tier, 0, k, [0], promotion=True)
    assert tier.failure(k[0]) is not None
    assert run(tier, 1, k, [0], promotion=False)
    assert tier.failure(k[0]) is None
    tier.shutdown()


def test_shutdown_closes_the_client() -> None:
    tier, _ = make_tier()
    tier.shutdown()
    assert tier.rows.client.closed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"key_prefix": "a/b"}, "key_prefix: expected a non-empty name without '/'"),
        ({"max_blocks_per_batch": 0}, "max_blocks_per_batch"),
        ({"retry_after_s": -1}, "retry_after_s: expected seconds ≥ 0, got -1"),
        ({"mooncake": {"protocol": "udp"}}, "protocol: expected one of"),
        ({"mooncake": {"master": "x"}}, "mooncake config: unknown keys"),
        ({"model": ""}, "model: expected a non-empty model name"),
    ],
)
def test_bad_options_are_clear_errors_before_connecting(monkeypatch, options, message) -> None:
    def no_connection(config: Any) -> None:
        raise AssertionError("connected before checking the options")

    monkeypatch.setattr(tier_module, "MooncakeStoreClient", no_connection)
    with pytest.raises(ValueError, match=message):
        make_tier(**options)


def test_rows_must_match_the_format_and_be_writable() -> None:
    spec = stub_spec()
    row_bytes = row_page_format(spec).block_bytes
    with pytest.raises(ValueError, match=f"expected rows of at least {row_bytes} bytes"):
        make_tier(rows=np.zeros((2, row_bytes - 1), dtype=np.uint8))
    read_only = memoryview(bytes(2 * row_bytes)).cast("B", (2, row_bytes))
    with pytest.raises(ValueError, match="expected writable rows"):
        primary_rows(read_only)
    with pytest.raises(ValueError, match="expected a \\[num_blocks, row bytes\\] byte view"):
        primary_rows(memoryview(bytearray(8)))
    rows = np.zeros((2, 4), dtype=np.uint8)
    primary_rows(memoryview(rows))[1, 2] = 9  # a view, not a copy
    assert rows[1, 2] == 9


def test_rows_need_a_spec_that_knows_the_kv_cache() -> None:
    spec = stub_spec()
    spec.kv_cache_config = None  # as a spec built from an OffloadingConfig
    with pytest.raises(ValueError, match="expected a spec built from \\(vllm_config"):
        row_page_format(spec)


def test_key_names() -> None:
    key = make_offload_key(b"\x00\xff", 3)
    assert offload_key_name(key) == "00ff_g3"
    with pytest.raises(ValueError, match="expected a block hash before the group index"):
        offload_key_name(make_offload_key(b"", 0))


def test_an_oversized_object_is_a_bad_object(fake_client) -> None:
    writer, _ = make_tier()
    reader, r_rows = make_tier()
    k = keys("big")
    assert run(writer, 0, k, [0], promotion=False)
    fake_client.objects[writer.rows.key(offload_key_name(k[0]))] += b"\0" * 64
    assert not run(reader, 1, k, [1], promotion=True)
    assert type(reader.failure(k[0])).__name__ == "BadStoreObject"
    assert "got a larger object" in str(reader.failure(k[0]))
    assert reader.lookup(k[0], CTX) is LookupResult.MISS and not r_rows.any()
    for tier in (writer, reader):
        tier.shutdown()


def test_bad_rows_remove_nothing_and_bad_flags_survive_other_failures(fake_client) -> None:
    tier, _ = make_tier(retry_after_s=60.0)
    k = keys("b")
    assert run(tier, 0, k, [0], promotion=False)
    fake_client.objects[tier.rows.key(offload_key_name(k[0]))] = b"x"
    assert not run(tier, 1, k, [1], promotion=True)  # now flagged bad
    before = dict(fake_client.objects)
    assert not run(tier, 2, k, [99], promotion=False)  # a row out of range: nothing removed
    assert fake_client.objects == before and tier.lookup(k[0], CTX) is LookupResult.MISS
    fake_client.down = True
    assert tier.lookup(keys("other")[0], CTX) is LookupResult.MISS  # starts the back-off
    fake_client.down = False
    assert not run(tier, 3, k, [1], promotion=False)  # fails at once: still bad
    assert tier.lookup(k[0], CTX) is LookupResult.MISS
    tier.shutdown()


def test_shutdown_reports_dropped_jobs_and_misses(fake_client) -> None:
    tier, _ = make_tier()
    gate, started = threading.Event(), threading.Semaphore(0)
    store = tier.rows.store

    def blocked_store(*args, **kwargs):
        started.release()
        gate.wait()
        return store(*args, **kwargs)

    tier.rows.store = blocked_store  # type: ignore[method-assign]
    for job_id in (5, 6, 7):  # two threads take 5 and 6; 7 stays queued
        tier.submit_store(TransferJob(job_id, keys(f"q{job_id}"), np.array([0]), False, CTX))
    assert started.acquire(timeout=10) and started.acquire(timeout=10)
    assert tier.jobs_in_flight == 3
    stopper = threading.Thread(target=tier.shutdown)
    stopper.start()
    wait_until(lambda: tier._closed and not tier._pool._store_q)
    gate.set()  # the running copies finish; the queued one was dropped
    stopper.join(timeout=10)
    results = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert results == {5: True, 6: True, 7: False}
    assert tier.jobs_in_flight == 0 and list(tier.get_finished_jobs()) == []
    assert tier.lookup(keys("q5")[0], CTX) is LookupResult.MISS
    with pytest.raises(RuntimeError, match="shut down"):
        tier.submit_store(TransferJob(8, keys("q8"), np.array([0]), False, CTX))
