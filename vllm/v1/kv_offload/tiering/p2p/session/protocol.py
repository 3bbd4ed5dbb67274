"""Wire protocol between two P2P sessions (one per peer pair, both roles on each side).

Every message is a msgpack-encoded dict whose :data:`TYPE_KEY` entry names its kind; the
classes below hold each kind's type string, field names and a ``validate`` that raises
``ValueError`` (``<field>: expected X, got Y``) on a malformed message.

Handshake: each side sends :class:`ConnectMsg` (data-plane metadata, block geometry, config
fingerprint, hash seed) as soon as it holds a connection. The receiver checks it, registers
the peer's memory with its data transport, and only then answers :class:`ConnectAckMsg`; a
side queues everything else until it holds the peer's ack.

Loads: the requester sends :class:`FetchMsg` (block keys and the requester's block indexes
to write into). The serving side writes blocks it holds at once and the others when they are
stored, then answers :class:`TransferDoneMsg`. A requester that waits too long sends
:class:`AbortFetchMsg`; the server stops the round and answers :class:`AbortAckMsg` once no
write can still land.

Symmetric P2P: a consumer first probes with :class:`LookupMsg` and gets one
:class:`LookupRespMsg` per probe (a hit pins the block on the producer). Each request runs
numbered rounds (``round_seq``): probes, the fetch that closes the round, and its completion
all carry it. An empty FetchMsg (no keys) tells the producer the request is finished.

:class:`DisconnectMsg` ends a session from either side.
"""

from __future__ import annotations

TYPE_KEY = "type"


def _require(msg: dict, key: str, typ: type) -> None:
    """``msg[key]`` must be an instance of ``typ``."""
    val = msg.get(key)
    if not isinstance(val, typ):
        raise ValueError(f"{key}: expected {typ.__name__}, got {type(val).__name__}")


def _require_int(msg: dict, key: str, minimum: int) -> None:
    """``msg[key]`` must be an int (not a bool) of at least ``minimum``."""
    val = msg.get(key)
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        kind = "positive" if minimum > 0 else "non-negative"
        raise ValueError(f"{key}: expected {kind} int, got {val!r}")


class ConnectMsg:
    """Handshake, sent by each side: who it is and what its KV region looks like.

    ``agent_metadata`` (bytes) is the data plane's opaque peer description, ``base_addr``
    the region's address, ``num_blocks`` its size in blocks, ``block_len`` a block's size in
    bytes (must equal the receiver's). ``config_fingerprint`` (optional) identifies the model
    configuration; ``hash_seed`` the prefix-cache hash seed (PYTHONHASHSEED or the default):
    peers that hash differently must not exchange blocks.
    """

    TYPE = "connect"
    PEER_ID = "peer_id"
    AGENT_METADATA = "agent_metadata"
    BASE_ADDR = "base_addr"
    NUM_BLOCKS = "num_blocks"
    BLOCK_LEN = "block_len"
    CONFIG_FINGERPRINT = "config_fingerprint"
    HASH_SEED = "hash_seed"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, ConnectMsg.PEER_ID, str)
        _require(msg, ConnectMsg.AGENT_METADATA, bytes)
        _require_int(msg, ConnectMsg.BASE_ADDR, 0)
        _require_int(msg, ConnectMsg.NUM_BLOCKS, 1)
        _require_int(msg, ConnectMsg.BLOCK_LEN, 1)
        _require(msg, ConnectMsg.HASH_SEED, str)


class ConnectAckMsg:
    """Handshake answer: the peer's ConnectMsg was accepted and its memory registered."""

    TYPE = "connect_ack"
    PEER_ID = "peer_id"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, ConnectAckMsg.PEER_ID, str)


class DisconnectMsg:
    """The sender is closing the session; no fields."""

    TYPE = "disconnect"


class FetchMsg:
    """Request to write ``keys[i]`` into the sender's block ``block_indexes[i]``.

    Closes lookup round ``round_seq``. With no keys it is the terminal "request finished"
    signal for ``kv_request_id``.
    """

    TYPE = "fetch"
    KV_REQUEST_ID = "kv_request_id"
    KEYS = "keys"
    BLOCK_INDEXES = "block_indexes"
    ROUND_SEQ = "round_seq"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, FetchMsg.KV_REQUEST_ID, str)
        _require_int(msg, FetchMsg.ROUND_SEQ, 0)
        _require(msg, FetchMsg.KEYS, list)
        _require(msg, FetchMsg.BLOCK_INDEXES, list)
        keys, indexes = msg[FetchMsg.KEYS], msg[FetchMsg.BLOCK_INDEXES]
        if len(keys) != len(indexes):
            raise ValueError(f"keys/block_indexes length mismatch: {len(keys)} vs {len(indexes)}")
        for idx in indexes:
            if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0:
                raise ValueError(f"block_indexes: invalid index {idx!r}")


class LookupMsg:
    """Probe: which of ``keys`` does the receiver hold? Hits are pinned for ``round_seq``."""

    TYPE = "lookup"
    KV_REQUEST_ID = "kv_request_id"
    KEYS = "keys"
    ROUND_SEQ = "round_seq"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, LookupMsg.KV_REQUEST_ID, str)
        _require(msg, LookupMsg.KEYS, list)
        _require_int(msg, LookupMsg.ROUND_SEQ, 0)


class LookupRespMsg:
    """Answer to a LookupMsg: ``hits[i]`` (bool) says whether ``keys[i]`` is held."""

    TYPE = "lookup_resp"
    KV_REQUEST_ID = "kv_request_id"
    KEYS = "keys"
    HITS = "hits"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, LookupRespMsg.KV_REQUEST_ID, str)
        _require(msg, LookupRespMsg.KEYS, list)
        _require(msg, LookupRespMsg.HITS, list)
        keys, hits = msg[LookupRespMsg.KEYS], msg[LookupRespMsg.HITS]
        if len(keys) != len(hits):
            raise ValueError(f"keys/hits length mismatch: {len(keys)} vs {len(hits)}")
        for hit in hits:
            if not isinstance(hit, bool):
                raise ValueError(f"hits: invalid value {hit!r}")


class TransferDoneMsg:
    """Round ``round_seq`` of ``kv_request_id`` finished; ``success`` says whether every
    demanded block was written."""

    TYPE = "transfer_done"
    KV_REQUEST_ID = "kv_request_id"
    SUCCESS = "success"
    ROUND_SEQ = "round_seq"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, TransferDoneMsg.KV_REQUEST_ID, str)
        _require(msg, TransferDoneMsg.SUCCESS, bool)
        _require_int(msg, TransferDoneMsg.ROUND_SEQ, 0)


class AbortFetchMsg:
    """Cancel round ``round_seq`` of ``kv_request_id``."""

    TYPE = "abort_fetch"
    KV_REQUEST_ID = "kv_request_id"
    ROUND_SEQ = "round_seq"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, AbortFetchMsg.KV_REQUEST_ID, str)
        _require_int(msg, AbortFetchMsg.ROUND_SEQ, 0)


class AbortAckMsg:
    """The aborted round can no longer write into the requester's blocks."""

    TYPE = "abort_ack"
    KV_REQUEST_ID = "kv_request_id"
    ROUND_SEQ = "round_seq"

    @staticmethod
    def validate(msg: dict) -> None:
        _require(msg, AbortAckMsg.KV_REQUEST_ID, str)
        _require_int(msg, AbortAckMsg.ROUND_SEQ, 0)
