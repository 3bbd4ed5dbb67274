"""The block file of the file-system tier: a header, then the block's bytes (the payload).

The header is :data:`HEADER_BYTES` long (little-endian fields, then zeros)::

    magic            8 bytes   b"VKVFSBLK"
    version          u32       1 (the layout and the checksum below)
    fingerprint      32 bytes  SHA-256 of the settings that decide the bytes
                               (:attr:`~vllm.v1.kv_offload.file_mapper.FileMapper.fingerprint`,
                               the page format's fingerprint included)
    key digest       16 bytes  BLAKE2b-128 of the offload key
    payload bytes    u64
    payload CRC-32   u32       ``zlib.crc32`` of the payload

A reader knows every field but the CRC, so it compares the whole header with the one it expects
(a damaged byte anywhere in it, padding included, is caught) before any payload byte reaches its
buffer, then checks the payload's CRC. A file of another format, another key's file, an old file
without a header and a damaged file are all :class:`BadBlockFile`. 4 KiB keep the payload
aligned for direct I/O and cost no disk space when the payload is a multiple of the file
system's 4 KiB blocks. CRC-32 (``zlib``, about 2.5 GiB/s on one core, the GIL released) is the
cheapest standard-library check that catches every error burst of up to 32 bits; BLAKE2b and
SHA-256 cost 2 to 4 times as much. A new checksum or layout takes a new version.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

from vllm.v1.kv_offload.base import OffloadKey

HEADER_BYTES = 4096
MAGIC = b"VKVFSBLK"
VERSION = 1

_FIELDS = struct.Struct("<8sI32s16sQI")
_FINGERPRINT_BYTES = 32
CHECKSUM_OFFSET = _FIELDS.size - 4
"""Byte offset of the payload CRC-32 (4 bytes) in the header: the one field a reader cannot
know before reading the file."""


class BadBlockFile(ValueError):
    """A block file that is damaged, truncated, or written for another key or format: a miss.
    ``file_identity`` is the ``(st_dev, st_ino, st_ctime_ns)`` of the file that was read, when
    known."""

    file_identity: tuple[int, int, int] | None = None


def payload_checksum(payload: memoryview | bytes, start: int = 0) -> int:
    """The CRC-32 a header records for ``payload`` (``start``: the CRC of the bytes before
    it, to check a payload in chunks)."""
    return zlib.crc32(payload, start)


class BlockFileHeader:
    """The header of ``key``'s block file in a folder of settings ``fingerprint``."""

    __slots__ = ("_fingerprint", "_key_digest")

    def __init__(self, fingerprint: bytes, key: OffloadKey) -> None:
        if len(fingerprint) != _FINGERPRINT_BYTES:
            raise ValueError(
                f"fingerprint: expected {_FINGERPRINT_BYTES} bytes, got {len(fingerprint)}"
            )
        self._fingerprint = bytes(fingerprint)
        self._key_digest = hashlib.blake2b(key, digest_size=16).digest()

    def pack(self, payload_bytes: int, checksum: int) -> bytes:
        """The header of a payload of ``payload_bytes`` bytes whose CRC-32 is ``checksum``."""
        fields = _FIELDS.pack(
            MAGIC, VERSION, self._fingerprint, self._key_digest, payload_bytes, checksum
        )
        return fields.ljust(HEADER_BYTES, b"\0")

    def check(self, raw: bytes, payload_bytes: int, where: str) -> int:
        """The payload CRC-32 that ``raw`` records, once ``raw`` is exactly the header of this
        key, format and ``payload_bytes``; else :class:`BadBlockFile` naming the first field
        that differs (``where``: the file, for the message)."""
        if len(raw) != HEADER_BYTES:
            raise BadBlockFile(f"{where}: expected a {HEADER_BYTES}-byte header, got {len(raw)}")
        magic, version, fingerprint, key_digest, size, checksum = _FIELDS.unpack_from(raw)
        if raw == self.pack(payload_bytes, checksum):
            return checksum
        for name, got, want in (
            ("magic", magic, MAGIC),
            ("version", version, VERSION),
            ("settings fingerprint", fingerprint.hex(), self._fingerprint.hex()),
            ("key digest", key_digest.hex(), self._key_digest.hex()),
            ("payload bytes", size, payload_bytes),
        ):
            if got != want:
                raise BadBlockFile(f"{where}: expected {name} {want!r}, got {got!r}")
        raise BadBlockFile(f"{where}: expected zeros after the header fields, got other bytes")
