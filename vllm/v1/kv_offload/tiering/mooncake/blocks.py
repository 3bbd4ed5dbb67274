"""Primary-tier rows in a Mooncake distributed store: whole offloaded blocks in and out.

An offloaded block (one row of the primary tier: every worker's pages of the block) is one
store object, put straight from the row and read straight into it (zero-copy: the rows are
registered with the store). Beside it lives a small header object
(:meth:`~vllm.v1.kv_offload.page_format.KVPageFormat.header`: format digest, block bytes, page
sizes). Keys: ``<prefix>/<format fingerprint>/<block hash hex>_g<group>`` and the same with
``.hdr``, so blocks of another model, format or geometry never match.

A load writes nothing into a row unless, for every block of the batch, the header matches this
tier's format exactly and the data object's size is exactly the row size; only then are the
data objects read. A put writes the data first and the header second, so a reader never trusts
a block whose data is not complete. Failures are raised, never hidden: a missing or evicted
block is a :class:`StoreMiss`, a foreign header or a wrong size a :class:`BadStoreObject` (a
``ValueError``), a store that
cannot be reached a :class:`MooncakeStoreError`. A block that vanishes after the checks (its
holder died between the check and the read) is a :class:`StoreMiss` too; its row, read in
place, may then hold part of the data, which is why the tiering manager drops the rows of a
failed promotion.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
    OBJECT_NOT_FOUND,
    OBJECT_TOO_LARGE,
    MooncakeStoreClient,
    MooncakeStoreError,
)
from vllm.utils import check_positive_int
from vllm.v1.kv_offload.base import OffloadKey, get_offload_block_hash, get_offload_group_idx
from vllm.v1.kv_offload.page_format import KVPageFormat

DEFAULT_KEY_PREFIX = "vllm-kv"
"""First component of every store key."""


class StoreMiss(LookupError):
    """Blocks are not (or no longer) in the store: the engine recomputes them."""


class BadStoreObject(ValueError):
    """A block's header belongs to another format, or its data has the wrong size."""

    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name
        """The block's store name (:func:`offload_key_name`)."""


class StoreUnreachable(MooncakeStoreError):
    """The store did not answer a query (its master is down or unreachable)."""


def offload_key_name(key: OffloadKey) -> str:
    """The store name of an offloaded block: its block hash in hex and its group."""
    block_hash = get_offload_block_hash(key)
    if not block_hash:
        raise ValueError(f"key: expected a block hash before the group index, got {key!r}")
    return f"{block_hash.hex()}_g{get_offload_group_idx(key)}"


def _chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def check_row_store_args(
    rows: torch.Tensor, page_format: KVPageFormat, key_prefix: str, max_blocks_per_batch: int
) -> None:
    """``ValueError`` for arguments :class:`MooncakeRowStore` cannot take (checked before a
    client connects)."""
    if rows.dim() != 2 or rows.dtype != torch.uint8 or not rows.is_contiguous():
        raise ValueError(
            f"rows: expected a contiguous [num_rows, row bytes] uint8 tensor, got "
            f"{rows.dtype} of shape {tuple(rows.shape)}"
        )
    # A row may end in padding (rows are page-aligned); a block is the row's first bytes.
    if rows.shape[1] < page_format.block_bytes:
        raise ValueError(
            f"rows: expected rows of at least {page_format.block_bytes} bytes (the page "
            f"format's block), got {rows.shape[1]}"
        )
    if not isinstance(key_prefix, str) or not key_prefix or "/" in key_prefix:
        raise ValueError(f"key_prefix: expected a non-empty name without '/', got {key_prefix!r}")
    check_positive_int("max_blocks_per_batch", max_blocks_per_batch)


