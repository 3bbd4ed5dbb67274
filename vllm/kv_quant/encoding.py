"""A layer's KV-cache encoding as one value: the format, its scales and layouts, the key
transform and the key sinks.

:class:`KVCacheEncoding` is everything that decides the bytes of a layer's pages apart from the
page geometry (tokens per page, heads, head sizes, NHD / HND) and the calibrated values
(scales, key offset): the registry's format (:mod:`vllm.kv_quant.formats`), the scale
granularity (per tensor, per KV head, or per token and head inline), the NVFP4 block-scale
layout of each side, and the key spec (:class:`KeySpec`: Hadamard rotation, key offset, keys
stored before RoPE and whose RoPE, FP8 key sink rows). Every part that sizes, writes, reads,
moves or fingerprints a page asks it.

One grammar names an encoding (docs/design.md §3)::

    <dtype>[/tensor | /head][@linear | @interleave4][+hadamard][+offset][+prerope][+sink[N]]

``<dtype>`` is any ``kv_cache_dtype`` string (aliases included; ``bf16`` / ``fp16`` / ``fp32``
for the unquantized ones), so every dtype string is the encoding with defaults. ``/head``:
one scale per KV head; ``@layout``: both sides' NVFP4 block-scale layout (default: the
geometry's, ``ScaleLayout.default_for``); ``+hadamard``: keys rotated (queries alike);
``+offset``: a calibrated mean key subtracted; ``+prerope``: keys stored before RoPE, rebuilt by
the reader; ``+sink`` / ``+sinkN``: the first 1 / N keys of each page kept again in FP8 inside
the page (docs/design.md §5.5-5.6, docs/formats.md §5).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from vllm.kv_quant.codecs import KVCodec, codec_for
from vllm.kv_quant.formats import (
    CacheKind,
    KVCacheFormat,
    cache_dtype_names,
    find_format,
    formats,
    lookup,
)
from vllm.kv_quant.fp8 import FP8_E4M3_MAX
from vllm.kv_quant.hadamard import HADAMARD, check_hadamard_head_size
from vllm.kv_quant.key_rope import KeyRope
from vllm.kv_quant.scale_layout import ScaleLayout

__all__ = [
    "KVCacheEncoding",
    "KeySpec",
    "RopeIdentity",
    "ScaleGranularity",
    "ENCODING_GRAMMAR",
    "canonical_sha256",
    "ENCODING_OPTION",
]

ENCODING_GRAMMAR = (
    "<dtype>[/tensor|/head][@linear|@interleave4][+hadamard][+offset][+prerope][+sink[N]]"
)
"""The form of an encoding id (module docstring)."""


class ScaleGranularity(str, Enum):
    """Which values share one dequantization scale."""

    NONE = "none"
    """Unquantized: no scale."""
    TENSOR = "tensor"
    """One ``k_scale`` / ``v_scale`` for the whole layer."""
    HEAD = "head"
    """One scale per KV head (``[H]``)."""
    TOKEN_HEAD = "token_head"
    """One scale per token and head, computed by the writer and stored in the row."""


@dataclass(frozen=True)
class RopeIdentity:
    """Which RoPE table keys stored before RoPE were turned back with (part of the bytes'
    meaning): its rotary dim, pairing style and a digest of the fp32 table."""

    rotary_dim: int
    is_neox_style: bool
    table_digest: str
    """:attr:`KeyRope.table_digest`."""

    @classmethod
    def of(cls, rope: KeyRope) -> RopeIdentity:
        return cls(rope.rotary_dim, rope.is_neox_style, rope.table_digest)


@dataclass(frozen=True)
class KeySpec:
    """What the cache does to keys: ``rotation`` (``None`` or ``"hadamard"``), ``offset`` (a
    calibrated mean key is subtracted; its values are calibrated state, not part of the
    encoding), ``prerope`` (keys stored before RoPE; ``rope`` names the table once the model's
    RoPE is bound) and ``sink_tokens`` (the first keys of each page kept again in FP8)."""

    rotation: str | None = None
    offset: bool = False
    prerope: bool = False
    sink_tokens: int = 0
    rope: RopeIdentity | None = None

    @property
    def is_identity(self) -> bool:
        """Keys are stored as given and read as stored."""
        return self == KeySpec()

    @property
    def suffix(self) -> str:
        """The key options of an encoding id: ``+hadamard+offset+prerope+sink``."""
        out = f"+{self.rotation}" if self.rotation else ""
        out += "+offset" if self.offset else ""
        out += "+prerope" if self.prerope else ""
        if self.sink_tokens:
            out += "+sink" if self.sink_tokens == 1 else f"+sink{self.sink_tokens}"
        return out


_SINK_OPTION = re.compile(r"sink(\d*)")

ENCODING_OPTION = re.compile(r"[/@+]")
"""What sets an encoding id apart from a plain dtype string (a granularity, layout or key
option)."""


def _dtype_names(include_mla_only: bool) -> dict[str, KVCacheFormat]:
    """Every name the grammar's ``<dtype>`` takes: the registry's names and the unquantized
    formats' labels (``bf16``)."""
    names: dict[str, KVCacheFormat] = {
        f.label: f for f in formats() if not f.is_quantized and not f.mla_only
    }
    for name in cache_dtype_names(include_mla_only=include_mla_only):
        fmt = find_format(name)
        assert fmt is not None
        names[name] = fmt
    return names


