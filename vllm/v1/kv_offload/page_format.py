"""What decides the bytes of an offloaded block, its fingerprint, and the header stored with it.

Pages leave a worker as raw bytes (:mod:`vllm.v1.kv_offload.worker.page_views`); another
instance may only read them into its own cache when everything that decides those bytes is the
same: the model, the layers of each KV-cache buffer and their specs (heads, head size, block
size, padding, and the whole encoding: format, scale granularity and layouts, key transform
and the RoPE it undoes, key sink rows), the cache dtype string, the physical order of the
pages (NHD or HND), the NVFP4 block-scale layout of each layer as the caches hold it, the
calibrated values (fp8 per-tensor scales, or a whole calibration: scales and key offsets), the
tensor-parallel rank, and the page geometry (page size of each buffer, pages per offloaded
block).
:class:`KVPageFormat` holds all of it; :attr:`KVPageFormat.fingerprint` digests it and goes
into every key, and :meth:`KVPageFormat.header` is stored beside each block so that a reader
checks the format and the page sizes before any byte reaches its cache.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from functools import cached_property
from typing import Any

from vllm.kv_quant.calibrated import KVCacheCalibration
from vllm.kv_quant.encoding import KVCacheEncoding, canonical_sha256
from vllm.utils import check_positive_int
from vllm.v1.attention.backends.utils import get_kv_cache_layout, validate_kv_cache_layout
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_offload.worker.page_views import (
    get_layer_kv_cache_specs,
    kv_cache_tensor_page_sizes,
)

HEADER_MAGIC = b"VKVPAGE1"
"""First 8 bytes of every block header (format version 1)."""

_HEADER_FIXED = struct.Struct("<8s32sQII")
"""magic, fingerprint digest (32 bytes), block bytes, pages per block, number of buffers."""

HEADER_ALIGN_BYTES = 64
"""Headers are padded with zeros to a multiple of this many bytes."""


def _spec_description(spec: KVCacheSpec) -> dict[str, Any]:
    """Every field of ``spec`` as JSON-able values (dtypes and enums by name, an encoding by
    its byte-deciding fields), the same in every process."""
    out: dict[str, Any] = {"type": type(spec).__name__}
    for item in fields(spec):
        value = getattr(spec, item.name)
        if isinstance(value, KVCacheEncoding):
            out[item.name] = value.describe()
        else:
            out[item.name] = _jsonable(value)
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # torch.dtype and similar: their name


@dataclass(frozen=True)
class BufferPageFormat:
    """One KV-cache buffer (:class:`KVCacheTensor`): its layers, their specs, its page size."""

    layer_names: tuple[str, ...]
    page_size_bytes: int
    layer_specs: tuple[str, ...]
    """Canonical JSON of each layer's spec, in ``layer_names`` order."""


