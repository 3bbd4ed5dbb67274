"""Two P2P tier managers on this host, with their real control plane (ZeroMQ over TCP
loopback) and data plane (NIXL, UCX in host memory): a PD decoder loads a request's blocks
from the prefiller that stored them, byte for byte."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

from vllm.v1.kv_offload.base import LookupResult, OffloadKey, OffloadPolicy, ReqContext
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.p2p import manager as manager_module
from vllm.v1.kv_offload.tiering.p2p.data import nixl as nixl_module
from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

pytestmark = pytest.mark.skipif(
    nixl_module._NixlAgent is None, reason="NIXL's Python package is not installed"
)

_NUM_BLOCKS = 8
_BLOCK_LEN = 512


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spec() -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(parallel=SimpleNamespace(data_parallel_index=0)),
        blocks_per_chunk=1,
    )


@pytest.fixture
def managers(monkeypatch) -> Iterator[tuple[P2PSecondaryTierManager, ...]]:
    # The run config (the compatibility fingerprint) comes from a real spec's file mapper;
    # both sides share this one.
    monkeypatch.setattr(
        manager_module.FileMapper,
        "from_offloading_spec",
        lambda **_: SimpleNamespace(get_run_config=lambda: {"model": "test"}),
    )
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    prefiller_rows = (np.arange(_NUM_BLOCKS * _BLOCK_LEN) % 251).astype(np.uint8)
    prefiller_view = prefiller_rows.reshape(_NUM_BLOCKS, _BLOCK_LEN)
    decoder_view = np.zeros((_NUM_BLOCKS, _BLOCK_LEN), dtype=np.uint8)
    built = []
    try:
        for view in (prefiller_view, decoder_view):
            built.append(
                P2PSecondaryTierManager(
                    _spec(),
                    memoryview(view),
                    host="127.0.0.1",
                    port=_free_port(),
                    num_threads=0,
                )
            )
        yield built[0], built[1], prefiller_view, decoder_view
    finally:
        for mgr in built:
            mgr.shutdown()


def _ctx(kv_params: dict) -> ReqContext:
    return ReqContext(req_id="req", kv_transfer_params=kv_params)


def _job(job_id: int, keys: list[OffloadKey], chunk_ids: list[int], ctx: ReqContext):
    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.array(chunk_ids),
        is_promotion=False,
        req_context=ctx,
    )


def _pump(*managers: P2PSecondaryTierManager, until, timeout_s: float = 20.0) -> list:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for mgr in managers:
            results.extend((mgr, r) for r in mgr.get_finished_jobs())
        if until(results):
            return results
        time.sleep(0.002)
    raise AssertionError(f"timed out; results so far: {results}")


def test_pd_decoder_loads_the_prefillers_blocks(managers):
    prefiller, decoder, prefiller_view, decoder_view = managers
    keys = [OffloadKey(b"k0"), OffloadKey(b"k1"), OffloadKey(b"k2")]

    producer_ctx = _ctx({"remote_decoder": {"kv_request_id": "kv-1"}})
    assert prefiller.on_new_request(producer_ctx).policy is OffloadPolicy.REQUEST_LEVEL
    prefiller.submit_store(_job(1, keys, [5, 2, 7], producer_ctx))

    host, port = prefiller._local_id.rsplit(":", 1)
    consumer_ctx = _ctx(
        {
            "remote_prefiller": {
                "kv_request_id": "kv-1",
                "remote_host": host,
                "remote_port": int(port),
            }
        }
    )
    decoder.on_new_request(consumer_ctx)
    assert decoder.lookup(keys[0], consumer_ctx) is LookupResult.HIT
    decoder.submit_load(_job(2, keys, [0, 1, 3], consumer_ctx))

    def both_done(results):
        return {r.job_id for _, r in results} >= {1, 2}

    results = _pump(prefiller, decoder, until=both_done)
    assert (prefiller, JobResult(job_id=1, success=True)) in results
    assert (decoder, JobResult(job_id=2, success=True)) in results
    np.testing.assert_array_equal(decoder_view[0], prefiller_view[5])
    np.testing.assert_array_equal(decoder_view[1], prefiller_view[2])
    np.testing.assert_array_equal(decoder_view[3], prefiller_view[7])
    assert not decoder_view[[2, 4, 5, 6, 7]].any()

    decoder.on_request_finished(consumer_ctx)
    prefiller.on_request_finished(producer_ctx)
    assert "kv-1" not in prefiller._kv_to_session
