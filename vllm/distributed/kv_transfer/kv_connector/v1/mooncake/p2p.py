"""Prefill -> decode transfer of KV pages with Mooncake's transfer engine (worker side).

Shape of upstream's Mooncake connector, worker side: both instances register their KV caches
(:meth:`MooncakeP2PConnectorWorker.register_kv_caches`) and publish an
:class:`P2PAgentMetadata` (transfer-engine session, buffer addresses, page format, a mailbox).
The decode (consumer) side announces a request with ``expect_request`` (its allocated block
ids and the producer's metadata) and gets a mailbox slot; the prefill (producer) side, once
the prefill is done, calls ``send_blocks`` with the consumer's metadata, the slot and the
consumer's block ids: it writes its pages into the consumer's pages by block id, then a
completion record into the consumer's mailbox slot. ``get_finished`` reports finished sends
and receives; failures (peer unreachable, transfer error, no record within ``timeout_s``, a
record from a different format) are reported by ``get_failed`` and
``get_block_ids_with_load_errors`` (the engine recomputes those blocks).

Both sides check that their page formats are identical (:class:`KVPageFormat`: model, specs,
dtype string, scale layouts and values, TP rank, page sizes) before any byte moves: the consumer
when it accepts a producer, the producer before it writes, and the consumer again on the
record, which carries the producer's format digest. Writes are one-sided: after a receive
failed by timeout, a producer that was only slow may still write those pages later, so the
engine must treat the failed blocks as dirty until it recomputes them (their mailbox slot is
retired for the same reason). Metadata travels as JSON text through the
engine's own request channel (``kv_transfer_params`` upstream); no extra transport.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.config import (
    MooncakeConfig,
    import_mooncake,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.page_format import KVPageFormat
from vllm.v1.kv_offload.worker.page_views import (
    KVCachePageView,
    LayerKVCache,
    build_kv_cache_page_views,
)
from vllm.v1.kv_offload.worker.transfer_stream import ThreadTransferStream, TransferEvent

RECORD_MAGIC = b"VKVDONE1"
_RECORD = struct.Struct("<8s32s32sQ")
"""magic, SHA-256 of the request id, producer's format digest, number of blocks; then crc32."""
RECORD_BYTES = 128
"""Bytes of one mailbox slot."""


def _request_digest(request_id: str) -> bytes:
    return hashlib.sha256(request_id.encode()).digest()


def _encode_record(request_id: str, page_format: KVPageFormat, num_blocks: int) -> bytes:
    body = _RECORD.pack(RECORD_MAGIC, _request_digest(request_id), page_format.digest, num_blocks)
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(RECORD_BYTES, b"\0")


@dataclass(frozen=True)
class P2PAgentMetadata:
    """What a peer needs to write into (or accept pages from) this worker.

    ``session``: the transfer engine's ``host:port``. ``buffer_addrs``: address of page 0 of
    each KV-cache buffer (``kv_cache_tensors`` order); ``num_blocks``: pages per buffer.
    ``mailbox_addr``: ``mailbox_slots`` completion slots of :data:`RECORD_BYTES` bytes.
    ``page_format``: :meth:`KVPageFormat.to_json` of the cache.
    """

    engine_id: str
    session: str
    buffer_addrs: tuple[int, ...]
    num_blocks: int
    mailbox_addr: int
    mailbox_slots: int
    page_format: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> P2PAgentMetadata:
        """Parse :meth:`to_json` output; ``ValueError`` for malformed text."""
        try:
            data = json.loads(text)
            data["buffer_addrs"] = tuple(int(a) for a in data["buffer_addrs"])
            return cls(**data)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"peer metadata: malformed JSON ({e!r})") from e

    @property
    def format(self) -> KVPageFormat:
        return KVPageFormat.from_json(self.page_format)


@dataclass
class _Expected:
    producer: str
    block_ids: tuple[int, ...]
    slot: int
    deadline: float


@dataclass
class _Sending:
    event: TransferEvent
    block_ids: tuple[int, ...]


