"""Offline calibration of a whole encoding, for engines: stream K/V through one object, get the
calibrated state (:class:`~vllm.kv_quant.calibrated.KVCacheCalibration`) to save and serve with.

An engine runs its calibration batches through the model (any cache, typically bf16) and hands
every attention layer's K/V, as it would write them (post-RoPE, ``[T, H, D]``, with each token's
position in its sequence), to :meth:`KVCacheCalibrator.observe`. The calibrator applies the
encoding's key options itself, so one loop serves every encoding::

    calibrator = KVCacheCalibrator("nvfp4_mse+offset+prerope+sink", key_rope=rope)
    while not calibrator.done:            # one pass, or two with +offset
        for batch in calibration_batches:
            ...                           # in each layer: calibrator.observe(name, k, v, pos)
        calibrator.finish_pass()
    calibrator.calibration().save("calibration.json")

What it computes (the same rules as :class:`~vllm.kv_quant.KVScaleObserver`, whose running
values it keeps per layer, so memory does not grow with the calibration text):

- with ``+offset``, a first pass takes each layer's key offset: the mean key per KV head and
  channel, of the keys with RoPE undone under ``+prerope``;
- the (last) pass takes ``amax / MAX`` per tensor or per KV head (the encoding's granularity) of
  the keys as the writer receives them (RoPE undone, offset subtracted, rotated:
  :meth:`~vllm.kv_quant.KeyTransform.stored_key`) and of the values;
- encodings whose writers read no scale (unquantized, per-token-head, packed K+V slots) get
  scales of one, so an engine calibrates every encoding the same way.

The offset needs a pass of its own because the scales are taken on keys it has moved (and,
with a rotation, mixed across channels).
"""

from __future__ import annotations

import torch

from vllm.kv_quant.calibrated import KVCacheCalibration, LayerCalibration
from vllm.kv_quant.calibration import KVScaleObserver
from vllm.kv_quant.encoding import KVCacheEncoding
from vllm.kv_quant.key_rope import KeyRope
from vllm.kv_quant.key_transform import KeyTransform

__all__ = ["KVCacheCalibrator"]