@dataclass(frozen=True)
class KVPageFormat:
    """Everything that decides the bytes of one offloaded block of a worker's KV cache.

    An offloaded block is ``block_size_factor`` pages of every buffer, buffer by buffer in
    ``kv_cache_tensors`` order; a primary-tier row of an engine with ``num_workers`` workers
    (a shared offload region's row) is ``num_workers`` such cells, worker by worker. Build it
    with :meth:`from_kv_cache_config`.
    """

    model: str
    kv_cache_dtype: str
    tp_rank: int
    block_size_factor: int
    buffers: tuple[BufferPageFormat, ...]
    num_workers: int = 1
    """Workers whose cells make up one block (1: one worker's pages)."""
    scale_layouts: tuple[tuple[str, str, str], ...] = field(default=())
    """(layer, K layout, V layout) of each NVFP4 layer, sorted by layer."""
    kv_scales: tuple[tuple[str, float, float], ...] = field(default=())
    """(layer, k_scale, v_scale) of each fp8 per-tensor layer, sorted by layer."""
    kv_cache_layout: str = "NHD"
    """Physical order of each page side: ``NHD`` or ``HND``."""
    calibration: str = ""
    """Fingerprint of the calibrated values (:class:`KVCacheCalibration`), "" without one."""

    @classmethod
    def from_kv_cache_config(
        cls,
        kv_cache_config: KVCacheConfig,
        *,
        model: str,
        kv_cache_dtype: str,
        tp_rank: int = 0,
        block_size_factor: int = 1,
        scale_layouts: Mapping[str, Sequence[Any]] | None = None,
        kv_scales: Mapping[str, Sequence[float]] | None = None,
        num_workers: int = 1,
        kv_cache_layout: str | None = None,
        calibration: KVCacheCalibration | None = None,
    ) -> KVPageFormat:
        """The format of ``kv_cache_config``'s buffers as the worker holds them (with
        ``num_workers`` > 1: the rows of every worker's cells, ``tp_rank`` then 0).

        ``scale_layouts`` maps NVFP4 layers to their (K, V) block-scale layouts (e.g. what
        :func:`~vllm.v1.worker.gpu.attn_utils.get_kv_cache_scale_layouts` returns; a layer not
        named has its encoding's, resolved for its geometry); ``kv_scales`` maps fp8 layers to
        their (k_scale, v_scale) values; ``kv_cache_layout`` is ``NHD`` or ``HND`` (default:
        the layout in effect, :func:`~vllm.v1.attention.backends.utils.get_kv_cache_layout`);
        ``calibration`` the calibrated values of the layers (scales and key offsets).
        """
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected a non-empty model name, got {model!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or tp_rank < 0:
            raise ValueError(f"tp_rank: expected an int ≥ 0, got {tp_rank!r}")
        check_positive_int("block_size_factor", block_size_factor)
        check_positive_int("num_workers", num_workers)
        specs = get_layer_kv_cache_specs(kv_cache_config)
        page_sizes = kv_cache_tensor_page_sizes(kv_cache_config)
        buffers = tuple(
            BufferPageFormat(
                layer_names=tuple(tensor.shared_by),
                page_size_bytes=page_size,
                layer_specs=tuple(
                    json.dumps(_spec_description(specs[name]), sort_keys=True)
                    for name in tensor.shared_by
                ),
            )
            for tensor, page_size in zip(kv_cache_config.kv_cache_tensors, page_sizes, strict=True)
        )
        named = {
            name: tuple(str(getattr(x, "value", x)) for x in pair)
            for name, pair in (scale_layouts or {}).items()
        }
        for name, spec in specs.items():
            encoding = getattr(spec, "encoding", None)
            if name not in named and encoding is not None and encoding.format.is_nvfp4:
                pair = encoding.scale_layouts(spec.block_size, spec.head_size, spec.head_size_v)
                named[name] = tuple(layout.value for layout in pair)
        layouts = tuple(sorted((name, *pair) for name, pair in named.items()))
        scales = tuple(
            sorted((name, *(float(x) for x in pair)) for name, pair in (kv_scales or {}).items())
        )
        for entry, what in ((layouts, "scale_layouts"), (scales, "kv_scales")):
            for item in entry:
                if len(item) != 3 or item[0] not in specs:
                    raise ValueError(
                        f"{what}: expected (K, V) values for known layers, got {item!r}"
                    )
        return cls(
            model=model,
            kv_cache_dtype=kv_cache_dtype,
            tp_rank=tp_rank,
            block_size_factor=block_size_factor,
            buffers=buffers,
            num_workers=num_workers,
            scale_layouts=layouts,  # type: ignore[arg-type]
            kv_scales=scales,  # type: ignore[arg-type]
            kv_cache_layout=validate_kv_cache_layout(
                get_kv_cache_layout() if kv_cache_layout is None else kv_cache_layout,
                "kv_cache_layout",
            ),
            calibration="" if calibration is None else calibration.fingerprint,
        )

    @property
    def page_sizes_bytes(self) -> tuple[int, ...]:
        """Page size in bytes of each buffer."""
        return tuple(b.page_size_bytes for b in self.buffers)

    @property
    def block_bytes(self) -> int:
        """Bytes of one offloaded block: ``block_size_factor`` pages of every buffer, on each
        of ``num_workers`` workers."""
        return self.num_workers * self.block_size_factor * sum(self.page_sizes_bytes)

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 (32 bytes) of the canonical JSON of every field (computed once: every store
        key and header carries it)."""
        return canonical_sha256(asdict(self))

    @property
    def fingerprint(self) -> str:
        """Hex of the first 16 bytes of :attr:`digest` (part of every store key)."""
        return self.digest[:16].hex()

    @property
    def header_bytes(self) -> int:
        """Size of :meth:`header` in bytes."""
        raw = _HEADER_FIXED.size + 8 * len(self.buffers)
        return -(-raw // HEADER_ALIGN_BYTES) * HEADER_ALIGN_BYTES

    def header(self) -> bytes:
        """The header stored beside each block: magic, digest, block bytes, page geometry."""
        fixed = _HEADER_FIXED.pack(
            HEADER_MAGIC, self.digest, self.block_bytes, self.block_size_factor, len(self.buffers)
        )
        sizes = struct.pack(f"<{len(self.buffers)}Q", *self.page_sizes_bytes)
        return (fixed + sizes).ljust(self.header_bytes, b"\0")

    def check_header(self, raw: bytes | bytearray | memoryview, where: str = "header") -> None:
        """``ValueError`` naming the first field where ``raw`` differs from :meth:`header`."""
        raw = bytes(raw)
        expected = self.header()
        if raw == expected:
            return
        if len(raw) < _HEADER_FIXED.size:
            raise ValueError(f"{where}: expected {len(expected)} header bytes, got {len(raw)}")
        magic, digest, block_bytes, factor, count = _HEADER_FIXED.unpack_from(raw)
        if magic != HEADER_MAGIC:
            raise ValueError(f"{where}: expected magic {HEADER_MAGIC!r}, got {magic!r}")
        if block_bytes != self.block_bytes:
            raise ValueError(
                f"{where}: expected a block of {self.block_bytes} bytes, got {block_bytes}"
            )
        if (factor, count) != (self.block_size_factor, len(self.buffers)):
            raise ValueError(
                f"{where}: expected {self.block_size_factor} pages of {len(self.buffers)} "
                f"buffers per block, got {factor} pages of {count} buffers"
            )
        sizes = struct.unpack_from(f"<{count}Q", raw, _HEADER_FIXED.size)
        if sizes != self.page_sizes_bytes:
            raise ValueError(
                f"{where}: expected page sizes {list(self.page_sizes_bytes)} bytes, got "
                f"{list(sizes)}"
            )
        if digest != self.digest:
            raise ValueError(
                f"{where}: expected format fingerprint {self.fingerprint}, got "
                f"{digest[:16].hex()} (a different model, encoding, page layout, scale layout, "
                "calibration or TP rank)"
            )
        raise ValueError(f"{where}: header bytes differ from the expected header")

    def describe_difference(self, other: KVPageFormat) -> str | None:
        """The first field in which ``other`` differs, as ``name: mine vs theirs`` (or None)."""
        for name in (
            "model",
            "kv_cache_dtype",
            "tp_rank",
            "block_size_factor",
            "num_workers",
            "page_sizes_bytes",
            "buffers",
            "scale_layouts",
            "kv_scales",
            "kv_cache_layout",
            "calibration",
        ):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                if name == "buffers":
                    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
                        if a != b:
                            return f"buffers[{i}]: {a} vs {b}"
                    return f"buffers: {len(mine)} vs {len(theirs)} buffers"
                return f"{name}: {mine!r} vs {theirs!r}"
        return None

    def to_json(self) -> str:
        """JSON text of every field (see :meth:`from_json`)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> KVPageFormat:
        """The format serialized by :meth:`to_json`; ``ValueError`` for malformed text."""
        try:
            data = json.loads(text)
            return cls(
                model=data["model"],
                kv_cache_dtype=data["kv_cache_dtype"],
                tp_rank=int(data["tp_rank"]),
                block_size_factor=int(data["block_size_factor"]),
                buffers=tuple(
                    BufferPageFormat(
                        layer_names=tuple(b["layer_names"]),
                        page_size_bytes=int(b["page_size_bytes"]),
                        layer_specs=tuple(b["layer_specs"]),
                    )
                    for b in data["buffers"]
                ),
                num_workers=int(data.get("num_workers", 1)),
                scale_layouts=tuple(tuple(x) for x in data["scale_layouts"]),  # type: ignore[misc]
                kv_scales=tuple(tuple(x) for x in data["kv_scales"]),  # type: ignore[misc]
                kv_cache_layout=str(data.get("kv_cache_layout", "NHD")),
                calibration=str(data.get("calibration", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"page format: malformed JSON description ({e!r})") from e