def _runs(
    src: np.ndarray, dst: np.ndarray, page_size: int, src_base: int, dst_base: int
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) of the page copies ``src[i] ->
    dst[i]``, consecutive pages on both sides merged into one run."""
    srcs: list[int] = []
    dsts: list[int] = []
    lengths: list[int] = []
    i = 0
    while i < len(src):
        j = i + 1
        while j < len(src) and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        srcs.append(src_base + int(src[i]) * page_size)
        dsts.append(dst_base + int(dst[i]) * page_size)
        lengths.append((j - i) * page_size)
        i = j
    return srcs, dsts, lengths


class MooncakeP2PConnectorWorker:
    """Worker side of prefill -> decode KV transfer over ``mooncake.engine.TransferEngine``.

    ``format_options``: the keyword arguments of :meth:`KVPageFormat.from_kv_cache_config`
    besides the config (``model`` required; ``kv_cache_dtype``, ``tp_rank``,
    ``scale_layouts``, ``kv_scales``). ``mailbox_slots``: requests this worker can receive at
    once. ``config.timeout_s`` bounds the wait for a completion record.
    """

    def __init__(
        self,
        config: MooncakeConfig,
        engine_id: str,
        format_options: Mapping[str, Any],
        mailbox_slots: int = 256,
    ):
        self.config = config
        self.engine_id = engine_id
        self.format_options = dict(format_options)
        self.mailbox_slots = mailbox_slots
        self._engine: Any = None
        self.page_views: list[KVCachePageView] = []
        self.page_format: KVPageFormat | None = None
        self._expected: dict[str, _Expected] = {}
        self._free_slots = list(range(mailbox_slots - 1, -1, -1))
        self._sending: dict[str, _Sending] = {}
        self._finished_recv: set[str] = set()
        self._failed: dict[str, str] = {}
        self._failed_blocks: set[int] = set()
        self._stream = ThreadTransferStream("kv-p2p-send")

    # ------------------------------------------------------------------ registration

    def register_kv_caches(
        self, kv_caches: Mapping[str, LayerKVCache], kv_cache_config: KVCacheConfig
    ) -> None:
        """Register the KV cache (and the mailbox) with a new transfer engine."""
        if self._engine is not None:
            raise RuntimeError("register_kv_caches: the KV cache is already registered")
        self.page_views = build_kv_cache_page_views(kv_caches, kv_cache_config)
        self.page_format = KVPageFormat.from_kv_cache_config(kv_cache_config, **self.format_options)
        engine_module = import_mooncake("engine")
        self.config.apply_environment()
        engine = engine_module.TransferEngine()
        code = engine.initialize(
            self.config.local_hostname,
            self.config.metadata_server,
            self.config.protocol,
            self.config.device_name,
        )
        if code != 0:
            raise RuntimeError(f"mooncake transfer engine: initialize failed with code {code}")
        self.mailbox = torch.zeros((self.mailbox_slots, RECORD_BYTES), dtype=torch.uint8)
        self._records = torch.zeros((self.mailbox_slots, RECORD_BYTES), dtype=torch.uint8)
        for tensor in [view.pages for view in self.page_views] + [self.mailbox, self._records]:
            code = engine.register_memory(tensor.data_ptr(), tensor.numel())
            if code != 0:
                raise RuntimeError(f"mooncake transfer engine: register_memory failed ({code})")
        self._engine = engine
        self._session = f"{self.config.local_hostname}:{engine.get_rpc_port()}"
        self._next_record = 0

    def metadata(self) -> P2PAgentMetadata:
        """This worker's metadata for its peers."""
        if self.page_format is None:
            raise RuntimeError("metadata: register the KV cache first")
        return P2PAgentMetadata(
            engine_id=self.engine_id,
            session=self._session,
            buffer_addrs=tuple(view.pages.data_ptr() for view in self.page_views),
            num_blocks=min(view.num_blocks for view in self.page_views),
            mailbox_addr=self.mailbox.data_ptr(),
            mailbox_slots=self.mailbox_slots,
            page_format=self.page_format.to_json(),
        )

    def _check_peer(self, peer: P2PAgentMetadata, role: str) -> None:
        assert self.page_format is not None
        difference = self.page_format.describe_difference(peer.format)
        if difference is not None:
            raise ValueError(
                f"{role}: its KV-cache format differs from this worker's, nothing is "
                f"transferred ({difference})"
            )
        if len(peer.buffer_addrs) != len(self.page_views):
            raise ValueError(
                f"{role}: expected {len(self.page_views)} buffer addresses, got "
                f"{len(peer.buffer_addrs)}"
            )

    def _check_ids(self, name: str, ids: Sequence[int], num_blocks: int) -> np.ndarray:
        array = np.asarray(list(ids), dtype=np.int64)
        bad = array[(array < 0) | (array >= num_blocks)]
        if bad.size:
            raise ValueError(f"{name}: block ids must be in [0, {num_blocks}), got {bad.tolist()}")
        return array

    # ------------------------------------------------------------------ consumer (decode)

    def expect_request(
        self, request_id: str, producer: P2PAgentMetadata, block_ids: Sequence[int]
    ) -> int:
        """Accept the pages of ``request_id`` from ``producer`` into ``block_ids``; returns
        the mailbox slot the producer must name. ``ValueError`` when the formats differ."""
        self._check_peer(producer, "producer")
        ids = self._check_ids("block_ids", block_ids, self.metadata().num_blocks)
        if request_id in self._expected:
            raise ValueError(f"request_id: {request_id!r} is already expected")
        if not self._free_slots:
            raise RuntimeError(f"expect_request: all {self.mailbox_slots} mailbox slots are in use")
        slot = self._free_slots.pop()
        self.mailbox[slot].zero_()
        self._expected[request_id] = _Expected(
            producer=producer.engine_id,
            block_ids=tuple(int(i) for i in ids),
            slot=slot,
            deadline=time.monotonic() + self.config.timeout_s,
        )
        return slot

    def _poll_receives(self) -> None:
        assert self.page_format is not None
        now = time.monotonic()
        for request_id, expected in list(self._expected.items()):
            raw = self.mailbox[expected.slot].numpy().tobytes()
            failure = None
            done = False
            body = raw[: _RECORD.size]
            (crc,) = struct.unpack_from("<I", raw, _RECORD.size)
            record_seen = body[:8] == RECORD_MAGIC and zlib.crc32(body) == crc
            if record_seen:
                _, req, producer_digest, count = _RECORD.unpack(body)
                if req != _request_digest(request_id):
                    failure = "the completion record names another request"
                elif producer_digest != self.page_format.digest:
                    failure = "the producer's pages are of another KV-cache format"
                elif count != len(expected.block_ids):
                    failure = (
                        f"the producer sent {count} blocks, {len(expected.block_ids)} expected"
                    )
                else:
                    done = True
            elif now > expected.deadline:
                failure = (
                    f"no completion from producer {expected.producer} within "
                    f"{self.config.timeout_s} s (dead or unreachable)"
                )
            if done or failure is not None:
                del self._expected[request_id]
                if done or record_seen:
                    # A slot whose producer never answered stays out of use: a late record
                    # must not be read as the answer for a later request.
                    self._free_slots.append(expected.slot)
                if done:
                    self._finished_recv.add(request_id)
                else:
                    self._failed[request_id] = f"receive of {request_id!r}: {failure}"
                    self._failed_blocks.update(expected.block_ids)

    # ------------------------------------------------------------------ producer (prefill)

    def send_blocks(
        self,
        request_id: str,
        consumer: P2PAgentMetadata,
        slot: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
    ) -> None:
        """Write pages ``local_block_ids`` into the consumer's ``remote_block_ids`` (every
        buffer), then the completion record into its mailbox ``slot``; returns at once.

        Everything is validated before any byte moves (``ValueError``): identical formats,
        block ids in range on both sides, equal counts, the slot in range.
        """
        if self.page_format is None:
            raise RuntimeError("send_blocks: register the KV cache first")
        self._check_peer(consumer, "consumer")
        src = self._check_ids("local_block_ids", local_block_ids, self.metadata().num_blocks)
        dst = self._check_ids("remote_block_ids", remote_block_ids, consumer.num_blocks)
        if src.size != dst.size:
            raise ValueError(
                f"remote_block_ids: expected {src.size} ids (one per local block), got {dst.size}"
            )
        if not 0 <= slot < consumer.mailbox_slots:
            raise ValueError(f"slot: expected 0..{consumer.mailbox_slots - 1}, got {slot}")
        if request_id in self._sending:
            raise ValueError(f"request_id: {request_id!r} is already being sent")
        if len(self._sending) >= self.mailbox_slots:
            # One staging row per send in flight holds its completion record.
            raise RuntimeError(
                f"send_blocks: {len(self._sending)} sends in flight, at most "
                f"{self.mailbox_slots}; call get_finished first"
            )
        srcs: list[int] = []
        dsts: list[int] = []
        lengths: list[int] = []
        for view, remote_base in zip(self.page_views, consumer.buffer_addrs, strict=True):
            s, d, n = _runs(src, dst, view.page_size_bytes, view.pages.data_ptr(), remote_base)
            srcs += s
            dsts += d
            lengths += n
        record_row = self._records[self._next_record % self.mailbox_slots]
        self._next_record += 1
        record = _encode_record(request_id, self.page_format, int(src.size))
        engine, session = self._engine, consumer.session
        record_dst = consumer.mailbox_addr + slot * RECORD_BYTES

        def transfer() -> None:
            if srcs:
                code = engine.batch_transfer_sync_write(session, srcs, dsts, lengths)
                if code != 0:
                    raise RuntimeError(f"page transfer to {session} failed with code {code}")
            record_row.copy_(torch.frombuffer(bytearray(record), dtype=torch.uint8))
            code = engine.transfer_sync_write(
                session, record_row.data_ptr(), record_dst, RECORD_BYTES
            )
            if code != 0:
                raise RuntimeError(f"completion record to {session} failed with code {code}")

        event = self._stream.submit(transfer, False)
        self._sending[request_id] = _Sending(event, tuple(int(i) for i in src))

    # ------------------------------------------------------------------ completion

    def get_finished(
        self, finished_req_ids: Iterable[str] = ()
    ) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose pages were sent, requests whose pages arrived) since the last
        call; ``None`` for an empty set, as upstream. Failed ones go to :meth:`get_failed`."""
        sent: set[str] = set()
        for request_id, sending in list(self._sending.items()):
            if sending.event.query():
                del self._sending[request_id]
                if sending.event.error is None:
                    sent.add(request_id)
                else:
                    self._failed[request_id] = f"send of {request_id!r}: {sending.event.error}"
        self._poll_receives()
        received, self._finished_recv = self._finished_recv, set()
        return sent or None, received or None

    def get_failed(self) -> dict[str, str]:
        """Requests that failed since the last call, with the reason (each reported once)."""
        failed, self._failed = self._failed, {}
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Consumer block ids whose receive failed since the last call (recompute them)."""
        blocks, self._failed_blocks = self._failed_blocks, set()
        return blocks

    def shutdown(self) -> None:
        """Wait for sends in flight (each bounded by the engine's own timeouts) and stop."""
        for sending in list(self._sending.values()):
            sending.event.synchronize()
        self._stream.close()
