"""GPU <-> Mooncake-store transfer handlers: offloaded blocks shared across engine instances.

An offloaded block (``block_size_factor`` GPU pages of every KV-cache buffer, buffer by
buffer) is one store object, put straight from the cache pages and read straight into them
(zero-copy: the cache memory is registered with the store). Beside it lives a small header
object (:meth:`~vllm.v1.kv_offload.page_format.KVPageFormat.header`: format digest, block
bytes, page sizes). Keys: ``<prefix>/<format fingerprint>/<block hash hex>`` and the same with
``.hdr``.

A load writes nothing into the cache unless, for every block of the job, the header matches
this worker's format exactly and the data object's size is exactly the block size; only then
are the data objects read into the destination pages. A put writes the data first and the
header second, so a reader never trusts a block whose data is not complete. Failures are
reported, never hidden: a missing or evicted block fails the load job with :class:`StoreMiss`
(the engine recomputes those tokens), a foreign header with ``ValueError``, a store that
cannot be reached with :class:`MooncakeStoreError`. A failure found by those checks leaves the
cache untouched. A block that vanishes after them (its holder died between the check and the
read) fails the load too; the reads are zero-copy, so that job's own destination pages may then
hold part of the data. They are reported unwritten (the engine recomputes them); no other page
is ever written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
    OBJECT_NOT_FOUND,
    MooncakeStoreClient,
    MooncakeStoreError,
)
from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec, TransferSpec
from vllm.v1.kv_offload.page_format import KVPageFormat
from vllm.v1.kv_offload.worker.page_views import KVCachePageView
from vllm.v1.kv_offload.worker.transfer_stream import (
    StreamOffloadingHandler,
    ThreadTransferStream,
    TransferStream,
)

BlockHash = bytes | int
"""A block's content hash (upstream's ``BlockHash`` is ``bytes``; ints are accepted too)."""


def block_hash_hex(block_hash: BlockHash) -> str:
    """The hash as hex text, for keys (``ValueError`` for other types)."""
    if isinstance(block_hash, (bytes, bytearray)):
        if not block_hash:
            raise ValueError("block_hashes: expected non-empty bytes, got b''")
        return bytes(block_hash).hex()
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return format(block_hash, "x")
    raise ValueError(f"block_hashes: expected bytes or int hashes, got {type(block_hash).__name__}")


class MooncakeLoadStoreSpec(LoadStoreSpec):
    """Offloaded blocks in a Mooncake distributed store, addressed by block hash.

    The key of a block is its hash plus the fingerprint of the page format
    (:class:`~vllm.v1.kv_offload.page_format.KVPageFormat`), so blocks of another model,
    format or geometry never match.
    """

    def __init__(self, block_hashes: Iterable[BlockHash]):
        self.block_hashes: tuple[BlockHash, ...] = tuple(block_hashes)
        self.hash_hex: tuple[str, ...] = tuple(block_hash_hex(h) for h in self.block_hashes)

    @staticmethod
    def medium() -> str:
        return "MOONCAKE"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_hashes={list(self.hash_hex)})"


DEFAULT_KEY_PREFIX = "vllm-kv"
"""First component of every store key."""


class StoreMiss(LookupError):
    """Blocks of a load are not (or no longer) in the store: recompute them."""


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


class MooncakeStorePages:
    """A worker's KV cache registered with a Mooncake store: whole offloaded blocks in and out.

    ``page_views`` are the worker's buffers (:func:`build_kv_cache_page_views`), ``page_format``
    describes them (its ``page_sizes_bytes`` must be the views' page sizes).
    ``max_blocks_per_batch`` bounds the blocks of one store call (and the registered header
    staging buffer, ``max_blocks_per_batch × header_bytes``).
    """

    def __init__(
        self,
        client: MooncakeStoreClient,
        page_views: Sequence[KVCachePageView],
        page_format: KVPageFormat,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        max_blocks_per_batch: int = 256,
    ):
        sizes = tuple(view.page_size_bytes for view in page_views)
        if sizes != page_format.page_sizes_bytes:
            raise ValueError(
                f"page_format: expected the page sizes of the registered buffers {list(sizes)}, "
                f"got {list(page_format.page_sizes_bytes)}"
            )
        if not key_prefix or "/" in key_prefix:
            raise ValueError(
                f"key_prefix: expected a non-empty name without '/', got {key_prefix!r}"
            )
        self.client = client
        self.page_views = list(page_views)
        self.page_format = page_format
        self.key_prefix = key_prefix
        self.max_blocks_per_batch = check_positive_int("max_blocks_per_batch", max_blocks_per_batch)
        self.num_gpu_blocks = min(view.num_blocks for view in self.page_views)
        self.device = self.page_views[0].pages.device
        for view in self.page_views:
            client.register(view.pages)
        header = page_format.header()
        self._header = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._header_staging = torch.zeros(
            max_blocks_per_batch * len(header), dtype=torch.uint8
        ).view(max_blocks_per_batch, len(header))
        client.register(self._header)
        client.register(self._header_staging)
        self._users = 0

    def acquire(self) -> None:
        """One more user (a handler) of the client."""
        self._users += 1

    def release(self) -> None:
        """One user fewer; the last one disconnects the client from the store."""
        self._users -= 1
        if self._users <= 0:
            self.client.close()

    def data_key(self, hash_hex: str) -> str:
        """Store key of a block's data."""
        return f"{self.key_prefix}/{self.page_format.fingerprint}/{hash_hex}"

    def header_key(self, hash_hex: str) -> str:
        """Store key of a block's header."""
        return self.data_key(hash_hex) + ".hdr"

    def _block_buffers(self, gpu_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Addresses and sizes of one block's pages: every buffer, its pages in order."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for view in self.page_views:
            base, size = view.pages.data_ptr(), view.page_size_bytes
            for page in gpu_ids:
                ptrs.append(base + page * size)
                sizes.append(size)
        return ptrs, sizes

    def check_job(self, hash_hex: Sequence[str], gpu_block_ids: np.ndarray) -> np.ndarray:
        factor = self.page_format.block_size_factor
        if gpu_block_ids.size != len(hash_hex) * factor:
            raise ValueError(
                f"spec: {len(hash_hex)} store blocks of {factor} pages need "
                f"{len(hash_hex) * factor} GPU block ids, got {gpu_block_ids.size}"
            )
        bad = gpu_block_ids[(gpu_block_ids < 0) | (gpu_block_ids >= self.num_gpu_blocks)]
        if bad.size:
            raise ValueError(
                f"spec: GPU block ids must be in [0, {self.num_gpu_blocks}), got {bad.tolist()}"
            )
        return gpu_block_ids.reshape(len(hash_hex), factor)

    def lookup(self, hash_hex: Sequence[str]) -> int:
        """How many leading blocks of a prefix are in the store (data and header).

        Batched (one existence query per ``max_blocks_per_batch`` blocks); stops at the first
        missing block. A store that cannot be reached counts as a miss.
        """
        found = 0
        for part in _chunks(len(hash_hex), self.max_blocks_per_batch):
            names = hash_hex[part]
            keys = [self.data_key(h) for h in names] + [self.header_key(h) for h in names]
            codes = self.client.exists(keys)
            n = len(names)
            for i in range(n):
                if codes[i] != 1 or codes[n + i] != 1:
                    return found + i
            found += n
        return found

    def store(self, hash_hex: Sequence[str], gpu_block_ids: np.ndarray) -> int:
        """Put the blocks not yet in the store; returns the bytes put.

        Raises :class:`MooncakeStoreError` when a put fails (the store full of pinned objects,
        the master unreachable).
        """
        blocks = self.check_job(hash_hex, gpu_block_ids)
        moved = 0
        for part in _chunks(len(hash_hex), self.max_blocks_per_batch):
            names = list(hash_hex[part])
            data_keys = [self.data_key(h) for h in names]
            header_keys = [self.header_key(h) for h in names]
            codes = self.client.exists(data_keys + header_keys)
            n = len(names)
            todo = [i for i in range(n) if codes[i] != 1 or codes[n + i] != 1]
            if not todo:
                continue
            buffers = [self._block_buffers(blocks[part][i].tolist()) for i in todo]
            put = self.client.put_from(
                [data_keys[i] for i in todo], [b[0] for b in buffers], [b[1] for b in buffers]
            )
            failed = {data_keys[i]: c for i, c in zip(todo, put, strict=True) if c != 0}
            stored = [header_keys[i] for i, c in zip(todo, put, strict=True) if c == 0]
            head = self.client.put_same(stored, self._header)
            failed.update({k: c for k, c in zip(stored, head, strict=True) if c != 0})
            if failed:
                raise MooncakeStoreError(
                    f"mooncake store: put failed for {len(failed)} of {len(todo)} objects, "
                    f"codes {sorted(set(failed.values()))} (first key {next(iter(failed))})"
                )
            moved += len(todo) * self.page_format.block_bytes
        return moved

    def _check_headers(self, names: Sequence[str]) -> None:
        """Every block's header matches and its data object has exactly the block's size."""
        for part in _chunks(len(names), self.max_blocks_per_batch):
            chunk = names[part]
            staging = self._header_staging[: len(chunk)]
            staging.zero_()
            width = staging.shape[1]
            codes = self.client.get_into(
                [self.header_key(h) for h in chunk],
                [[staging[i].data_ptr()] for i in range(len(chunk))],
                [[width]] * len(chunk),
            )
            missing = [h for h, c in zip(chunk, codes, strict=True) if c == OBJECT_NOT_FOUND]
            if missing:
                raise StoreMiss(
                    f"store: {len(missing)} blocks not in the store, first {missing[0]}"
                )
            for h, code, row in zip(chunk, codes, staging, strict=True):
                if code < 0:
                    raise MooncakeStoreError(
                        f"mooncake store: reading the header of block {h} failed with code {code}"
                    )
                self.page_format.check_header(
                    row[:code].numpy().tobytes(), where=f"header of block {h}"
                )
            sizes = self.client.sizes([self.data_key(h) for h in chunk])
            for h, size in zip(chunk, sizes, strict=True):
                if size == OBJECT_NOT_FOUND:
                    raise StoreMiss(f"store: the data of block {h} is not in the store")
                if size != self.page_format.block_bytes:
                    raise ValueError(
                        f"store object of block {h}: expected {self.page_format.block_bytes} "
                        f"bytes, got {size}"
                    )

    def load(self, hash_hex: Sequence[str], gpu_block_ids: np.ndarray) -> int:
        """Read the blocks into the given GPU pages; returns the bytes read.

        Every header and object size is checked before the first data byte is read; a miss
        raises :class:`StoreMiss`, a foreign header ``ValueError``, and the cache is untouched.
        A block that disappears after the check raises :class:`StoreMiss` too, and then the
        job's destination pages may be partly written (never any other page).
        """
        blocks = self.check_job(hash_hex, gpu_block_ids)
        self._check_headers(hash_hex)
        block_bytes = self.page_format.block_bytes
        for part in _chunks(len(hash_hex), self.max_blocks_per_batch):
            names = list(hash_hex[part])
            buffers = [self._block_buffers(ids.tolist()) for ids in blocks[part]]
            codes = self.client.get_into(
                [self.data_key(h) for h in names],
                [b[0] for b in buffers],
                [b[1] for b in buffers],
            )
            bad = {h: c for h, c in zip(names, codes, strict=True) if c != block_bytes}
            if bad:
                # Gone between the check and the read (evicted, or its holder died): the job
                # fails; its pages, read in place, may be partly written.
                raise StoreMiss(
                    f"store: {len(bad)} blocks could not be read (codes "
                    f"{sorted(set(bad.values()))}), first {next(iter(bad))}"
                )
        return len(hash_hex) * block_bytes


class MooncakeStoreHandler(StreamOffloadingHandler):
    """One direction (GPU -> MOONCAKE or MOONCAKE -> GPU) of :class:`MooncakeStorePages`.

    Jobs run in submission order on ``transfer_stream`` (a worker thread for CPU caches; the
    store calls block, the submitting thread does not).
    """

    def __init__(
        self,
        pages: MooncakeStorePages,
        to_store: bool,
        transfer_stream: TransferStream,
        depends_on: StreamOffloadingHandler | None = None,
    ):
        transfer_type = ("GPU", "MOONCAKE") if to_store else ("MOONCAKE", "GPU")
        super().__init__(transfer_type, transfer_stream, False, depends_on)
        self.pages = pages
        pages.acquire()
        self.to_store = to_store

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        src, dst = spec
        gpu, store = (src, dst) if self.to_store else (dst, src)
        if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(store, MooncakeLoadStoreSpec):
            raise ValueError(
                f"spec: expected GPU block ids and Mooncake block hashes, got "
                f"{type(src).__name__} -> {type(dst).__name__}"
            )
        names = store.hash_hex
        ids = self.pages.check_job(names, gpu.block_ids).reshape(-1)
        run = self.pages.store if self.to_store else self.pages.load
        produced = None
        if self.to_store and self.pages.device.type == "cuda":
            # The pages are read by the store's engine, not by a CUDA stream: wait on the host
            # (in the job's thread) for the compute work queued so far, which writes them.
            produced = torch.cuda.Event()
            produced.record()

        def copy() -> None:
            if produced is not None:
                produced.synchronize()
            run(names, ids)

        return self.submit_job(job_id, copy, len(names) * self.pages.page_format.block_bytes)

    def shutdown(self) -> None:
        """Wait for this direction's jobs; the last direction shut down closes the client."""
        super().shutdown()
        self.pages.release()


class MooncakeStoreHandlers:
    """Both directions over one :class:`MooncakeStorePages`; a load waits for earlier stores."""

    def __init__(self, pages: MooncakeStorePages):
        self.pages = pages
        # Store calls block the calling thread whatever the cache's device: a worker thread
        # per direction runs them.
        self.store_handler = MooncakeStoreHandler(
            pages, True, ThreadTransferStream("kv-offload-gpu-to-mooncake")
        )
        self.load_handler = MooncakeStoreHandler(
            pages,
            False,
            ThreadTransferStream("kv-offload-mooncake-to-gpu"),
            depends_on=self.store_handler,
        )

    def lookup(self, block_hashes: Iterable[bytes | int]) -> int:
        """Leading blocks of a prefix present in the store."""
        return self.pages.lookup(MooncakeLoadStoreSpec(block_hashes).hash_hex)

    def shutdown(self) -> None:
        """Wait for jobs in flight, stop the streams and disconnect from the store."""
        self.store_handler.shutdown()
        self.load_handler.shutdown()
