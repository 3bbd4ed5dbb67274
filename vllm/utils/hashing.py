"""Hash functions for prefix-cache block keys (upstream's ``vllm.utils.hashing``).

Every function maps a Python object to a digest of raw ``bytes``: 32 bytes for the SHA-256
variants, 16 for the xxHash (XXH3-128) ones. The ``*_cbor`` variants serialize with canonical
CBOR, so equal values give equal digests across processes and languages; the plain variants
serialize with pickle (Python-only, but any picklable object).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import cbor2

try:
    # Optional: only the xxhash* functions need it, and they say so when it is missing.
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

__all__ = ["get_hash_fn_by_name", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    if _xxhash is None or not hasattr(_xxhash, "xxh3_128_digest"):
        raise ModuleNotFoundError(
            "xxhash: expected the xxhash package (with xxh3_128_digest) for the xxhash "
            "prefix-caching hash functions, got none installed (pip install xxhash)"
        )
    return _xxhash.xxh3_128_digest(data)


def sha256(input: Any) -> bytes:
    """32-byte SHA-256 digest of the pickled ``input`` (no seed; prepend one if needed)."""
    return hashlib.sha256(_pickled(input)).digest()


def sha256_cbor(input: Any) -> bytes:
    """32-byte SHA-256 digest of the canonical CBOR encoding of ``input``."""
    return hashlib.sha256(_cbor(input)).digest()


def xxhash(input: Any) -> bytes:
    """16-byte XXH3-128 digest of the pickled ``input``."""
    return _xxh3_128(_pickled(input))


def xxhash_cbor(input: Any) -> bytes:
    """16-byte XXH3-128 digest of the canonical CBOR encoding of ``input``."""
    return _xxh3_128(_cbor(input))


_BY_NAME: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    """The hash function called ``hash_fn_name`` (one of the four above)."""
    try:
        return _BY_NAME[hash_fn_name]
    except KeyError:
        raise ValueError(
            f"hash_fn_name: expected one of {sorted(_BY_NAME)}, got {hash_fn_name!r}"
        ) from None
