"""Byte counting over KV-cache specs: bytes per stored entry, per token and per sequence.

Everything is read from the specs' own page math (``real_page_size_bytes``,
``storage_block_size``, ``page_size_bytes``, ``sliding_window``, ``compress_ratio``); nothing
here knows a format's byte layout. Units: bytes; ``Fraction`` where a per-token rate is not a
whole number of bytes (compressed layers store one entry per ``compress_ratio`` tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec

__all__ = [
    "KVFootprint",
    "entry_bytes_per_token",
    "kv_bytes_for_tokens",
    "kv_bytes_per_entry",
    "kv_footprint",
    "spec_bytes_per_token",
    "total_state_bytes",
]


def kv_bytes_per_entry(spec: KVCacheSpec) -> int:
    """Bytes of one stored slot (one token, or one compressed group of tokens) of an attention
    spec, all heads, K and V, without page padding."""
    if isinstance(spec, MambaSpec):
        raise ValueError("spec: a MambaSpec holds a fixed state, not per-token entries")
    return spec.real_page_size_bytes // spec.storage_block_size  # type: ignore[attr-defined]


def spec_bytes_per_token(spec: KVCacheSpec) -> Fraction:
    """Allocated bytes per token of sequence (``page_size_bytes / block_size``, padding
    included); 0 for Mamba specs, whose state does not grow with the sequence."""
    if isinstance(spec, MambaSpec):
        return Fraction(0)
    return Fraction(spec.page_size_bytes, spec.block_size)


def kv_bytes_for_tokens(specs: Mapping[str, KVCacheSpec], num_tokens: int) -> int:
    """Logical cache bytes one sequence of ``num_tokens`` tokens holds across ``specs``:
    full/MLA layers ``num_tokens // ratio`` entries, sliding layers ``min(num_tokens, window)``
    entries, Mamba layers their whole state. Pages and padding are not counted."""
    total = 0
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            total += spec.real_page_size_bytes
            continue
        window = getattr(spec, "sliding_window", None)
        ratio = getattr(spec, "compress_ratio", 1)
        entries = min(num_tokens, window) if window is not None else num_tokens // ratio
        total += entries * kv_bytes_per_entry(spec)
    return total


def total_state_bytes(specs: Mapping[str, KVCacheSpec]) -> int:
    """Sum of Mamba state bytes (unpadded) over ``specs``: the fixed per-sequence state."""
    return sum(s.real_page_size_bytes for s in specs.values() if isinstance(s, MambaSpec))


def entry_bytes_per_token(spec: KVCacheSpec) -> Fraction:
    """Exact bytes one more token adds to an attention layer (compressed: entry / ratio),
    without page padding."""
    return Fraction(kv_bytes_per_entry(spec), getattr(spec, "compress_ratio", 1))


@dataclass(frozen=True)
class KVFootprint:
    """What one sequence costs across a model's layers, without pages or padding.

    ``per_token``: bytes every token adds to the attention layers while it is in their window;
    ``growing_per_token``: the part that never stops growing (full-context layers);
    ``window_cap_per_sequence``: the most the sliding-window layers hold for one sequence;
    ``state_per_sequence``: the fixed Mamba / linear-attention state of one sequence.
    """

    per_token: Fraction
    growing_per_token: Fraction
    window_cap_per_sequence: int
    state_per_sequence: int


def kv_footprint(specs: Mapping[str, KVCacheSpec]) -> KVFootprint:
    """The :class:`KVFootprint` of ``specs`` (one model's layers on one rank)."""
    per_token = growing = Fraction(0)
    window_cap = 0
    for spec in specs.values():
        if isinstance(spec, MambaSpec):
            continue
        rate = entry_bytes_per_token(spec)
        per_token += rate
        window = getattr(spec, "sliding_window", None)
        if window is None:
            growing += rate
        else:
            window_cap += window * kv_bytes_per_entry(spec)
    return KVFootprint(per_token, growing, window_cap, total_state_bytes(specs))
