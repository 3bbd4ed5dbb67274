"""Message validation errors that upstream's tests do not pin (bools are not ints, exact
messages)."""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.tiering.p2p.session.protocol import (
    TYPE_KEY,
    AbortAckMsg,
    AbortFetchMsg,
    ConnectAckMsg,
    ConnectMsg,
    FetchMsg,
    LookupMsg,
    LookupRespMsg,
    TransferDoneMsg,
)


def _connect_msg(**overrides) -> dict:
    msg = {
        TYPE_KEY: ConnectMsg.TYPE,
        ConnectMsg.PEER_ID: "peer:1",
        ConnectMsg.AGENT_METADATA: b"meta",
        ConnectMsg.BASE_ADDR: 0,
        ConnectMsg.NUM_BLOCKS: 4,
        ConnectMsg.BLOCK_LEN: 64,
        ConnectMsg.HASH_SEED: "0",
    }
    msg.update(overrides)
    return msg


@pytest.mark.parametrize(
    ("validate", "msg", "pattern"),
    [
        (ConnectMsg.validate, _connect_msg(num_blocks=True), "num_blocks: expected positive"),
        (ConnectMsg.validate, _connect_msg(base_addr=-1), "base_addr: expected non-negative"),
        (ConnectMsg.validate, _connect_msg(peer_id=7), "peer_id: expected str, got int"),
        (ConnectAckMsg.validate, {}, "peer_id: expected str, got NoneType"),
        (
            FetchMsg.validate,
            {"kv_request_id": "r", "round_seq": 0, "keys": [b"k"], "block_indexes": [True]},
            "block_indexes: invalid index True",
        ),
        (
            FetchMsg.validate,
            {"kv_request_id": "r", "round_seq": 0, "keys": (), "block_indexes": []},
            "keys: expected list, got tuple",
        ),
        (LookupMsg.validate, {"kv_request_id": "r", "keys": []}, "round_seq: expected non-neg"),
        (
            LookupRespMsg.validate,
            {"kv_request_id": "r", "keys": [b"k"], "hits": [1]},
            "hits: invalid value 1",
        ),
        (
            LookupRespMsg.validate,
            {"kv_request_id": "r", "keys": [b"k"], "hits": []},
            "keys/hits length mismatch: 1 vs 0",
        ),
        (
            TransferDoneMsg.validate,
            {"kv_request_id": "r", "success": True, "round_seq": -1},
            "round_seq: expected non-negative int, got -1",
        ),
        (AbortFetchMsg.validate, {"kv_request_id": b"r", "round_seq": 0}, "kv_request_id"),
        (AbortAckMsg.validate, {"kv_request_id": "r", "round_seq": "0"}, "round_seq"),
    ],
)
def test_validate_rejects(validate, msg, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate(msg)
