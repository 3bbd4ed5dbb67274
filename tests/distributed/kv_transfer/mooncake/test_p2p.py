"""Prefill -> decode transfer through Mooncake's transfer engine between two processes:
byte-exact for every format, into differently numbered pages; faults are failures reported
in bounded time with the consumer's cache untouched."""

from __future__ import annotations

import time

import pytest
from mooncake_harness import FORMATS, assert_loopback_only

pytestmark = pytest.mark.needs_mooncake

BOUND_S = 15.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_to_decode_byte_exact(shared_instances, fmt: str) -> None:
    prefill, decode = shared_instances
    producer = prefill.call("init_p2p", cache=fmt, fmt=fmt, num_blocks=12)
    consumer = decode.call("init_p2p", cache=fmt, fmt=fmt, num_blocks=10)
    # Runs of consecutive pages on both sides and scattered pages.
    src, dst = [3, 4, 5, 9, 0, 11], [6, 7, 8, 1, 9, 2]
    expected = prefill.call("fill", cache=fmt, seed=11, blocks=src)
    decode.call("fill", cache=fmt, seed=12, blocks=list(range(10)))
    untouched = decode.call("digest", cache=fmt, blocks=[0, 3, 4, 5])
    slot = decode.call("expect", cache=fmt, request_id="req-1", producer=producer, blocks=dst)
    prefill.call(
        "send",
        cache=fmt,
        request_id="req-1",
        consumer=consumer,
        slot=slot,
        src_blocks=src,
        dst_blocks=dst,
    )
    sent = prefill.call("wait_p2p", cache=fmt, sent=["req-1"])
    assert sent["sent"] == ["req-1"] and not sent["failed"], sent
    received = decode.call("wait_p2p", cache=fmt, received=["req-1"])
    assert received["received"] == ["req-1"] and not received["failed"], received
    assert decode.call("digest", cache=fmt, blocks=dst) == expected
    assert decode.call("digest", cache=fmt, blocks=[0, 3, 4, 5]) == untouched


def test_no_traffic_leaves_loopback(sandbox, shared_instances) -> None:
    """After transfers, every socket of both instances is on 127.0.0.1 (see the harness)."""
    prefill, decode = shared_instances
    producer = prefill.call("init_p2p", cache="net", fmt="bf16", num_blocks=2)
    consumer = decode.call("init_p2p", cache="net", fmt="bf16", num_blocks=2)
    slot = decode.call("expect", cache="net", request_id="n", producer=producer, blocks=[1])
    prefill.call(
        "send",
        cache="net",
        request_id="n",
        consumer=consumer,
        slot=slot,
        src_blocks=[0],
        dst_blocks=[1],
    )
    assert decode.call("wait_p2p", cache="net", received=["n"])["received"] == ["n"]
    assert_loopback_only(sandbox, [prefill.pid, decode.pid])


def test_format_mismatch_moves_nothing(shared_instances) -> None:
    prefill, decode = shared_instances
    producer = prefill.call("init_p2p", cache="mm-fp8", fmt="fp8", num_blocks=4)
    consumer = decode.call("init_p2p", cache="mm-nvfp4", fmt="nvfp4", num_blocks=4)
    other_rank = decode.call("init_p2p", cache="mm-rank", fmt="fp8", num_blocks=4, tp_rank=1)
    decode.call("fill", cache="mm-nvfp4", seed=5, blocks=[0, 1, 2, 3])
    before = decode.call("digest_all", cache="mm-nvfp4")
    # The consumer refuses a producer of another format ...
    with pytest.raises(Exception, match="producer: its KV-cache format differs"):
        decode.call("expect", cache="mm-nvfp4", request_id="r", producer=producer, blocks=[0])
    # ... and the producer refuses to write into one, before any byte moves.
    for meta, what in ((consumer, "kv_cache_dtype"), (other_rank, "tp_rank")):
        with pytest.raises(Exception, match=f"consumer: its KV-cache format differs.*{what}"):
            prefill.call(
                "send",
                cache="mm-fp8",
                request_id="r",
                consumer=meta,
                slot=0,
                src_blocks=[0],
                dst_blocks=[1],
            )
    with pytest.raises(Exception, match=r"remote_block_ids: block ids must be in \[0, 4\)"):
        same = decode.call("init_p2p", cache="mm-fp8b", fmt="fp8", num_blocks=4)
        prefill.call(
            "send",
            cache="mm-fp8",
            request_id="r",
            consumer=same,
            slot=0,
            src_blocks=[0],
            dst_blocks=[7],
        )
    assert decode.call("digest_all", cache="mm-nvfp4") == before


