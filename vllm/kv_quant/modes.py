"""The kinds of KV-cache quantization: upstream's ``KVQuantMode`` (what a spec records) and the
row encodings ``CacheKind`` (what codecs and kernels dispatch on). The format registry
(:mod:`vllm.kv_quant.formats`) names a mode and a kind for every dtype; it re-exports both.
This module imports nothing from vllm."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["CacheKind", "KVQuantMode"]


class KVQuantMode(IntEnum):
    """How a KV cache is quantized: upstream v0.33's members and values (a spec stores the mode,
    not the string; kernels and backends branch on it).

    ``CUSTOM`` marks a dtype whose platform backend dispatches its own kernels (a
    :class:`~vllm.config.cache.KVCacheDTypeHandler`): quantized, but no generic path. Upstream
    gives it the value 12, which makes it an alias of ``OCTAVE_K3V4`` (an ``IntEnum`` member with
    a taken value is the earlier member): there ``KVQuantMode.CUSTOM.is_octave`` holds and a
    custom dtype takes Octave's kernel path. Here it is its own member, 15 (docs/design.md §3).
    """

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10
    ULTRAQUANT_4BIT = 11
    OCTAVE_K3V4 = 12
    OCTAVE_K3V3 = 13
    OCTAVE_K3V3_COMPACT = 14
    CUSTOM = 15

    @property
    def is_per_token_head(self) -> bool:
        """One scale per token and head, computed by the writer and stored with the row."""
        return self in (
            KVQuantMode.INT8_PER_TOKEN_HEAD,
            KVQuantMode.FP8_PER_TOKEN_HEAD,
            KVQuantMode.INT4_PER_TOKEN_HEAD,
        )

    @property
    def is_nvfp4(self) -> bool:
        return self == KVQuantMode.NVFP4

    @property
    def is_octave(self) -> bool:
        return self in (
            KVQuantMode.OCTAVE_K3V4,
            KVQuantMode.OCTAVE_K3V3,
            KVQuantMode.OCTAVE_K3V3_COMPACT,
        )

    @property
    def is_turboquant(self) -> bool:
        return self in (
            KVQuantMode.TURBOQUANT_K8V4,
            KVQuantMode.TURBOQUANT_4BIT_NC,
            KVQuantMode.TURBOQUANT_K3V4_NC,
            KVQuantMode.TURBOQUANT_3BIT_NC,
        )

    @property
    def is_ultraquant(self) -> bool:
        return self == KVQuantMode.ULTRAQUANT_4BIT

    @property
    def is_custom_mode(self) -> bool:
        """A platform backend's own kernels (quantized, no generic kernel mode)."""
        return self == KVQuantMode.CUSTOM

    @property
    def is_fp8(self) -> bool:
        return self == KVQuantMode.FP8_PER_TENSOR

    @property
    def is_quantized(self) -> bool:
        return self != KVQuantMode.NONE


class CacheKind(IntEnum):
    """The byte encoding of one cached row, shared by the reference codecs
    (:func:`vllm.kv_quant.codecs.codec_for`), the compiled kernels (``CacheKind`` of
    ``csrc/cache_kernels.h``, ``k`` + the member's CamelCase name, same values; a test pins the
    two) and the Triton kernels (their ``KIND`` constant)."""

    UNQUANTIZED = 0
    FP8_E4M3 = 1
    FP8_E5M2 = 2
    NVFP4 = 3
    INT8_PER_TOKEN_HEAD = 4
    FP8_PER_TOKEN_HEAD = 5
    INT4_PER_TOKEN_HEAD = 6

    @property
    def cpp_name(self) -> str:
        """The C++ enumerator: ``kNvfp4``, ``kFp8E4M3``, ``kInt8PerTokenHead``, ... (a part
        with a digit second, like ``E4M3``, keeps its capitals)."""
        parts = self.name.split("_")
        return "k" + "".join(p if p[1:2].isdigit() else p.capitalize() for p in parts)