class MooncakeRowStore:
    """The primary tier's rows registered with a Mooncake store client.

    ``rows`` is the ``[num_rows, row bytes]`` uint8 tensor over the primary tier's memory (a
    view, no copy); ``page_format`` describes one block, the first ``block_bytes`` of a row
    (the rest is padding). ``max_blocks_per_batch`` bounds the blocks of one store call (and
    the registered header staging buffer, ``max_blocks_per_batch × header_bytes``).
    """

    def __init__(
        self,
        client: MooncakeStoreClient,
        rows: torch.Tensor,
        page_format: KVPageFormat,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        max_blocks_per_batch: int = 256,
    ):
        check_row_store_args(rows, page_format, key_prefix, max_blocks_per_batch)
        self.max_blocks_per_batch = max_blocks_per_batch
        self.client = client
        self.rows = rows
        self.page_format = page_format
        self.key_prefix = key_prefix
        client.register(rows)
        header = page_format.header()
        self._header = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        self._header_staging = torch.zeros(
            max_blocks_per_batch * len(header), dtype=torch.uint8
        ).view(max_blocks_per_batch, len(header))
        client.register(self._header)
        client.register(self._header_staging)
        # One staging buffer: promotions running on two threads take turns checking headers.
        self._staging_lock = threading.Lock()

    def data_key(self, name: str) -> str:
        """Store key of a block's data (``name``: :func:`offload_key_name`)."""
        return f"{self.key_prefix}/{self.page_format.fingerprint}/{name}"

    def header_key(self, name: str) -> str:
        """Store key of a block's header."""
        return self.data_key(name) + ".hdr"

    def _row_addresses(self, rows: Sequence[int]) -> list[list[int]]:
        base, size = self.rows.data_ptr(), self.rows.shape[1]
        return [[base + int(row) * size] for row in rows]

    def _check_rows(self, names: Sequence[str], rows: np.ndarray) -> None:
        if rows.shape != (len(names),):
            raise ValueError(
                f"block_ids: expected one primary row per key ({len(names)}), got shape "
                f"{rows.shape}"
            )
        bad = rows[(rows < 0) | (rows >= self.rows.shape[0])]
        if bad.size:
            raise ValueError(
                f"block_ids: expected primary rows in [0, {self.rows.shape[0]}), got {bad.tolist()}"
            )

    def present(self, names: Sequence[str]) -> list[bool]:
        """Per block: data and header are both in the store (one existence query per
        ``max_blocks_per_batch`` blocks). :class:`StoreUnreachable` when the store cannot
        say."""
        found: list[bool] = []
        for part in _chunks(len(names), self.max_blocks_per_batch):
            chunk = names[part]
            codes = self.client.exists(
                [self.data_key(n) for n in chunk] + [self.header_key(n) for n in chunk]
            )
            if any(c < 0 for c in codes):
                raise StoreUnreachable(
                    f"mooncake store: existence query failed with codes "
                    f"{sorted({c for c in codes if c < 0})}"
                )
            n = len(chunk)
            found.extend(codes[i] == 1 and codes[n + i] == 1 for i in range(n))
        return found

    def remove(self, names: Sequence[str]) -> None:
        """Remove the blocks' data and header objects (missing ones are no error)."""
        keys = [self.data_key(n) for n in names] + [self.header_key(n) for n in names]
        codes = self.client.remove(keys)
        failed = [c for c in codes if c not in (0, OBJECT_NOT_FOUND)]
        if failed:
            raise MooncakeStoreError(f"mooncake store: remove failed with codes {sorted(failed)}")

    def store(self, names: Sequence[str], rows: np.ndarray, replace: Collection[str] = ()) -> int:
        """Put the blocks not yet in the store from their rows (the blocks named in ``replace``
        are removed first, so that they are put again); returns the bytes put.

        ``MooncakeStoreError`` when a put fails (the store full of pinned objects, an object
        larger than every segment, the master unreachable). Nothing is removed or put unless
        ``rows`` holds one valid row per block.
        """
        self._check_rows(names, rows)
        self.remove([n for n in names if n in replace])
        moved = 0
        for part in _chunks(len(names), self.max_blocks_per_batch):
            chunk = list(names[part])
            todo = [i for i, held in enumerate(self.present(chunk)) if not held]
            if not todo:
                continue
            data_keys = [self.data_key(chunk[i]) for i in todo]
            addresses = self._row_addresses(rows[part][todo])
            size = [[self.page_format.block_bytes]] * len(todo)
            put = self.client.put_from(data_keys, addresses, size)
            failed = {k: c for k, c in zip(data_keys, put, strict=True) if c != 0}
            stored = [self.header_key(chunk[i]) for i, c in zip(todo, put, strict=True) if c == 0]
            head = self.client.put_same(stored, self._header)
            failed.update({k: c for k, c in zip(stored, head, strict=True) if c != 0})
            if failed:
                raise MooncakeStoreError(
                    f"mooncake store: put failed for {len(failed)} of {2 * len(todo)} objects, "
                    f"codes {sorted(set(failed.values()))} (first key {next(iter(failed))})"
                )
            moved += len(todo) * self.page_format.block_bytes
        return moved

    def _check_headers(self, names: Sequence[str]) -> None:
        """Every block's header matches and its data object has exactly the row's size."""
        with self._staging_lock:
            self._check_headers_locked(names)

    def _check_headers_locked(self, names: Sequence[str]) -> None:
        for part in _chunks(len(names), self.max_blocks_per_batch):
            chunk = names[part]
            staging = self._header_staging[: len(chunk)]
            staging.zero_()
            width = staging.shape[1]
            codes = self.client.get_into(
                [self.header_key(n) for n in chunk],
                [[staging[i].data_ptr()] for i in range(len(chunk))],
                [[width]] * len(chunk),
            )
            missing = [n for n, c in zip(chunk, codes, strict=True) if c == OBJECT_NOT_FOUND]
            if missing:
                raise StoreMiss(
                    f"mooncake store: {len(missing)} blocks not in the store, first {missing[0]}"
                )
            for n, code, row in zip(chunk, codes, staging, strict=True):
                if code == OBJECT_TOO_LARGE or code > width:
                    raise BadStoreObject(
                        f"header of block {n}: expected at most {width} bytes, got a larger object",
                        n,
                    )
                if code < 0:
                    raise MooncakeStoreError(
                        f"mooncake store: reading the header of block {n} failed with code {code}"
                    )
                try:
                    self.page_format.check_header(
                        row[:code].numpy().tobytes(), where=f"header of block {n}"
                    )
                except ValueError as e:
                    raise BadStoreObject(str(e), n) from None
            sizes = self.client.sizes([self.data_key(n) for n in chunk])
            for n, size in zip(chunk, sizes, strict=True):
                if size == OBJECT_NOT_FOUND:
                    raise StoreMiss(f"mooncake store: the data of block {n} is not in the store")
                if size != self.page_format.block_bytes:
                    raise BadStoreObject(
                        f"store object of block {n}: expected {self.page_format.block_bytes} "
                        f"bytes, got {size}",
                        n,
                    )

    def load(self, names: Sequence[str], rows: np.ndarray) -> int:
        """Read the blocks into their rows; returns the bytes read.

        Every header and object size is checked before the first data byte is read; a miss
        raises :class:`StoreMiss`, a foreign header or size :class:`BadStoreObject`, and no
        row is written. A block that disappears after the checks raises :class:`StoreMiss` too, and
        then the rows of the batch may be partly written (never any other row).
        """
        self._check_rows(names, rows)
        self._check_headers(names)
        block_bytes = self.page_format.block_bytes
        for part in _chunks(len(names), self.max_blocks_per_batch):
            chunk = list(names[part])
            codes = self.client.get_into(
                [self.data_key(n) for n in chunk],
                self._row_addresses(rows[part]),
                [[block_bytes]] * len(chunk),
            )
            bad = {n: c for n, c in zip(chunk, codes, strict=True) if c != block_bytes}
            if bad:
                raise StoreMiss(
                    f"mooncake store: {len(bad)} blocks could not be read (codes "
                    f"{sorted(set(bad.values()))}), first {next(iter(bad))}"
                )
        return len(names) * block_bytes
