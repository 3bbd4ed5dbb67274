"""Calibrated state of an encoding, per layer, and its file: what an engine calibrates offline
once and serves with.

An encoding (:class:`~vllm.kv_quant.encoding.KVCacheEncoding`) says how pages are written; the
values it needs from data are calibrated state: each layer's ``k_scale`` / ``v_scale`` (fp32,
one value or one per KV head) and, with ``+offset``, its key offset (fp32 ``[H, D]``).
:class:`KVCacheCalibration` holds the encoding and one :class:`LayerCalibration` per layer;
:meth:`KVCacheCalibration.save` / :meth:`KVCacheCalibration.load` write and read it as one JSON
file (docs/design.md §5.7)::

    {"format": "vllm-kvcache-calibration", "version": 1,
     "encoding": "<encoding id>", "fingerprint": "<encoding fingerprint>",
     "key_rope": null | {"rotary_dim": ..., "is_neox_style": ..., "table_digest": "..."},
     "layers": {"<layer name>": {"k_scale": <value or list>, "v_scale": <value or list>,
                                 "key_offset": null | [[...], ...]}, ...}}

Values are the fp32 numbers written as JSON numbers (a float64 holds each fp32 exactly and
Python writes the shortest text that reads back to it), so a load gives the same bits. A 0-d
scale is a number, a per-head scale a list. A load checks the header, the encoding's
fingerprint (so a file is never read for another encoding) and every value (finite, scales
> 0, shapes), and names the first thing wrong.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm.kv_quant.encoding import KVCacheEncoding, RopeIdentity, canonical_sha256

__all__ = ["CALIBRATION_FILE_FORMAT", "KVCacheCalibration", "LayerCalibration"]

CALIBRATION_FILE_FORMAT = "vllm-kvcache-calibration"
"""The ``format`` field of a calibration file."""

_VERSION = 1


def _fp32(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise ValueError(f"{what}: expected a float tensor, got {type(value).__name__}")
    value = value.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{what}: expected finite values, got {value.flatten().tolist()}")
    return value


@dataclass(frozen=True, eq=False)
class LayerCalibration:
    """One layer's calibrated values (fp32, on the CPU): ``k_scale`` / ``v_scale`` one value
    (0-d) or ``[H]``, > 0; ``key_offset`` ``[H, D]`` or None."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    key_offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            scale = _fp32(getattr(self, name), name)
            if scale.dim() > 1 or not bool((scale > 0).all()):
                raise ValueError(
                    f"{name}: expected one value or [H] values > 0, got "
                    f"{list(scale.shape)} {scale.flatten().tolist()}"
                )
            object.__setattr__(self, name, scale)
        if self.key_offset is not None:
            offset = _fp32(self.key_offset, "key_offset")
            if offset.dim() != 2:
                raise ValueError(f"key_offset: expected [H, D], got {list(offset.shape)}")
            object.__setattr__(self, "key_offset", offset)

    def to_json(self) -> dict[str, Any]:
        offset = self.key_offset
        return {
            "k_scale": self.k_scale.tolist(),
            "v_scale": self.v_scale.tolist(),
            "key_offset": None if offset is None else offset.tolist(),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> LayerCalibration:
        if not isinstance(data, dict) or not {"k_scale", "v_scale"} <= set(data):
            raise ValueError(f"{where}: expected an object with k_scale and v_scale, got {data!r}")
        values = {}
        for name in ("k_scale", "v_scale", "key_offset"):
            raw = data.get(name)
            if raw is None:
                values[name] = None
                continue
            try:
                exact = torch.tensor(raw, dtype=torch.float64)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.{name}: expected numbers, got {raw!r}") from None
            values[name] = exact.to(torch.float32)
            if not torch.equal(values[name].to(torch.float64), exact):
                raise ValueError(f"{where}.{name}: expected fp32 values, got {raw!r}")
        try:
            return cls(values["k_scale"], values["v_scale"], values["key_offset"])
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None

    def same_values(self, other: LayerCalibration) -> bool:
        """Bit for bit the same values (shapes included)."""
        pairs = [(self.k_scale, other.k_scale), (self.v_scale, other.v_scale)]
        if (self.key_offset is None) != (other.key_offset is None):
            return False
        if self.key_offset is not None:
            pairs.append((self.key_offset, other.key_offset))  # type: ignore[arg-type]
        return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


@dataclass(frozen=True, eq=False)
class KVCacheCalibration:
    """An encoding and the calibrated values of each of its layers (by layer name). A layer
    has a key offset exactly when the encoding says ``+offset``."""

    encoding: KVCacheEncoding
    layers: Mapping[str, LayerCalibration]

    def __post_init__(self) -> None:
        if not isinstance(self.encoding, KVCacheEncoding):
            raise ValueError(
                f"encoding: expected a KVCacheEncoding, got {type(self.encoding).__name__}"
            )
        if not self.layers:
            raise ValueError("layers: expected at least one layer, got none")
        for name, layer in self.layers.items():
            if not isinstance(name, str) or not isinstance(layer, LayerCalibration):
                raise ValueError(
                    f"layers: expected layer name -> LayerCalibration, got {name!r} -> "
                    f"{type(layer).__name__}"
                )
            if (layer.key_offset is not None) != self.encoding.key.offset:
                wanted = "a key offset" if self.encoding.key.offset else "no key offset"
                raise ValueError(
                    f"layers[{name!r}]: expected {wanted} for encoding {self.encoding.id!r}"
                )
        object.__setattr__(self, "layers", dict(self.layers))

    def to_json(self) -> dict[str, Any]:
        """The file's content (module docstring) as a JSON-able dict."""
        rope = self.encoding.key.rope
        return {
            "format": CALIBRATION_FILE_FORMAT,
            "version": _VERSION,
            "encoding": self.encoding.id,
            "fingerprint": self.encoding.fingerprint,
            "key_rope": None if rope is None else dataclasses.asdict(rope),
            "layers": {name: layer.to_json() for name, layer in self.layers.items()},
        }

    @property
    def fingerprint(self) -> str:
        """Hex of the first 16 bytes of the SHA-256 of the file's canonical JSON: equal exactly
        when the encoding and every calibrated value are."""
        return canonical_sha256(self.to_json()).hex()[:32]

    def save(self, path: str | Path) -> None:
        """Write the file (module docstring); the parent directory must exist."""
        Path(path).write_text(json.dumps(self.to_json(), allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> KVCacheCalibration:
        """Read a file written by :meth:`save`; ``ValueError`` naming the first thing wrong
        (unreadable JSON, another format or version, an encoding that does not match its
        fingerprint, a bad value)."""
        where = str(path)
        try:
            data = json.loads(Path(path).read_text(), parse_constant=_no_constant)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"{where}: expected a calibration file, got {e}") from None
        if not isinstance(data, dict) or data.get("format") != CALIBRATION_FILE_FORMAT:
            raise ValueError(f"{where}: expected format {CALIBRATION_FILE_FORMAT!r}")
        if data.get("version") != _VERSION:
            raise ValueError(f"{where}: expected version {_VERSION}, got {data.get('version')!r}")
        encoding = KVCacheEncoding.parse(str(data.get("encoding")), f"{where}: encoding")
        rope = data.get("key_rope")
        if rope is not None:
            try:
                identity = RopeIdentity(**rope)
            except TypeError:
                raise ValueError(
                    f"{where}: key_rope: expected a RoPE identity, got {rope!r}"
                ) from None
            encoding = encoding.with_key(rope=identity)
        if data.get("fingerprint") != encoding.fingerprint:
            raise ValueError(
                f"{where}: fingerprint: expected {encoding.fingerprint} (encoding "
                f"{encoding.id!r}), got {data.get('fingerprint')!r}"
            )
        layers = data.get("layers")
        if not isinstance(layers, dict):
            raise ValueError(f"{where}: layers: expected an object, got {layers!r}")
        parsed = {
            name: LayerCalibration.from_json(value, f"{where}: layers[{name!r}]")
            for name, value in layers.items()
        }
        try:
            return cls(encoding, parsed)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _no_constant(name: str) -> float:
    """JSON's NaN / Infinity are not calibrated values."""
    raise ValueError(f"a non-finite number ({name})")
