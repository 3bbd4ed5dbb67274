"""HiSparse constants and the scheduler-to-worker messages (upstream's
``vllm.v1.hisparse.types``).

Units: block ids index pages of their own pool; row starts and counts are in token rows
(``block_id * block_size + offset``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "SparseKVOffloadCommand",
    "SparseKVPageTransfer",
    "SparseKVResidencyUpdate",
    "SparseKVRowMirror",
]

ACTIVE_TAIL_PAGES = 2
"""Sealed pages this far behind a request's block-table tail stay pinned on the device: a page
an in-flight step still writes is never spilled under it."""


@dataclass(frozen=True)
class SparseKVPageTransfer:
    """Copy one page between a host page and its device pages (one per resident group):
    device to host (a write-back, ``after_forward``: after the step's forward pass) or, with
    ``restore``, host to device."""

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    after_forward: bool
    restore: bool = False


@dataclass(frozen=True)
class SparseKVRowMirror:
    """Copy ``num_rows`` rows written this step from the resident rows at ``source_starts``
    (one per resident group) to the host rows at ``destination_start``."""

    source_starts: tuple[int, ...]
    destination_start: int
    num_rows: int


@dataclass(frozen=True)
class SparseKVResidencyUpdate:
    """Where some of a request's pages are read from: for each of ``pages``, per resident
    group, the device block id (the null block id: read from the host)."""

    pages: list[int]
    block_ids: tuple[list[int], ...]


@dataclass
class SparseKVOffloadCommand:
    """The page transfers of one model step, scheduler to worker."""

    page_transfers: list[SparseKVPageTransfer]