def test_bad_requests_are_clear_errors(shared_instances) -> None:
    prefill, decode = shared_instances
    producer = prefill.call("init_p2p", cache="bad", fmt="bf16", num_blocks=4)
    consumer = decode.call("init_p2p", cache="bad", fmt="bf16", num_blocks=4)
    send = {"cache": "bad", "request_id": "r", "consumer": consumer, "slot": 0}
    with pytest.raises(Exception, match="remote_block_ids: expected 2 ids"):
        prefill.call("send", **send, src_blocks=[0, 1], dst_blocks=[2])
    with pytest.raises(Exception, match="slot: expected 0..255, got 256"):
        prefill.call("send", **{**send, "slot": 256}, src_blocks=[0], dst_blocks=[2])
    with pytest.raises(Exception, match=r"local_block_ids: block ids must be in \[0, 4\)"):
        prefill.call("send", **send, src_blocks=[-1], dst_blocks=[2])
    with pytest.raises(Exception, match="peer metadata: malformed JSON"):
        prefill.call("send", **{**send, "consumer": "{}"}, src_blocks=[0], dst_blocks=[2])
    decode.call("expect", cache="bad", request_id="dup", producer=producer, blocks=[1])
    with pytest.raises(Exception, match="request_id: 'dup' is already expected"):
        decode.call("expect", cache="bad", request_id="dup", producer=producer, blocks=[1])


def test_dead_producer_is_a_failure_in_bounded_time(spawn) -> None:
    prefill, decode = spawn("prefill"), spawn("decode")
    producer = prefill.call("init_p2p", cache="c", fmt="bf16", num_blocks=4)
    decode.call("init_p2p", cache="c", fmt="bf16", num_blocks=4, timeout_s=2.0)
    decode.call("fill", cache="c", seed=1, blocks=[0, 1, 2, 3])
    before = decode.call("digest_all", cache="c")
    decode.call("expect", cache="c", request_id="lost", producer=producer, blocks=[2, 3])
    prefill.kill()
    start = time.monotonic()
    result = decode.call("wait_p2p", cache="c", received=["lost"])
    assert time.monotonic() - start < BOUND_S
    assert result["received"] == []
    assert "no completion from producer" in result["failed"]["lost"]
    assert result["failed_blocks"] == [2, 3]
    assert decode.call("digest_all", cache="c") == before


def test_dead_consumer_is_a_send_failure_in_bounded_time(spawn) -> None:
    prefill, decode = spawn("prefill"), spawn("decode")
    prefill.call("init_p2p", cache="c", fmt="bf16", num_blocks=4)
    consumer = decode.call("init_p2p", cache="c", fmt="bf16", num_blocks=4)
    prefill.call("fill", cache="c", seed=1, blocks=[0, 1])
    decode.kill()
    start = time.monotonic()
    prefill.call(
        "send",
        cache="c",
        request_id="orphan",
        consumer=consumer,
        slot=0,
        src_blocks=[0, 1],
        dst_blocks=[0, 1],
    )
    result = prefill.call("wait_p2p", cache="c", sent=["orphan"])
    assert time.monotonic() - start < BOUND_S
    assert result["sent"] == []
    assert "failed with code" in result["failed"]["orphan"]
