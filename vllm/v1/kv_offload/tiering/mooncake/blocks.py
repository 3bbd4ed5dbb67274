"""Primary-tier rows in a Mooncake distributed store: whole offloaded blocks in and out.

An offloaded block (one row of the primary tier: every worker's pages of the block) is one
store object: its header (:meth:`~vllm.v1.kv_offload.page_format.KVPageFormat.header`: format
digest, block bytes, page sizes), then the block, put straight from the row and read straight
into it (zero-copy: the rows are registered with the store). Keys:
``<prefix>/<format fingerprint>/<block hash hex>_g<group>``, so blocks of another model, format
or geometry never match.

One Mooncake batch call per direction and batch (the header travels in the object): a put is
one ``put_from`` of header and row per block (Mooncake keeps an object that is already there
and answers 0 without moving it, so no existence query comes first); a load is one
``get_into`` of each object into the block's header staging slot and its row, which Mooncake
answers only when the object has exactly the header's and the row's size, and then every header
is checked. So a failed load may have written the batch's rows (never any other row): the
tiering manager drops the rows of a failed promotion, and nothing of it is ever read as a value.
Failures are raised, never hidden: a missing, evicted or vanished block is a
:class:`StoreMiss`, a foreign header or a wrong size a :class:`BadStoreObject` (a
``ValueError``), a store that cannot be reached a :class:`StoreUnreachable`, any other refusal a
:class:`MooncakeStoreError`.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Sequence

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
    OBJECT_NOT_FOUND,
    OBJECT_TOO_LARGE,
    RPC_FAILED,
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
        # One staging buffer: promotions running on two threads take turns reading headers.
        self._staging_lock = threading.Lock()

    @property
    def object_bytes(self) -> int:
        """Bytes of a block's store object: its header, then the block."""
        return self._header.numel() + self.page_format.block_bytes

    def key(self, name: str) -> str:
        """Store key of a block's object (``name``: :func:`offload_key_name`)."""
        return f"{self.key_prefix}/{self.page_format.fingerprint}/{name}"

    def _row_address(self, row: int) -> int:
        return self.rows.data_ptr() + int(row) * self.rows.shape[1]

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
        """Per block: its object is in the store (one existence query per
        ``max_blocks_per_batch`` blocks). :class:`StoreUnreachable` when the store cannot
        say."""
        found: list[bool] = []
        for part in _chunks(len(names), self.max_blocks_per_batch):
            codes = self.client.exists([self.key(n) for n in names[part]])
            if any(c < 0 for c in codes):
                raise StoreUnreachable(
                    f"mooncake store: existence query failed with codes "
                    f"{sorted({c for c in codes if c < 0})}"
                )
            found.extend(c == 1 for c in codes)
        return found

    def remove(self, names: Sequence[str]) -> None:
        """Remove the blocks' objects (missing ones are no error)."""
        codes = self.client.remove([self.key(n) for n in names])
        failed = [c for c in codes if c not in (0, OBJECT_NOT_FOUND)]
        if failed:
            raise MooncakeStoreError(f"mooncake store: remove failed with codes {sorted(failed)}")

    def store(self, names: Sequence[str], rows: np.ndarray, replace: Collection[str] = ()) -> int:
        """Put the blocks from their rows, one batch call per ``max_blocks_per_batch`` blocks
        (the blocks named in ``replace`` are removed first, so that they are put again; the
        others already in the store stay as they are); returns the bytes handed to the store.

        :class:`StoreUnreachable` when the master does not answer, ``MooncakeStoreError`` when
        a put fails otherwise (the store full of pinned objects, an object larger than every
        segment). Nothing is removed or put unless ``rows`` holds one valid row per block.
        """
        self._check_rows(names, rows)
        if replace:
            self.remove([n for n in names if n in replace])
        header, block_bytes = self._header, self.page_format.block_bytes
        for part in _chunks(len(names), self.max_blocks_per_batch):
            keys = [self.key(n) for n in names[part]]
            codes = self.client.put_from(
                keys,
                [[header.data_ptr(), self._row_address(row)] for row in rows[part]],
                [[header.numel(), block_bytes]] * len(keys),
            )
            failed = {k: c for k, c in zip(keys, codes, strict=True) if c != 0}
            if failed and all(c == RPC_FAILED for c in failed.values()):
                raise StoreUnreachable(
                    f"mooncake store: put of {len(failed)} blocks failed with code {RPC_FAILED} "
                    "(the master did not answer)"
                )
            if failed:
                raise MooncakeStoreError(
                    f"mooncake store: put failed for {len(failed)} of {len(keys)} blocks, "
                    f"codes {sorted(set(failed.values()))} (first key {next(iter(failed))})"
                )
        return len(names) * block_bytes

    def load(self, names: Sequence[str], rows: np.ndarray) -> int:
        """Read the blocks into their rows (one batch call per ``max_blocks_per_batch``
        blocks); returns the bytes read.

        A miss raises :class:`StoreMiss`, an object of another size or with a foreign header
        :class:`BadStoreObject`, a master that does not answer :class:`StoreUnreachable`; the
        rows of the batch may then be partly written (never any other row).
        """
        self._check_rows(names, rows)
        with self._staging_lock:
            for part in _chunks(len(names), self.max_blocks_per_batch):
                self._load_chunk(list(names[part]), rows[part])
        return len(names) * self.page_format.block_bytes

    def _load_chunk(self, names: list[str], rows: np.ndarray) -> None:
        staging = self._header_staging[: len(names)]
        width, block_bytes = staging.shape[1], self.page_format.block_bytes
        base = staging.data_ptr()
        codes = self.client.get_into(
            [self.key(n) for n in names],
            [[base + i * width, self._row_address(row)] for i, row in enumerate(rows)],
            [[width, block_bytes]] * len(names),
        )
        if any(c != width + block_bytes for c in codes):
            self._raise_for(names, codes)
        matches = (staging.numpy() == self._header.numpy()).all(axis=1)
        for name, header, ok in zip(names, staging, matches, strict=True):
            if ok:
                continue
            try:  # raises for bytes unlike the header, naming the first field that differs
                self.page_format.check_header(
                    header.numpy().tobytes(), where=f"header of block {name}"
                )
            except ValueError as e:
                raise BadStoreObject(str(e), name) from None

    def _raise_for(self, names: list[str], codes: list[int]) -> None:
        """The error of a read that did not return every object whole: the first block's that
        did not (its size asked of the master when the read's code does not say)."""
        expected = self.object_bytes
        for name, code in zip(names, codes, strict=True):
            if code == expected:
                continue
            if code == OBJECT_NOT_FOUND:
                raise StoreMiss(f"mooncake store: block {name} is not in the store")
            if code == RPC_FAILED:
                raise StoreUnreachable(
                    f"mooncake store: reading block {name} failed with code {code} (the master "
                    "did not answer)"
                )
            size = (
                OBJECT_TOO_LARGE
                if code == OBJECT_TOO_LARGE
                else self.client.sizes([self.key(name)])[0]
            )
            if size == OBJECT_NOT_FOUND:
                raise StoreMiss(f"mooncake store: block {name} left the store during the read")
            if size == OBJECT_TOO_LARGE or size != expected:
                got = "a larger object" if size == OBJECT_TOO_LARGE else f"{size} bytes"
                raise BadStoreObject(
                    f"store object of block {name}: expected {expected} bytes (header and "
                    f"block), got {got}",
                    name,
                )
            raise StoreMiss(
                f"mooncake store: block {name} could not be read (code {code}); it may have "
                "left the store"
            )