@dataclass(frozen=True)
class KVCacheEncoding:
    """One layer's cache encoding (module docstring). Build it with :meth:`parse` (an id),
    :meth:`of` (an id, a format or an encoding) or the constructor; :meth:`with_rope` binds the
    model's RoPE to a ``+prerope`` encoding. Every compatibility rule is checked when it is
    built (:meth:`validate`) or placed on a geometry (:meth:`check_geometry`)."""

    format: KVCacheFormat
    granularity: ScaleGranularity | None = None
    """``None``: the format's default (none, tensor, or token and head)."""
    k_scale_layout: ScaleLayout | None = None
    """NVFP4 block-scale layout of the K side (``None``: the geometry's default)."""
    v_scale_layout: ScaleLayout | None = None
    key: KeySpec = field(default_factory=KeySpec)

    def __post_init__(self) -> None:
        if self.granularity is None:
            object.__setattr__(self, "granularity", _default_granularity(self.format))
        self.validate()

    # ------------------------------------------------------------------------------ build

    @classmethod
    def parse(
        cls, text: str, arg_name: str = "kv_cache_dtype", *, include_mla_only: bool = True
    ) -> KVCacheEncoding:
        """The encoding an id names (module docstring); ``ValueError`` naming ``arg_name``. A
        plain dtype string that names no format gets the registry's unknown-dtype error;
        ``include_mla_only=False`` rejects MLA-only record layouts as the registry does."""
        if not isinstance(text, str):
            raise ValueError(f"{arg_name}: expected an encoding id, got {text!r}")
        raw = text.strip()
        body, *options = raw.split("+")
        body, _, layout = body.partition("@")
        dtype, _, granularity = body.partition("/")
        names = _dtype_names(include_mla_only)
        fmt = names.get(dtype)
        if fmt is None:
            if dtype == raw:
                lookup(dtype, arg_name, include_mla_only=include_mla_only)  # its error
        elif dtype == raw:
            return cls(fmt)
        sinks = [m for o in options if (m := _SINK_OPTION.fullmatch(o))]
        known = {HADAMARD, "offset", "prerope"}
        plain = [o for o in options if not _SINK_OPTION.fullmatch(o)]
        if (
            fmt is None
            or granularity not in ("", "tensor", "head")
            or not set(plain) <= known
            or len(set(plain)) != len(plain)
            or len(sinks) > 1
            or (sinks and int(sinks[0].group(1) or 1) == 0)
        ):
            raise ValueError(
                f"{arg_name}: unknown KV-cache encoding {raw!r}; expected {ENCODING_GRAMMAR} "
                f"with <dtype> one of {', '.join(names)}"
            )
        sink_tokens = int(sinks[0].group(1) or 1) if sinks else 0
        try:
            scale_layout = ScaleLayout.parse(layout) if layout else None
            return cls(
                fmt,
                _granularity(fmt, granularity),
                scale_layout,
                scale_layout,
                KeySpec(
                    rotation=HADAMARD if HADAMARD in plain else None,
                    offset="offset" in plain,
                    prerope="prerope" in plain,
                    sink_tokens=sink_tokens,
                ),
            )
        except ValueError as e:
            raise ValueError(f"{arg_name}: invalid KV-cache encoding {raw!r}: {e}") from None

    @classmethod
    def of(
        cls,
        value: KVCacheEncoding | KVCacheFormat | str,
        arg_name: str = "kv_cache_dtype",
        *,
        include_mla_only: bool = True,
    ) -> KVCacheEncoding:
        """``value`` as an encoding: itself, a format with defaults, or a parsed id."""
        if isinstance(value, KVCacheEncoding):
            encoding = value
        elif isinstance(value, KVCacheFormat):
            encoding = cls(value)
        else:
            return cls.parse(value, arg_name, include_mla_only=include_mla_only)
        if encoding.format.mla_only and not include_mla_only:
            lookup(encoding.format.name, arg_name, include_mla_only=False)  # its error
        return encoding

    def with_key(self, **changes: Any) -> KVCacheEncoding:
        """The same encoding with key-spec fields changed (checked again)."""
        return dataclasses.replace(self, key=dataclasses.replace(self.key, **changes))

    def with_rope(self, rope: KeyRope | None) -> KVCacheEncoding:
        """Bind the model's RoPE: keys stored before it (``+prerope``) with ``rope``'s
        identity; ``None`` stores keys after RoPE."""
        if rope is None:
            return self.with_key(prerope=False, rope=None)
        if not isinstance(rope, KeyRope):
            raise ValueError(f"key_rope: expected None or a KeyRope, got {type(rope).__name__}")
        return self.with_key(prerope=True, rope=RopeIdentity.of(rope))

    # --------------------------------------------------------------------------- checks

    def validate(self) -> None:
        """Every rule between the parts (``ValueError`` naming the part): the granularity the
        format allows; block-scale layouts only where the format has block scales; key
        options only on a quantized format that a reference codec reads (they only reduce
        quantization error); key sinks only on a format with a K scale (FP8, NVFP4)."""
        fmt, key = self.format, self.key
        if not isinstance(fmt, KVCacheFormat):
            raise ValueError(f"format: expected a KVCacheFormat, got {type(fmt).__name__}")
        allowed = _granularities(fmt)
        if self.granularity not in allowed:
            raise ValueError(
                f"granularity: expected {' or '.join(g.value for g in allowed)} for "
                f"{fmt.name!r}, got {getattr(self.granularity, 'value', self.granularity)!r}"
            )
        for name in ("k_scale_layout", "v_scale_layout"):
            layout = getattr(self, name)
            if layout is not None and (
                not isinstance(layout, ScaleLayout) or layout.value not in fmt.scale_layouts
            ):
                got = layout.value if isinstance(layout, ScaleLayout) else repr(layout)
                raise ValueError(
                    f"{name}: only NVFP4 formats have block scales, got {got} for {fmt.name!r}"
                )
        if key.rotation not in (None, HADAMARD):
            raise ValueError(f"key_rotation: expected None or {HADAMARD!r}, got {key.rotation!r}")
        sinks = key.sink_tokens
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"key_sink_tokens: expected an int >= 0, got {sinks!r}")
        if key.rope is not None and not key.prerope:
            raise ValueError("key_rope: a RoPE identity needs keys stored before RoPE (prerope)")
        for name, used in (
            ("key_rotation", key.rotation is not None),
            ("key_offset", key.offset),
            ("key_rope", key.prerope),
            ("key_sink_tokens", sinks > 0),
        ):
            if used and not fmt.is_quantized:
                raise ValueError(
                    f"{name}: expected a quantized cache format (it only reduces quantization "
                    f"error), got {fmt.name!r}"
                )
            # INT4's writers rotate every row already (a fixed RHT), so they take none.
            if used and fmt.cache_kind in (None, CacheKind.INT4_PER_TOKEN_HEAD):
                raise ValueError(
                    f"{name}: expected a format whose writers apply key options (FP8, NVFP4, "
                    f"per-token-head INT8 / FP8), got {fmt.name!r}"
                )
        if sinks and not self.codec.reads_kv_scale:
            raise ValueError(
                "key_sink_tokens: expected an FP8 or NVFP4 cache (the sink rows use its K "
                f"scale), got {fmt.name!r}"
            )

    def check_geometry(
        self,
        block_size: int | None,
        num_kv_heads: int,
        head_size: int,
        head_size_v: int | None = None,
    ) -> None:
        """``ValueError`` unless pages of ``block_size`` tokens of ``num_kv_heads`` heads of
        ``head_size`` (``head_size_v``) can hold this encoding: the format's head-size rule,
        the rotation's power-of-two head size, RoPE within the head, the key sinks within a
        page, the named block-scale layouts fitting the page (``block_size=None``: the rules
        of the heads only)."""
        head_size_v = head_size if head_size_v is None else head_size_v
        for size in (head_size, head_size_v):
            self.format.last_dim(size)
        key = self.key
        if key.rotation is not None:
            check_hadamard_head_size(head_size)
        if key.rope is not None and key.rope.rotary_dim > head_size:
            raise ValueError(
                f"key_rope: expected rotary_dim <= head_size={head_size}, got {key.rope.rotary_dim}"
            )
        if block_size is None:
            return
        if key.sink_tokens > block_size:
            raise ValueError(
                f"key_sink_tokens: expected at most block_size={block_size}, got {key.sink_tokens}"
            )
        for name, layout, size in (
            ("k_scale_layout", self.k_scale_layout, head_size),
            ("v_scale_layout", self.v_scale_layout, head_size_v),
        ):
            if layout is not None and not layout.fits(block_size, size):
                raise ValueError(
                    f"{name}: expected a layout that fits pages of {block_size} tokens and "
                    f"heads of {size} ({layout.value} needs multiples of 4 tokens and of 64 "
                    f"elements), got {layout.value}"
                )

    def check_attention(
        self, logits_soft_cap: float | None, has_logit_sinks: bool, arg_name: str = "key_offset"
    ) -> None:
        """``ValueError`` (naming ``arg_name``) when a key offset would change the attention:
        it moves every score of a query by ``q . offset``, which only plain softmax ignores
        (not a soft cap, not per-head logit sinks), unless the reader adds it back (keys stored
        before RoPE)."""
        if not self.key.offset or self.key.prerope:
            return
        if logits_soft_cap is not None or has_logit_sinks:
            raise ValueError(
                f"{arg_name}: expected an attention without sinks or logits_soft_cap (a key "
                "offset shifts scores, which only plain softmax ignores), got one with them"
            )

    # ---------------------------------------------------------------------------- facts

    @property
    def id(self) -> str:
        """The canonical id (module docstring; the dtype by its canonical name, so an id is
        also a ``kv_cache_dtype`` string): ``parse(enc.id)`` is ``enc`` up to the RoPE identity
        and per-side layouts."""
        out = self.format.name
        if self.granularity is ScaleGranularity.HEAD:
            out += "/head"
        if self.k_scale_layout is not None and self.k_scale_layout == self.v_scale_layout:
            out += f"@{self.k_scale_layout.value}"
        return out + self.key.suffix

    def __str__(self) -> str:
        return self.id

    @property
    def codec(self) -> KVCodec:
        """The format's reference codec (:func:`vllm.kv_quant.codecs.codec_for`)."""
        return codec_for(self.format)

    @property
    def is_quantized(self) -> bool:
        return self.format.is_quantized

    @property
    def per_head_scales(self) -> bool:
        """One ``k_scale`` / ``v_scale`` per KV head."""
        return self.granularity is ScaleGranularity.HEAD

    @property
    def sink_scale_multiplier(self) -> float:
        """The sink rows' FP8 e4m3 scale over the layer's K scale: ``scale_max / 448`` (1 for
        FP8 e4m3, 6 for NVFP4, 128 for e5m2), so that the rows span the amax the K scale was
        calibrated on."""
        scale_max = self.codec.scale_max
        assert scale_max is not None
        return scale_max / FP8_E4M3_MAX

    def scale_layouts(
        self, block_size: int, head_size: int, head_size_v: int | None = None
    ) -> tuple[ScaleLayout, ScaleLayout]:
        """The (K, V) block-scale layouts of pages of this geometry: the named ones, else
        ``ScaleLayout.default_for`` each side (meaningful for NVFP4 only)."""
        head_size_v = head_size if head_size_v is None else head_size_v
        return (
            ScaleLayout.resolve(self.k_scale_layout, block_size, head_size),
            ScaleLayout.resolve(self.v_scale_layout, block_size, head_size_v),
        )

    def kv_bytes_per_page(
        self,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        head_size_v: int | None = None,
        itemsize: int | None = None,
    ) -> int:
        """Bytes of a page's K and V rows (block and inline scales included);
        ``itemsize`` (bytes per storage element) is needed for ``auto``."""
        head_size_v = head_size if head_size_v is None else head_size_v
        storage = self.format.storage_dtype
        if itemsize is None:
            if storage is None:
                raise ValueError("itemsize: expected the model dtype's size for 'auto', got None")
            itemsize = storage.itemsize
        row = self.format.last_dim(head_size) + self.format.last_dim(head_size_v)
        return block_size * num_kv_heads * row * itemsize

    def sink_bytes_per_page(self, num_kv_heads: int, head_size: int) -> int:
        """Bytes of a page's key sink rows: ``sink_tokens * H * D`` FP8 bytes."""
        return self.key.sink_tokens * num_kv_heads * head_size

    def page_bytes(
        self,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        head_size_v: int | None = None,
        itemsize: int | None = None,
    ) -> int:
        """Every byte a page of this geometry holds: K and V rows, then the sink rows."""
        return self.kv_bytes_per_page(
            block_size, num_kv_heads, head_size, head_size_v, itemsize
        ) + self.sink_bytes_per_page(num_kv_heads, head_size)

    def describe(self) -> dict[str, Any]:
        """Every byte-deciding field as JSON-able values."""
        rope = self.key.rope
        return {
            "format": self.format.name,
            "granularity": self.granularity.value,  # type: ignore[union-attr]
            "k_scale_layout": None if self.k_scale_layout is None else self.k_scale_layout.value,
            "v_scale_layout": None if self.v_scale_layout is None else self.v_scale_layout.value,
            "key_rotation": self.key.rotation,
            "key_offset": self.key.offset,
            "key_prerope": self.key.prerope,
            "key_sink_tokens": self.key.sink_tokens,
            "key_rope": None if rope is None else dataclasses.asdict(rope),
        }

    @property
    def fingerprint(self) -> str:
        """Hex of the first 16 bytes of the SHA-256 of :meth:`describe`'s canonical JSON: equal
        exactly when two encodings write the same bytes for the same inputs."""
        return canonical_sha256(self.describe()).hex()[:32]


def canonical_sha256(value: Any) -> bytes:
    """SHA-256 (32 bytes) of ``value``'s canonical JSON (sorted keys, no spaces): the same in
    every process for equal JSON-able values, the digest behind every fingerprint here."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).digest()


def _default_granularity(fmt: KVCacheFormat) -> ScaleGranularity:
    return _granularities(fmt)[0]


def _granularities(fmt: KVCacheFormat) -> tuple[ScaleGranularity, ...]:
    """The granularities ``fmt`` allows, its default first."""
    if not fmt.is_quantized:
        return (ScaleGranularity.NONE,)
    if fmt.is_per_token_head:
        return (ScaleGranularity.TOKEN_HEAD,)
    return (ScaleGranularity.TENSOR, ScaleGranularity.HEAD)


def _granularity(fmt: KVCacheFormat, text: str) -> ScaleGranularity | None:
    """The granularity an id's ``/tensor`` or ``/head`` names (``None``: the default)."""
    if not text:
        return None
    if not fmt.is_quantized or fmt.is_per_token_head:
        raise ValueError(
            f"granularity: /{text} needs a format with a k_scale / v_scale, got {fmt.name!r}"
        )
    return ScaleGranularity(text)