class KVCacheCalibrator:
    """Calibrates ``encoding`` (an encoding id such as ``fp8_e4m3/head+hadamard+offset`` or a
    :class:`~vllm.kv_quant.encoding.KVCacheEncoding`) from streamed K/V, layer by layer.

    ``key_rope``: the model's RoPE, needed exactly when the encoding stores keys before RoPE
    (``+prerope``; bound into the result's encoding). Layers are named by the caller (any
    strings, e.g. ``"model.layers.0.self_attn"``); every pass must see the same layers.
    """

    def __init__(self, encoding: KVCacheEncoding | str, key_rope: KeyRope | None = None) -> None:
        encoding = KVCacheEncoding.of(encoding, "encoding", include_mla_only=False)
        self._transform = KeyTransform.bind(encoding.key, key_rope)  # checks key_rope
        self.encoding = encoding.with_rope(key_rope) if encoding.key.prerope else encoding
        """The encoding calibrated (the RoPE identity bound under ``+prerope``)."""
        self.passes = 2 if encoding.key.offset else 1
        """Passes over the calibration data: 2 with ``+offset`` (the offset, then the scales)."""
        self.pass_index = 0
        """The pass being observed (0-based); equal to :attr:`passes` once done."""
        self._observers: dict[str, KVScaleObserver] = {}
        self._layers: list[str] = []  # the first pass's, which later passes must see again
        self._offsets: dict[str, torch.Tensor] = {}

    @property
    def done(self) -> bool:
        """Every pass finished: :meth:`calibration` is ready."""
        return self.pass_index == self.passes

    @property
    def _offset_pass(self) -> bool:
        return self.passes == 2 and self.pass_index == 0

    def observe(
        self,
        layer: str,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Fold one batch of layer ``layer`` into the pass: ``key [T, H, D]`` and
        ``value [T, H, Dv]`` as the cache's writer would take them (post-RoPE, any float
        dtype), ``positions [T]`` each token's position in its sequence (needed with
        ``+prerope``). Everything is checked before any running value changes."""
        if self.done:
            raise RuntimeError("observe: calibration finished; call calibration()")
        if not isinstance(layer, str) or not layer:
            raise ValueError(f"layer: expected a non-empty layer name, got {layer!r}")
        if self.pass_index > 0 and layer not in self._layers:
            raise ValueError(
                f"layer: expected one of the layers of the first pass "
                f"({', '.join(self._layers)}), got {layer!r}"
            )
        if not isinstance(key, torch.Tensor) or not key.dtype.is_floating_point or key.dim() != 3:
            got = (
                f"{key.dtype} of shape {list(key.shape)}"
                if isinstance(key, torch.Tensor)
                else (type(key).__name__)
            )
            raise ValueError(f"key: expected a float tensor [T, H, D], got {got}")
        observer = self._observers.get(layer)
        if observer is None:
            observer = KVScaleObserver(per_head=self.encoding.per_head_scales)
        if key.shape[0] == 0:
            observer.observe(key, value)  # its shape checks; an empty batch changes nothing
        elif self._offset_pass:
            unroped = key
            if self._transform.rope is not None:
                self._check_positions(key, positions)
                unroped = self._transform.rope.unrotate(key.to(torch.float32), positions)
            observer.observe(unroped, value)
        else:
            observer.observe(self._stored_key(layer, key, positions), value)
        self._observers[layer] = observer

    def _check_positions(self, key: torch.Tensor, positions: torch.Tensor | None) -> None:
        if positions is None:
            raise ValueError(
                "positions: expected each key's position in its sequence (the encoding stores "
                "keys before RoPE), got None"
            )
        if positions.dim() != 1 or positions.shape[0] != key.shape[0]:
            raise ValueError(
                f"positions: expected [{key.shape[0]}] (one per key), got {list(positions.shape)}"
            )

    def _stored_key(
        self, layer: str, key: torch.Tensor, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """``key`` as the writer receives it with this layer's offset (the first pass's)."""
        if self._transform.rope is not None:
            self._check_positions(key, positions)
        transform = self._transform
        offset = self._offsets.get(layer)
        if offset is not None:
            transform = KeyTransform(transform.rotation, offset.to(key.device), transform.rope)
        return transform.stored_key(key, positions)

    def finish_pass(self) -> None:
        """End the pass: every layer observed at least one token (``RuntimeError`` naming the
        first that did not); after the offset pass, each layer's offset is fixed."""
        if self.done:
            raise RuntimeError("finish_pass: calibration finished; call calibration()")
        expected = self._layers if self.pass_index > 0 else list(self._observers)
        if not expected:
            raise RuntimeError("finish_pass: no K/V observed in this pass; call observe() first")
        for layer in expected:
            observer = self._observers.get(layer)
            if observer is None or observer.k_amax is None:
                raise RuntimeError(f"finish_pass: layer {layer!r} observed no token in this pass")
        self._layers = expected
        if self._offset_pass:
            self._offsets = {name: obs.key_mean() for name, obs in self._observers.items()}
            self._observers = {}
        self.pass_index += 1

    def calibration(self) -> KVCacheCalibration:
        """The calibrated state of every layer (fp32 on the CPU), after the last pass."""
        if not self.done:
            raise RuntimeError(
                f"calibration: expected {self.passes} finished pass(es), got {self.pass_index}; "
                "observe the calibration data and call finish_pass()"
            )
        dtype = self.encoding.format.name
        layers = {}
        for name, observer in self._observers.items():
            k_scale, v_scale = observer.scales(dtype)
            layers[name] = LayerCalibration(k_scale, v_scale, self._offsets.get(name))
        return KVCacheCalibration(self.encoding, layers)
